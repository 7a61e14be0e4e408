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


def test_save_copies_counts_non_contiguous_tensors_and_cpu_views():
    """megatron-core 0.16.1's save makes a non-contiguous tensor contiguous (a copy) and its writer clones a CPU
    tensor whose storage is larger than itself (a slice of a parameter); a contiguous tensor that owns its storage,
    and a whole parameter, are staged as they are."""
    from lab.checkpoint.state_storage_probe import save_copies

    weight, whole, square = torch.zeros(4, 8), torch.zeros(2, 8), torch.zeros(8, 8)
    state = {"model": {"w": ShardedTensor.from_rank_offsets("decoder.w", weight[1:], replica_id=0),
                       "b": ShardedTensor.from_rank_offsets("decoder.b", whole, replica_id=0)},
             "optimizer": {"m": ShardedTensor.from_rank_offsets("optimizer.m.decoder.w", weight.clone(), replica_id=0),
                           "t": ShardedTensor.from_rank_offsets("optimizer.m.decoder.t", square.t(), replica_id=0)}}
    assert save_copies(state) == (3 * 8 * 4 + 8 * 8 * 4, {"decoder.w": 3 * 8 * 4, "decoder.t": 8 * 8 * 4})
