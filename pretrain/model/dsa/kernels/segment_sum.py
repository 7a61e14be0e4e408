"""Deterministic scatter-add of per-(query, slot) rows into key rows, for the DSA kernels' backward.

The key/value (or index-key) gradient of sparse attention is a sum over every (token t, slot j)
with S_t[j] = s. fp32 atomics give that sum in a run-dependent order; here a kernel writes each
(t, j) contribution to a buffer for a block of query rows, the entries are sorted by key (stable,
so by t then j), and one program per key adds its entries in that order. Blocks of query rows
are added in a fixed order, so the result is bitwise reproducible.
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl


@triton.jit
def _segment_sum_kernel(part_ptr, src_ptr, key_ptr, start_ptr, out_ptr, D,
                        BE: tl.constexpr, BD: tl.constexpr):
    u = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1).to(tl.int64) * BD + tl.arange(0, BD)
    start = tl.load(start_ptr + u)
    end = tl.load(start_ptr + u + 1)
    acc = tl.zeros((BD,), tl.float32)
    for e0 in range(start, end, BE):
        e = e0 + tl.arange(0, BE)
        src = tl.load(src_ptr + e, mask=e < end, other=0)
        vals = tl.load(part_ptr + src[:, None] * D + d[None, :], mask=(e[:, None] < end) & (d[None, :] < D), other=0.0)
        acc += tl.sum(vals, 0)
    key = tl.load(key_ptr + u)
    dst = out_ptr + key * D + d
    tl.store(dst, tl.load(dst, mask=d < D, other=0.0) + acc, mask=d < D)


def scatter_rows_deterministic(launch: Callable, indices: torch.Tensor, out: torch.Tensor, s: int,
                               buffer_bytes: int = 1 << 30) -> None:
    """out [b, T, D] fp32 += sum of contributions. `launch(r0, rows, part)` writes the contribution
    of (token r0 + i, slot j) of batch row bb to part[bb, i, j] (part [b, rows, K, D] fp32) for the
    valid slots of `indices` [b, s, K]."""
    b, _, k = indices.shape
    t, d = out.shape[1], out.shape[2]
    rows = max(1, min(s, buffer_bytes // max(1, 4 * b * k * d)))
    part = torch.empty(b, rows, k, d, dtype=torch.float32, device=out.device)
    batch = torch.arange(b, device=out.device).view(b, 1, 1)
    for r0 in range(0, s, rows):
        n = min(rows, s - r0)
        launch(r0, n, part)
        idx = indices[:, r0:r0 + n].long()
        valid = idx >= 0
        keys = (batch * t + idx)[valid]
        src = torch.arange(b * rows * k, device=out.device).view(b, rows, k)[:, :n][valid]
        keys, order = torch.sort(keys, stable=True)
        src = src[order].contiguous()
        uniq, counts = torch.unique_consecutive(keys, return_counts=True)
        starts = torch.zeros(uniq.numel() + 1, dtype=torch.int64, device=out.device)
        torch.cumsum(counts, 0, out=starts[1:])
        if uniq.numel():
            bd = min(128, triton.next_power_of_2(d))
            _segment_sum_kernel[(uniq.numel(), triton.cdiv(d, bd))](
                part, src, uniq.contiguous(), starts, out, d, BE=16, BD=bd)
