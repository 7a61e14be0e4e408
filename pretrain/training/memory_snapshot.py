"""What is alive at the peak of a CUDA memory snapshot, grouped by the code that allocated it.

The snapshot is torch's (`torch.cuda.memory._snapshot()`), written by a run with
`logging.profile_memory: true` over its profile window (pretrain/training/profiler.py). Its trace is
replayed: each `alloc` adds a block, each `free_completed` removes it; memory allocated before the
window began is the baseline (weights, optimizer state, gradients, whatever the last step left). At the
highest point of baseline + live blocks, the live blocks are grouped by their allocation site: the
innermost stack frame in this project's or megatron's code, which is what one changes to bring the peak
down.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Sequence, Tuple

SITE_MARKERS = ("pretrain/", "parallel/", "megatron/core/")


def allocation_site(frames: Sequence[dict], markers: Sequence[str] = SITE_MARKERS) -> str:
    """The innermost frame whose file lies in one of `markers` (else the innermost frame)."""
    for f in frames:
        name = f.get("filename", "")
        if any(m in name for m in markers):
            tail = name.split("site-packages/")[-1]
            return f"{tail}:{f.get('line')} {f.get('name')}"
    return f"{frames[0].get('filename')}:{frames[0].get('line')}" if frames else "?"


BEFORE_WINDOW = "(allocated before the window, still alive)"


def peak_breakdown(trace: List[dict], baseline_bytes: int = 0,
                   markers: Sequence[str] = SITE_MARKERS) -> Tuple[int, Dict[str, int]]:
    """(peak bytes, bytes alive at the peak per allocation site) of one device's trace; the sites sum to the
    peak, the baseline's blocks still alive there under `BEFORE_WINDOW` (those freed before it are gone: a
    previous step's activations, say, freed as the next forward reaches them)."""
    current = peak = baseline_bytes
    peak_at = -1  # index of the allocation that reached the peak
    for i, event in enumerate(trace):  # first pass: where the peak is
        action = event.get("action")
        if action == "alloc":
            current += event["size"]
            if current > peak:
                peak, peak_at = current, i
        elif action == "free_completed":
            current -= event["size"]  # a block from before the window leaves the baseline
    live: Dict[int, dict] = {}
    old_alive = baseline_bytes
    for event in trace[:peak_at + 1]:  # second pass: what is alive there
        if event.get("action") == "alloc":
            live[event["addr"]] = event
        elif event.get("action") == "free_completed":
            if live.pop(event["addr"], None) is None:
                old_alive -= event["size"]
    sites: Dict[str, int] = defaultdict(int)
    if old_alive:
        sites[BEFORE_WINDOW] = old_alive
    for event in live.values():
        sites[allocation_site(event.get("frames", []), markers)] += event["size"]
    return peak, dict(sites)


def format_report(peak: int, sites: Dict[str, int], baseline: int, top: int = 25) -> str:
    gib = 1024 ** 3
    old = sites.get(BEFORE_WINDOW, 0)
    lines = [f"peak {peak / gib:.2f} GiB = {old / gib:.2f} GiB allocated before the window and still alive (of "
             f"{baseline / gib:.2f} GiB at its start) + {(peak - old) / gib:.2f} GiB allocated in it; alive at the "
             f"peak by site:"]
    for site, size in sorted(sites.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {size / gib:8.3f} GiB  {site}")
    return "\n".join(lines)
