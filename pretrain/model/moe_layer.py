"""The MoE layer of the GLM-5 model: megatron-core's `MoELayer` with our token dispatchers.

With megatron's all-to-all dispatcher configured, the layer swaps in `LocalTokenDispatcher`
(`pretrain.model.moe_dispatch`: host-sync-free gathers when every expert is local) or, with
`moe_token_dispatcher_type: alltoall_dedup`, `DedupTokenDispatcher` (`pretrain.model.ep_dispatch`: one row
per (token, destination rank)). With `moe_shared_expert_overlap` or `moe_overlap_chunks > 1` the forward
is `pretrain.model.moe_overlap`'s (all-to-alls in flight under the shared expert / the other chunk's experts).
Kept apart from both dispatchers so that neither imports the other's user.
"""

from __future__ import annotations

import copy
import logging

from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from pretrain.model.ep_dispatch import DedupTokenDispatcher, say_dispatcher
from pretrain.model.moe_dispatch import LocalTokenDispatcher
from pretrain.model.moe_overlap import overlapped_forward
from pretrain.notices import say_once

_log = logging.getLogger(__name__)

FORCED_BALANCE_WARNING = ("model.moe_router_force_load_balancing=true: the router's logits are random (balanced "
                          "load, untrained routing); for benchmarks only, this run does not train its router")


class GLM5MoELayer(MoELayer):
    """megatron's MoELayer whose all-to-all dispatcher is `LocalTokenDispatcher` (same behaviour with
    EP or TP > 1, the sync-free gather path when every expert is local), or with
    `moe_token_dispatcher_type: alltoall_dedup` the per-rank dispatch of `pretrain.model.ep_dispatch`."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None):
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        shared_overlap = bool(getattr(config, "moe_shared_expert_overlap", False))
        if shared_overlap:
            # ours runs the whole shared expert under an async all-to-all (moe_overlap); megatron's version of
            # the key would build a CUDA side stream and split the shared expert over its dispatcher's hooks
            config = copy.copy(config)
            config.moe_shared_expert_overlap = False
        super().__init__(config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection)
        old = self.token_dispatcher
        if type(old) is MoEAlltoAllTokenDispatcher:
            dedup = getattr(config, "moe_alltoall_dedup", False)
            cls = DedupTokenDispatcher if dedup else LocalTokenDispatcher
            self.token_dispatcher = cls(self.num_local_experts, self.local_expert_indices,
                                        config=self.config, pg_collection=pg_collection)
            if old.shared_experts is not None:
                self.token_dispatcher.set_shared_experts(old.shared_experts)
            if old.ep_size > 1 and not dedup:
                say_dispatcher(f"megatron's alltoall, one row per (token, expert) pair over EP={old.ep_size}")
        self.shared_under_dispatch = shared_overlap and self.shared_experts is not None
        self.overlap_chunks = int(getattr(config, "moe_overlap_chunks", 1))
        if self.shared_under_dispatch or self.overlap_chunks > 1:
            # the config refuses these layouts first (pretrain.config.cross_checks); a direct build gets the same line
            if type(self.token_dispatcher) is not DedupTokenDispatcher or self.token_dispatcher.ep_size == 1:
                raise ValueError("model.moe_shared_expert_overlap / model.moe_overlap_chunks need "
                                 "model.moe_token_dispatcher_type=alltoall_dedup and parallel.expert_model_parallel_size > 1")
            say_once(_log, "MoE all-to-all overlap: shared expert under the dispatch: %s; chunks per micro-batch: %d",
                     self.shared_under_dispatch, self.overlap_chunks)
        if config.moe_router_force_load_balancing:
            say_once(_log, FORCED_BALANCE_WARNING, level=logging.WARNING)

    def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
        if not (self.shared_under_dispatch or self.overlap_chunks > 1):
            return super().forward(hidden_states, intermediate_tensors=intermediate_tensors, padding_mask=padding_mask)
        if intermediate_tensors is not None:  # megatron's partial CUDA-graph capture of the MoE layer
            raise ValueError("model.moe_shared_expert_overlap / model.moe_overlap_chunks do not run under CUDA "
                             "graphs of the MoE layer; turn one of them off")
        return overlapped_forward(self, hidden_states, padding_mask, self.overlap_chunks, self.shared_under_dispatch)
