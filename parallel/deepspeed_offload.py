"""Activation offloading through DeepSpeed's activation checkpointing (`checkpoint_in_cpu`).

The second backend of `model.activation_offload` (`model.activation_offload_backend: deepspeed`).
DeepSpeed's `deepspeed.checkpointing.checkpoint` is a full-recompute unit, like megatron's
`tensor_parallel.checkpoint`; with `checkpoint_in_cpu=True` it keeps a unit's *inputs* in pinned host
memory (copied on a side stream by its `_ActivationOffloadEngine`) instead of on the device, and
re-runs the unit in backward (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", SC'20, section on activation checkpoint offloading; DeepSpeed docs,
"Activation Checkpointing").

So it needs `model.recompute_granularity: full`: what it offloads is what full recompute keeps, the
input of each recompute unit (decoder layers and the MTP layer). The torch backend
(`parallel.activation_offload`) offloads the same inputs and, without recompute, everything a layer
saves. DeepSpeed restores its own RNG tracker, not megatron's, so the config refuses dropout with it.

Partitioning the saved inputs over tensor-parallel ranks (`partition_activations`) stays off: with
sequence parallelism megatron's inputs are already split.
"""

from __future__ import annotations

import logging

import torch

from parallel.recompute_units import route_recompute_units
from pretrain.notices import say_once

log = logging.getLogger(__name__)


def enable_deepspeed_offload(model: torch.nn.Module) -> None:
    """Route the recompute units of decoder and MTP through DeepSpeed's checkpoint with CPU inputs."""
    import deepspeed
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing
    from megatron.core import parallel_state

    if not deepspeed.comm.is_initialized():  # DeepSpeed's comm wraps the process group already made
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), auto_mpi_discovery=False,
                                   verbose=False)
    # megatron's parallel_state has get_tensor_model_parallel_{rank,world_size,group}: DeepSpeed's mpu.
    ds_checkpointing.configure(parallel_state, partition_activations=False, checkpoint_in_cpu=True,
                               contiguous_checkpointing=False, synchronize=False, profile=False)

    def wrap(_megatron_checkpoint):
        def offloaded(function, _distribute_saved_activations, *args):
            # DeepSpeed frees a unit's inputs by emptying the tensors it was given (`t.data = empty`);
            # megatron's callers still hold theirs (MTP reuses its input), so it gets aliases (views
            # share the storage, and the storage goes once the caller lets go).
            return ds_checkpointing.checkpoint(function, *[a.view_as(a) if torch.is_tensor(a) else a for a in args])
        return offloaded

    route_recompute_units(wrap)
    say_once(log, "activation offload: DeepSpeed %s checkpoint_in_cpu for every recompute unit", deepspeed.__version__)


def reset_deepspeed_offload() -> None:
    """Drop DeepSpeed's pinned buffers and settings (tests, rebuilt models)."""
    import sys

    module = sys.modules.get("deepspeed.runtime.activation_checkpointing.checkpointing")
    if module is not None:  # DeepSpeed keeps these as module state; it offers no public reset of them
        module._reset_cpu_offload_engine()
        module._configure_defaults()
