"""What a run's host memory keeps: a native-heap profile of a window of training steps (memray).

`benchmarks/soak.py --heap-profile FILE --heap-window A:B` tracks every host allocation (Python and native, with
both stacks) from step A to step B, then lists the allocations made in that window and still held at its end,
grouped by call stack, largest first. A per-step growth shows as a stack held about (B - A) times (or a
multiple). Transient per-step memory is freed inside the window and does not appear. Needs `pip install memray`
(Linux); tracking slows the host side of each step several times, so choose a short window.

    python benchmarks/soak.py --config configs/quickstart/glm5-tiny-stdlib.yaml --data data/stdlib \
        --tokenizer data/tokenizer.json --steps 700 --interval 1000 --no-eval --out tiny_heap.json \
        --heap-profile tiny_heap.bin --heap-window 200:600 data.num_workers=0
    python benchmarks/heap_profile.py tiny_heap.bin            # the summary again, from the capture
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple


def parse_window(text: str) -> Tuple[int, int]:
    """'A:B' -> (A, B) with 0 <= A < B; a one-line error otherwise."""
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--heap-window must be START:STOP steps, got {text!r}") from None
    if not 0 <= a < b:
        raise ValueError(f"--heap-window needs 0 <= START < STOP, got {text!r}")
    return a, b


class HeapWindow:
    """Tracks host allocations from step `start` (after it) to step `stop` (after it) into `path`."""

    def __init__(self, path: str, start: int, stop: int):
        import memray  # checked here, before the model is built: a missing memray fails at once

        self.memray, self.path, self.start, self.stop = memray, Path(path), start, stop
        self._tracker = None
        self.done = False

    def after_step(self, step: int) -> None:
        if step == self.start and self._tracker is None and not self.done:
            if self.path.exists():
                self.path.unlink()  # memray refuses to overwrite
            self._tracker = self.memray.Tracker(str(self.path), native_traces=True,
                                                file_format=self.memray.FileFormat.AGGREGATED_ALLOCATIONS)
            self._tracker.__enter__()
        elif step == self.stop:
            self.close()

    def close(self) -> None:
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self._tracker, self.done = None, True


def _frame(f, width: int = 140) -> str:
    name, file, line = f
    name = name if len(name) <= width else name[:width] + "..."  # C++ template names run to pages
    return f"{name} ({os.path.basename(file)}:{line})" if line else name


def summarize(capture: str, top: int = 8, sites: int = 15, frames: int = 14) -> Dict:
    """The window's allocations still held at its end: the largest stacks, and the same grouped by the innermost
    Python frames that made them (where a per-step growth is recognized: one site, a fixed count per step)."""
    from memray import FileReader

    records = sorted(FileReader(capture).get_leaked_allocation_records(merge_threads=True), key=lambda r: -r.size)
    rows: List[Dict] = []
    by_site: Dict[str, Dict] = {}
    for i, r in enumerate(records):
        try:
            stack = r.hybrid_stack_trace(max_stacks=64)
        except NotImplementedError:  # a capture without native frames
            stack = r.stack_trace(max_stacks=64)
        if i < top:
            rows.append({"bytes": r.size, "allocations": r.n_allocations, "stack": [_frame(f) for f in stack[:frames]]})
        python = [_frame(f) for f in stack if str(f[1]).endswith(".py")][:4]
        native = [_frame(f, 80) for f in stack if not str(f[1]).endswith(".py")][:2]
        site = by_site.setdefault(" < ".join(python) or "(no Python frame)", {"bytes": 0, "allocations": 0,
                                                                             "native": native})
        site["bytes"] += r.size
        site["allocations"] += r.n_allocations
    grouped = sorted(({"site": k, **v} for k, v in by_site.items()), key=lambda v: -v["bytes"])[:sites]
    return {"capture": os.path.basename(capture), "held_bytes": sum(r.size for r in records),
            "held_allocations": sum(r.n_allocations for r in records), "by_python_site": grouped, "top": rows}


def report(summary: Dict, steps: Optional[int] = None) -> str:
    per = (lambda b: f", {b / steps / 1024:.2f} KB a step") if steps else (lambda b: "")
    lines = [f"held at the window's end: {summary['held_bytes'] / 2**20:.2f} MiB in "
             f"{summary['held_allocations']:,} allocations{per(summary['held_bytes'])}", "",
             "by the Python frames that allocated (innermost first), with the first native frames:"]
    for row in summary["by_python_site"]:
        lines.append(f"  {row['bytes'] / 1024:,.1f} KB in {row['allocations']:,} allocations{per(row['bytes'])}: "
                     f"{row['site']}")
        lines += [f"      {f}" for f in row["native"]]
    lines += ["", "largest stacks:"]
    for i, row in enumerate(summary["top"], 1):
        lines.append(f"{i:>2}. {row['bytes'] / 1024:,.1f} KB in {row['allocations']:,} allocations{per(row['bytes'])}")
        lines += [f"      {f}" for f in row["stack"]]
    return "\n".join(lines)


def write(capture: str, steps: Optional[int] = None) -> str:
    """Summary of `capture` written beside it (`<capture>.summary.json` and `.summary.txt`); the text returned."""
    summary = summarize(capture)
    summary["steps"] = steps
    base = Path(capture)
    base.with_name(base.name + ".summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    text = report(summary, steps)
    base.with_name(base.name + ".summary.txt").write_text(text + "\n")
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("capture", help="a memray capture written by soak.py --heap-profile")
    parser.add_argument("--steps", type=int, help="steps in the window (per-step figures)")
    args = parser.parse_args(argv)
    print(write(args.capture, args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
