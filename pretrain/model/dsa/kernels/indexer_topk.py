"""Triton lightning indexer with top-k selection (GLM-5 report, DSA; DeepSeek-V3.2 section 2.1).

For query token t with visible keys [lo_t, hi_t) (causal, within t's document):

    I[t, s] = d^-1/2 * sum_j w[t, j] * ReLU(q_I[t, j] . k_I[s])        (w already carries H_I^-1/2)
    S_t     = the min(K, hi_t - lo_t) keys of largest I[t, s]

Two kernels per block of query rows, never an [S, S] matrix:

1. `_scores_kernel`: one program per BM query tokens multiplies tiles of BN keys with their [BM * H_I, d]
   queries (tensor cores, keys as the MMA's M), applies ReLU and the head weights, sums over heads and writes
   the [BM, BN] fp32 scores into a row-block buffer [rows, T] (rows x T x 4 bytes, bounded by
   `buffer_bytes`).
2. `radix_select`: one program per query row finds the K-th largest score exactly by radix selection on
   the scores' order-preserving 32-bit keys, usually reading the row once (a sampled threshold, then a copy of
   the keys above it), then writes the selected key indices in ascending order.
3. (asked for by the sparse indexer loss) `_selected_lse_kernel`: each row's log sum exp over its selected keys'
   scores, read back from the buffer, so that the loss's kernel (`indexer_kl`) need not form it again.

Tie rule (the reference `pretrain.model.dsa.indexer.select_topk` follows it too): every key
scoring above the K-th largest value is selected, and among keys equal to it the lowest key
indices are taken; -0.0 counts as +0.0. Output slots are ascending key indices, rows with fewer than K visible keys
list all of them and pad with -1. The result is deterministic.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pretrain.model.dsa.kernels.common import dot_precision, pow2
from pretrain.model.dsa.kernels.radix_select import select_rows
from pretrain.model.dsa.kernels.ranges import ranges_move_backwards
from pretrain.model.dsa.kernels.tuning import DEFAULT_TUNING, DSAKernelTuning


@triton.jit
def _scores_kernel(q_ptr, k_ptr, w_ptr, lo_ptr, hi_ptr, out_ptr, ks_ptr, r0, n_rows, T,
                   s_qb, s_qt, s_qh, s_kb, s_kt, s_wb, s_wt, s_lb, s_ob, s_or, s_ksb, scale,
                   H: tl.constexpr, D: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr, KSCALE: tl.constexpr,
                   KEYS_M: tl.constexpr):
    # Heavy (late, causal) row blocks first: they bound the kernel's tail.
    pid = tl.num_programs(0) - 1 - tl.program_id(0).to(tl.int64)
    bid = tl.program_id(1).to(tl.int64)
    rows = pid * BM + tl.arange(0, BM)                 # local rows of this chunk
    row_ok = rows < n_rows
    m = tl.arange(0, BM * BH)                          # (token, head) pairs as the MMA's M dim
    tok, head = m // BH, m % BH
    d = tl.arange(0, BD)
    m_ok = ((pid * BM + tok) < n_rows) & (head < H)
    q = tl.load(q_ptr + bid * s_qb + (r0 + pid * BM + tok)[:, None] * s_qt + head[:, None] * s_qh + d[None, :],
                mask=m_ok[:, None] & (d[None, :] < D), other=0.0)
    w = tl.load(w_ptr + bid * s_wb + (r0 + pid * BM + tok) * s_wt + head, mask=m_ok, other=0.0)
    lo = tl.load(lo_ptr + bid * s_lb + r0 + rows, mask=row_ok, other=2147483647)
    hi = tl.load(hi_ptr + bid * s_lb + r0 + rows, mask=row_ok, other=0)
    # lo and hi do not decrease along the sequence (checked by the wrapper): the block's key range
    # runs from its first row's lo to its last row's hi.
    last = tl.minimum(pid * BM + BM, n_rows) - 1
    k_start = (tl.load(lo_ptr + bid * s_lb + r0 + pid * BM) // BN) * BN
    k_end = tl.load(hi_ptr + bid * s_lb + r0 + last)
    for n0 in range(k_start, k_end, BN):
        n = n0 + tl.arange(0, BN)
        k = tl.load(k_ptr + bid * s_kb + n[:, None] * s_kt + d[None, :],
                    mask=(n[:, None] < T) & (d[None, :] < D), other=0.0)
        if KEYS_M:  # keys as the MMA's M: the head sum runs along each thread's columns (fewer shuffles)
            z = tl.dot(k, tl.trans(q), input_precision=PREC)      # [BN, BM * BH]
            z = tl.maximum(z, 0.0) * w[None, :]
            score = tl.trans(tl.sum(tl.reshape(z, (BN, BM, BH)), axis=2)) * scale
        else:
            z = tl.dot(q, tl.trans(k), input_precision=PREC)      # [BM * BH, BN]
            z = tl.maximum(z, 0.0) * w[:, None]
            score = tl.sum(tl.reshape(z, (BM, BH, BN)), axis=1) * scale
        if KSCALE:  # FP8 selection (indexer_fp8): each key's own scale, after the exact e4m3 products
            score = score * tl.load(ks_ptr + bid * s_ksb + n, mask=n < T, other=1.0)[None, :]
        vis = (n[None, :] >= lo[:, None]) & (n[None, :] < hi[:, None])
        score = tl.where(vis, score, float("-inf"))
        tl.store(out_ptr + bid * s_ob + rows[:, None] * s_or + n[None, :], score,
                 mask=row_ok[:, None] & (n[None, :] < T))


def _score_config(h: int, block_m: int, block_n: int, num_warps: int, tiles):
    """(BH, BM, BN, num_warps, num_stages, keys_m) from `tiles` (`DSAKernelTuning.score_tiles`: keys as the MMA's M,
    64 keys x 128 / heads tokens, 4 warps, the best of an H200 sweep; with the (token, head) rows as M the head sum
    crosses warps): BM tokens x BH heads = 128 MMA columns (or rows) by default."""
    bm0, bn0, warps0, stages0, keys_m = tiles
    bh = pow2(h, 1)
    bm = block_m or bm0 or max(1, 128 // bh)
    return (bh, max(bm, 16 // bh if bh < 16 else 1), block_n or bn0 or 64, num_warps or warps0 or 8, stages0 or 3,
            bool(keys_m))


def index_score_rows(q, k, w, lo, hi, r0: int, n: int, out: torch.Tensor, block_m: int = 0, block_n: int = 0,
                     num_warps: int = 0, k_scale=None, tuning: DSAKernelTuning = DEFAULT_TUNING) -> torch.Tensor:
    """Scores of query rows [r0, r0 + n) into out[:, :n] ([b, >= n, T] fp32); keys outside a row's
    [lo, hi) are -inf or left unwritten. lo / hi int32 contiguous [b | 1, s]. q and k bf16 / fp32, or
    float8_e4m3fn with `k_scale` [b, T] fp32 multiplying each key's column (`indexer_fp8`)."""
    b, s, h, d = q.shape
    t = k.shape[1]
    bh, bm, bn, warps, stages, keys_m = _score_config(h, block_m, block_n, num_warps, tuning.score_tiles)
    ks = k_scale if k_scale is not None else w
    _scores_kernel[(triton.cdiv(n, bm), b)](
        q, k, w, lo, hi, out, ks, r0, n, t,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), w.stride(0), w.stride(1),
        0 if lo.shape[0] == 1 else lo.stride(0), out.stride(0), out.stride(1), ks.stride(0), d**-0.5,
        H=h, D=d, BH=bh, BD=pow2(d, 32 if q.dtype == torch.float8_e4m3fn else 16), BM=bm, BN=bn,
        PREC=dot_precision(q), KSCALE=k_scale is not None, KEYS_M=keys_m, num_warps=warps, num_stages=stages)
    return out


