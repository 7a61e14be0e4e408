"""megatron-core 0.16.1's dataset builders in a process without torch.distributed (part of `pretrain.compat`)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from pretrain.compat.registry import Workaround


@contextlib.contextmanager
def rank_zero_without_process_group() -> Iterator[None]:
    """Let megatron's BlendedDataset build its cache in a process without torch.distributed.

    megatron-core 0.16.1 `BlendedDataset._build_indices` calls `torch.distributed.get_rank()` on a
    cache miss without checking `is_initialized()` (GPTDataset does check), which raises in a plain
    process. A lone process is rank 0, so answer 0 while the builder runs.
    """
    if torch.distributed.is_initialized():
        yield
        return
    original = torch.distributed.get_rank
    torch.distributed.get_rank = lambda group=None: 0
    try:
        yield
    finally:
        torch.distributed.get_rank = original


WORKAROUNDS = [
    Workaround(
        name="rank_zero_without_process_group",
        target="megatron.core.datasets.blended_dataset.BlendedDataset._build_indices",
        reason="calls torch.distributed.get_rank() without a process group and raises in a plain process",
        upstream="open",
        test="tests/test_datasets.py::test_blend_follows_its_weights",
    ),
]
