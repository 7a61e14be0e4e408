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


def test_writer_clones_counts_views_into_larger_storage():
    """megatron-core 0.16.1's writer clones a tensor whose storage is larger than itself (a slice of a parameter);
    a tensor that owns its storage, and a whole parameter, are copied to the host as they are."""
    from lab.checkpoint.state_storage_probe import writer_clones

    weight, whole = torch.zeros(4, 8), torch.zeros(2, 8)
    state = {"model": {"w": ShardedTensor.from_rank_offsets("decoder.w", weight[1:], replica_id=0),
                       "b": ShardedTensor.from_rank_offsets("decoder.b", whole, replica_id=0)},
             "optimizer": {"m": ShardedTensor.from_rank_offsets("optimizer.m.decoder.w", weight.clone(), replica_id=0)}}
    assert writer_clones(state) == (3 * 8 * 4, {"decoder.w": 3 * 8 * 4})
