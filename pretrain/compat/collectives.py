"""Collectives over one-rank groups skipped: NCCL >= 2.27.3 leaks host memory on each (part of `pretrain.compat`).

From NCCL 2.27.3 every collective on a one-rank communicator allocates a 160-byte group job that is
never freed (NVIDIA/nccl#1944: `ncclCallocDebug<ncclGroupJob>` in `ncclGroupEndInternal`). A training
step makes dozens of all-reduces over groups of one rank whatever the layout: megatron-core's
vocab-parallel cross entropy all-reduces three times over a tensor-parallel group of one, its gradient
norm over a model-parallel group of one, its MoE loss trackers and expert-bias update over groups of
one, the trainer's loss mean over a data-parallel group of one. A native-heap profile of glm5-tiny on
one H200 (docs/training.md, "Checkpoints") found 9.7 KB a step held by these calls, of the 8-12 KB a
step the host RSS grew: about 1 GB per rank over 100,000 steps.

An all-reduce over one rank is the identity for SUM, AVG, MAX, MIN and PRODUCT, so
`skip_single_rank_all_reduce` returns at once for those (synchronous calls only: an asynchronous one
must hand back a work handle, and goes to the backend as before). Every other call is unchanged.
"""

from __future__ import annotations

import functools

import torch.distributed as dist

from pretrain.compat.registry import Workaround

_IDENTITY_OPS = ("SUM", "AVG", "MAX", "MIN", "PRODUCT")


def identity_op(op) -> bool:
    """Whether `op` leaves a one-rank all-reduce unchanged (a pre-multiplied sum, say, does not)."""
    return any(op == getattr(dist.ReduceOp, name) for name in _IDENTITY_OPS)


def one_rank(group) -> bool:
    """Whether `group` (None: the default group) holds this rank alone."""
    return dist.is_initialized() and dist.get_world_size(group) == 1


def skip_single_rank_all_reduce() -> None:
    """Make `torch.distributed.all_reduce` return at once over a one-rank group (module docstring)."""
    original = dist.all_reduce
    if getattr(original, "skips_single_rank", False):
        return

    @functools.wraps(original)
    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not async_op and one_rank(group) and identity_op(op):
            return None
        return original(tensor, op=op, group=group, async_op=async_op)

    all_reduce.skips_single_rank = True
    dist.all_reduce = all_reduce


WORKAROUNDS = [
    Workaround(
        name="skip_single_rank_all_reduce",
        target="torch.distributed.all_reduce",
        reason="NCCL >= 2.27.3 leaks 160 bytes of host memory per collective on a one-rank communicator, and a "
               "step all-reduces dozens of times over groups of one (megatron's cross entropy, gradient norm, MoE "
               "trackers): host RSS grows about 10 KB a step",
        upstream="NVIDIA/nccl#1944",
        test="tests/test_compat_collectives.py::test_one_rank_all_reduce_never_reaches_the_backend",
        install=skip_single_rank_all_reduce,
    ),
]
