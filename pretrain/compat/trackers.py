"""megatron-core's MoE auxiliary-loss tracker across pipeline stages (part of `pretrain.compat`).

megatron-core 0.16.1 logs each router's load-balancing loss into a module-level dictionary
(`moe_utils.get_moe_layer_wise_logging_tracker()`), one entry per loss type, created by the first
router that records into it. `reduce_aux_losses_tracker_across_ranks()` then all-reduces every
entry over the pipeline-parallel group. A pipeline stage without MoE layers (GLM-5's dense first
layers, or a stage holding only the dense layers) never creates the entry, skips that collective,
and the stages that do hold it wait forever. `ensure_moe_tracker_entry` creates the empty entry on
every stage before the reduction, with megatron's own layout (one slot per decoder and MTP layer).
"""

from __future__ import annotations

from typing import Optional

import torch

from pretrain.compat.registry import Workaround

# megatron-core's tracker name of each load-balancing loss type (router.py); the trainer logs it as
# "aux_loss", the loss before its coefficient.
MOE_TRACKER_NAMES = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
}


def ensure_moe_tracker_entry(tracker: dict, load_balancing_type: str, num_moe_experts: Optional[int],
                             num_layers: int, mtp_num_layers: Optional[int], device: torch.device) -> None:
    """Give `tracker` (megatron's MoE logging tracker) the entry of `load_balancing_type` if this
    stage's routers did not create it, so that every pipeline stage joins the reduction."""
    name = MOE_TRACKER_NAMES.get(load_balancing_type)
    if not num_moe_experts or name is None or name in tracker:
        return
    size = num_layers + (mtp_num_layers or 0)
    tracker[name] = {"values": torch.zeros(size, device=device), "reduce_group": None, "avg_group": None,
                     "reduce_group_has_dp": False}


WORKAROUNDS = [
    Workaround(
        name="ensure_moe_tracker_entry",
        target="megatron.core.transformer.moe.moe_utils.reduce_aux_losses_tracker_across_ranks",
        reason="it all-reduces each tracked MoE loss over the pipeline group, but stages without MoE layers "
               "never create the entry: they skip the collective and the other stages hang",
        upstream="open",
        test="tests/test_training.py::test_pipeline_parallel_matches_single_stage",
        install=None,
    ),
]
