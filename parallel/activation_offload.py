"""Activation offloading: what a layer saves for backward waits in host memory between its forward and backward.

GLM-5 report (training infrastructure): pipeline activation offloading moves layer activations to host
memory after the forward and brings them back before the backward, combined with fine-grained
recompute, so long sequences fit. megatron-core 0.16.1's offloading needs Transformer Engine; this one
is torch-native:

* Each layer's forward runs inside `ActivationOffloader.layer()`, which installs torch's saved-tensor
  hooks (`torch.autograd.graph.saved_tensors_hooks`). Every tensor autograd saves in that forward
  (of at least `min_bytes`, not a weight: see below) is copied into a pinned host buffer on a side stream
  (`d2h`) as soon as it is saved; the device memory returns to the caching allocator once the copy is
  done (`record_stream`), without the default stream ever waiting.
* In backward, the first use of a layer's tensors brings them back (on a second side stream, `h2d`)
  and at the same time starts bringing back the layer before it in the same forward: the copy for
  layer l-1 overlaps the backward of layer l. The default stream waits on an event, never on the host.
* Groups are linked per forward pass, so micro-batches interleaved by a 1F1B pipeline schedule keep
  their own chains; a layer re-run in backward (recompute) is not offloaded again.

Weights saved for backward stay on the device (they live there anyway; a copy would only add traffic).
A saved tensor is a weight when it is a parameter, a view of one (`weight.t()` in a linear), or shares
storage with a parameter of the excluded modules as they are *now*: the wrappers applied after the model
is built (bf16 casting under Float16Module, ZeRO-2 / DDP moving parameters into flat buffers) give the
parameters new storage, so the storages are looked up from the live modules at the start of each forward
pass, never remembered from build time.

On a machine without CUDA the round trip goes through a separate plain host buffer (a copy), so the
hook logic runs and is tested on CPU; it saves no memory there.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Iterator, List, Optional, Set

import torch

from parallel.deepspeed_offload import reset_deepspeed_offload
from parallel.recompute_units import route_recompute_units


def in_backward() -> bool:
    """True while autograd runs a backward pass (e.g. a recomputed forward inside it)."""
    return torch._C._current_graph_task_id() != -1


class _Group:
    """The tensors one layer's forward saved: where they wait, and the events that order the copies."""

    def __init__(self, index: Optional[int], prev: Optional["_Group"]):
        self.index = index
        self.prev = prev
        self.host: List[Optional[torch.Tensor]] = []  # pinned host copies until the backward takes them
        self.device: List[Optional[torch.Tensor]] = []
        self.saved_to_host: Optional[torch.cuda.Event] = None
        self.back_on_device: Optional[torch.cuda.Event] = None
        self.open = False  # the layer's forward is running
        self.fetched = False  # the copy back to the device was issued
        self.in_backward = False  # its backward has begun (the default stream waited for the copy)


