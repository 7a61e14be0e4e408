"""ZeRO-2's buckets of one owner (`pretrain.optim.zero2_grads`): the greedy ownership rule, the bucket whose
gradients are reduced to its owner (over NCCL or `pretrain.optim.zero2_copy_engine`), and the start of the owners'
parameter broadcast after the step. The math and the layout are in `pretrain.optim.zero2_grads`'s docstring.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from pretrain.optim.zero2_copy_engine import CopyEngineReduce
from pretrain.optim.zero2_scatter import flatten_parameters


def assign_owners(costs: Sequence[float], sizes: Sequence[int], world: int) -> List[int]:
    """Owner rank of each item: greedy two-resource balance of compute `costs` and memory `sizes`."""
    if world == 1:
        return [0] * len(costs)
    total_cost = float(sum(costs)) or 1.0
    total_size = float(sum(sizes)) or 1.0
    load_c, load_s = [0.0] * world, [0.0] * world
    owners = [0] * len(costs)
    order = sorted(range(len(costs)), key=lambda i: (-max(costs[i] / total_cost, sizes[i] / total_size), i))
    for i in order:
        c, s = costs[i] / total_cost, sizes[i] / total_size
        best = min(range(world), key=lambda r: (max(load_c[r] + c, load_s[r] + s), r))
        owners[i] = best
        load_c[best] += c
        load_s[best] += s
    return owners


class OwnerBucket:
    """Parameters of one owner and dtype whose gradients are reduced together.

    `grad`: the owner's persistent fp32 accumulation (its parameters' main_grad); `local`: this
    rank's gradients of the current micro-batch(es), fp32; `comm`: what is being reduced (`local`
    itself, or its copy in `reduce_dtype`). An owner reducing in fp32 accumulates straight into
    `grad` and reduces it in place, so it needs no transient memory.
    """

    def __init__(self, params: List[torch.nn.Parameter], owner: int, group, scale: float, reduce_dtype: torch.dtype):
        self.params, self.owner, self.group, self.scale = params, owner, group, scale
        self.reduce_dtype = reduce_dtype
        self.owner_global = dist.get_global_rank(group, owner) if group.size() > 1 else dist.get_rank()
        self.is_owner = group.rank() == owner
        self.numel = sum(p.numel() for p in params)
        self.offsets: Dict[torch.nn.Parameter, Tuple[int, int]] = {}
        start = 0
        for p in params:
            self.offsets[p] = (start, start + p.numel())
            start += p.numel()
        self.param_data = flatten_parameters(params, self.offsets, self.numel)
        self.grad: Optional[torch.Tensor] = None
        if self.is_owner:
            self.grad = torch.zeros(self.numel, dtype=torch.float32, device=params[0].device)
            for p in params:
                s, e = self.offsets[p]
                p.main_grad = self.grad[s:e].view_as(p)
        self.local: Optional[torch.Tensor] = None
        self.written: set = set()  # parameters whose gradient was written into a fresh `local` (not zeroed)
        self.comm: Optional[torch.Tensor] = None
        self.transport: Optional[CopyEngineReduce] = None  # None: NCCL's reduce
        self.ready: set = set()
        self.work = None
        self.owned_params = params if self.is_owner else []
        self.owned_numel = self.numel if self.is_owner else 0

    def start_reduce(self) -> None:
        """Reduce `comm` (set by the caller) to the owner."""
        if self.transport is not None:  # the owner's transport adds into `grad` itself
            own = None if self.comm is self.grad else self.comm
            self.work = self.transport.reduce(own, self.owner, self.grad, self.reduce_dtype)
            return
        self.work = dist.reduce(self.comm, dst=self.owner_global, group=self.group, async_op=True)

    def start_param_sync(self):
        """Send the owner's updated parameters to its group (the work)."""
        return dist.broadcast(self.param_data, src=self.owner_global, group=self.group, async_op=True)

    @property
    def in_place(self) -> bool:
        return self.is_owner and self.reduce_dtype == torch.float32

    def transient_bytes(self) -> int:
        live = {id(t): t for t in (self.local, self.comm) if t is not None and t is not self.grad}
        return sum(t.numel() * t.element_size() for t in live.values())

    def settle(self) -> None:
        """Wait for this bucket's reduce; the owner adds a low-precision result into its fp32
        accumulation, and the transient buffers are dropped."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.comm is not None:
            if self.is_owner and self.comm is not self.grad and self.transport is None:
                self.grad.add_(self.comm)
            self.comm = None


def broadcast_bucket(b):
    """Start sending the owners' updated parameters of bucket `b` to its group (a broadcast, or an
    all-gather for a `ScatterBucket`): the work, or None alone."""
    if b.group.size() == 1:
        return None
    return b.start_param_sync()
