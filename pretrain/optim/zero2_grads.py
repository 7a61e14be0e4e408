"""ZeRO-2 for Muon: gradients reduced to their owner, whole-matrix ownership, owner-only broadcast
(GLM-5 report, section 7: ZeRO-2 gradient sharding and zero-redundant Muon).

Muon orthogonalizes whole matrices (or whole head / expert blocks), so the unit of ownership is a
parameter, not a flat slice of one as in megatron-core's distributed optimizer. With data-parallel
size d, every trainable parameter p gets one owner rank o(p) in its data-parallel group (dense
parameters: DP x CP; expert parameters: the expert-data-parallel group). Per micro-batch:

    owner:      G_p <- G_p + (1/d) g_p^local + sum_{r != o(p)} (1/d) g_p^(r)   (reduce to o(p))
    non-owner:  sends (1/d) g_p^local and frees it

so each rank keeps fp32 gradient memory only for the parameters it owns (about 1/d of the model,
up to one matrix) plus a bounded number of reduce buckets in flight; megatron-core's distributed
optimizer keeps a full-size gradient buffer on every rank. The price is one reduce per micro-batch
(in fp32, or in the parameters' dtype with `grad_reduce_in_fp32=False`, megatron's field: half the
traffic, the owner still accumulates in fp32). `reduce_per="step"` (`optimizer.zero2_grad_reduce:
step`) instead accumulates locally and reduces once per step (DDP's traffic, a full-size gradient
buffer while the step's backward passes run, still sharded optimizer state and main weights).
`optimizer.zero2_grad_reduce: microbatch_scatter` reduces per micro-batch as reduce-scatters of
buckets that mix owners (`pretrain.optim.zero2_scatter`: half the time of a reduce at d = 2, the
compute stream not waiting for it until the step's end), with ownership decided per bucket.

After the optimizer step each owner broadcasts the updated parameters it owns: every parameter
crosses the network once (the "all-gather of owned shards"), bucket by bucket, and the broadcasts
overlap the Newton-Schulz work of the buckets that follow (`Zero2DataParallel.broadcast_order`
interleaves owners).

Ownership balances two loads at once: the optimizer's compute (Newton-Schulz cost of a matrix, given
by `cost_fn`) and gradient memory (elements). Parameters are placed largest first on the rank whose
larger normalized load grows least (a greedy two-resource longest-processing-time rule), ties to the
lower rank, so every rank of a group computes the same placement without communication.
Parameters are grouped into buckets of one owner and one dtype in backward order; a bucket's reduce
starts when its last gradient arrives, strictly in bucket order (the same order on every rank).
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.data_parallel_base import _BaseDataParallel

from pretrain.optim.zero2_scatter import ScatterBucket, flatten_parameters, scatter_windows, window_owners

DEFAULT_BUCKET_ELEMENTS = 40_000_000  # megatron-core's DDP default bucket size


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


class _Bucket:
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
        self.comm: Optional[torch.Tensor] = None
        self.ready: set = set()
        self.work = None
        self.owned_params = params if self.is_owner else []
        self.owned_numel = self.numel if self.is_owner else 0

    def start_reduce(self) -> None:
        """Reduce `comm` (set by the caller) to the owner."""
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
            if self.is_owner and self.comm is not self.grad:
                self.grad.add_(self.comm)
            self.comm = None


def broadcast_bucket(b):
    """Start sending the owners' updated parameters of bucket `b` to its group (a broadcast, or an
    all-gather for a `ScatterBucket`): the work, or None alone."""
    if b.group.size() == 1:
        return None
    return b.start_param_sync()


class Zero2DataParallel(DistributedDataParallel):
    """megatron-core's DDP interface (no_sync, finish_grad_sync, zero_grad_buffer, ...) over ZeRO-2.

    Subclasses megatron's DistributedDataParallel only so megatron's `unwrap_model` and checkpoint
    code recognize the wrapper; none of its buffers are built (its __init__ is not called).
    `cost_fn(name, param)` is the optimizer work of a parameter (Newton-Schulz flops or an
    elementwise estimate) used to balance ownership.
    """

    def __init__(self, config, module: torch.nn.Module, cost_fn: Callable[[str, torch.nn.Parameter], float],
                 reduce_per: str = "microbatch", grad_reduce_in_fp32: bool = True,
                 bucket_elements: int = DEFAULT_BUCKET_ELEMENTS, max_inflight: int = 2):
        _BaseDataParallel.__init__(self, config=config, module=module)
        if reduce_per not in ("microbatch", "step", "microbatch_scatter"):
            raise ValueError(f"optimizer.zero2_grad_reduce must be 'microbatch', 'step' or 'microbatch_scatter', "
                             f"got {reduce_per!r}")
        self.scatter = reduce_per == "microbatch_scatter"
        reduce_per = "microbatch" if self.scatter else reduce_per
        # "step": megatron's schedules run every micro-batch but the last under no_sync(); gradients
        # then accumulate locally (full-size, transient) and are reduced once, as with DDP.
        self.reduce_per = reduce_per
        self.grad_reduce_in_fp32 = grad_reduce_in_fp32
        self._sync = True
        # finalize_model_grads reads these two flags.
        self.ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=grad_reduce_in_fp32,
                                                        use_distributed_optimizer=True)
        self.max_inflight = max_inflight
        self._side_stream = None  # CUDA stream of the scatter buckets' accumulation
        dense_group = ps.get_data_parallel_group(with_context_parallel=True)
        expert_group = ps.get_expert_data_parallel_group()
        # Gradients are averaged over the data-parallel replicas of the model (experts too: their
        # tokens came from all DP x CP ranks), as megatron-core's DDP does.
        scale = 1.0 / dense_group.size()
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        named.reverse()  # about the order gradients arrive in backward
        self.buckets: List[_Bucket] = []
        self.param_owner: Dict[torch.nn.Parameter, Tuple[int, object]] = {}
        for expert in (False, True):
            part = [(n, p) for n, p in named if (not getattr(p, "allreduce", True)) == expert]
            if not part:
                continue
            group = expert_group if expert else dense_group
            if self.scatter and group.size() > 1:
                self._make_scatter_buckets(part, [cost_fn(n, p) for n, p in part], group, scale, bucket_elements)
                continue
            owners = assign_owners([cost_fn(n, p) for n, p in part], [p.numel() for _, p in part], group.size())
            for (n, p), o in zip(part, owners):
                # A weight shared between pipeline stages (MTP's embedding) is all-reduced between the
                # stages by finalize_model_grads: both copies need the same owner.
                if getattr(p, "shared_embedding", False):
                    o = 0
                self.param_owner[p] = (o, group)
            self._make_buckets(part, group, scale, bucket_elements)
        # One launch order for dense and expert buckets together, by when a bucket's last gradient
        # arrives: in dense-then-expert order the expert buckets (most of an MoE model) could only
        # start after the dense embedding's gradient, at the very end of every backward.
        position = {p: i for i, (_, p) in enumerate(named)}
        self.buckets.sort(key=lambda b: max(position[p] for p in b.params))
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self._next_launch = 0
        self._inflight: deque = deque()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for _, p in named]
        self.peak_transient_bytes = 0

    def _make_buckets(self, part, group, scale: float, bucket_elements: int) -> None:
        open_buckets: Dict[Tuple[int, torch.dtype], Tuple[List, List[int]]] = {}  # key -> (params, [elements])
        closing: List[Tuple[int, List, int]] = []  # (position of last param, params, owner)
        for pos, (_, p) in enumerate(part):
            owner = self.param_owner[p][0]
            key = (owner, p.dtype)
            members, size = open_buckets.setdefault(key, ([], [0]))
            members.append(p)
            size[0] += p.numel()
            if size[0] >= bucket_elements:
                closing.append((pos, members, owner))
                del open_buckets[key]
        closing += [(len(part), members, key[0]) for key, (members, _) in open_buckets.items()]
        closing.sort(key=lambda t: (t[0], t[2]))  # a bucket is ready when its last gradient arrives
        for _, members, owner in closing:
            dtype = torch.float32 if self.grad_reduce_in_fp32 else members[0].dtype
            self.buckets.append(_Bucket(members, owner, group, scale, dtype))

    def _make_scatter_buckets(self, part, costs, group, scale: float, bucket_elements: int) -> None:
        """Windows of consecutive parameters, owners balanced inside each (`pretrain.optim.zero2_scatter`);
        a parameter of half a window or more alone, reduced to the rank with the least load."""
        world = group.size()
        total_cost = float(sum(costs)) or 1.0
        total_size = float(sum(p.numel() for _, p in part)) or 1.0
        load = [0.0] * world
        device = part[0][1].device
        if self._side_stream is None and device.type == "cuda":
            self._side_stream = torch.cuda.Stream(device=device)
        for kind, idx in scatter_windows(part, costs, bucket_elements):
            params = [part[i][1] for i in idx]
            dtype = torch.float32 if self.grad_reduce_in_fp32 else params[0].dtype
            if kind == "solo":
                p = params[0]
                c, s = costs[idx[0]] / total_cost, p.numel() / total_size
                o = 0 if getattr(p, "shared_embedding", False) else min(range(world), key=lambda r: (load[r] + max(c, s), r))
                load[o] += max(c, s)
                self.param_owner[p] = (o, group)
                self.buckets.append(_Bucket([p], o, group, scale, dtype))
                continue
            for dt in sorted({p.dtype for p in params}, key=str):  # one dtype per flat bucket
                sub = [i for i in idx if part[i][1].dtype == dt]
                owners = window_owners([costs[i] for i in sub], [part[i][1].numel() for i in sub], world, load,
                                       total_cost, total_size)
                members = [part[i][1] for i in sub]
                for p, o in zip(members, owners):
                    self.param_owner[p] = (o, group)
                reduce_dtype = torch.float32 if self.grad_reduce_in_fp32 else dt
                self.buckets.append(ScatterBucket(members, owners, group, scale, reduce_dtype, self._side_stream))

    # ------------------------------------------------------------------ gradients
    def owns(self, param: torch.nn.Parameter) -> bool:
        owner, group = self.param_owner[param]
        return group.rank() == owner

    def owned_grad_elements(self) -> int:
        """Elements of persistent gradient storage on this rank."""
        return sum(b.owned_numel for b in self.buckets)

    @torch.no_grad()
    def _on_grad(self, param: torch.nn.Parameter) -> None:
        if param.grad is None:
            return
        b = self.bucket_of[param]
        if param in b.ready:  # a second gradient in one micro-batch (e.g. recomputation): just add
            self._accumulate(b, param)
            return
        self._open(b)
        self._accumulate(b, param)
        if not self._sync:  # per-step reduction: the gradient stays here until the last micro-batch
            return
        b.ready.add(param)
        while self._next_launch < len(self.buckets) and len(self.buckets[self._next_launch].ready) == len(
                self.buckets[self._next_launch].params):
            self._launch(self.buckets[self._next_launch])

    def _open(self, b: _Bucket) -> None:
        """Give the bucket somewhere to collect this rank's gradients."""
        if b.local is not None:
            return
        if b.in_place:
            b.settle()  # the previous reduce writes into the accumulation: it must be done first
            b.local = b.grad
        else:
            b.local = torch.zeros(b.numel, dtype=torch.float32, device=b.param_data.device)
            self._track_transient()

    def _accumulate(self, b: _Bucket, param: torch.nn.Parameter) -> None:
        s, e = b.offsets[param]
        b.local[s:e].view_as(param).add_(param.grad, alpha=b.scale)
        param.grad = None

    def _launch(self, b: _Bucket) -> None:
        self._open(b)  # a bucket flushed without any gradient here sends zeros
        b.settle()  # this bucket's previous reduce (the last micro-batch's) is folded in first
        b.comm = b.local if b.reduce_dtype == torch.float32 else b.local.to(b.reduce_dtype)
        b.local = None
        self._track_transient()
        if b.group.size() > 1:
            b.start_reduce()
        else:
            b.settle()
        b.ready.clear()
        self._next_launch = (self._next_launch + 1) % len(self.buckets)
        if not b.in_place:
            self._inflight.append(b)
            while len(self._inflight) > self.max_inflight:  # bound the transient gradient memory
                self._inflight.popleft().settle()

    def _track_transient(self) -> None:
        live = sum(b.transient_bytes() for b in self.buckets)
        self.peak_transient_bytes = max(self.peak_transient_bytes, live)

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Launch the buckets not launched yet (in order) and wait for every reduce."""
        if self._next_launch or any(b.ready for b in self.buckets):
            for b in self.buckets[self._next_launch:]:
                self._launch(b)
            self._next_launch = 0
        for b in self.buckets:
            b.settle()
        self._inflight.clear()
        self._join_side_stream()

    def _join_side_stream(self) -> None:
        """The compute stream waits for the owners' accumulation on the side stream (scatter buckets)."""
        if self._side_stream is not None:
            torch.cuda.current_stream().wait_stream(self._side_stream)

    def start_grad_sync(self, *unused) -> None:
        pass  # reduces start from the gradient hooks

    @contextmanager
    def no_sync(self):
        """Per-micro-batch mode ignores it (holding gradients would need the full-size buffer the
        mode avoids); per-step mode accumulates locally inside it."""
        if self.reduce_per == "microbatch":
            yield
            return
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def zero_grad_buffer(self) -> None:
        for b in self.buckets:
            b.settle()
        self._join_side_stream()  # the side stream's last adds land before the zeroing
        for b in self.buckets:
            b.ready.clear()
            b.local = None
            if b.is_owner:
                b.grad.zero_()
            for p in b.params:
                p.grad = None
        self._next_launch = 0
        self._inflight.clear()

    def scale_gradients(self, scaling_factor: float) -> None:
        for b in self.buckets:
            if b.is_owner:
                b.grad.mul_(scaling_factor)

    # ------------------------------------------------------------------ parameters
    def broadcast_order(self) -> List[_Bucket]:
        """Buckets in the order of the post-step broadcasts: owners interleaved round-robin, so each
        rank's first buckets go out while it orthogonalizes its next ones."""
        per_owner: Dict[Tuple[int, int], List[_Bucket]] = {}
        for b in self.buckets:
            per_owner.setdefault((id(b.group), b.owner), []).append(b)
        order = []
        for k in range(max((len(v) for v in per_owner.values()), default=0)):
            for key in sorted(per_owner, key=lambda t: t[1]):
                if k < len(per_owner[key]):
                    order.append(per_owner[key][k])
        return order

    def broadcast_params(self) -> None:
        """Make every rank's parameters its owners' (e.g. after loading weights on one rank)."""
        works = [broadcast_bucket(b) for b in self.broadcast_order()]
        for w in works:
            if w is not None:
                w.wait()

    def start_param_sync(self, *unused, **kwargs) -> None:
        pass  # parameters are broadcast by the optimizer step (pretrain.optim.zero2_owner)
