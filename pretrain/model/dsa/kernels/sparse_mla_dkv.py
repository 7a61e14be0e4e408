"""The key/value gradient of sparse MLA attention as its own pass over stored probabilities (GLM-5 report,
DSA section; DeepSeek-V3.2 section 2). Math, with the notation of `sparse_mla`:

    dkv[S_t[j], :C] += sum_h dS_h(t, j) q_h(t)[:C] + P_h(t, j) dO_h(t)
    dkv[S_t[j], C:] += sum_h dS_h(t, j) q_h(t)[C:]

The fused backward (`sparse_mla._bwd_kernel`, DKV 0) forms these products next to dq, where dS and P sit in
registers in the [heads, keys] orientation and q / dO as A operands of the score products: the key-side products
then need dS^T and P^T and q / dO in a second orientation, which Triton keeps as a second shared-memory copy or
re-reads in narrow slices (at 64 heads most of the backward's time). Here the backward's first pass stores dS and P
(bf16, as the fused kernel rounds them before its products) per (token, slot) as rows of 2H values, and this pass
reads them as the A operand [slots, heads] of one product per column slice: [dS | P] [BN, 2H] x [q ; dO] [2H, DS], q
and dO only ever as B operands, each program owning one (token, column slice). Its rows go into dkv through fp32
atomics as in the fused kernel. The buffer is transient backward memory: 2 k H bf16 per query row, at most
`DSAKernelTuning.dkv_scratch_bytes` (blocks of query rows). `plan.kernel_plan` takes this pass from 32 heads per
rank.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pretrain.model.dsa.kernels.atomics import add_rows, reduction_mode
from pretrain.model.dsa.kernels.common import pow2, slot_range
from pretrain.model.dsa.kernels.tuning import DEFAULT_TUNING, DSAKernelTuning


@triton.jit
def _dkv_kernel(q_ptr, do_ptr, idx_ptr, nv_ptr, part_ptr, dkv_ptr, S, H, T, r0, k_lo, k_hi,
                s_qb, s_qt, s_qh, s_dob, s_dot, s_doh, s_ib, s_it, s_pb, s_pt, s_pj,
                C: tl.constexpr, R: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, DS: tl.constexpr,
                NSL: tl.constexpr, ROPE: tl.constexpr, PREC: tl.constexpr, PART: tl.constexpr, RED: tl.constexpr):
    # program = (token, column slice); the slices of one token are neighbours in the grid, so they read the
    # token's [dS | P] rows at about the same time (L2 can serve all but the first).
    pid = tl.program_id(0).to(tl.int64)
    bid = tl.program_id(1).to(tl.int64)
    t = r0 + pid // NSL
    c0 = (pid % NSL) * DS + (C if ROPE else 0)
    h = tl.arange(0, BH)
    n = tl.arange(0, BN)
    cols = c0 + tl.arange(0, DS)
    nv = tl.load(nv_ptr + bid * S + t)
    idx_row = idx_ptr + bid * s_ib + t * s_it
    prow = part_ptr + bid * s_pb + (t - r0) * s_pt
    if PART:  # only the slots whose keys lie in [k_lo, k_hi) (sparse_mla.key_partitions); no loads where none
        j_lo, j_hi = slot_range(idx_row, nv, k_lo, k_hi, 256)
        hm = h < tl.where(j_hi > j_lo, H, 0)
    else:
        j_lo, j_hi = 0, nv
        hm = h < H
    cm = cols < (C + R if ROPE else C)
    q_c = tl.load(q_ptr + bid * s_qb + t * s_qt + h[:, None] * s_qh + cols[None, :],
                  mask=hm[:, None] & cm[None, :], other=0.0)
    if not ROPE:
        do_c = tl.load(do_ptr + bid * s_dob + t * s_dot + h[:, None] * s_doh + cols[None, :],
                       mask=hm[:, None] & cm[None, :], other=0.0)
    for j0 in range(j_lo, j_hi, BN):
        j = j0 + n
        idx = tl.load(idx_row + j, mask=j < j_hi, other=-1)
        ok = idx >= 0
        pb = prow + j[:, None] * s_pj + h[None, :]
        ds = tl.load(pb, mask=ok[:, None] & hm[None, :], other=0.0)
        dk = tl.dot(ds, q_c, input_precision=PREC)
        if not ROPE:
            p = tl.load(pb + H, mask=ok[:, None] & hm[None, :], other=0.0)
            dk = tl.dot(p, do_c, dk, input_precision=PREC)
        add_rows(dkv_ptr + (bid * T + idx.to(tl.int64)) * (C + R), c0, dk, ok, C + R if ROPE else C, RED)


def dkv_config(h: int, c: int, tiles=None):
    """(BN, DS, num_warps, num_stages) of the key-gradient pass: `tiles` (`DSAKernelTuning.dkv_tiles`) if given,
    else the best of an H200 sweep at 8-64 heads."""
    return tuple(tiles) if tiles is not None else (32, min(128, pow2(c)), 4, 3)


def scratch_rows(b: int, k: int, h: int, s: int, itemsize: int, scratch_bytes: int = 1 << 30) -> int:
    """Query rows per block so that the [dS | P] buffer [b, rows, k, 2h] stays within `scratch_bytes`."""
    return max(1, min(s, int(scratch_bytes) // max(1, b * k * 2 * h * itemsize)))


def key_gradient(q, grad_out, indices, nvalid, part, dkv, r0: int, rows: int, c: int, r: int, prec: str,
                 keys=None, tuning: DSAKernelTuning = DEFAULT_TUNING):
    """dkv [b, T, C + R] fp32 += the key/value gradient of query rows r0 .. r0 + rows from part [b, rows', k, 2h]
    (dS, then P, per (token, slot)); `keys` = (lo, hi): only the selected keys in [lo, hi)."""
    b, s, h = q.shape[:3]
    bn, ds, warps, stages = dkv_config(h, c, tuning.dkv_tiles)
    k_lo, k_hi = keys if keys is not None else (0, dkv.shape[1])
    red = reduction_mode(dkv, c, r, vector=tuning.vector_atomics)
    for rope, width, nsl in ((False, c, triton.cdiv(c, ds)), (True, r, 1)):
        _dkv_kernel[(rows * nsl, b)](
            q, grad_out, indices, nvalid, part, dkv, s, h, dkv.shape[1], r0, k_lo, k_hi,
            q.stride(0), q.stride(1), q.stride(2), grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
            indices.stride(0), indices.stride(1), part.stride(0), part.stride(1), part.stride(2),
            C=c, R=r, BH=pow2(h), BN=bn, DS=ds if not rope else pow2(width), NSL=nsl, ROPE=rope, PREC=prec,
            PART=keys is not None, RED=red, num_warps=warps, num_stages=stages)


def empty_scratch(q: torch.Tensor, k: int, rows: int) -> torch.Tensor:
    """The [dS | P] buffer [b, rows, k, 2h] in q's dtype."""
    return torch.empty(q.shape[0], rows, k, 2 * q.shape[2], dtype=q.dtype, device=q.device)
