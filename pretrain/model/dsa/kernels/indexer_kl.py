"""DSA's sparse indexer loss and its gradient in one Triton kernel (GLM-5 report, DSA training; DeepSeek-V3.2
section 2.1). For query token t with selected keys S_t (slots j; -1 = empty) and target p_j (the attention's
head-summed probabilities at the selected keys, normalized: `indexer_loss.normalize_heads`, or by the kernel itself,
`sparse_kl(normalize=True)`):

    z_hj = q_I[t, h] . k_I[S_t[j]],    I_j = d^-1/2 sum_h w_h ReLU(z_hj),    lse = log sum_j exp(I_j)
    L_t  = sum_j p_j log p_j - p_j (I_j - lse)                       (KL(p || softmax(I)) when sum_j p_j = 1)
    g_j  = dL_t / dI_j = P exp(I_j - lse) - p_j,   P = sum_j p_j
    dq_I[t, h] = d^-1/2 w_h sum_j [z_hj > 0] g_j k_I[S_t[j]],     dw[t, h] = d^-1/2 sum_j ReLU(z_hj) g_j
    dk_I[S_t[j]] += d^-1/2 sum_h [z_hj > 0] w_h g_j q_I[t, h]

One program per query token. Given lse from the selection (`indexer_topk`'s `lse`: each row's log sum exp over
its selected keys' scores, read back from the top-k's score buffer, 4 bytes a token) it walks its selection once,
forming g and the gradients; without it (FP8 selection, whose scores are not these) a first walk forms lse by an
online max and sum, and the second recomputes z. Nothing per (token, slot) is written or read besides the target:
the unfused form (index scores at the selected keys from one kernel, the KL through PyTorch autograd, the gradient
from a second kernel) wrote and read the scores, their log-softmax and its gradient as [rows, K] fp32 tensors.
What is left per pair is a gather of a d-wide k_I row (mostly L2 hits: k_I is 256 B per key), four small
products, and the fp32 add of the key row's gradient. With KEYS_M the slots are the products' M dimension
(z^T = k q^T, dq^T = k^T dz^T, dk = dz^T q: M = BN, d, BN), as in the top-k's score kernel, else the heads are
(M = H_I, 16-32). Key rows are shared between tokens: fp32 atomics (`atomics.add_rows`) or, deterministic,
per-(token, slot) rows reduced per key in a fixed order (`segment_sum`).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from pretrain.model.dsa.kernels.atomics import add_rows, reduction_mode
from pretrain.model.dsa.kernels.common import dot_precision, pow2
from pretrain.model.dsa.kernels.segment_sum import scatter_rows_deterministic
from pretrain.model.dsa.kernels.tuning import DEFAULT_TUNING, DSAKernelTuning

@triton.jit
def _slot_scores(qo, w, k_ptr, idx_row, j0, K, d, dm, s_kt, scale, BN: tl.constexpr, PREC: tl.constexpr,
                 KEYS_M: tl.constexpr):
    """Slots j0 .. j0 + BN: (slots, key indices, valid, gathered k_I [BN, BD], z, I [BN]); KEYS_M: qo = q^T
    [BD, BH] and z = z^T [BN, BH] (the slots as the MMA's M), else qo = q [BH, BD] and z [BH, BN]."""
    j = j0 + tl.arange(0, BN)
    idx = tl.load(idx_row + j, mask=j < K, other=-1)
    ok = idx >= 0
    kk = tl.load(k_ptr + idx.to(tl.int64)[:, None] * s_kt + d[None, :], mask=ok[:, None] & dm[None, :], other=0.0)
    if KEYS_M:
        z = tl.dot(kk, qo, input_precision=PREC)
        score = tl.sum(tl.maximum(z, 0.0) * w[None, :], 1) * scale
    else:
        z = tl.dot(qo, tl.trans(kk), input_precision=PREC)
        score = tl.sum(tl.maximum(z, 0.0) * w[:, None], 0) * scale
    return j, idx, ok, kk, z, score


@triton.jit
def _sparse_kl_kernel(q_ptr, k_ptr, w_ptr, idx_ptr, p_ptr, lse_ptr, dq_ptr, dw_ptr, dk_ptr, part_ptr, stats_ptr,
                      S, H, D, K, T, r0, p0, s_qb, s_qt, s_qh, s_kb, s_kt, s_wb, s_wt, s_ib, s_it, s_pb, s_pt,
                      s_xb, s_xt, s_xj, scale, grad_scale,
                      BH: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr, KEYS_M: tl.constexpr,
                      HAS_LSE: tl.constexpr, DETERMINISTIC: tl.constexpr, RED: tl.constexpr, NORMALIZE: tl.constexpr):
    # program = query token t (launch rows from r0; p holds rows from p0); grid axis 1 = batch row
    t = r0 + tl.program_id(0).to(tl.int64)
    bid = tl.program_id(1).to(tl.int64)
    h = tl.arange(0, BH)
    d = tl.arange(0, BD)
    hm = h < H
    dm = d < D
    qb = q_ptr + bid * s_qb + t * s_qt
    if KEYS_M:
        qo = tl.load(qb + h[None, :] * s_qh + d[:, None], mask=hm[None, :] & dm[:, None], other=0.0)
    else:
        qo = tl.load(qb + h[:, None] * s_qh + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0)
    w = tl.load(w_ptr + bid * s_wb + t * s_wt + h, mask=hm, other=0.0).to(tl.float32)
    idx_row = idx_ptr + bid * s_ib + t * s_it
    p_row = p_ptr + bid * s_pb + (t - p0) * s_pt
    k_base = k_ptr + bid * s_kb
    p_i = tl.zeros([], tl.float32)
    p_logp = tl.zeros([], tl.float32)
    p_sum = tl.zeros([], tl.float32)
    # the sums over the target row as given (raw head sums under NORMALIZE); `inv` rescales them below
    if HAS_LSE:  # lse from the selection (`indexer_topk`'s `lse`): one pass over p for its sums
        lse = tl.load(lse_ptr + bid * S + t)
        for j0 in range(0, K, 256):
            p = tl.load(p_row + j0 + tl.arange(0, 256), mask=j0 + tl.arange(0, 256) < K, other=0.0)
            p_logp += tl.sum(tl.where(p > 0, p * tl.log(tl.where(p > 0, p, 1.0)), 0.0), 0)
            p_sum += tl.sum(p, 0)
    else:  # walk 1: lse by an online max / sum; sum p I, sum p log p and P
        m = tl.full([], float("-inf"), tl.float32)
        lsum = tl.zeros([], tl.float32)
        for j0 in range(0, K, BN):
            j, idx, ok, kk, z, score = _slot_scores(qo, w, k_base, idx_row, j0, K, d, dm, s_kt, scale, BN, PREC,
                                                    KEYS_M)
            p = tl.load(p_row + j, mask=ok, other=0.0)
            m_new = tl.maximum(m, tl.max(tl.where(ok, score, float("-inf")), 0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            lsum = lsum * tl.exp(m - m_use) + tl.sum(tl.where(ok, tl.exp(score - m_use), 0.0), 0)
            m = m_new
            p_i += tl.sum(p * score, 0)
            p_logp += tl.sum(tl.where(p > 0, p * tl.log(tl.where(p > 0, p, 1.0)), 0.0), 0)
            p_sum += tl.sum(p, 0)
        lse = tl.where(lsum > 0, m + tl.log(tl.where(lsum > 0, lsum, 1.0)), 0.0)
    inv = tl.full([], 1.0, tl.float32)
    if NORMALIZE:  # p = h / sum(h): sum p log p = inv sum h log h + sum(h) inv log inv, sum p = inv sum(h)
        inv = tl.where(p_sum > 0, 1.0 / tl.where(p_sum > 0, p_sum, 1.0), 0.0)
        p_logp = inv * p_logp + tl.where(p_sum > 0, p_sum * inv * tl.log(tl.where(inv > 0, inv, 1.0)), 0.0)
        p_i = inv * p_i
        p_sum = inv * p_sum
    # walk 2: g, then dq and dw in registers and the key rows' gradients
    if KEYS_M:
        dq = tl.zeros((BD, BH), tl.float32)
    else:
        dq = tl.zeros((BH, BD), tl.float32)
    dw = tl.zeros((BH,), tl.float32)
    for j0 in range(0, K, BN):
        j, idx, ok, kk, z, score = _slot_scores(qo, w, k_base, idx_row, j0, K, d, dm, s_kt, scale, BN, PREC, KEYS_M)
        p = tl.load(p_row + j, mask=ok, other=0.0) * inv
        if HAS_LSE:
            p_i += tl.sum(p * score, 0)
        g = tl.where(ok, p_sum * tl.exp(score - lse) - p, 0.0) * grad_scale
        if KEYS_M:
            dw += tl.sum(tl.maximum(z, 0.0) * g[:, None], 0) * scale
            dzc = (tl.where(z > 0, g[:, None] * w[None, :], 0.0) * scale).to(kk.dtype)  # [BN, BH]
            dq = tl.dot(tl.trans(kk), dzc, dq, input_precision=PREC)
            dk = tl.dot(dzc, tl.trans(qo), input_precision=PREC)
        else:
            dw += tl.sum(tl.maximum(z, 0.0) * g[None, :], 1) * scale
            dzc = (tl.where(z > 0, w[:, None] * g[None, :], 0.0) * scale).to(kk.dtype)  # [BH, BN]
            dq = tl.dot(dzc, kk, dq, input_precision=PREC)
            dk = tl.dot(tl.trans(dzc), qo, input_precision=PREC)
        if DETERMINISTIC:
            tl.store(part_ptr + bid * s_xb + (t - r0) * s_xt + j[:, None] * s_xj + d[None, :], dk,
                     mask=ok[:, None] & dm[None, :])
        else:
            add_rows(dk_ptr + (bid * T + idx.to(tl.int64)) * D, 0, dk, ok, D, RED)
    tl.store(stats_ptr + (bid * S + t) * 2, p_logp - p_i + lse * p_sum)
    tl.store(stats_ptr + (bid * S + t) * 2 + 1, p_sum)
    base = (bid * S + t) * H + h
    if KEYS_M:
        tl.store(dq_ptr + base[None, :] * D + d[:, None], dq.to(dq_ptr.dtype.element_ty),
                 mask=hm[None, :] & dm[:, None])
    else:
        tl.store(dq_ptr + base[:, None] * D + d[None, :], dq.to(dq_ptr.dtype.element_ty),
                 mask=hm[:, None] & dm[None, :])
    tl.store(dw_ptr + base, dw, mask=hm)


def sparse_kl(q, k, w, indices, target: Callable, rows: Optional[int] = None, deterministic: bool = False,
              lse: Optional[torch.Tensor] = None, normalize: bool = False, grad_scale: float = 1.0,
              tuning: DSAKernelTuning = DEFAULT_TUNING):
    """The sparse indexer loss over the selected keys and its gradient, no autograd: q_I [b, s, H, d], k_I [b, T, d]
    (d-contiguous; T keys, e.g. gathered over context parallelism), w [b, s, H], indices [b, s, K] (int32, -1 =
    empty), `target(r0, r1, indices[:, r0:r1])` -> p [b, r1 - r0, K] (fp32, 0 on empty slots), asked for `rows`
    query rows at a time (None: all at once).
    `lse` [b, s] fp32: log sum_j exp(I_j) over each row's selection, as the top-k formed it (`indexer_topk`'s
    `lse`), which spares the kernel its first walk. `normalize`: the target rows are not yet L1-normalized (the
    attention's head sums as they come): the kernel divides each by its sum (a row summing to 0 counts as an empty
    target), which spares a division pass and a sum pass over [b, s, K] fp32. `grad_scale`: a factor on the gradients
    only (the loss's coefficient), applied inside the kernel instead of a pass over each gradient. -> (mean_t L_t,
    (dq_I, dk_I, dw) of grad_scale times that mean, in the inputs' dtypes, mean_t sum_j p_j)."""
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("the sparse indexer loss kernel needs the head dim contiguous in q_I and k_I")
    b, s, h, d = q.shape
    kk, n = indices.shape[-1], b * s
    if indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"the sparse indexer loss kernel needs int32 or int64 indices, got {indices.dtype}")
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # written as [b, s, H, d] whatever q's layout
    dw = torch.empty(b, s, h, dtype=torch.float32, device=q.device)
    dk = torch.zeros(b, k.shape[1], d, dtype=torch.float32, device=q.device)
    stats = torch.empty(b, s, 2, dtype=torch.float32, device=q.device)
    prec, red = dot_precision(q), reduction_mode(dk, d, vector=tuning.vector_atomics)
    rows = s if rows is None else max(1, int(rows))
    bn, warps, stages, keys_m = tuning.kl_tiles  # (BN slots per block, num_warps, num_stages, slots as M)
    if lse is not None and (lse.shape != (b, s) or lse.dtype != torch.float32 or not lse.is_contiguous()):
        raise ValueError(f"lse must be a contiguous fp32 [{b}, {s}] tensor, got {lse.dtype} {tuple(lse.shape)}")

    def launch(r0, count, p, p0, part):
        _sparse_kl_kernel[(count, b)](
            q, k, w, indices, p, stats if lse is None else lse, dq, dw, dk, part, stats, s, h, d, kk, k.shape[1], r0,
            p0,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), w.stride(0), w.stride(1),
            indices.stride(0), indices.stride(1), p.stride(0), p.stride(1),
            *(part.stride()[:3] if part.dim() == 4 else (0, 0, 0)), d**-0.5, float(grad_scale) / n,
            BH=pow2(h), BD=pow2(d), BN=bn, PREC=prec, KEYS_M=bool(keys_m), HAS_LSE=lse is not None,
            DETERMINISTIC=deterministic, RED=red, NORMALIZE=bool(normalize), num_warps=warps, num_stages=stages)

    for r0 in range(0, s, rows):
        r1 = min(s, r0 + rows)
        p = target(r0, r1, indices[:, r0:r1]).float()
        p = p if p.stride(-1) == 1 else p.contiguous()
        if deterministic:
            scatter_rows_deterministic(lambda c0, count, part: launch(r0 + c0, count, p, r0, part),
                                       indices[:, r0:r1], dk, r1 - r0)
        else:
            launch(r0, r1 - r0, p, r0, dk)
    totals = stats.sum((0, 1)) / n
    return totals[0], (dq, dk.to(k.dtype), dw.to(w.dtype)), totals[1]
