"""The MoE layer of the GLM-5 model: megatron-core's `MoELayer` with our token dispatchers.

With megatron's all-to-all dispatcher configured, the layer swaps in `LocalTokenDispatcher`
(`pretrain.model.moe_dispatch`: host-sync-free gathers when every expert is local) or, with
`moe_token_dispatcher_type: alltoall_dedup`, `DedupTokenDispatcher` (`pretrain.model.ep_dispatch`: one row
per (token, destination rank)). Kept apart from both dispatchers so that neither imports the other's user.
"""

from __future__ import annotations

from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from pretrain.model.ep_dispatch import DedupTokenDispatcher, say_dispatcher
from pretrain.model.moe_dispatch import LocalTokenDispatcher


class GLM5MoELayer(MoELayer):
    """megatron's MoELayer whose all-to-all dispatcher is `LocalTokenDispatcher` (same behaviour with
    EP or TP > 1, the sync-free gather path when every expert is local), or with
    `moe_token_dispatcher_type: alltoall_dedup` the per-rank dispatch of `pretrain.model.ep_dispatch`."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None):
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
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
