"""Sliding-window causal attention: each query attends to itself and the `left` keys before it.

    visible(i, j) = i' - left <= j <= i' + right,   i' = i + (s_k - s_q)   (right = 0: causal)

as megatron-core's `window_size = (left, right)` (`get_sliding_window_causal_mask`) and
FlashAttention's `window_size`; Mistral 7B (Jiang et al. 2023, section 2) and Longformer (Beltagy
et al. 2020) use it. Here it is a boolean mask for `F.scaled_dot_product_attention`, so the
attention work stays quadratic: enough for the DSA ablation's sliding-window baseline
(`model.window_size`), not a fast long-context kernel.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def sliding_window_mask(sq: int, sk: int, window: Sequence[int], device=None) -> torch.Tensor:
    """[sq, sk] boolean, True where query i may attend to key j."""
    left, right = int(window[0]), int(window[1])
    offset = sk - sq
    i = torch.arange(sq, device=device).view(-1, 1) + offset
    j = torch.arange(sk, device=device).view(1, -1)
    return (j >= i - left) & (j <= i + right)


def combine(allowed: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """The window AND an attention mask in megatron's convention (True = masked out), as SDPA's
    boolean `attn_mask` (True = attend), broadcastable to [b, heads, sq, sk]."""
    if attention_mask is None:
        return allowed.view(1, 1, *allowed.shape)
    return allowed & ~attention_mask
