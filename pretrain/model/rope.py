"""MLA's rotary position embedding (RoPE) in one Triton kernel per direction, bitwise megatron-core's formula.

RoFormer (Su et al., 2021) as DeepSeek-V2's MLA and GLM-5 apply it to the rope part of queries and keys (the MLA
layer's q_pe, k_pe and the DSA indexer's q_I, k_I). megatron-core 0.16.1's unfused `_apply_rotary_pos_emb_bshd`
with `multi_latent_attention` (and `rotary_interleaved` off), for t [s, b, h, d] and freqs [s, 1, 1, r]:

    x   = [t[..., 0:r:2], t[..., 1:r:2]]              the rope dims de-interleaved: x = [x1, x2]
    y   = x * cos + rotate_half(x) * sin,              rotate_half([x1, x2]) = [-x2, x1]
    out = [y, t[..., r:]]
    cos = (cos(freqs) * mscale).to(t.dtype), sin likewise.

Each product and the sum are rounded to t's dtype, as PyTorch's elementwise operations round them; the kernel
rounds at the same points (compiled without FMA contraction, which would round a product and the sum once), so its
output equals megatron's bit for bit, and its backward equals autograd's through megatron's formula:

    dx1 = dy1 * cos1 + dy2 * sin2,   dx2 = dy2 * cos2 - dy1 * sin1   (each product rounded, then the sum)
    dt[..., 0:r:2] = dx1,  dt[..., 1:r:2] = dx2,  dt[..., r:] = dy[..., r:].

Why: megatron's formula is a de-interleaving cat, two products, a negation, a sum and a final cat, each a pass over
the tensor (with its backward: one more of each), and the cos / sin of the table on every call. For glm5-proxy's
DSA layer at 32K that was about 0.9 ms per layer in the indexer's RoPE alone, in forward and again when its loss
recomputes the projection in backward; the kernel takes about 0.09 ms per call (both in the DSA step's profile on an H200). `mla_rope(freqs, mscale)` builds the cos /
sin tables once for the four tensors a layer rotates.
"""

from __future__ import annotations

import os
from typing import Callable

import torch
import triton
import triton.language as tl

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    from pretrain.compat.triton_interpreter import patch_triton_interpreter

    patch_triton_interpreter()

ROWS = 16  # (token, head) rows per program


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, B, H, s_xs, s_xb, s_xh,
                 D: tl.constexpr, R: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, ROWS: tl.constexpr,
                 BACKWARD: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rm = rows < n_rows
    si, bi, hi = rows // (B * H), (rows // H) % B, rows % H
    src = x_ptr + si * s_xs + bi * s_xb + hi * s_xh
    dst = out_ptr + rows * D
    half = R // 2
    j = tl.arange(0, BR)
    jm = rm[:, None] & (j[None, :] < half)
    ty = out_ptr.dtype.element_ty
    c1 = tl.load(cos_ptr + si[:, None] * R + j[None, :], mask=jm, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + si[:, None] * R + half + j[None, :], mask=jm, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + si[:, None] * R + j[None, :], mask=jm, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + si[:, None] * R + half + j[None, :], mask=jm, other=0.0).to(tl.float32)
    if BACKWARD:  # x = dy (de-interleaved halves), written back interleaved
        a1 = tl.load(src[:, None] + j[None, :], mask=jm, other=0.0).to(tl.float32)
        a2 = tl.load(src[:, None] + half + j[None, :], mask=jm, other=0.0).to(tl.float32)
        y1 = ((a1 * c1).to(ty).to(tl.float32) + (a2 * s2).to(ty).to(tl.float32)).to(ty)
        y2 = ((a2 * c2).to(ty).to(tl.float32) - (a1 * s1).to(ty).to(tl.float32)).to(ty)
        tl.store(dst[:, None] + 2 * j[None, :], y1, mask=jm)
        tl.store(dst[:, None] + 2 * j[None, :] + 1, y2, mask=jm)
    else:  # x = t, read interleaved, written de-interleaved
        a1 = tl.load(src[:, None] + 2 * j[None, :], mask=jm, other=0.0).to(tl.float32)
        a2 = tl.load(src[:, None] + 2 * j[None, :] + 1, mask=jm, other=0.0).to(tl.float32)
        y1 = ((a1 * c1).to(ty).to(tl.float32) + (-a2 * s1).to(ty).to(tl.float32)).to(ty)
        y2 = ((a2 * c2).to(ty).to(tl.float32) + (a1 * s2).to(ty).to(tl.float32)).to(ty)
        tl.store(dst[:, None] + j[None, :], y1, mask=jm)
        tl.store(dst[:, None] + half + j[None, :], y2, mask=jm)
    if D > R:  # the dims past the rope part pass through
        p = tl.arange(0, BD)
        pm = rm[:, None] & (p[None, :] < D - R)
        tl.store(dst[:, None] + R + p[None, :], tl.load(src[:, None] + R + p[None, :], mask=pm, other=0.0), mask=pm)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    if x.dim() != 4:
        raise ValueError(f"RoPE takes [s, b, heads, d] tensors, got shape {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    s, b, h, d = x.shape
    r = cos.shape[-1]
    if cos.shape != (s, r) or r % 2 or r > d:
        raise ValueError(f"RoPE tables {tuple(cos.shape)} do not fit a tensor of shape {tuple(x.shape)}")
    out = torch.empty(s, b, h, d, dtype=x.dtype, device=x.device)
    n = s * b * h
    if n:
        _rope_kernel[(triton.cdiv(n, ROWS),)](
            x, cos, sin, out, n, b, h, x.stride(0), x.stride(1), x.stride(2), D=d, R=r,
            BD=triton.next_power_of_2(max(d - r, 1)), BR=triton.next_power_of_2(r // 2), ROWS=ROWS,
            BACKWARD=backward, num_warps=4, enable_fp_fusion=False)
    return out


class _RoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _launch(t, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _launch(grad, cos, sin, backward=True), None, None


def rope_tables(freqs: torch.Tensor, mscale: float, dtype: torch.dtype):
    """(cos, sin) [s, r] in `dtype` from megatron's freqs [s, 1, 1, r], computed as megatron computes them."""
    freqs = freqs.reshape(freqs.shape[0], freqs.shape[-1])
    cos = (torch.cos(freqs) * mscale).to(dtype).contiguous()
    sin = (torch.sin(freqs) * mscale).to(dtype).contiguous()
    return cos, sin


def mla_rope(freqs: torch.Tensor, mscale: float = 1.0) -> Callable[[torch.Tensor], torch.Tensor]:
    """rope(t) for t [s, b, heads, d] (d >= r; any strides) -> [s, b, heads, d] contiguous, differentiable; the
    cos / sin tables are built on first use, once per dtype."""
    tables = {}

    def rope(t: torch.Tensor) -> torch.Tensor:
        if t.dtype not in tables:
            tables[t.dtype] = rope_tables(freqs, mscale, t.dtype)
        return _RoPE.apply(t, *tables[t.dtype])

    return rope


__all__ = ["mla_rope", "rope_tables"]
