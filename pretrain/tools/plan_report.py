"""Report over a context-curriculum run: one loss curve against tokens across every stage.

    python -m pretrain.tools.plan_report RUN_DIR        # or: python -m pretrain.tools.report --plan RUN_DIR

Reads `<RUN_DIR>/plan.json` (written by the curriculum runner) and each stage's `metrics.jsonl`,
and writes `<RUN_DIR>/plan_report.md` (a table per stage: context length, steps, tokens, loss at
entry and exit, the jump in loss across the boundary, median tokens/s, peak memory, LR, RoPE base,
CP, DSA) and `<RUN_DIR>/plan_report.png` (loss against cumulative tokens with stage boundaries and
context lengths marked; tokens/s and peak memory per stage). A stage still running or not started
shows what it has logged so far.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional

WINDOW = 5  # steps averaged for the loss at a stage's entry and exit


def read_plan(run_dir: Path) -> Dict[str, object]:
    path = Path(run_dir) / "plan.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} the run_dir of a curriculum plan?")
    return json.loads(path.read_text())


def _metrics(stage_dir: Path) -> List[dict]:
    path = stage_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("loss") is not None]


def stage_rows(run_dir: Path) -> List[dict]:
    """One dict per stage: its plan entry, its logged steps, and the cumulative token offset it starts at."""
    plan, offset, out = read_plan(run_dir), 0, []
    for stage in plan["stages"]:
        rows = _metrics(Path(run_dir) / stage["dir"])
        out.append({**stage, "rows": rows, "offset": offset,
                    "done": (Path(run_dir) / stage["dir"] / "stage_complete.json").is_file()})
        offset += stage["tokens"]
    return out


def _mean(values: List[float]) -> Optional[float]:
    return statistics.mean(values) if values else None


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(run_dir: Path, stages: List[dict]) -> str:
    lines = [f"# Curriculum {read_plan(run_dir)['name']} ({run_dir})", "",
             "| stage | context | steps | tokens | loss entry -> exit | jump at entry | tokens/s | peak mem GiB "
             "| LR | RoPE base | CP | DSA | optimizer |",
             "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | --- | --- |"]
    previous_exit = None
    for s in stages:
        rows = s["rows"]
        losses = [r["loss"] for r in rows]
        entry, exit_ = _mean(losses[:WINDOW]), _mean(losses[-WINDOW:])
        jump = losses[0] - previous_exit if losses and previous_exit is not None else None
        speed = [r["tokens_per_sec"] for r in rows[1:] or rows if r.get("tokens_per_sec")]  # step 1 warms up
        memory = [r["mem_peak_gb"] for r in rows if r.get("mem_peak_gb") is not None]
        dsa = "sparse" if s["dsa_sparse_attention"] else ("warm-up" if s["trainable_params"] == "dsa_indexer" else "dense")
        steps = f"{len(rows)}/{s['train_iters']}" + ("" if s["done"] else " (unfinished)")
        lines.append(
            f"| {s['name']} | {s['seq_length']:,} | {steps} | {len(rows) * s['tokens_per_step']:,} | "
            f"{_fmt(entry, '.4f')} -> {_fmt(exit_, '.4f')} | {_fmt(jump, '+.4f')} | "
            f"{_fmt(statistics.median(speed) if speed else None, ',.0f')} | {_fmt(max(memory) if memory else None, '.2f')} | "
            f"{s['lr'][0]:g} -> {s['lr'][1]:g} | {s['rotary_base']:g} | {s['context_parallel_size']} | {dsa} | "
            f"{s['optimizer_state']} |")
        previous_exit = losses[-1] if losses else previous_exit
    lines += ["", f"Loss entry/exit: mean of the first/last {WINDOW} steps; jump at entry: the stage's first loss "
              "minus the previous stage's last; tokens/s: median without the first step."]
    return "\n".join(lines) + "\n"


def plot(stages: List[dict], out: Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("pretrain.tools.plan_report needs matplotlib for the plot: pip install matplotlib") from None
    fig, (ax_loss, ax_speed) = plt.subplots(2, 1, figsize=(11, 8), gridspec_kw={"height_ratios": [2, 1]})
    for s in stages:
        x = [s["offset"] + r["step"] * s["tokens_per_step"] for r in s["rows"]]
        ax_loss.plot(x, [r["loss"] for r in s["rows"]], marker="." if len(x) < 50 else None,
                     label=f"{s['name']} ({s['seq_length']:,} tokens)")
        ax_loss.axvline(s["offset"], color="gray", linestyle=":", linewidth=1)
        ax_loss.annotate(f"{s['seq_length'] // 1024}K" if s["seq_length"] >= 1024 else str(s["seq_length"]),
                         (s["offset"], 1.0), xycoords=("data", "axes fraction"), fontsize=8, va="top")
    ax_loss.set_xlabel("tokens (cumulative over the plan)")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("loss across the curriculum (dotted: stage boundaries, labels: context length)")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(fontsize=7)
    names = [s["name"] for s in stages]
    speed = [statistics.median([r["tokens_per_sec"] for r in s["rows"][1:] or s["rows"] if r.get("tokens_per_sec")]
                               or [0]) for s in stages]
    memory = [max([r.get("mem_peak_gb") or 0 for r in s["rows"]] or [0]) for s in stages]
    positions = list(range(len(stages)))
    ax_speed.bar([p - 0.2 for p in positions], speed, width=0.4, color="tab:blue", label="tokens/s (median)")
    ax_speed.set_ylabel("tokens/s")
    ax_mem = ax_speed.twinx()
    ax_mem.bar([p + 0.2 for p in positions], memory, width=0.4, color="tab:orange", label="peak memory (GiB)")
    ax_mem.set_ylabel("peak memory GiB")
    ax_speed.set_xticks(positions, names, fontsize=8)
    ax_speed.set_title("throughput (blue) and peak memory (orange) per stage")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def write_report(run_dir: Path) -> Dict[str, Path]:
    run_dir = Path(run_dir)
    stages = stage_rows(run_dir)
    table = run_dir / "plan_report.md"
    table.write_text(markdown(run_dir, stages))
    return {"table": table, "plot": plot(stages, run_dir / "plan_report.png")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="the plan's run_dir (holds plan.json)")
    args = parser.parse_args(argv)
    try:
        paths = write_report(Path(args.run_dir))
    except FileNotFoundError as err:
        print(f"plan_report: {err}", file=sys.stderr)
        return 2
    print(paths["table"].read_text() + f"\nplot: {paths['plot']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
