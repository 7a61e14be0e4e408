"""Checks on the visible-key ranges [lo_t, hi_t) that the DSA top-k kernels take (causal attention within documents),
shared by the kernels and the PyTorch reference (`pretrain.model.dsa.indexer`)."""

from __future__ import annotations

import torch


def ranges_move_backwards(lo: torch.Tensor, hi: torch.Tensor) -> bool:
    """Whether some row's visible-key range [lo, hi) starts or ends before the previous row's (a host sync)."""
    return bool((lo.diff(dim=-1) < 0).any() | (hi.diff(dim=-1) < 0).any())


__all__ = ["ranges_move_backwards"]
