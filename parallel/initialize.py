"""Process groups: torch.distributed plus megatron-core's parallel state (TP, PP, CP, EP, DP).

Under torchrun the usual environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) is read. In a plain
Python process without it, `ensure_single_rank()` sets up a one-rank group, so conversion and
inspection work on CPU-only nodes without a launcher.
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from pretrain import compat
from pretrain.config.schema import ParallelConfig



def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(backend: Optional[str] = None, timeout_minutes: Optional[int] = None) -> None:
    """Initialize torch.distributed from the launcher's environment (or as a single rank).

    `timeout_minutes` (`parallel.distributed_timeout_minutes`) bounds every collective of the default
    group: a rank that waits longer for the others (one of them hung or died) raises instead of
    hanging. None keeps torch's default (10 minutes for NCCL, 30 for gloo).

    On a host without CUDA, `pretrain.compat.install()` must have run (every entry point calls it):
    megatron's RNG tracker and streams need its CPU layer.
    """
    if not torch.cuda.is_available() and not compat.installed():
        raise RuntimeError("no CUDA here: call pretrain.compat.install() once before initializing process groups "
                           "(megatron-core needs its CPU layer; every entry point of this project calls it)")
    if dist.is_initialized():
        return
    backend = backend or default_backend()
    timeout = {"timeout": timedelta(minutes=timeout_minutes)} if timeout_minutes else {}
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if restart and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun keeps its store across worker restarts, and process-group keys from the
            # failed attempt (gloo/NCCL peer addresses under the same group names) would be read
            # by the new one: give each attempt its own key space.
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  int(os.environ["WORLD_SIZE"]), is_master=False)
            dist.init_process_group(backend=backend, store=dist.PrefixStore(f"glm5/attempt_{restart}", store),
                                    rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), **timeout)
        else:
            dist.init_process_group(backend=backend, **timeout)
    else:
        # A lone process: a file store needs no free TCP port and no environment.
        store_file = tempfile.NamedTemporaryFile(prefix="glm5_store_", delete=False).name
        dist.init_process_group(backend=backend, init_method=f"file://{store_file}", rank=0, world_size=1, **timeout)


def initialize_parallel(parallel: ParallelConfig, seed: int = 1234, backend: Optional[str] = None) -> None:
    """torch.distributed, megatron's model-parallel groups, and the model-parallel RNG seeds."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    init_distributed(backend, parallel.distributed_timeout_minutes)
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        distributed_timeout_minutes=parallel.distributed_timeout_minutes,  # megatron's groups: the same bound
        nccl_communicator_config_path=nccl_options_path(parallel),
        # MTP before the last stage: its embedding copy is tied to the first stage's, not the last's
        get_embedding_ranks=compat.embedding_ranks(parallel.pipeline_model_parallel_layout,
                                                   parallel.pipeline_model_parallel_size),
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def nccl_options_path(parallel: ParallelConfig) -> Optional[str]:
    """`parallel.nccl_communicator_config_path` for megatron, or None. NCCL options need NCCL: on gloo (no CUDA)
    megatron would build NCCL option objects that a CPU build of torch lacks, so it is refused there."""
    path = parallel.nccl_communicator_config_path
    if path is not None and not torch.cuda.is_available():
        raise RuntimeError(f"parallel.nccl_communicator_config_path={path} sets NCCL options, but this run has no "
                           "CUDA and uses gloo; set it to null")
    return path


def ensure_single_rank(seed: int = 1234) -> None:
    """Make megatron usable in a plain process: one rank, no model parallelism."""
    from megatron.core import parallel_state as ps

    if dist.is_initialized() and ps.model_parallel_is_initialized():
        return
    initialize_parallel(ParallelConfig(), seed=seed)


def destroy_parallel() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
