"""The DSA layer's entry points into the Triton kernels (same contracts as the reference path)."""

from __future__ import annotations

from typing import Callable

import torch

from pretrain.model.indexer_loss import _normalize_heads
from pretrain.model.kernels.indexer_kl import head_summed_probs, index_scores_at
from pretrain.model.kernels.indexer_topk import indexer_topk
from pretrain.model.kernels.sparse_mla import sparse_mla_attention


def sparse_target(q_abs: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, lse: torch.Tensor, scale: float,
                  v_dim: int, tp_group=None) -> Callable:
    """Target rows of the sparse indexer loss from the sparse attention's own log-sum-exp."""

    def rows(r0: int, r1: int, _indices_rows: torch.Tensor) -> torch.Tensor:
        probs = head_summed_probs(q_abs, kv, indices, lse, scale, v_dim, r0, r1)
        return _normalize_heads(probs, tp_group)

    return rows


def scores_at(deterministic: bool = False) -> Callable:
    """`indexer_kl_sparse`'s scores_at through the Triton kernel (rows of q / w / indices given)."""

    def fn(qc, kc, wc, idx):
        return index_scores_at(qc, kc, wc.float(), idx, 0, qc.shape[1], deterministic)

    return fn


__all__ = ["indexer_topk", "scores_at", "sparse_mla_attention", "sparse_target"]
