"""Exact top-k selection of DSA's index-score rows by radix selection (GLM-5 report, DSA; DeepSeek-V3.2 section
2.1), the second kernel of `indexer_topk`.

One program per query row finds the K-th largest score exactly on the scores' order-preserving 32-bit keys, 8 bits per
histogram pass from the top, then writes the selected key indices in ascending order. Tie rule: every key above the
K-th largest value is selected, and among keys equal to it the lowest key indices; -0.0 counts as +0.0. Rows with
at most K visible keys list all of them and pad with -1. The result is deterministic.

Passes over a row of n keys (each pass loads its next block while it works on this one, `SelectTuning.prefetch`):

- sampled (`SelectTuning.sample`, rows of 8K keys or more): the r-th largest of a sample, 64 chunks of n / 1,024 keys
  (at most 128) spread over the row, r such that about 1.5 K keys are expected at or above it, is a threshold; one
  pass copies the keys at or above it; if they are at least K and at most the capacity, the four radix passes and the
  write read only the copy. So the row is read once, plus the sample (1/16 of it, at most 8,192 keys). The K-th
  largest is among the copied keys whenever they are at least K, so the result is exact whatever the sample; a sample
  unlike its row only costs the passes below.
- otherwise: two 8-bit passes over the row; the keys still in play (above the K-th largest's 16-bit bucket, and that
  bucket) are copied out when they fit the capacity (`select_capacity`) and the last two passes and the write read
  only them: three passes over the row; past the capacity, five.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pretrain.model.dsa.kernels.tuning import SelectTuning


@triton.jit
def _order_key(x):
    """fp32 -> int64 in [0, 2^32) with the same order (-0.0 mapped to +0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(x == 0.0, 0, bits)
    return tl.where(bits < 0, (~bits).to(tl.int64), bits.to(tl.int64) + 2147483648)


@triton.jit
def _block(src, j, n, x, BLOCK: tl.constexpr, PREFETCH: tl.constexpr):
    """(block j of src[0:n], what the loop carries): with PREFETCH the block was loaded one iteration ahead (x) and
    the next one is issued now, so its load is in flight while this block is worked on; else loaded here."""
    if PREFETCH:
        return x, tl.load(src + j + BLOCK, mask=j + BLOCK < n, other=0.0)
    return tl.load(src + j, mask=j < n, other=0.0), x


@triton.jit
def _digit_histogram(src, n, prefix, shift, BLOCK: tl.constexpr, PREFETCH: tl.constexpr):
    """Histogram of the 8-bit digit at `shift` over the keys of src[0:n] whose higher digits equal prefix's."""
    offs = tl.arange(0, BLOCK)
    hist = tl.zeros((256,), tl.int32)
    x = tl.load(src + offs, mask=(offs < n) & PREFETCH, other=0.0)
    for j0 in range(0, n, BLOCK):
        j = j0 + offs
        cur, x = _block(src, j, n, x, BLOCK, PREFETCH)
        key = _order_key(cur)
        match = (key >> (shift + 8)) == (prefix >> (shift + 8))
        hist += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=(j < n) & match)
    return hist


@triton.jit
def _pick_digit(hist, prefix, k_rem, shift):
    """The digit holding the k_rem-th largest matching key: (prefix with it, its rank within that digit,
    the count of keys with that digit)."""
    bins = tl.arange(0, 256)
    below = tl.cumsum(hist, 0)
    above = tl.sum(hist, 0) - below               # count with a larger digit
    hit = (above < k_rem) & (above + hist >= k_rem)
    digit_sel = tl.sum(tl.where(hit, bins, 0), 0)
    k_rem -= tl.sum(tl.where(hit, above, 0), 0)
    return prefix + (digit_sel.to(tl.int64) << shift), k_rem, tl.sum(tl.where(hit, hist, 0), 0)


