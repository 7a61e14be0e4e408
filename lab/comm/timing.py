"""Wall-clock timing of synchronized CUDA work and the rank-0 report, shared by the communication probes."""

from __future__ import annotations

import json
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


def report_and_finish(out: dict, path: str) -> None:
    """Rank 0 writes `out` to `path` as JSON and prints it; every rank leaves its process group."""
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        print(json.dumps(out, indent=1))
    dist.destroy_process_group()