@triton.jit
def _selected_lse_kernel(s_ptr, idx_ptr, lse_ptr, r0, S, K, s_sb, s_sr, s_ib, s_it, BLOCK: tl.constexpr):
    # lse[t] = log sum_j exp(I[t, S_t[j]]) over row t's selection (0 where it has no key), read back from the row's
    # scores while they are still in the buffer: the sparse indexer loss's normalizer, 4 bytes per token
    row = tl.program_id(0).to(tl.int64)
    bid = tl.program_id(1).to(tl.int64)
    src = s_ptr + bid * s_sb + row * s_sr
    idx_row = idx_ptr + bid * s_ib + (r0 + row) * s_it
    m = tl.full([], float("-inf"), tl.float32)
    lsum = tl.zeros([], tl.float32)
    for j0 in range(0, K, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        idx = tl.load(idx_row + j, mask=j < K, other=-1)
        v = tl.load(src + idx, mask=idx >= 0, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(v, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        lsum = lsum * tl.exp(m - m_use) + tl.sum(tl.where(idx >= 0, tl.exp(v - m_use), 0.0), 0)
        m = m_new
    tl.store(lse_ptr + bid * S + r0 + row, tl.where(lsum > 0, m + tl.log(tl.where(lsum > 0, lsum, 1.0)), 0.0))


def visible_ranges(lo: torch.Tensor, hi: torch.Tensor, check: bool = True):
    """lo / hi as the kernels take them; `check` that they never move backwards (a host sync: callers
    whose ranges are non-decreasing by construction, as `VisibleKeys.ranges`, skip it)."""
    lo, hi = lo.to(torch.int32).contiguous(), hi.to(torch.int32).contiguous()
    if check and ranges_move_backwards(lo, hi):
        raise ValueError("the DSA top-k kernel needs visible-key ranges that never move backwards along the "
                         "sequence (causal attention within documents)")
    return lo, hi


def indexer_topk(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, topk: int, lo: torch.Tensor, hi: torch.Tensor,
                 buffer_bytes: int = 1 << 30, block_m: int = 0, block_n: int = 0, num_warps: int = 0,
                 check_ranges: bool = True, k_scale=None, lse: Optional[torch.Tensor] = None,
                 tuning: DSAKernelTuning = DEFAULT_TUNING) -> torch.Tensor:
    """q [b, s, H_I, d], k [b, T, d], w [b, s, H_I] (fp32), lo / hi [b | 1, s] (visible keys [lo, hi)) ->
    indices [b, s, min(topk, T)] int32, ascending per row, -1 padded. `check_ranges`: see `visible_ranges`.
    FP8 selection (`pretrain.model.dsa.indexer_fp8`): q, k float8_e4m3fn, w with the query scales folded in,
    `k_scale` [b, T] fp32 the key scales. `lse` (not with FP8 scores): a contiguous [b, s] fp32 tensor that receives
    each row's log sum exp of its selected keys' scores (`indexer_kl.sparse_kl`'s `lse`)."""
    b, s, h, d = q.shape
    t = k.shape[1]
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("indexer_topk needs the head dim contiguous in q and k")
    if lse is not None and (k_scale is not None or lse.shape != (b, s) or lse.dtype != torch.float32
                            or not lse.is_contiguous()):
        raise ValueError("indexer_topk's lse takes a contiguous fp32 [b, s] tensor, and no FP8 scores")
    w = w.float()
    lo, hi = visible_ranges(lo, hi, check_ranges)
    out = torch.empty(b, s, min(int(topk), t), dtype=torch.int32, device=q.device)
    rows = max(16, min(s, buffer_bytes // (4 * t * b)) // 16 * 16)
    buf = torch.empty(b, min(rows, s), t, dtype=torch.float32, device=q.device)
    for r0 in range(0, s, rows):
        n = min(rows, s - r0)
        index_score_rows(q, k, w, lo, hi, r0, n, buf, block_m, block_n, num_warps, k_scale, tuning)
        select_rows(buf, lo, hi, r0, n, topk, out, tuning=tuning.select)
        if lse is not None:
            _selected_lse_kernel[(n, b)](buf, out, lse, r0, s, out.shape[-1], buf.stride(0), buf.stride(1),
                                         out.stride(0), out.stride(1), BLOCK=256)
    return out
