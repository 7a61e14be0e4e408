"""One micro-batch's forward and its loss, in the form megatron-core's pipeline schedules call.

The LM loss of a micro-batch is the mean over its loss-masked tokens; the schedule divides by the
number of micro-batches and DDP averages over data-parallel ranks, so the step's loss is the mean
of the micro-batch means (equal to the token mean whenever micro-batches carry equal numbers of
loss tokens, as packed pretraining sequences do). MTP depths and MoE auxiliary losses reach the
gradient through megatron's loss auto-scalers inside the model.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Dict, Optional, Tuple

import torch
from megatron.core.utils import unwrap_model

from parallel.context_parallel import cp_size_and_rank, global_token_count, split_batch
from parallel.cp_load_balance import assign
from pretrain.config.schema import CP_WORK_CHUNKS_PER_RANK
from pretrain.model.documents import document_layout, layout_assignment, with_assignment
from pretrain.notices import say_once
from pretrain.training.profile_scopes import scope

_log = logging.getLogger(__name__)


def _to_device(batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    if not torch.cuda.is_available():
        return batch
    return {k: (v.cuda(non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}


def loss_func(loss_mask: torch.Tensor, output: torch.Tensor, cp_group=None) -> Tuple[torch.Tensor, torch.Tensor, dict]:
    """Per-token losses [b, s] -> (masked sum, token count, logging reduction).

    The schedule divides the sum by the count (calculate_per_token_loss=False). Under context
    parallelism a rank holds 1/cp of the sequence's tokens and DDP averages gradients over the
    DP x CP group, so the rank returns cp x its sum and the token count of the whole sequence: the
    CP average of cp * sum_r / N is sum_r sum_r / N, the token mean (not the mean of the ranks'
    means). The logged sum and count are the rank's own; the trainer sums them over all ranks."""
    with scope("output"):
        return _masked_sum(loss_mask, output, cp_group)


def _masked_sum(loss_mask, output, cp_group):
    mask = loss_mask.reshape(-1).float()
    total = (output.float().reshape(-1) * mask).sum()
    count = mask.sum()
    log = {"lm loss": torch.stack([total.detach(), count.detach()])}
    cp_size = cp_size_and_rank(cp_group)[0]
    if cp_size > 1:
        return total * cp_size, global_token_count(count, cp_group).to(torch.int), log
    return total, count.to(torch.int), log


def with_documents(batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The batch with its document layout (`pretrain.model.documents`: O(S) per sequence, built on the host from
    `cu_seqlens` and `position_ids`) as `document_layout` when its documents are isolated or its positions
    restart; the model takes it as its `attention_mask`. It covers the whole sequence: context parallelism splits
    the batch's other entries (`split_batch`), not this one."""
    if batch.get("attention_mask") is not None or "tokens" not in batch:
        return batch  # a caller's own megatron mask
    b, s = batch["tokens"].shape
    layout = document_layout(batch.get("cu_seqlens"), batch.get("position_ids"), b, s)
    return batch if layout is None else dict(batch, document_layout=layout)


def with_chunk_assignment(batch: Dict[str, torch.Tensor], cp_size: int, cp_chunk_assignment: str = "zigzag",
                          cp_chunks_per_rank: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """`parallel.cp_chunk_assignment: work`: the batch whose document layout carries the chunk assignment that
    balances its causal work over the CP ranks (`parallel.cp_load_balance.assign`, computed on the host from the
    document starts, so every CP rank computes the same). Batches without isolated documents keep the zigzag split,
    which balances one causal window exactly (said once)."""
    if cp_size == 1 or cp_chunk_assignment == "zigzag" or not batch:  # not batch: a stage that reads no data
        return batch
    layout = batch.get("document_layout")
    assignment = assign(layout[:, 0], cp_size, cp_chunks_per_rank or CP_WORK_CHUNKS_PER_RANK) if layout is not None else None
    if assignment is None:
        say_once(_log, "parallel.cp_chunk_assignment=work: a micro-batch without isolated documents keeps the zigzag "
                 "split (it balances one causal window exactly)")
        return batch
    return dict(batch, document_layout=with_assignment(layout, assignment))


def forward_step(data_iterator, model, *, cp_group, cp_chunk_assignment: str = "zigzag",
                 cp_chunks_per_rank: Optional[int] = None):
    """Stages that need data (first: tokens; last: labels and MTP's tokens) read a batch; under
    context parallelism each rank keeps its chunks of the sequence (`parallel.context_parallel`): two by the zigzag
    split, or those the batch's chunk assignment gives it (`with_chunk_assignment`, `parallel.cp_chunk_assignment`).
    Every stage's attention needs the documents of packed sequences: stages between the first and the last
    read the batch too (for its document layout and chunk assignment) when they are given a data iterator.
    `cp_group`: the context-parallel group (None without CP), bound by the caller with the config's
    `parallel.cp_chunk_assignment` and `parallel.cp_chunks_per_rank` (`partial(forward_step, cp_group=...)`);
    megatron's schedules pass the iterator and the model."""
    unwrapped = unwrap_model(model)
    needs_data = unwrapped.pre_process or unwrapped.post_process or data_iterator is not None
    cp_size, cp_rank = cp_size_and_rank(cp_group)
    batch = with_documents(next(data_iterator)) if needs_data else {}
    batch = with_chunk_assignment(batch, cp_size, cp_chunk_assignment, cp_chunks_per_rank)
    assignment = layout_assignment(batch.get("document_layout"), cp_size)  # read on the host: no device sync
    batch = split_batch(_to_device(batch), cp_size, cp_rank, assignment)
    output = model(
        batch.get("tokens"),
        batch.get("position_ids"),
        batch.get("document_layout", batch.get("attention_mask")),
        labels=batch.get("labels"),
        loss_mask=batch.get("loss_mask"),
    )
    return output, partial(loss_func, batch.get("loss_mask"), cp_group=cp_group)