class ActivationOffloader:
    """Saved-tensor hooks that move each layer's saved activations to host memory and prefetch them back."""

    def __init__(self, min_bytes: int = 1 << 20):
        self.min_bytes = min_bytes
        self.cuda = torch.cuda.is_available()
        self.d2h = torch.cuda.Stream() if self.cuda else None
        self.h2d = torch.cuda.Stream() if self.cuda else None
        self._last: Optional[_Group] = None
        self._excluded: List[weakref.ref] = []  # the modules whose parameters stay (not kept alive by this)
        self._param_storages: Optional[Set[int]] = None  # their storages, looked up again each forward pass
        self.offloaded_bytes = 0  # since construction, for tests and logs
        self.prefetched_groups = 0

    def exclude_parameters(self, modules) -> None:
        """Never offload these modules' parameters, their views, or tensors sharing their storage (saved
        weights), wherever the parameters' storage is when the forward runs."""
        self._excluded += [weakref.ref(m) for m in modules]
        self._param_storages = None

    def _parameter_storages(self) -> Set[int]:
        if self._param_storages is None:
            modules = [m for m in (ref() for ref in self._excluded) if m is not None]
            self._param_storages = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}
        return self._param_storages

    @contextlib.contextmanager
    def layer(self, index: Optional[int] = None) -> Iterator[None]:
        """Offload what autograd saves inside this block (the forward of layer `index`).

        The layer's backward prefetches the group of layer `index - 1` when that was the forward just
        before it (so micro-batches interleaved by a pipeline schedule keep separate chains)."""
        if in_backward() or not torch.is_grad_enabled():
            yield
            return
        last = self._last
        linked = last is not None and not last.fetched and (index is None or last.index == index - 1)
        group = _Group(index, prev=last if linked else None)
        if not linked:  # a new forward pass: parameters may have been re-pointed since the last one
            self._param_storages = None
        self._last = group
        group.open = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, group),
                                                          functools.partial(self._unpack, group)):
                yield
        finally:
            # The forward may itself run a backward over what it saved (autograd.grad inside an autograd
            # Function): the device tensors stay until the forward ends, then only the host copies do.
            group.open = False
            group.device = [None] * len(group.device)
        if self.cuda and group.host:
            group.saved_to_host = torch.cuda.Event()
            group.saved_to_host.record(self.d2h)

    def end_forward(self) -> None:
        """The next layer starts a new chain (call between forward passes that are not one model)."""
        self._last = None

    # ------------------------------------------------------------------ hooks
    def _keep(self, t: torch.Tensor) -> bool:
        if t.numel() * t.element_size() < self.min_bytes or (self.cuda and not t.is_cuda):
            return True
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            return True  # a weight or a view of one (autograd saves `weight.t()` for a linear)
        return t.untyped_storage().data_ptr() in self._parameter_storages()

    def _pack(self, group: _Group, t: torch.Tensor):
        if self._keep(t):
            return ("keep", t)
        if self.cuda:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.d2h.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.d2h):
                host.copy_(t, non_blocking=True)
            t.record_stream(self.d2h)  # its memory is reused only after the copy
        else:
            host = torch.empty(t.shape, dtype=t.dtype)
            host.copy_(t)
        group.host.append(host)
        group.device.append(t)  # until the layer's forward ends (see `layer`)
        self.offloaded_bytes += t.numel() * t.element_size()
        return ("host", len(group.host) - 1, t.device)

    def _unpack(self, group: _Group, handle):
        if handle[0] == "keep":
            return handle[1]
        _, index, device = handle
        if group.open:  # a backward nested in the layer's forward (e.g. the indexer loss's own gradient)
            return group.device[index]
        if not group.in_backward:  # this layer's backward begins
            group.in_backward = True
            if not group.fetched:
                self._fetch(group, device)
            if group.prev is not None and not group.prev.fetched:
                self._fetch(group.prev, device)  # overlaps this layer's backward
                self.prefetched_groups += 1
            group.prev = None  # no chain keeps finished groups (and their host buffers) alive
            if self.cuda:
                torch.cuda.current_stream().wait_event(group.back_on_device)
        # A custom backward may read its saved tensors more than once, so the group keeps the device
        # copy; it is freed with the group, when autograd has run (and dropped) this layer's nodes.
        return group.device[index]

    def _fetch(self, group: _Group, device: torch.device) -> None:
        group.fetched = True
        if not self.cuda:
            group.device = [h.clone() for h in group.host]  # a second buffer: the round trip is real
            return
        if group.saved_to_host is None:  # the forward's copies were issued but the layer has not ended
            group.saved_to_host = torch.cuda.Event()
            group.saved_to_host.record(self.d2h)
        self.h2d.wait_event(group.saved_to_host)
        with torch.cuda.stream(self.h2d):
            group.device = [h.to(device, non_blocking=True) for h in group.host]
            group.back_on_device = torch.cuda.Event()
            group.back_on_device.record(self.h2d)
        main = torch.cuda.current_stream()
        for t in group.device:
            t.record_stream(main)  # allocated on h2d, used and freed on the default stream


def offload_layers(layers, offloader: ActivationOffloader) -> list:
    """Run each module's forward inside `offloader.layer(...)` (forward hooks; megatron's layers stay as they are).

    A module's `layer_number` (megatron's TransformerLayer has one) orders the prefetch chain. Returns the
    hook handles (`handle.remove()` undoes it)."""
    handles = []
    for module in layers:
        stack: List[contextlib.ExitStack] = []

        def enter(mod, _args, stack=stack):
            scope = contextlib.ExitStack()
            scope.enter_context(offloader.layer(getattr(mod, "layer_number", None)))
            stack.append(scope)

        def leave(_mod, _args, _out, stack=stack):
            stack.pop().close()

        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave, always_call=True))
    return handles


_PROCESS_OFFLOADER: Optional[ActivationOffloader] = None
MIN_OFFLOAD_BYTES = 1 << 20  # smaller saved tensors stay: their copies would cost more than they free


def enable_torch_offload(model: torch.nn.Module, layers) -> ActivationOffloader:
    """Offload what `layers` save (one group per layer), and, under full recompute, each recompute
    unit's saved inputs (one group per unit: the inputs are what full recompute keeps). One offloader
    per process serves every model chunk (virtual pipeline stages)."""
    global _PROCESS_OFFLOADER
    if _PROCESS_OFFLOADER is None:
        _PROCESS_OFFLOADER = ActivationOffloader(MIN_OFFLOAD_BYTES)
    offloader = _PROCESS_OFFLOADER
    offloader.exclude_parameters([model])
    offload_layers(layers, offloader)

    def wrap(checkpoint):
        def offloaded(function, distribute_saved_activations, *args):
            with offloader.layer():
                return checkpoint(function, distribute_saved_activations, *args)
        return offloaded

    route_recompute_units(wrap)
    return offloader


def reset_activation_offload() -> None:
    """Forget the process's offloader and restore megatron's recompute units (tests, rebuilt models)."""
    global _PROCESS_OFFLOADER
    _PROCESS_OFFLOADER = None
    route_recompute_units(None)
    reset_deepspeed_offload()


def process_offloader() -> Optional[ActivationOffloader]:
    """The offloader the models of this process use, if activation offloading is on."""
    return _PROCESS_OFFLOADER
