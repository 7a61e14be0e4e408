"""Triton pieces of DSA's sparse indexer loss (GLM-5 report, DSA training; DeepSeek-V3.2 section 2.1).

    L_I = mean_t KL( p[t, S_t] || softmax(I[t, S_t]) ),   p[t, j] = sum_h P_h(t, j) / sum_{h, j} P_h(t, j)

- the target p: the sparse attention's backward kernel sums P over this rank's heads as it goes
  (`sparse_mla.sparse_mla_backward`'s `head_sums`), so it costs no gather or product of its own.
- `index_scores_at`: I[t, j] = d^-1/2 sum_h w[t, h] ReLU(q_I[t, h] . k_I[S_t[j]]) at the selected
  keys, with a backward to q_I, w and k_I (k_I rows are shared between tokens: fp32 atomics or the
  deterministic per-key reduction of `segment_sum`).

The KL itself, its TP reduction and normalization are elementwise work on [rows, K] in
`pretrain.model.dsa.indexer_loss`, which runs them block by block of query rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pretrain.model.dsa.kernels.atomics import add_rows, reduction_mode
from pretrain.model.dsa.kernels.common import dot_precision, pow2
from pretrain.model.dsa.kernels.segment_sum import scatter_rows_deterministic


@triton.jit
def _scores_at_fwd(q_ptr, k_ptr, w_ptr, idx_ptr, out_ptr, H, D, K, r0,
                   s_qb, s_qt, s_qh, s_kb, s_kt, s_wb, s_wt, s_ib, s_it, s_ob, s_ot, scale,
                   BH: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
    t = r0 + tl.program_id(0).to(tl.int64)
    bid = tl.program_id(1).to(tl.int64)
    h = tl.arange(0, BH)
    d = tl.arange(0, BD)
    hm = h < H
    q = tl.load(q_ptr + bid * s_qb + t * s_qt + h[:, None] * s_qh + d[None, :],
                mask=hm[:, None] & (d[None, :] < D), other=0.0)
    w = tl.load(w_ptr + bid * s_wb + t * s_wt + h, mask=hm, other=0.0)
    for j0 in range(0, K, BN):
        j = j0 + tl.arange(0, BN)
        idx = tl.load(idx_ptr + bid * s_ib + t * s_it + j, mask=j < K, other=-1)
        ok = idx >= 0
        kk = tl.load(k_ptr + bid * s_kb + idx.to(tl.int64)[:, None] * s_kt + d[None, :],
                     mask=ok[:, None] & (d[None, :] < D), other=0.0)
        z = tl.dot(q, tl.trans(kk), input_precision=PREC)
        score = tl.sum(tl.maximum(z, 0.0) * w[:, None], 0) * scale
        tl.store(out_ptr + bid * s_ob + (t - r0) * s_ot + j, tl.where(ok, score, float("-inf")), mask=j < K)


@triton.jit
def _scores_at_bwd(q_ptr, k_ptr, w_ptr, idx_ptr, g_ptr, dq_ptr, dw_ptr, dk_ptr, part_ptr, S, H, D, K, T, r0,
                   s_qb, s_qt, s_qh, s_kb, s_kt, s_wb, s_wt, s_ib, s_it, s_gb, s_gt, s_pb, s_pt, s_pj, scale,
                   BH: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr,
                   DETERMINISTIC: tl.constexpr, RED: tl.constexpr):
    t = r0 + tl.program_id(0).to(tl.int64)
    bid = tl.program_id(1).to(tl.int64)
    h = tl.arange(0, BH)
    d = tl.arange(0, BD)
    hm = h < H
    dm = d < D
    q = tl.load(q_ptr + bid * s_qb + t * s_qt + h[:, None] * s_qh + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0)
    w = tl.load(w_ptr + bid * s_wb + t * s_wt + h, mask=hm, other=0.0)
    dq = tl.zeros((BH, BD), tl.float32)
    dw = tl.zeros((BH,), tl.float32)
    for j0 in range(0, K, BN):
        j = j0 + tl.arange(0, BN)
        idx = tl.load(idx_ptr + bid * s_ib + t * s_it + j, mask=j < K, other=-1)
        ok = idx >= 0
        row = idx.to(tl.int64)[:, None]
        kk = tl.load(k_ptr + bid * s_kb + row * s_kt + d[None, :], mask=ok[:, None] & dm[None, :], other=0.0)
        g = tl.load(g_ptr + bid * s_gb + (t - r0) * s_gt + j, mask=(j < K) & ok, other=0.0)
        z = tl.dot(q, tl.trans(kk), input_precision=PREC)
        dw += tl.sum(tl.maximum(z, 0.0) * g[None, :], 1) * scale
        dz = tl.where(z > 0, w[:, None] * g[None, :], 0.0) * scale
        dzc = dz.to(kk.dtype)
        dq = tl.dot(dzc, kk, dq, input_precision=PREC)
        dk = tl.dot(tl.trans(dzc), q, input_precision=PREC)
        if DETERMINISTIC:
            tl.store(part_ptr + bid * s_pb + (t - r0).to(tl.int64) * s_pt + j[:, None] * s_pj + d[None, :], dk,
                     mask=ok[:, None] & dm[None, :])
        else:
            add_rows(dk_ptr + (bid * T + idx.to(tl.int64)) * D, 0, dk, ok, D, RED)
    base = (bid * S + t).to(tl.int64) * H + h
    tl.store(dq_ptr + base[:, None] * D + d[None, :], dq, mask=hm[:, None] & dm[None, :])
    tl.store(dw_ptr + base, dw, mask=hm)


class IndexScoresAt(torch.autograd.Function):
    """Index scores at the selected keys of rows [r0, r1): q [b, s, H, d], k [b, T, d], w [b, s, H] fp32,
    indices [b, s, K] int32 -> [b, r1 - r0, K] fp32 (-inf on empty slots). Gradients for q, k and w are
    full-size (zero outside the rows)."""

    @staticmethod
    def forward(ctx, q, k, w, indices, r0: int, r1: int, deterministic: bool):
        b, s, h, d = q.shape
        kk = indices.shape[-1]
        out = torch.empty(b, r1 - r0, kk, dtype=torch.float32, device=q.device)
        prec = dot_precision(q)
        _scores_at_fwd[(r1 - r0, b)](
            q, k, w, indices, out, h, d, kk, r0, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
            w.stride(0), w.stride(1), indices.stride(0), indices.stride(1), out.stride(0), out.stride(1), d**-0.5,
            BH=pow2(h), BD=pow2(d), BN=64, PREC=prec, num_warps=4)
        ctx.save_for_backward(q, k, w, indices)
        ctx.rows, ctx.deterministic = (r0, r1), deterministic
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, w, indices = ctx.saved_tensors
        r0, r1 = ctx.rows
        b, s, h, d = q.shape
        t, kk = k.shape[1], indices.shape[-1]
        grad = grad.float().contiguous()
        dq = torch.zeros(b, s, h, d, dtype=torch.float32, device=q.device)
        dw = torch.zeros(b, s, h, dtype=torch.float32, device=q.device)
        dk = torch.zeros(b, t, d, dtype=torch.float32, device=q.device)
        prec = dot_precision(q)
        red = reduction_mode(dk, d)

        def launch(c0, rows, part):
            g = grad[:, c0 - r0:]
            _scores_at_bwd[(rows, b)](
                q, k, w, indices, g, dq, dw, dk, part, s, h, d, kk, t, c0,
                q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), w.stride(0), w.stride(1),
                indices.stride(0), indices.stride(1), g.stride(0), g.stride(1),
                *(part.stride()[:3] if part.dim() == 4 else (0, 0, 0)), d**-0.5,
                BH=pow2(h), BD=pow2(d), BN=64, PREC=prec, DETERMINISTIC=ctx.deterministic, RED=red,
                num_warps=4)

        if ctx.deterministic:
            scatter_rows_deterministic(lambda c0, rows, part: launch(r0 + c0, rows, part),
                                       indices[:, r0:r1], dk, r1 - r0)
        else:
            launch(r0, r1 - r0, dk)
        return dq.to(q.dtype), dk.to(k.dtype), dw.to(w.dtype), None, None, None, None


def index_scores_at(q, k, w, indices, r0: int, r1: int, deterministic: bool = False) -> torch.Tensor:
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("index_scores_at needs the head dim contiguous in q and k")
    return IndexScoresAt.apply(q, k, w, indices, int(r0), int(r1), bool(deterministic))