@triton.jit
def _radix_pass(src, n, prefix, k_rem, shift, BLOCK: tl.constexpr, PREFETCH: tl.constexpr):
    """One radix pass over src[0:n]: `_pick_digit` of the digit at `shift` -> (prefix, k_rem, bucket)."""
    return _pick_digit(_digit_histogram(src, n, prefix, shift, BLOCK, PREFETCH), prefix, k_rem, shift)


@triton.jit
def _low_passes(src, n, prefix, k_rem, BLOCK: tl.constexpr, PREFETCH: tl.constexpr):
    """The two low-digit passes (bits 8-15, then 0-7) -> (prefix, k_rem)."""
    prefix, k_rem, _ = _radix_pass(src, n, prefix, k_rem, 8, BLOCK, PREFETCH)
    prefix, k_rem, _ = _radix_pass(src, n, prefix, k_rem, 0, BLOCK, PREFETCH)
    return prefix, k_rem


@triton.jit
def _write_selected(src, idx_src, n, lo, prefix, k_rem, dst, BLOCK: tl.constexpr, HAS_IDX: tl.constexpr,
                    PREFETCH: tl.constexpr):
    """prefix is the K-th largest key: write every larger key's index and the first k_rem equal ones,
    ascending. Indices are lo + position, or idx_src[position] (compacted candidates)."""
    offs = tl.arange(0, BLOCK)
    ties = k_rem * 0
    written = k_rem * 0
    x = tl.load(src + offs, mask=(offs < n) & PREFETCH, other=0.0)
    for j0 in range(0, n, BLOCK):
        j = j0 + offs
        cur, x = _block(src, j, n, x, BLOCK, PREFETCH)
        key = _order_key(cur)
        inside = j < n
        gt = inside & (key > prefix)
        eq = inside & (key == prefix)
        eq_rank = tl.cumsum(eq.to(tl.int32), 0) + ties
        sel = gt | (eq & (eq_rank <= k_rem))
        pos = tl.cumsum(sel.to(tl.int32), 0) - 1 + written
        if HAS_IDX:
            tl.store(dst + pos, tl.load(idx_src + j, mask=sel, other=0), mask=sel)
        else:
            tl.store(dst + pos, lo + j, mask=sel)
        ties += tl.sum(eq.to(tl.int32), 0)
        written += tl.sum(sel.to(tl.int32), 0)


