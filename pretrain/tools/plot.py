"""Loss and throughput curves of one or more runs, from their metrics.jsonl, to a PNG.

    python -m pretrain.tools.plot RUN_DIR [RUN_DIR ...] [--out plot.png] [--smooth N]

Top panel: the LM loss against the step (solid), each MTP depth's loss (dashed, same colour) and
the validation loss (dots) when logged; bottom panel: tokens/s against the step. `--smooth N`
draws a trailing moving average over N logged steps. Skipped (non-finite) steps are left out.
Needs matplotlib (drawn with the Agg backend, so no display is required).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

METRICS_FILE = "metrics.jsonl"

Series = Tuple[List[int], List[float]]


def read_metrics(run_dir: Path) -> List[dict]:
    """The records of `run_dir/metrics.jsonl` (a torn last line from a crash is ignored)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: {run_dir} is not a run directory with metrics (the trainer writes "
            f"metrics.jsonl into logging.run_dir)"
        )
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def series(records: Sequence[dict], key: str) -> Series:
    """(steps, values) of `key`, skipping steps where it is absent or null."""
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None and not r.get("skipped")]
    return [p[0] for p in points], [float(p[1]) for p in points]


def smooth(values: List[float], window: int) -> List[float]:
    """Trailing moving average over `window` points (the first points average what exists)."""
    if window <= 1:
        return list(values)
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_runs(run_dirs: Sequence[Path], out: Path, smooth_window: int = 1) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("pretrain.tools.plot needs matplotlib: pip install matplotlib") from None

    runs: Dict[str, List[dict]] = {}
    for run_dir in run_dirs:
        runs[str(run_dir)] = read_metrics(Path(run_dir))

    fig, (ax_loss, ax_tps) = plt.subplots(2, 1, figsize=(10, 8), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    short = [Path(name).name or name for name in runs]
    labels = short if len(set(short)) == len(short) else list(runs)  # full paths when names collide
    for i, ((name, records), label) in enumerate(zip(runs.items(), labels)):
        color = colors[i % len(colors)]
        steps, loss = series(records, "loss")
        ax_loss.plot(steps, smooth(loss, smooth_window), color=color, label=f"{label} loss")
        mtp_keys = sorted({k for r in records for k in r if k.startswith("mtp_loss_")}, key=lambda k: int(k.rsplit("_", 1)[1]))
        for depth, key in enumerate(mtp_keys):
            steps_d, values = series(records, key)
            ax_loss.plot(steps_d, smooth(values, smooth_window), color=color, linestyle="--",
                         alpha=max(0.3, 0.8 - 0.15 * depth), linewidth=1, label=f"{label} {key}")
        steps_v, valid = series(records, "valid_loss")
        if valid:
            ax_loss.plot(steps_v, valid, "o", color=color, markersize=4, label=f"{label} valid_loss")
        steps_t, tps = series(records, "tokens_per_sec")
        ax_tps.plot(steps_t, smooth(tps, smooth_window), color=color, label=label)

    ax_loss.set_ylabel("loss")
    ax_loss.set_title("loss" + (f" (moving average over {smooth_window} steps)" if smooth_window > 1 else ""))
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(fontsize=7)
    ax_tps.set_xlabel("step")
    ax_tps.set_ylabel("tokens/s")
    ax_tps.set_title("throughput")
    ax_tps.grid(alpha=0.3)
    ax_tps.legend(fontsize=7)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument("--out", type=Path, default=Path("plot.png"), help="PNG to write (default: plot.png)")
    parser.add_argument("--smooth", type=int, default=1, metavar="N", help="moving average over N steps")
    args = parser.parse_args(argv)
    if args.smooth < 1:
        parser.error("--smooth must be >= 1")
    try:
        out = plot_runs(args.run_dirs, args.out, args.smooth)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
