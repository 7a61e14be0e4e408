"""megatron-core 0.16.1 on a CPU-only host (part of `pretrain.compat`).

megatron-core is written for CUDA; this small layer lets its models, parallel linear layers, MoE
dispatchers and RNG tracker run on CPU with a gloo process group: `torch.cuda.current_device`
answers "cpu", the model-parallel RNG tracker forks the CPU generator, CUDA streams / events become
no-ops, gradient clipping accepts CPU tensors, and a torch-function mode maps every "cuda" device
argument to CPU. `install_cpu_support()` is applied by `pretrain.compat.install()` when CUDA is
unavailable; idempotent. Its changes are process-wide and stay for the life of the process.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from pretrain.compat.registry import Workaround
from pretrain.notices import say_once

_log = logging.getLogger(__name__)

_CPU_INSTALLED = False


def _cpu_current_device() -> str:
    # Many megatron modules allocate with `device=torch.cuda.current_device()`.
    return "cpu"


def _patch_rng_tracker() -> None:
    # The model-parallel RNG tracker saves and restores CUDA generator states; on CPU the CPU
    # generator plays that role. Used by weight init (fork per TP rank) and dropout.
    from megatron.core.tensor_parallel import random as mp_random

    def get_state(*_args, **_kwargs) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(state: torch.Tensor, *_args, **_kwargs) -> None:
        torch.set_rng_state(state)

    class CPURNGStatesTracker(mp_random.CudaRNGStatesTracker):
        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            # Same contract as the CUDA tracker, minus its "CPU RNG changed" warning: on CPU the
            # forked generator *is* the CPU generator.
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    mp_random._get_cuda_rng_state = get_state
    mp_random._set_cuda_rng_state = set_state
    mp_random.CudaRNGStatesTracker = CPURNGStatesTracker


def _patch_cuda_streams() -> None:
    # DDP bucketing, schedules and some dispatchers create CUDA streams/events and synchronize;
    # on CPU all work is already ordered, so no-ops are exact.
    class _NoOpEvent:
        def __init__(self, *args, **kwargs):
            pass

        def record(self, *args, **kwargs):
            pass

        def wait(self, *args, **kwargs):
            pass

        def synchronize(self):
            pass

        def query(self):
            return True

        def elapsed_time(self, other):
            return 0.0

    class _NoOpStream(_NoOpEvent):
        def wait_stream(self, *args, **kwargs):
            pass

        def wait_event(self, *args, **kwargs):
            pass

        def record_event(self, *args, **kwargs):
            return _NoOpEvent()

    torch.cuda.Stream = _NoOpStream  # type: ignore[misc,assignment]
    torch.cuda.Event = _NoOpEvent  # type: ignore[misc,assignment]
    torch.cuda.current_stream = lambda *a, **k: _NoOpStream()  # type: ignore[assignment]
    torch.cuda.default_stream = lambda *a, **k: _NoOpStream()  # type: ignore[assignment]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]


class _CudaToCpuMode(torch.overrides.TorchFunctionMode):
    """Maps literal `device="cuda"` requests (and `.cuda()`) to CPU.

    megatron's DDP buffers, schedules and loss reductions allocate with `device="cuda"` or call
    `.cuda()`; this mode rewrites those calls so the same code runs on a CPU-only host. Pinned host
    memory (`pin_memory=True`, e.g. the chunk indices of context parallelism's RoPE,
    `get_pos_emb_on_this_cp_rank`) needs an accelerator: the request is dropped.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        dev = kwargs.get("device")
        if dev is not None and _is_cuda(dev):
            kwargs["device"] = "cpu"
        if func in (torch.Tensor.cuda,):
            return args[0]
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


def _is_cuda(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return False


_CPU_MODE: _CudaToCpuMode | None = None


def _patch_grad_clipping() -> None:
    # clip_grad_by_total_norm_fp32 asserts every grad is a `torch.cuda.FloatTensor` before
    # scaling them. Same computation for CPU tensors: scale all grads by max_norm / total_norm.
    from megatron.core.optimizer import optimizer as mcore_optimizer

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0 and grads:
            torch._foreach_mul_(grads, clip_coeff)

    mcore_optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


def install_cpu_support() -> None:
    """Let megatron-core run on a CPU-only host (see module docstring)."""
    global _CPU_INSTALLED, _CPU_MODE
    if _CPU_INSTALLED or torch.cuda.is_available():
        return
    torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]
    _patch_rng_tracker()
    _patch_cuda_streams()
    _patch_grad_clipping()
    # Entered once and left active for the life of the process: every megatron call site
    # that says "cuda" must see CPU, including ones running inside autograd backward.
    _CPU_MODE = _CudaToCpuMode()
    _CPU_MODE.__enter__()
    _CPU_INSTALLED = True
    # Said because a GPU node whose torch sees no CUDA (a CPU build of torch, a broken driver) would train here too.
    say_once(_log, "no CUDA device: megatron-core runs on the CPU with gloo (pretrain.compat.cpu); on a GPU node, "
                   "check that torch is a CUDA build and sees the driver")


def token_dispatcher_for_device(name: str) -> str:
    """`model.moe_token_dispatcher_type` as megatron builds it: "auto" is alltoall on GPU, allgather on CPU."""
    # megatron's alltoall dispatcher needs CUDA streams in its constructor.
    if name == "auto":
        return "alltoall" if torch.cuda.is_available() else "allgather"
    return name


WORKAROUNDS = [
    Workaround(
        name="install_cpu_support",
        target="torch.cuda.{current_device, Stream, Event, ...}, megatron RNG tracker and grad clipping",
        reason="megatron-core is written for CUDA: models, parallel linears, dispatchers and DDP fail on a CPU host",
        upstream="open (megatron-core targets CUDA only)",
        test="tests/test_parallel_equivalence.py::test_tp2_matches_single_rank",
        install=install_cpu_support,
        when="cpu",
    ),
    Workaround(
        name="token_dispatcher_for_device",
        target="megatron.core.transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher",
        reason="the alltoall dispatcher needs CUDA streams: model.moe_token_dispatcher_type=auto picks allgather on CPU",
        upstream="open (megatron-core targets CUDA only)",
        test="tests/test_parallel_equivalence.py::test_ep2_matches_single_rank",
    ),
]