@triton.jit
def _sample_histogram(src, n, ch, prefix, shift, NCH: tl.constexpr, BLOCK: tl.constexpr):
    """`_digit_histogram` over the sample: NCH chunks of ch keys spread evenly over src[0:n] (n >= NCH * ch), read
    BLOCK at a time (so the sample never sits in registers whole, which would cost every pass its occupancy)."""
    offs = tl.arange(0, BLOCK)
    hist = tl.zeros((256,), tl.int32)
    for a0 in range(0, NCH * ch, BLOCK):
        a = a0 + offs
        key = _order_key(tl.load(src + (a // ch) * n // NCH + a % ch, mask=a < NCH * ch, other=0.0))
        match = (key >> (shift + 8)) == (prefix >> (shift + 8))
        hist += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=(a < NCH * ch) & match)
    return hist


@triton.jit
def _sample_threshold(src, n, ch, K, NCH: tl.constexpr, BLOCK: tl.constexpr):
    """The order key of the r-th largest key of the sample (`_sample_histogram`), r such that about 1.5 K keys of
    the row are expected at or above it."""
    m = NCH * ch
    r = tl.minimum(tl.maximum((K * m * 3) // (2 * n), 1), m)
    prefix = (n * 0).to(tl.int64)
    prefix, r, _ = _pick_digit(_sample_histogram(src, n, ch, prefix, 24, NCH, BLOCK), prefix, r, 24)
    prefix, r, _ = _pick_digit(_sample_histogram(src, n, ch, prefix, 16, NCH, BLOCK), prefix, r, 16)
    prefix, r, _ = _pick_digit(_sample_histogram(src, n, ch, prefix, 8, NCH, BLOCK), prefix, r, 8)
    prefix, r, _ = _pick_digit(_sample_histogram(src, n, ch, prefix, 0, NCH, BLOCK), prefix, r, 0)
    return prefix


@triton.jit
def _compact(src, n, lo, threshold, shift, cv, ci, CAP, BLOCK: tl.constexpr, PREFETCH: tl.constexpr):
    """Copy the keys of src[0:n] whose order key >> shift is at least threshold's, ascending (values to cv, key
    indices lo + position to ci, the first CAP of them) -> how many there are (also past CAP)."""
    offs = tl.arange(0, BLOCK)
    count = (n * 0).to(tl.int32)
    nxt = tl.load(src + offs, mask=(offs < n) & PREFETCH, other=0.0)
    for j0 in range(0, n, BLOCK):
        j = j0 + offs
        x, nxt = _block(src, j, n, nxt, BLOCK, PREFETCH)
        keep = (j < n) & ((_order_key(x) >> shift) >= (threshold >> shift))
        pos = tl.cumsum(keep.to(tl.int32), 0) - 1 + count
        tl.store(cv + pos, x, mask=keep & (pos < CAP))
        tl.store(ci + pos, (lo + j).to(tl.int32), mask=keep & (pos < CAP))
        count += tl.sum(keep.to(tl.int32), 0)
    return count


@triton.jit
def _radix_select_kernel(s_ptr, lo_ptr, hi_ptr, out_ptr, cv_ptr, ci_ptr, count_ptr, r0, K, s_sb, s_sr, s_lb, s_ob,
                         s_ot, s_cb, s_cr, CAP, BLOCK: tl.constexpr, PREFETCH: tl.constexpr, SAMPLE: tl.constexpr,
                         NCH: tl.constexpr, CH: tl.constexpr, MIN_CH: tl.constexpr, COUNT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    bid = tl.program_id(1).to(tl.int64)
    lo = tl.load(lo_ptr + bid * s_lb + r0 + row)
    hi = tl.load(hi_ptr + bid * s_lb + r0 + row)
    n = hi - lo
    src = s_ptr + bid * s_sb + row * s_sr + lo
    dst = out_ptr + bid * s_ob + (r0 + row) * s_ot
    cv = cv_ptr + bid * s_cb + row * s_cr
    ci = ci_ptr + bid * s_cb + row * s_cr
    offs = tl.arange(0, BLOCK)
    done = n <= K
    if done:
        for j0 in range(0, K, BLOCK):
            j = j0 + offs
            tl.store(dst + j, tl.where(j < n, lo + j, -1), mask=j < K)
    ch = tl.minimum(n // (16 * NCH), CH)  # the sample's chunk length: at most 1/16 of the row is sampled
    if SAMPLE and not done and ch >= MIN_CH:
        # A threshold from a sample: the keys at or above it are copied out in one pass; when they are at least K
        # (so the K-th largest and all its ties are among them) and fit in CAP, the four radix passes and the write
        # read only them. Otherwise (a sample unlike its row) the passes below run as without it.
        threshold = _sample_threshold(src, n, ch, K, NCH, BLOCK)
        count = _compact(src, n, lo, threshold, 0, cv, ci, CAP, BLOCK, PREFETCH)
        if (count >= K) & (count <= CAP):
            prefix = (lo * 0).to(tl.int64)
            k_rem = K
            prefix, k_rem, _ = _radix_pass(cv, count, prefix, k_rem, 24, BLOCK, PREFETCH)
            prefix, k_rem, _ = _radix_pass(cv, count, prefix, k_rem, 16, BLOCK, PREFETCH)
            prefix, k_rem = _low_passes(cv, count, prefix, k_rem, BLOCK, PREFETCH)
            _write_selected(cv, ci, count, lo, prefix, k_rem, dst, BLOCK, True, PREFETCH)
            done = count >= 0
            if COUNT:  # rows selected from the sample's copy (`select_rows`' `sampled`)
                tl.atomic_add(count_ptr, 1)
    if not done:
        # Radix selection of the K-th largest key, 8 bits per pass from the top: two passes over the row.
        prefix = (lo * 0).to(tl.int64)
        k_rem = K
        prefix, k_rem, _ = _radix_pass(src, n, prefix, k_rem, 24, BLOCK, PREFETCH)
        prefix, k_rem, bucket = _radix_pass(src, n, prefix, k_rem, 16, BLOCK, PREFETCH)
        # The keys whose top 16 bits reach the K-th largest's are K - k_rem larger ones plus its bucket; if
        # they fit in CAP, one more pass copies them (ascending) and the last passes read only them.
        n_cand = K - k_rem + bucket
        if n_cand <= CAP:  # CAP = 0: never
            count = _compact(src, n, lo, prefix, 16, cv, ci, CAP, BLOCK, PREFETCH)
            prefix, k_rem = _low_passes(cv, count, prefix, k_rem, BLOCK, PREFETCH)
            _write_selected(cv, ci, count, lo, prefix, k_rem, dst, BLOCK, True, PREFETCH)
        else:
            prefix, k_rem = _low_passes(src, n, prefix, k_rem, BLOCK, PREFETCH)
            _write_selected(src, src, n, lo, prefix, k_rem, dst, BLOCK, False, PREFETCH)




def select_capacity(topk: int, t: int, tuning: SelectTuning = SelectTuning()) -> int:
    """Candidates per row that `select_rows` compacts (0: it never compacts, the rows are short)."""
    cap = tuning.capacity * int(topk)
    return cap if cap < t else 0


def select_rows(scores: torch.Tensor, lo, hi, r0: int, n: int, topk: int, out: torch.Tensor,
                sampled: Optional[torch.Tensor] = None, tuning: SelectTuning = SelectTuning()) -> torch.Tensor:
    """Exact top-k (the tie rule above) of score rows [r0, r0 + n) (scores[:, :n]) into out[:, r0:r0 + n].

    The passes are the module docstring's: a sampled threshold and one copy of the keys above it (rows long enough
    for the sample), else two 8-bit radix passes and a copy of the keys still in play when they fit in
    `select_capacity` (three passes over the row instead of five). The copies take 8 bytes per candidate in a
    scratch of at most `tuning.scratch_bytes`, reused by launches over successive rows. `sampled` (an int32 tensor
    of one element): add to it the number of rows selected from the sample's copy (the others took the radix
    passes). `tuning`: `DSAKernelTuning.select`."""
    b = out.shape[0]
    k = min(int(topk), scores.shape[-1])
    cap = select_capacity(k, scores.shape[-1], tuning)
    per = max(1, min(n, tuning.scratch_bytes // (8 * cap * b))) if cap else n
    cv = torch.empty(b, per if cap else 1, max(cap, 1), dtype=torch.float32, device=scores.device)
    ci = torch.empty(cv.shape, dtype=torch.int32, device=scores.device)
    for q0 in range(0, n, per):
        sc = scores[:, q0:]
        _radix_select_kernel[(min(per, n - q0), b)](
            sc, lo, hi, out, cv, ci, ci if sampled is None else sampled, r0 + q0, k, sc.stride(0), sc.stride(1),
            0 if lo.shape[0] == 1 else lo.stride(0), out.stride(0), out.stride(1), cv.stride(0), cv.stride(1), cap,
            BLOCK=tuning.block, PREFETCH=bool(tuning.prefetch), SAMPLE=bool(tuning.sample) and cap > 0,
            NCH=tuning.sample_chunks, CH=tuning.sample_chunk, MIN_CH=tuning.sample_min_chunk,
            COUNT=sampled is not None, num_warps=tuning.warps)
    return out
