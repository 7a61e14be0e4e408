"""Summarize a run directory: loss at the start and end, validation loss, throughput, memory,
the newest checkpoint, and (with matplotlib) a plot of the curves.

    python -m pretrain.tools.report RUN_DIR
    python -m pretrain.tools.report --plan RUN_DIR     # a curriculum plan's run_dir (pretrain.tools.plan_report)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import List


def read_metrics(run_dir: str) -> List[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: is {run_dir} a run directory?")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summarize(run_dir: str) -> str:
    rows = [r for r in read_metrics(run_dir) if r.get("loss") is not None]
    if not rows:
        return f"{run_dir}: no logged steps yet"
    head, tail = rows[:10], rows[-10:]
    first, last = statistics.mean(r["loss"] for r in head), statistics.mean(r["loss"] for r in tail)
    lines = [
        f"run {run_dir}: {rows[-1]['step']} steps",
        f"  loss {first:.3f} (first {len(head)} steps) -> {last:.3f} (last {len(tail)})"
        + ("  falling" if last < first else "  NOT falling"),
    ]
    valid = [r for r in rows if r.get("valid_loss") is not None]
    if valid:
        lines.append(f"  validation loss {valid[0]['valid_loss']:.3f} (step {valid[0]['step']}) -> "
                     f"{valid[-1]['valid_loss']:.3f} (step {valid[-1]['step']})")
    speed = [r["tokens_per_sec"] for r in tail if r.get("tokens_per_sec")]
    if speed:
        mfu = [r["mfu"] for r in tail if r.get("mfu") is not None]
        lines.append(f"  throughput {statistics.median(speed):,.0f} tokens/s"
                     + (f", MFU {100 * statistics.median(mfu):.1f}%" if mfu else "")
                     + f", peak memory {max(r.get('mem_peak_gb') or 0 for r in rows):.2f} GiB")
    skipped = sum(1 for r in rows if r.get("skipped"))
    if skipped:
        lines.append(f"  {skipped} steps skipped (non-finite loss or gradient)")
    plot = os.path.join(run_dir, "curves.png")
    try:
        from pretrain.tools.plot import main as plot_main

        plot_main([run_dir, "--out", plot])
        lines.append(f"  curves: {plot}")
    except SystemExit:
        pass  # matplotlib missing: the plot module said so
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--plan", action="store_true", help="RUN_DIR is a curriculum plan's run_dir")
    args = parser.parse_args(argv)
    if args.plan:
        from pretrain.tools.plan_report import main as plan_main

        return plan_main([args.run_dir])
    try:
        print(summarize(args.run_dir))
    except FileNotFoundError as err:
        print(f"report: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
