"""Wall-clock timing of synchronized CUDA work, shared by the communication probes."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def timed(fn, reps: int, warmups: int = 1, align_ranks: bool = False) -> float:
    """Milliseconds per call of `fn` over `reps` calls, after `warmups` calls (and a barrier with `align_ranks`)."""
    for _ in range(warmups):
        fn()
    torch.cuda.synchronize()
    if align_ranks:
        dist.barrier()
    began = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - began) / reps * 1e3
