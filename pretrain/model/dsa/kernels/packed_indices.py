"""Passes over the top-k index rows [b, s, K] in one kernel each, where PyTorch takes several.

`unpack`: indices kept for backward as int16 (`pretrain.model.dsa.indexer.pack_indices`) back to int32:

    unpacked = -1            where packed = -1 (an empty slot, 0xFFFF)
             = packed & 0xFFFF  otherwise (the unsigned 16-bit key index: keys 32768..65534 were wrapped)

In PyTorch that is a widening copy, a comparison, a mask and a select: four passes over [b, s, K], twice per DSA
layer (in the attention backward and in the indexer loss's). One kernel reads the int16 tensor once and writes the
int32 one.

`valid_counts`: nvalid[b, t] = #{j : indices[b, t, j] >= 0}, the valid slots of each row that the sparse attention
kernels walk. `(indices >= 0).sum(-1, dtype=int32)` is a comparison, a widening copy and a reduction, twice per DSA
layer; one kernel reads the row once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _unpack_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(src_ptr + offs, mask=m, other=-1).to(tl.int32)
    tl.store(dst_ptr + offs, tl.where(x == -1, -1, x & 0xFFFF), mask=m)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """int16 `packed` (any shape) -> int32 indices, -1 on empty slots."""
    if packed.dtype != torch.int16:
        raise ValueError(f"unpack takes the int16 packing, got {packed.dtype}")
    src = packed.contiguous()
    out = torch.empty(src.shape, dtype=torch.int32, device=src.device)
    n = src.numel()
    if n:
        _unpack_kernel[(triton.cdiv(n, BLOCK),)](src, out, n, BLOCK=BLOCK, num_warps=8)
    return out


@triton.jit
def _count_kernel(idx_ptr, out_ptr, S, K, s_b, s_t, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    bid = tl.program_id(1).to(tl.int64)
    row = idx_ptr + bid * s_b + t * s_t
    count = tl.zeros([BLOCK], tl.int32)
    for j0 in range(0, K, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        count += (tl.load(row + j, mask=j < K, other=-1) >= 0).to(tl.int32)
    tl.store(out_ptr + bid * S + t, tl.sum(count, 0))


def valid_counts(indices: torch.Tensor) -> torch.Tensor:
    """int32 [b, s] counts of the slots >= 0 in each row of `indices` [b, s, K] (int32 or int64, unit slot stride)."""
    if indices.dim() != 3 or indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"valid_counts takes [b, s, K] int32 / int64 indices, got {indices.dtype} "
                         f"{tuple(indices.shape)}")
    if indices.shape[-1] > 1 and indices.stride(-1) != 1:
        indices = indices.contiguous()
    b, s, k = indices.shape
    out = torch.empty(b, s, dtype=torch.int32, device=indices.device)
    if out.numel():
        block = min(max(triton.next_power_of_2(k), 16), 2048)
        _count_kernel[(s, b)](indices, out, s, k, indices.stride(0), indices.stride(1), BLOCK=block, num_warps=4)
    return out


__all__ = ["unpack", "valid_counts"]
