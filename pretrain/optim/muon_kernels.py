"""Muon's elementwise passes fused into two Triton kernels (`pretrain.optim.muon`).

Per Muon block (a [groups, rows, cols] view of a matrix: the whole matrix, or its heads, experts or
GLU halves) with gradient G, momentum M and weight W (fp32), a Newton-Schulz stage S and its result
O (in `ns_dtype`, bf16 by default), momentum mu, Nesterov mu_n, lr, weight decay wd and the block's
coef = -lr * 0.2 * sqrt(max(rows, cols)):

    momentum_and_stage:   M <- G + mu M                 (fp32, in place, rounded as torch.add(G, M, alpha=mu))
                          S <- G + mu_n M  or  S <- M   (computed in fp32 from the new M, rounded once into S)
    decay_and_add:        W <- (W (1 - lr wd)) + coef O (the decayed weight rounded first, as p.mul_ then p.add_)

Sums with a scaled term are one fused multiply-add (`tl.fma`), as PyTorch's CUDA `add(a, b, alpha=s)`
computes a + s b (nvcc contracts it into an fma): on the GPU the kernels give the bits of the torch
ops they replace. (Triton's CPU interpreter computes a fma unfused, so there they differ by an ulp.)

Why: these passes are pure memory traffic. Bytes per element with fp32 G, M, W and a bf16 S, O:

    torch ops                                        fused
    M <- G + mu M       read G, M, write M   12 B    momentum_and_stage: read G, M,          14 B
    W <- W (1 - lr wd)  read W, write W       8 B                        write M, S
    S <- G + mu_n M     read G, M, write S   10 B    decay_and_add:      read W, O, write W  10 B
    W <- W + coef O     read W, O, write W   10 B
                                             40 B                                            24 B

(without Nesterov, S <- M reads M only: 36 B before, 24 B after). Each kernel takes any strides: a
block of a head, expert or GLU split is a strided view, and a tall block's stage is the transposed
view of the stage's wide-orientation span. A program handles one BLOCK_R x BLOCK_C tile of one group.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

BLOCK_R = 64
BLOCK_C = 64
NUM_WARPS = 4
# G, M, W: computed in fp32 (PyTorch's op math for these); fp64 would need fp64 scalars, which Triton's
# float arguments are not.
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STAGE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _tile(pid, rows, cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """(group, row indices [BLOCK_R, 1], col indices [1, BLOCK_C] in int64, mask) of program `pid`."""
    tiles_c = tl.cdiv(cols, BLOCK_C)
    per_group = tl.cdiv(rows, BLOCK_R) * tiles_c
    group = pid // per_group
    tile = pid % per_group
    r = (tile // tiles_c) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = (tile % tiles_c) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r[:, None] < rows) & (c[None, :] < cols)
    return group.to(tl.int64), r.to(tl.int64)[:, None], c.to(tl.int64)[None, :], mask


@triton.jit
def _momentum_and_stage_kernel(g_ptr, m_ptr, s_ptr, rows, cols, sg0, sg1, sg2, sm0, sm1, sm2, ss0, ss1, ss2,
                               mu, nesterov_mu, NESTEROV: tl.constexpr, BLOCK_R: tl.constexpr,
                               BLOCK_C: tl.constexpr):
    group, r, c, mask = _tile(tl.program_id(0), rows, cols, BLOCK_R, BLOCK_C)
    m_at = m_ptr + group * sm0 + r * sm1 + c * sm2
    g = tl.load(g_ptr + group * sg0 + r * sg1 + c * sg2, mask=mask).to(tl.float32)
    m = tl.fma(tl.load(m_at, mask=mask).to(tl.float32), mu, g).to(m_ptr.dtype.element_ty)
    tl.store(m_at, m, mask=mask)
    if NESTEROV:
        u = tl.fma(m.to(tl.float32), nesterov_mu, g)  # from M as stored, as torch reads it back
    else:
        u = m.to(tl.float32)
    tl.store(s_ptr + group * ss0 + r * ss1 + c * ss2, u.to(s_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decay_and_add_kernel(w_ptr, o_ptr, rows, cols, sw0, sw1, sw2, so0, so1, so2, decay, coef,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    group, r, c, mask = _tile(tl.program_id(0), rows, cols, BLOCK_R, BLOCK_C)
    w_at = w_ptr + group * sw0 + r * sw1 + c * sw2
    w = (tl.load(w_at, mask=mask).to(tl.float32) * decay).to(w_ptr.dtype.element_ty).to(tl.float32)
    o = tl.load(o_ptr + group * so0 + r * so1 + c * so2, mask=mask).to(tl.float32)
    tl.store(w_at, tl.fma(o, coef, w).to(w_ptr.dtype.element_ty), mask=mask)


def _check(name: str, t: torch.Tensor, like: torch.Tensor, dtypes) -> None:
    if t.dim() != 3 or t.shape != like.shape:
        raise ValueError(f"{name} must be [groups, rows, cols] of shape {tuple(like.shape)}, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be one of {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device}, expected {like.device}")


def _grid(t: torch.Tensor):
    groups, rows, cols = t.shape
    return (groups * triton.cdiv(rows, BLOCK_R) * triton.cdiv(cols, BLOCK_C),)


def momentum_and_stage(grad: torch.Tensor, momentum: torch.Tensor, stage: torch.Tensor, mu: float,
                       nesterov_mu: Optional[float]) -> None:
    """momentum <- grad + mu * momentum in place; stage <- grad + nesterov_mu * momentum (or momentum
    when `nesterov_mu` is None), in stage's dtype. All three [groups, rows, cols], any strides."""
    _check("momentum", momentum, grad, STATE_DTYPES)
    _check("grad", grad, grad, STATE_DTYPES)
    _check("stage", stage, grad, STAGE_DTYPES)
    if grad.numel():
        _momentum_and_stage_kernel[_grid(grad)](
            grad, momentum, stage, grad.shape[1], grad.shape[2], *grad.stride(), *momentum.stride(), *stage.stride(),
            float(mu), 0.0 if nesterov_mu is None else float(nesterov_mu), NESTEROV=nesterov_mu is not None,
            BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=NUM_WARPS)


def decay_and_add(param: torch.Tensor, out: torch.Tensor, decay: float, coef: float) -> None:
    """param <- param * decay + coef * out in place (the decayed param rounded to its dtype first);
    both [groups, rows, cols], any strides."""
    _check("param", param, param, STATE_DTYPES)
    _check("out", out, param, STAGE_DTYPES)
    if param.numel():
        _decay_and_add_kernel[_grid(param)](
            param, out, param.shape[1], param.shape[2], *param.stride(), *out.stride(), float(decay), float(coef),
            BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=NUM_WARPS)
