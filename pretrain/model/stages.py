"""What a training stage trains (`train.trainable_params`), applied to the built model chunks.

* "all": every parameter (pretraining, the DSA sparse stage, dense continued pretraining).
* "dsa_indexer": the DSA warm-up (GLM-5 report, DSA training; DeepSeek-V3.2 section 2.1, dense
  warm-up): only the lightning indexers learn, from the KL to the frozen main attention. The MoE
  routers' correction biases, which the balancing rule moves outside the optimizer, stay fixed too,
  so the warm-up leaves every non-indexer tensor as it found it.
"""

from __future__ import annotations

from typing import Iterable

import torch

from pretrain.model.dsa import is_indexer_parameter


def freeze_for_stage(chunks: Iterable[torch.nn.Module], trainable_params: str) -> None:
    """Set `requires_grad` on the chunks' parameters for `trainable_params` (before DDP wraps them:
    DDP allocates gradient buffers for trainable parameters only)."""
    if trainable_params != "dsa_indexer":
        return
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            param.requires_grad_(is_indexer_parameter(name))
        chunk.config.moe_router_bias_update_rate = 0.0
