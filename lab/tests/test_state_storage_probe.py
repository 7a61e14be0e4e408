"""The checkpoint-state probe counts copies and not views (a ShardedTensor over a parameter against one over a clone)."""

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from lab.checkpoint.state_storage_probe import new_storage, storages


def test_views_are_free_and_copies_are_counted():
    weight = torch.zeros(4, 8)
    momentum = torch.zeros(4, 8)

    def sharded(key, data):
        return ShardedTensor.from_rank_offsets(key, data, replica_id=0)

    state = {"model": {"w": sharded("decoder.w", weight[1:])},  # a view of the parameter: free
             "optimizer": {"m": sharded("optimizer.state.exp_avg.decoder.w", momentum.clone())}}  # a copy: counted
    total, new, by_key = new_storage(state, storages([weight, momentum]))
    assert total == (3 * 8 + 4 * 8) * 4
    assert new == 4 * 8 * 4 and by_key == {"decoder.w": 4 * 8 * 4}
