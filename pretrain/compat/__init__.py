"""Every workaround for megatron-core 0.16.1 (and one for Triton's interpreter, one for NCCL) lives here.

Moving to a newer megatron-core means revisiting this package only. One concern per module
(`CONCERNS`), each ending with `WORKAROUNDS = [Workaround(...), ...]` (`registry.py`: what it
changes, why, the upstream issue, the test that fails without it); `WORKAROUNDS` below is the
whole table, and `python -m pretrain.compat` prints it.

`install()` is the one front door. Every entry point calls it once, before any process group or
model exists: `pretrain.train`, `glm5-convert`, `pretrain.model.summary`, `load_hf_model`, and
`build_model` (so a library user who builds a model directly gets the same megatron-core; it is
idempotent, so the entry points' own call makes that one free). It

* warns (`MegatronVersionWarning`, naming both versions) when the installed megatron-core is not
  the 0.16.1 these patches target, and applies them anyway;
* applies every workaround with an `install` function whose `when` holds: "always" (megatron-core
  without Transformer Engine or apex, tensor parallelism on the torch-native backend, the
  torch_dist checkpoint writer), "triton_interpreter" (TRITON_INTERPRET=1), and "cpu";
* on a host without CUDA, enters the CPU layer (`cpu.install_cpu_support`). Its changes are
  process-wide and last for the life of the process: `torch.cuda.current_device()` answers "cpu",
  CUDA streams and events become no-ops, megatron's RNG tracker forks the CPU generator, and a
  `TorchFunctionMode` maps every "cuda" device argument (and `.cuda()`) to CPU. CPU support is a
  product feature: the quickstart trains on CPU and checkpoint conversion runs on CPU-only nodes.

Helpers used at their call site (context managers, replacement classes) are in the table with
`install=None` and are imported from here.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from typing import Optional, Tuple

import torch

from pretrain.compat.cpu import install_cpu_support, token_dispatcher_for_device
from pretrain.compat.datasets import rank_zero_without_process_group
from pretrain.compat.dsa import dsa_config_check_without_cp
from pretrain.compat.dist_checkpointing import pageable_staging, patch_dist_checkpoint_writer
from pretrain.compat.model import (
    MTPLogitsWithoutLabels,
    gpt_model_mtp_block_class,
    grouped_gemm_check_skipped,
    grouped_mm_available,
)
from pretrain.compat.pipeline import embedding_ranks, tie_local_embedding_copies
from pretrain.compat.registry import Workaround
from pretrain.compat.te_absent import te_available
from pretrain.compat.tensor_parallel import SequenceParallelTorchNorm
from pretrain.compat.triton_interpreter import patch_triton_interpreter

MEGATRON_CORE_VERSION = "0.16.1"  # the release every workaround here was written and tested against
CONCERNS = ("te_absent", "tensor_parallel", "dist_checkpointing", "datasets", "model", "trackers", "dsa", "pipeline",
            "collectives", "cpu", "triton_interpreter")
WORKAROUNDS: Tuple[Workaround, ...] = tuple(
    w for concern in CONCERNS for w in importlib.import_module(f"pretrain.compat.{concern}").WORKAROUNDS
)

_INSTALLED = False


class MegatronVersionWarning(UserWarning):
    """The installed megatron-core is not the release `pretrain.compat` targets."""


def check_megatron_version() -> Optional[str]:
    """Warn (and return the message) when megatron-core is not `MEGATRON_CORE_VERSION`."""
    import megatron.core

    found = getattr(megatron.core, "__version__", "unknown")
    if found == MEGATRON_CORE_VERSION:
        return None
    message = (
        f"megatron-core {found} is installed, but pretrain.compat's workarounds target megatron-core "
        f"{MEGATRON_CORE_VERSION}; they are applied anyway. Install megatron-core=={MEGATRON_CORE_VERSION}, or "
        "re-check each entry of pretrain.compat.WORKAROUNDS with its test"
    )
    warnings.warn(message, MegatronVersionWarning, stacklevel=3)
    return message


def applies(when: str) -> bool:
    """Whether a workaround applied "always" / on "cpu" / under the "triton_interpreter" holds here."""
    if when == "always":
        return True
    if when == "cpu":
        return not torch.cuda.is_available()
    if when == "triton_interpreter":
        return os.environ.get("TRITON_INTERPRET", "0") == "1" and importlib.util.find_spec("triton") is not None
    raise ValueError(f"unknown Workaround.when {when!r}")


def install() -> None:
    """Check the megatron-core version and apply every workaround that applies here (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    check_megatron_version()
    for workaround in WORKAROUNDS:
        if workaround.install is not None and applies(workaround.when):
            workaround.install()
    _INSTALLED = True


def installed() -> bool:
    """Whether `install()` has run in this process."""
    return _INSTALLED


__all__ = [
    "CONCERNS",
    "MEGATRON_CORE_VERSION",
    "MTPLogitsWithoutLabels",
    "MegatronVersionWarning",
    "SequenceParallelTorchNorm",
    "WORKAROUNDS",
    "Workaround",
    "applies",
    "check_megatron_version",
    "dsa_config_check_without_cp",
    "embedding_ranks",
    "gpt_model_mtp_block_class",
    "grouped_gemm_check_skipped",
    "grouped_mm_available",
    "install",
    "install_cpu_support",
    "installed",
    "pageable_staging",
    "patch_dist_checkpoint_writer",
    "patch_triton_interpreter",
    "rank_zero_without_process_group",
    "te_available",
    "tie_local_embedding_copies",
    "token_dispatcher_for_device",
]
