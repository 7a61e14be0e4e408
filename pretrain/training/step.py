"""One micro-batch's forward and its loss, in the form megatron-core's pipeline schedules call.

The LM loss of a micro-batch is the mean over its loss-masked tokens; the schedule divides by the
number of micro-batches and DDP averages over data-parallel ranks, so the step's loss is the mean
of the micro-batch means (equal to the token mean whenever micro-batches carry equal numbers of
loss tokens, as packed pretraining sequences do). MTP depths and MoE auxiliary losses reach the
gradient through megatron's loss auto-scalers inside the model.
"""

from __future__ import annotations

from functools import partial
from typing import Dict, Tuple

import torch


def _to_device(batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    if not torch.cuda.is_available():
        return batch
    return {k: (v.cuda(non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}


def loss_func(loss_mask: torch.Tensor, output: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, dict]:
    """Per-token losses [b, s] -> (masked sum, token count, logging reduction)."""
    mask = loss_mask.reshape(-1).float()
    total = (output.float().reshape(-1) * mask).sum()
    count = mask.sum()
    # The schedule divides `total` by `count` (calculate_per_token_loss=False).
    return total, count.to(torch.int), {"lm loss": torch.stack([total.detach(), count.detach()])}


def forward_step(data_iterator, model):
    """Stages that need data (first: tokens; last: labels and MTP's tokens) read a batch."""
    unwrapped = model
    while hasattr(unwrapped, "module"):
        unwrapped = unwrapped.module
    needs_data = unwrapped.pre_process or unwrapped.post_process
    batch = _to_device(next(data_iterator)) if needs_data else {}
    output = model(
        batch.get("tokens"),
        batch.get("position_ids"),
        batch.get("attention_mask"),
        labels=batch.get("labels"),
        loss_mask=batch.get("loss_mask"),
    )
    return output, partial(loss_func, batch.get("loss_mask"))
