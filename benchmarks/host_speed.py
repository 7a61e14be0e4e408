"""How fast one host core runs a fixed piece of Python, every `--period` seconds: run it beside a training run
to tell a slower host (a neighbour's load, a clock change) from more work in the trainer.

    python benchmarks/host_speed.py --core 15 --seconds 300 --out host_speed.csv &
    python benchmarks/soak.py ... --out soak.json

Each row: `unix_time`, `units_per_s` (a unit is a fixed interpreter-bound loop, much like the trainer's
launch path: attribute lookups, calls, small-integer arithmetic). Line the rows up with the soak's per-step
`unix_time`: when the trainer's steps slow and this rate does not, the trainer does more host work per step
(or waits); when both slow together, the core runs slower. `--core` pins this process away from the trainer's
cores, so it does not compete with the run it watches.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


class _Point:
    __slots__ = ("x", "y")

    def __init__(self, x: int, y: int):
        self.x, self.y = x, y


def unit() -> int:
    """One unit of interpreter-bound work (about 50 microseconds on a 2020s server core)."""
    total = 0
    for i in range(200):
        p = _Point(i, i + 1)
        total += p.x * p.y % 7
    return total


def rate(units: int) -> float:
    """Units per second over `units` units: the speed of the core this thread runs on now (the soak calls it in
    the trainer's own thread after every step, where a probe on another core cannot see)."""
    start = time.perf_counter()
    for _ in range(units):
        unit()
    return units / (time.perf_counter() - start)


def measure(period: float) -> float:
    """Units per second over one period."""
    done, start = 0, time.perf_counter()
    while True:
        for _ in range(20):
            unit()
        done += 20
        elapsed = time.perf_counter() - start
        if elapsed >= period:
            return done / elapsed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--core", type=int, help="pin to this CPU core (default: not pinned)")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--period", type=float, default=0.5)
    parser.add_argument("--out", required=True, help="CSV: unix_time,units_per_s")
    args = parser.parse_args(argv)
    if args.core is not None:
        if args.core not in os.sched_getaffinity(0):
            parser.error(f"--core {args.core} is not one of this process's cores {sorted(os.sched_getaffinity(0))}")
        os.sched_setaffinity(0, {args.core})
    deadline = time.time() + args.seconds
    with open(args.out, "w") as f:
        f.write("unix_time,units_per_s\n")
        while time.time() < deadline:
            rate = measure(args.period)
            f.write(f"{time.time():.3f},{rate:.1f}\n")
            f.flush()  # a probe killed with its run keeps its rows
    return 0


if __name__ == "__main__":
    sys.exit(main())
