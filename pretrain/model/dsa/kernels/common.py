"""Helpers shared by the DSA kernels: launch parameters and the absorbed-MLA tile loads.

`load_query`, `gather_block` and `block_scores` are the Triton device functions that the sparse MLA
kernels (`sparse_mla`) and the sparse indexer-loss target (`indexer_kl`) both build on: a token's
absorbed queries split into the latent part (C dims) and the rope part (R dims), a block of BN
gathered key rows, and their scores q . k over both parts (fp32).
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl


def pow2(n: int, least: int = 16) -> int:
    """A block size covering n: the next power of two, at least `least` (tl.dot needs >= 16)."""
    return max(least, triton.next_power_of_2(int(n)))


def dot_precision(t: torch.Tensor) -> str:
    """fp32 inputs multiply in IEEE fp32 (the CPU tests compare with float64); bf16 ignores it."""
    return "ieee" if t.dtype == torch.float32 else "tf32"


LOG2E = 1.4426950408889634


@functools.lru_cache(maxsize=None)
def _device_capability(index: int) -> Tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> Optional[Tuple[int, int]]:
    """The compute capability (major, minor) of a CUDA `device`; None for any other device (the CPU, where the
    Triton kernels run in the interpreter)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _device_capability(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def load_query(qb, h, c, r, H, C: tl.constexpr, R: tl.constexpr):
    """The token's queries [BH, BC] (latent part) and [BH, BR] (rope part); qb points at head 0."""
    q_lat = tl.load(qb + c[None, :], mask=(h[:, None] < H) & (c[None, :] < C), other=0.0)
    q_rope = tl.load(qb + C + r[None, :], mask=(h[:, None] < H) & (r[None, :] < R), other=0.0)
    return q_lat, q_rope


@triton.jit
def gather_block(idx_row, kv_base, j0, n, s_kt, c, r, C: tl.constexpr, R: tl.constexpr, BN: tl.constexpr):
    """Slots j0 .. j0 + BN of a token's selection (slots >= n or -1 are empty) and their gathered
    key rows: (slots, key indices, valid, latent [BN, BC], rope [BN, BR])."""
    j = j0 + tl.arange(0, BN)
    idx = tl.load(idx_row + j, mask=j < n, other=-1)
    ok = idx >= 0
    kb = kv_base + idx.to(tl.int64)[:, None] * s_kt
    k_lat = tl.load(kb + c[None, :], mask=ok[:, None] & (c[None, :] < C), other=0.0)
    k_rope = tl.load(kb + C + r[None, :], mask=ok[:, None] & (r[None, :] < R), other=0.0)
    return j, idx, ok, k_lat, k_rope


@triton.jit
def slot_range(idx_row, nv, k_lo, k_hi, BK: tl.constexpr):
    """Slots [a, b) of a row's selection whose keys lie in [k_lo, k_hi): the valid slots 0 .. nv hold ascending
    key indices (both top-k paths write them so), so these are counts of keys below each bound."""
    a = tl.full([], 0, tl.int32)
    b = tl.full([], 0, tl.int32)
    for j0 in range(0, nv, BK):
        j = j0 + tl.arange(0, BK)
        x = tl.load(idx_row + j, mask=j < nv, other=2147483647)
        a += tl.sum((x < k_lo).to(tl.int32), 0)
        b += tl.sum((x < k_hi).to(tl.int32), 0)
    return a, b


@triton.jit
def block_scores(q_lat, q_rope, k_lat, k_rope, PREC: tl.constexpr):
    """q . k over latent and rope parts: [BH, BN] fp32."""
    s = tl.dot(q_lat, tl.trans(k_lat), input_precision=PREC)
    return tl.dot(q_rope, tl.trans(k_rope), s, input_precision=PREC)


def mla_shapes(q, kv, v_dim):
    """(b, s, h, C, R) of absorbed q [b, s, h, C + R] and kv [b, T, C + R] with C = v_dim; checks layouts."""
    b, s, h, d = q.shape
    c, r = int(v_dim), d - int(v_dim)
    if kv.shape[-1] != d or r <= 0:
        raise ValueError(f"sparse MLA kernels need q [.., {d}] and kv [.., {d}] with a rope part after v_dim={v_dim}")
    if q.stride(-1) != 1 or kv.stride(-1) != 1:
        raise ValueError("sparse MLA kernels need the feature dim contiguous in q and kv")
    return b, s, h, c, r
