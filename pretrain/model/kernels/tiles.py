"""Launch helpers shared by the DSA kernels."""

from __future__ import annotations

import torch
import triton


def pow2(n: int, least: int = 16) -> int:
    """A block size covering n: the next power of two, at least `least` (tl.dot needs >= 16)."""
    return max(least, triton.next_power_of_2(int(n)))


def dot_precision(t: torch.Tensor) -> str:
    """fp32 inputs multiply in IEEE fp32 (the CPU tests compare with float64); bf16 ignores it."""
    return "ieee" if t.dtype == torch.float32 else "tf32"
