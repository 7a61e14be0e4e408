"""ZeRO-2 buckets reduced by reduce-scatter: one flat bucket holds the parameters of every owner
(`optimizer.zero2_grad_reduce: microbatch_scatter`; GLM-5 report, section 7: ZeRO-2 gradient sharding
and the zero-redundant all-gather of owned shards).

Per-micro-batch ZeRO-2 (`pretrain.optim.zero2_grads`) sends the whole model's gradients every
micro-batch, so its cost is the reduce's time, d ranks of data parallelism:

    reduce to one owner (ring): every rank but the owner sends the whole bucket S: time ~ S / B
    reduce-scatter of S:         every rank sends (d-1)/d of S, in both directions: ~ (d-1)/d * S / B

with B one direction of a GPU's link. A bucket of one owner can only be reduced, so here a bucket is
a window of consecutive parameters (in backward order) whose ownership is decided inside the window:
largest first onto the rank with the fewest window elements (ties: the smaller global load of
Newton-Schulz work and memory), so each rank's segment is about S/d and the padding to equal
segments is at most one parameter. Layout: rank r's parameters at [r*seg, r*seg + n_r), padding to
(r+1)*seg. Per micro-batch each rank reduce-scatters its local gradients (scaled by 1/d, in fp32 or
the parameters' dtype) into its own segment, in place, and the owner adds that segment into its
persistent fp32 accumulation: gradient memory stays 1/d of the model plus the buckets in flight.
After the step every rank's owned parameters reach the others with one all-gather per bucket
(in place: the bucket's flat parameter tensor), not one broadcast per owner.

On CUDA the owner's accumulation runs on a side stream that waits for the reduce-scatter, so the
backward's stream never waits for gradient traffic until `finish_grad_sync` at the end of the step.
Parameters of a window's size or more (the embedding tables) keep a one-owner bucket and a reduce.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist


def window_owners(costs: Sequence[float], sizes: Sequence[int], world: int, load: List[float],
                  total_cost: float, total_size: float) -> List[int]:
    """Owners inside one window: largest first onto the rank with the fewest window elements, ties
    to the rank with the smaller global load `load[r]` (max of its normalized cost and size shares,
    updated in place), then the lower rank. Every rank of a group computes the same answer."""
    window = [0] * world
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (window[r], load[r], r))
        owners[i] = r
        window[r] += sizes[i]
        load[r] += max(costs[i] / total_cost, sizes[i] / total_size)
    return owners


def flatten_parameters(params: Sequence[torch.nn.Parameter], offsets: Dict[torch.nn.Parameter, Tuple[int, int]],
                       numel: int) -> torch.Tensor:
    """One flat tensor of `numel` elements holding every parameter at its `offsets` (zeros elsewhere), each parameter
    re-pointed to its slice: the bucket's broadcast / all-gather then moves the weights without copies."""
    flat = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
    for p in params:
        s, e = offsets[p]
        flat[s:e].copy_(p.data.reshape(-1))
        p.data = flat[s:e].view_as(p)
    return flat


class ScatterBucket:
    """A flat bucket whose d equal segments belong to the d ranks of `group` (see the module docstring).

    Same interface as `zero2_buckets.OwnerBucket`: `grad` is this rank's persistent fp32 accumulation
    (its owned parameters' main_grad), `local` the current micro-batch's gradients (fp32, full
    bucket), `comm` what is reduce-scattered (`local` or its copy in `reduce_dtype`); the reduced
    segment is a view of `comm`, so no other buffer exists.
    """

    transport = None  # always NCCL's reduce-scatter (no copy-engine transport)

    owner = -1  # many owners: `Zero2DataParallel.broadcast_order` puts these buckets first
    in_place = False

    def __init__(self, params: List[torch.nn.Parameter], owners: List[int], group, scale: float,
                 reduce_dtype: torch.dtype, side_stream=None):
        self.params, self.group, self.scale, self.reduce_dtype = params, group, scale, reduce_dtype
        self.world, self.rank = group.size(), group.rank()
        self.side_stream = side_stream
        counts = [0] * self.world
        for o, p in zip(owners, params):
            counts[o] += p.numel()
        self.seg = max(counts)
        self.numel = self.seg * self.world
        self.offsets: Dict[torch.nn.Parameter, Tuple[int, int]] = {}
        fill = [r * self.seg for r in range(self.world)]
        for o, p in zip(owners, params):
            self.offsets[p] = (fill[o], fill[o] + p.numel())
            fill[o] += p.numel()
        self.owned_params = [p for o, p in zip(owners, params) if o == self.rank]
        self.owned_numel = counts[self.rank]
        self.is_owner = self.owned_numel > 0
        device = params[0].device
        self.param_data = flatten_parameters(params, self.offsets, self.numel)
        self.grad: Optional[torch.Tensor] = None
        if self.is_owner:
            self.grad = torch.zeros(self.owned_numel, dtype=torch.float32, device=device)
            base = self.rank * self.seg
            for p in self.owned_params:
                s, e = self.offsets[p]
                p.main_grad = self.grad[s - base:e - base].view_as(p)
        self.local: Optional[torch.Tensor] = None
        self.written: set = set()  # parameters whose gradient was written into a fresh `local` (not zeroed)
        self.comm: Optional[torch.Tensor] = None
        self.ready: set = set()
        self.work = None

    def transient_bytes(self) -> int:
        live = {id(t): t for t in (self.local, self.comm) if t is not None}
        return sum(t.numel() * t.element_size() for t in live.values())

    def _segment(self) -> torch.Tensor:
        return self.comm[self.rank * self.seg:(self.rank + 1) * self.seg]

    def start_reduce(self) -> None:
        """Reduce-scatter `comm` (set by the caller): this rank's segment becomes the sum over ranks."""
        self.work = dist.reduce_scatter_tensor(self._segment(), self.comm, group=self.group, async_op=True)

    def settle(self) -> None:
        """Fold the finished reduce into the fp32 accumulation; on CUDA on the side stream, which
        waits for the reduce-scatter while the compute stream goes on."""
        if self.comm is None:
            return
        side = self.side_stream
        with torch.cuda.stream(side) if side is not None else nullcontext():
            if self.work is not None:
                self.work.wait()  # on CUDA: the current (side) stream waits, the host does not
            if self.is_owner:
                self.grad.add_(self._segment()[:self.owned_numel])
        if side is not None:
            self.comm.record_stream(side)  # freed by the host now, reused only after the side stream's add
        self.work = None
        self.comm = None

    def start_param_sync(self):
        """All-gather of the owned segments into every rank's flat parameters (in place)."""
        seg = self.param_data[self.rank * self.seg:(self.rank + 1) * self.seg]
        return dist.all_gather_into_tensor(self.param_data, seg, group=self.group, async_op=True)


def scatter_windows(part, costs: Sequence[float], bucket_elements: int) -> List[Tuple[str, List[int]]]:
    """Split parameters (in backward order) into windows of about `bucket_elements` elements:
    ("scatter", indices) windows of several parameters and ("solo", [i]) for a parameter of half a
    window or more (it would leave most of a scattered bucket as padding)."""
    out: List[Tuple[str, List[int]]] = []
    current: List[int] = []
    size = 0
    for i, (_, p) in enumerate(part):
        if p.numel() * 2 >= bucket_elements or getattr(p, "shared_embedding", False):
            if current:
                out.append(("scatter", current))
                current, size = [], 0
            out.append(("solo", [i]))
            continue
        current.append(i)
        size += p.numel()
        if size >= bucket_elements:
            out.append(("scatter", current))
            current, size = [], 0
    if current:
        out.append(("scatter", current))
    return out
