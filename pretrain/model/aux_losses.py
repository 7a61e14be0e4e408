"""Auxiliary losses next to the LM loss, behind one interface the trainer iterates over.

Each auxiliary loss reaches the gradient inside the model through an auto-scaler (an identity on an
activation whose backward feeds d(loss) = scale into the loss), and is recorded for logging in a
module-level tracker. Per step the trainer, for every `AuxLoss` of `aux_losses_for(model_cfg)`:

1. `prepare(loss_scale, num_microbatches)` before each pipeline schedule: the auto-scaler's scale is
   `loss_scale / num_microbatches`, so the auxiliary gradient is averaged over micro-batches like
   the LM loss's and carries the fp16 loss scale;
2. `collect(groups)` after the step: the logged numbers, reduced over pipeline stages (each stage
   holds its own layers) and data-parallel replicas (averaged), identical on every rank;
3. `reset()` after an evaluation, whose forward passes must not leak into the next step's numbers.

Implemented: the MoE load-balancing loss (`aux_loss`, before its coefficient, the mean over MoE
layers of the per-micro-batch mean), the MTP depths' losses (`mtp_loss_<d>`, d = 1..D) and the DSA
indexer's KL with its top-k recall (`indexer_loss`, `topk_recall`, plus per-layer
`indexer_loss/layer_<NN>` and `.../mtp`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import (
    clear_aux_losses_tracker,
    get_moe_layer_wise_logging_tracker,
    reduce_aux_losses_tracker_across_ranks,
)
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

from pretrain.compat.trackers import ensure_moe_tracker_entry
from pretrain.config.schema import ModelConfig
from pretrain.model.dsa import DSAMetrics, IndexerLossAutoScaler


@dataclass(frozen=True)
class ReduceGroups:
    """Where the logged numbers are reduced: `pp` sums the stages' layers, `dp` averages replicas;
    `device` holds the reduction buffers (the collective backend's device)."""

    pp: Optional[dist.ProcessGroup]
    dp: Optional[dist.ProcessGroup]
    device: torch.device


class AuxLoss(ABC):
    """One auxiliary loss: its gradient scale before a schedule runs, its logged numbers after."""

    num_microbatches: int = 1

    def prepare(self, loss_scale: torch.Tensor, num_microbatches: int) -> None:
        """Before a schedule of `num_microbatches` micro-batches; `loss_scale` is the optimizer's
        (1 without fp16 loss scaling), a 1-element tensor."""
        self.num_microbatches = num_microbatches

    @abstractmethod
    def collect(self, groups: ReduceGroups) -> Dict[str, float]:
        """This step's numbers, reduced across ranks (a collective: every rank calls it); clears them."""

    @abstractmethod
    def reset(self) -> None:
        """Drop whatever was recorded (after an evaluation)."""


class MTPLosses(AuxLoss):
    """`mtp_loss_<d>`: each depth's token-mean CE, averaged over micro-batches and DP replicas.

    Only stages holding the MTP block record; megatron-core's schedule sets `MTPLossAutoScaler`'s
    scale itself, so `prepare` only notes the number of micro-batches."""

    def __init__(self, depths: int):
        self.depths = depths

    def collect(self, groups: ReduceGroups) -> Dict[str, float]:
        # [depth losses..., 1 on ranks that recorded]: one all-reduce over every rank gives each rank
        # the mean over the recording ranks (the MTP stage of every DP replica).
        vec = torch.zeros(self.depths + 1, dtype=torch.float64, device=groups.device)
        tracker = MTPLossLoggingHelper.tracker
        if "values" in tracker:
            MTPLossLoggingHelper.reduce_loss_in_tracker()
            vec[: self.depths] = tracker["values"].double() / self.num_microbatches
            vec[self.depths] = 1.0
            MTPLossLoggingHelper.clean_loss_in_tracker()
        dist.all_reduce(vec)
        if vec[self.depths] <= 0:
            return {}
        return {f"mtp_loss_{d + 1}": (vec[d] / vec[self.depths]).item() for d in range(self.depths)}

    def reset(self) -> None:
        MTPLossLoggingHelper.tracker.pop("values", None)


class MoEAuxLoss(AuxLoss):
    """`aux_loss`: the load-balancing loss before its coefficient, summed over micro-batches per
    layer slot, averaged over the slots that recorded (the MoE layers) and the micro-batches; other
    losses in megatron's tracker (z_loss, ...) are logged under their own names the same way.

    megatron-core's schedule sets `MoEAuxLossAutoScaler`'s scale itself."""

    def __init__(self, model_cfg: ModelConfig):
        self.load_balancing_type = model_cfg.moe_router_load_balancing_type
        self.num_moe_experts = model_cfg.num_moe_experts
        self.num_layers = model_cfg.num_layers
        self.mtp_num_layers = model_cfg.mtp_num_layers

    def collect(self, groups: ReduceGroups) -> Dict[str, float]:
        out: Dict[str, float] = {}
        tracker = get_moe_layer_wise_logging_tracker()
        ensure_moe_tracker_entry(tracker, self.load_balancing_type, self.num_moe_experts, self.num_layers,
                                 self.mtp_num_layers, groups.device)
        if not tracker:
            return out
        reduce_aux_losses_tracker_across_ranks()  # megatron's own pipeline / data-parallel groups
        for name, entry in tracker.items():
            values = entry["values"]
            reporting = int((values != 0).sum().item()) or 1  # the MoE layers (dense ones stay 0)
            key = "aux_loss" if "load_balancing" in name else name.replace(" ", "_")
            out[key] = values.sum().item() / reporting / self.num_microbatches
        clear_aux_losses_tracker()
        return out

    def reset(self) -> None:
        clear_aux_losses_tracker()


class IndexerLoss(AuxLoss):
    """`indexer_loss` and `topk_recall` (DSA), overall and per layer (`DSAMetrics`).

    megatron-core 0.16.1 never sets the DSA auto-scaler's scale: `prepare` does."""

    def __init__(self, model_cfg: ModelConfig):
        self.num_slots = model_cfg.num_layers + 1  # decoder layers, then the MTP layer

    def prepare(self, loss_scale: torch.Tensor, num_microbatches: int) -> None:
        super().prepare(loss_scale, num_microbatches)
        IndexerLossAutoScaler.set_loss_scale(loss_scale / num_microbatches)

    def collect(self, groups: ReduceGroups) -> Dict[str, float]:
        return DSAMetrics.collect(self.num_slots, pp_group=groups.pp, dp_group=groups.dp, device=groups.device)

    def reset(self) -> None:
        DSAMetrics.clear()


def aux_losses_for(model_cfg: ModelConfig) -> List[AuxLoss]:
    """The auxiliary losses a model of `model_cfg` records, in the order they are collected (the
    same on every rank: `collect` runs collectives)."""
    losses: List[AuxLoss] = []
    if model_cfg.mtp_num_layers:
        losses.append(MTPLosses(model_cfg.mtp_num_layers))
    if model_cfg.num_moe_experts:
        losses.append(MoEAuxLoss(model_cfg))
    if model_cfg.experimental_attention_variant == "dsa":
        losses.append(IndexerLoss(model_cfg))
    return losses
