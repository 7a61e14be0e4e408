"""Summary of a DSA continued-pretraining run (launch/dsa_continued_pretraining.sh).

    python -m pretrain.tools.dsa_report RUN_DIR [--out-prefix PATH]

Reads RUN_DIR/{warmup,sparse,dense}/metrics.jsonl and writes RUN_DIR/dsa_report.md (a table: the
warm-up's indexer KL and top-k recall at its start and end; the LM loss of the sparse stage against
dense continuation over the same steps) and RUN_DIR/dsa_report.png (KL and recall during warm-up;
both stages' LM loss). The dense baseline is optional.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional

from pretrain.tools.plot import read_metrics, series


def _mean(values: List[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _stage(run_dir: Path, name: str) -> Optional[List[dict]]:
    path = run_dir / name
    return read_metrics(path) if (path / "metrics.jsonl").is_file() else None


def summarize(run_dir: Path, window: int = 5) -> Dict[str, float]:
    """Numbers of the report: first/last `window` logged steps' means."""
    out: Dict[str, float] = {}
    warm = _stage(run_dir, "warmup")
    if warm is None:
        raise FileNotFoundError(f"{run_dir}/warmup/metrics.jsonl not found: run the warm-up stage first")
    for key in ("indexer_loss", "topk_recall"):
        _, ys = series(warm, key)
        if ys:
            out[f"warmup_{key}_first"], out[f"warmup_{key}_last"] = _mean(ys[:window]), _mean(ys[-window:])
    for name in ("sparse", "dense"):
        records = _stage(run_dir, name)
        if records:
            _, ys = series(records, "loss")
            out[f"{name}_loss_first"], out[f"{name}_loss_last"] = _mean(ys[:window]), _mean(ys[-window:])
            out[f"{name}_loss_mean"] = _mean(ys)
            out[f"{name}_steps"] = float(len(ys))
            _, tok = series(records, "tokens_per_sec")
            out[f"{name}_tokens_per_sec"] = _mean(tok[len(tok) // 2:])
    if "sparse_loss_mean" in out and "dense_loss_mean" in out:
        out["sparse_minus_dense_loss_mean"] = out["sparse_loss_mean"] - out["dense_loss_mean"]
    return out


def markdown(numbers: Dict[str, float], run_dir: Path, window: int) -> str:
    rows = [("warm-up indexer KL", "warmup_indexer_loss"), ("warm-up top-k recall", "warmup_topk_recall"),
            ("sparse stage LM loss", "sparse_loss"), ("dense continuation LM loss", "dense_loss")]
    lines = [f"# DSA continued pretraining: {run_dir}", "",
             f"Means over the first and last {window} logged steps.", "",
             "| quantity | first | last |", "|---|---|---|"]
    for label, key in rows:
        if f"{key}_first" in numbers:
            lines.append(f"| {label} | {numbers[key + '_first']:.4f} | {numbers[key + '_last']:.4f} |")
    if "sparse_minus_dense_loss_mean" in numbers:
        lines += ["", f"Mean LM loss over all steps, sparse minus dense: {numbers['sparse_minus_dense_loss_mean']:+.4f}"]
    for name in ("sparse", "dense"):
        if f"{name}_tokens_per_sec" in numbers:
            lines.append(f"- {name} stage: {numbers[name + '_tokens_per_sec']:,.0f} tokens/s (second half of the run)")
    return "\n".join(lines) + "\n"


def plot(run_dir: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    warm = _stage(run_dir, "warmup") or []
    for ax, key, label in ((axes[0], "indexer_loss", "indexer KL (dense)"), (axes[1], "topk_recall", "top-k recall")):
        xs, ys = series(warm, key)
        ax.plot(xs, ys)
        ax.set_title(f"warm-up: {label}")
        ax.set_xlabel("step")
    for name, style in (("sparse", "-"), ("dense", "--")):
        records = _stage(run_dir, name)
        if records:
            xs, ys = series(records, "loss")
            axes[2].plot(xs, ys, style, label=f"{name} attention")
    axes[2].set_title("LM loss after warm-up")
    axes[2].set_xlabel("step")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--window", type=int, default=5)
    args = parser.parse_args(argv)
    try:
        numbers = summarize(args.run_dir, args.window)
    except FileNotFoundError as err:
        print(f"dsa_report: error: {err}", file=sys.stderr)
        return 2
    text = markdown(numbers, args.run_dir, args.window)
    (args.run_dir / "dsa_report.md").write_text(text)
    try:
        plot(args.run_dir, args.run_dir / "dsa_report.png")
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
