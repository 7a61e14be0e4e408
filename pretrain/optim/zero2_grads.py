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
`optimizer.zero2_reduce_transport: copy_engine` moves the reduces' bytes with the GPUs' copy engines
instead of NCCL's kernels (`pretrain.optim.zero2_copy_engine`; one node).

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
from typing import Callable, Dict, List, Optional, Tuple

import torch
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.data_parallel_base import _BaseDataParallel

from pretrain.optim.zero2_buckets import OwnerBucket, assign_owners
from pretrain.optim.zero2_copy_engine import CopyEngineReduce, make_reducers
from pretrain.optim.zero2_scatter import ScatterBucket, scatter_windows, window_owners

DEFAULT_BUCKET_ELEMENTS = 40_000_000  # megatron-core's DDP default bucket size


class Zero2DataParallel(DistributedDataParallel):
    """megatron-core's DDP interface (no_sync, finish_grad_sync, zero_grad_buffer, ...) over ZeRO-2.

    Subclasses megatron's DistributedDataParallel only so megatron's `unwrap_model` and checkpoint
    code recognize the wrapper; none of its buffers are built (its __init__ is not called).
    `cost_fn(name, param)` is the optimizer work of a parameter (Newton-Schulz flops or an
    elementwise estimate) used to balance ownership.
    """

    def __init__(self, config, module: torch.nn.Module, cost_fn: Callable[[str, torch.nn.Parameter], float],
                 reduce_per: str = "microbatch", grad_reduce_in_fp32: bool = True,
                 bucket_elements: int = DEFAULT_BUCKET_ELEMENTS, max_inflight: int = 2,
                 reduce_transport: str = "nccl", transports: Optional[Dict[str, CopyEngineReduce]] = None,
                 fabric_factory=None):
        _BaseDataParallel.__init__(self, config=config, module=module)
        if reduce_per not in ("microbatch", "step", "microbatch_scatter"):
            raise ValueError(f"optimizer.zero2_grad_reduce must be 'microbatch', 'step' or 'microbatch_scatter', "
                             f"got {reduce_per!r}")
        self.scatter = reduce_per == "microbatch_scatter"
        if reduce_transport not in ("nccl", "copy_engine") or (reduce_transport == "copy_engine" and self.scatter):
            raise ValueError(f"optimizer.zero2_reduce_transport must be 'nccl' or 'copy_engine' (not with "
                             f"microbatch_scatter), got {reduce_transport!r} with {reduce_per!r}")
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
        self.buckets: List[OwnerBucket] = []
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
        if reduce_transport == "copy_engine":
            self._attach_copy_engines(dense_group, expert_group, transports, fabric_factory)
        position = {p: i for i, (_, p) in enumerate(named)}
        self.buckets.sort(key=lambda b: max(position[p] for p in b.params))
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self._next_launch = 0
        self._inflight: deque = deque()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for _, p in named]
        self.peak_transient_bytes = 0

    def _attach_copy_engines(self, dense_group, expert_group, transports, fabric_factory) -> None:
        """Every bucket of a group of more than one rank reduces through that group's copy-engine transport,
        shared by the model chunks (`transports`: filled by the first chunk, in the same order on every rank)."""
        transports = {} if transports is None else transports
        groups = {"dense": dense_group, "expert": expert_group}
        missing = {k: g for k, g in groups.items() if k not in transports}
        if missing:
            device = self.buckets[0].param_data.device if self.buckets else torch.device("cpu")
            transports.update(make_reducers(missing, device, fabric_factory))
        by_group = {id(g): transports.get(k) for k, g in groups.items()}
        for b in self.buckets:
            b.transport = by_group.get(id(b.group))

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
            self.buckets.append(OwnerBucket(members, owner, group, scale, dtype))

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
                self.buckets.append(OwnerBucket([p], o, group, scale, dtype))
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

    def _open(self, b: OwnerBucket) -> None:
        """Give the bucket somewhere to collect this rank's gradients."""
        if b.local is not None:
            return
        if b.in_place:
            b.settle()  # the previous reduce writes into the accumulation: it must be done first
            b.local = b.grad
        else:
            # Not zeroed: a parameter's first gradient is written into it (`_accumulate`), and `_launch` zeros
            # what no gradient wrote. Zeroing and then adding cost two more passes over the bucket per
            # micro-batch on every rank that does not own it.
            b.local = torch.empty(b.numel, dtype=torch.float32, device=b.param_data.device)
            b.written = set()
            self._track_transient()

    def _accumulate(self, b: OwnerBucket, param: torch.nn.Parameter) -> None:
        s, e = b.offsets[param]
        into = b.local[s:e].view_as(param)
        if b.local is b.grad or param in b.written:
            into.add_(param.grad, alpha=b.scale)
        else:
            torch.mul(param.grad, b.scale, out=into)
            b.written.add(param)
        param.grad = None

    @staticmethod
    def _zero_unwritten(b: OwnerBucket) -> None:
        """Zero the parts of a fresh `local` that no gradient wrote (parameters without a gradient here)."""
        if b.local is b.grad or len(b.written) == len(b.params):
            return
        if not b.written:
            b.local.zero_()
            return
        for p in b.params:
            if p not in b.written:
                s, e = b.offsets[p]
                b.local[s:e].zero_()

    def _launch(self, b: OwnerBucket) -> None:
        self._open(b)  # a bucket flushed without any gradient here sends zeros
        self._zero_unwritten(b)
        b.settle()  # this bucket's previous reduce (the last micro-batch's) is folded in first
        # an owner reducing through a transport adds its own fp32 gradients: no cast for it
        keep = b.reduce_dtype == torch.float32 or (b.transport is not None and b.is_owner)
        b.comm = b.local if keep else b.local.to(b.reduce_dtype)
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
    def broadcast_order(self) -> List[OwnerBucket]:
        """Buckets in the order of the post-step broadcasts: owners interleaved round-robin, so each
        rank's first buckets go out while it orthogonalizes its next ones."""
        per_owner: Dict[Tuple[int, int], List[OwnerBucket]] = {}
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
