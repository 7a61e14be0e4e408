"""`pretrain.compat.collectives`: all-reduces over one-rank groups never reach the backend (NCCL >= 2.27.3 leaks
host memory on each), and give what the backend gives; every other all-reduce still reaches it."""

from __future__ import annotations

import torch
import torch.distributed as dist

from pretrain.compat import collectives
from tests.distributed import run_ranks


def _one_and_two_rank_groups(rank, world_size):
    """On 2 gloo ranks: all-reduces over the world, over a one-rank group, and the calls the backend received."""
    assert getattr(dist.all_reduce, "skips_single_rank", False)  # run_ranks called compat.install()
    dist.init_process_group("gloo")
    singles = [dist.new_group([r]) for r in range(world_size)]
    mine = singles[rank]
    received = []
    backend = dist.distributed_c10d.all_reduce  # torch's own, which the workaround leaves in place

    def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        received.append((dist.get_world_size(group), async_op))
        return backend(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = counting
    collectives.skip_single_rank_all_reduce()
    x = torch.arange(4, dtype=torch.float64) + rank
    world = x.clone()
    dist.all_reduce(world)  # 2 ranks: reduced, by the backend
    alone = {}
    for name in ("SUM", "AVG", "MAX", "MIN", "PRODUCT"):
        t = x.clone()
        dist.all_reduce(t, op=getattr(dist.ReduceOp, name), group=mine)
        alone[name] = t
    reference = x.clone()
    backend(reference, group=mine)  # what the backend itself gives over one rank
    bits = torch.tensor([6, 3], dtype=torch.int64)
    dist.all_reduce(bits, op=dist.ReduceOp.BAND, group=mine)  # not among the skipped ops: to the backend
    handle = dist.all_reduce(x.clone(), group=mine, async_op=True)  # asynchronous: to the backend, as before
    handle.wait()
    dist.destroy_process_group()
    return {"world": world, "alone": alone, "reference": reference, "received": received, "bits": bits}


def test_one_rank_all_reduce_never_reaches_the_backend():
    results = run_ranks(_one_and_two_rank_groups, 2)
    for rank, r in enumerate(results):
        x = torch.arange(4, dtype=torch.float64) + rank
        assert torch.equal(r["world"], 2 * torch.arange(4, dtype=torch.float64) + 1)  # 0+1, 1+2, ...
        for name, t in r["alone"].items():
            assert torch.equal(t, x), name
            assert torch.equal(t, r["reference"]), name
        # the world all-reduce, the BAND one and the asynchronous one; none of the five synchronous one-rank calls
        assert r["received"] == [(2, False), (1, False), (1, True)], r["received"]
        assert r["bits"].tolist() == [6, 3]


def test_a_premultiplied_sum_is_not_skipped():
    """Only ops that leave one rank's tensor unchanged are skipped: a pre-multiplied sum scales it."""
    assert all(collectives.identity_op(getattr(dist.ReduceOp, n)) for n in ("SUM", "AVG", "MAX", "MIN", "PRODUCT"))
    assert not collectives.identity_op(dist._make_nccl_premul_sum(2.0))
