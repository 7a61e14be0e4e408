"""Top-k indices kept for backward as int16 (`pretrain.model.dsa.indexer.pack_indices`), unpacked in one pass.

    unpacked = -1            where packed = -1 (an empty slot, 0xFFFF)
             = packed & 0xFFFF  otherwise (the unsigned 16-bit key index: keys 32768..65534 were wrapped)

In PyTorch that is a widening copy, a comparison, a mask and a select: four passes over [b, s, K], about 0.55 ms per
unpack at glm5-proxy's 32K (two unpacks per DSA layer, in the attention backward and in the indexer loss's;
benchmarks/results/README.md). One kernel reads the int16 tensor once and writes the int32 one.
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


__all__ = ["unpack"]
