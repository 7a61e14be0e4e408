"""A sweep's results: one row per variant (mean and spread over seeds) as Markdown and JSON, and the
loss curves of every variant overlaid in one PNG (with matplotlib, the `plot` extra; without it the table
is written and one line says how to get the plot).

Per run, from `<run_dir>/metrics.jsonl` (`pretrain.training.metrics`): the final train loss (last
logged step), the train loss averaged over the last `report.average_last` steps, the last
validation loss, the median tokens/s and MFU over the second half of the run (the first steps
carry compilation and warm-up), and the peak memory; from `<run_dir>/eval_<name>.json`, the
evaluation metrics. Per variant: mean and sample standard deviation over seeds ("spread"; none with
one seed).

The paper compares attention and MTP variants at equal parameters and equal training FLOPs, so a
variant whose parameter count (with the MTP layers, `pretrain.model.summary.count_parameters`) or
training FLOPs per token (`pretrain.training.flops.configured_flops_per_step`) differs from the
first reported variant's by more than 1% is flagged.

A run that stopped before its planned steps (interrupted, out of time) is flagged with the step it reached.
`at_step` reports every run as of one common step (a sweep compared before it finished): each run's records
are cut at that step (the validation loss is then the last one at or before it), runs that had not reached it
are left out and named in the flags, and the evaluations are those of the run's checkpoint at that step
(`eval_<name>_step<N>.json`, written by `python -m pretrain.ablate SWEEP --evaluate-at N`), or of its last
checkpoint when `at_step` reaches the run's planned length.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from pretrain.ablate.runner import EVAL_FILE, STEP_EVAL_FILE
from pretrain.ablate.sweep import Run, Sweep, rel
from pretrain.tools.plot import read_metrics, series, smooth

_STEP_EVAL = re.compile(r"_step\d+\.json$")
RUN_METRICS = ("final_loss", "avg_loss", "valid_loss", "tokens_per_sec", "mfu", "mem_peak_gb")
FLAG_TOLERANCE = 0.01


def run_records(run: Run, at_step: Optional[int] = None) -> List[dict]:
    """The run's metrics records (up to `at_step` when given)."""
    records = read_metrics(run.run_dir)
    return records if at_step is None else [r for r in records if r["step"] <= at_step]


def run_metrics(run: Run, average_last: int, at_step: Optional[int] = None) -> Dict[str, Optional[float]]:
    records = [r for r in run_records(run, at_step) if not r.get("skipped")]
    losses = [r["loss"] for r in records if r.get("loss") is not None]
    valid = [r["valid_loss"] for r in records if r.get("valid_loss") is not None]
    second_half = records[len(records) // 2:]

    def median(key):
        values = [r[key] for r in second_half if r.get(key) is not None]
        return statistics.median(values) if values else None

    mem = [r["mem_peak_gb"] for r in records if r.get("mem_peak_gb") is not None]
    out = {
        "steps": records[-1]["step"] if records else 0,
        "final_loss": losses[-1] if losses else None,
        "avg_loss": statistics.fmean(losses[-average_last:]) if losses else None,
        "valid_loss": valid[-1] if valid else None,
        "tokens_per_sec": median("tokens_per_sec"),
        "mfu": median("mfu"),
        "mem_peak_gb": max(mem) if mem else None,
    }
    if at_step is not None and at_step < run.train_iters:  # the evaluations of the checkpoint at that step
        paths = run.run_dir.glob(STEP_EVAL_FILE.format(name="*", step=at_step))
    else:  # those of the last checkpoint
        paths = [p for p in run.run_dir.glob(EVAL_FILE.format(name="*")) if not _STEP_EVAL.search(p.name)]
    for path in sorted(paths):
        out.update(json.loads(path.read_text(encoding="utf-8"))["metrics"])
    return out


def _mean_spread(values: List[Optional[float]]) -> Dict[str, Optional[float]]:
    present = [v for v in values if v is not None]
    if not present:
        return {"mean": None, "spread": None, "n": 0}
    spread = statistics.stdev(present) if len(present) > 1 else None
    return {"mean": statistics.fmean(present), "spread": spread, "n": len(present)}


def model_cost(run: Run) -> Dict[str, float]:
    """Parameters (with MTP) and training FLOPs per token of the run's model."""
    from pretrain import compat
    from pretrain.config import load_config
    from pretrain.model.summary import count_parameters
    from pretrain.training.flops import configured_flops_per_step

    compat.install()
    cfg = load_config(run.config_path, run.overrides)
    counts = count_parameters(cfg)
    seq = cfg.data.seq_length
    return {"params": float(sum(sum(part.values()) for part in counts.values())),
            "flops_per_token": configured_flops_per_step(cfg.model, seq, seq) / seq}


def _reported_runs(sweep: Sweep, variant: str, at_step: Optional[int]) -> Tuple[List[Run], List[str]]:
    """The variant's runs with metrics (those that reached `at_step`), and flags for unfinished or left-out runs."""
    runs, flags = [], []
    for run in [r for r in sweep.runs_of(variant) if (r.run_dir / "metrics.jsonl").is_file()]:
        records = read_metrics(run.run_dir)
        reached = records[-1]["step"] if records else 0
        if at_step is None:
            if reached < run.train_iters:
                flags.append(f"seed {run.seed} unfinished: step {reached} of {run.train_iters}")
        elif reached < min(at_step, run.train_iters):  # a finished run shorter than at_step counts whole
            flags.append(f"seed {run.seed} left out: stopped at step {reached} of {run.train_iters}")
            continue
        runs.append(run)
    return runs, flags


def collect(sweep: Sweep, at_step: Optional[int] = None) -> Dict[str, object]:
    """{"variants": [row, ...]} over the reported variants that have runs with metrics (as of `at_step`)."""
    rows = []
    for variant in [v for v in sweep.variants if v.report]:
        runs, flags = _reported_runs(sweep, variant.name, at_step)
        if not runs:
            continue
        per_run = {str(r.seed): run_metrics(r, sweep.average_last, at_step) for r in runs}
        keys = list(dict.fromkeys(k for m in per_run.values() for k in m if k != "steps"))
        row = {"variant": variant.name, "seeds": [r.seed for r in runs], **model_cost(runs[0]),
               "metrics": {k: _mean_spread([m.get(k) for m in per_run.values()]) for k in keys}, "runs": per_run,
               "flags": flags}
        rows.append(row)
    if rows:
        ref = rows[0]
        for row in rows[1:]:
            for key, label in (("params", "params"), ("flops_per_token", "FLOPs")):
                if abs(row[key] - ref[key]) > FLAG_TOLERANCE * ref[key]:
                    row["flags"].append(f"{label} {100 * (row[key] / ref[key] - 1):+.1f}% vs {ref['variant']}")
    return {"sweep": rel(sweep.path), "average_last": sweep.average_last, "at_step": at_step, "variants": rows}


def _fmt(cell: Dict[str, Optional[float]], key: str) -> str:
    mean, spread = cell["mean"], cell["spread"]
    if mean is None:
        return "-"
    if key == "mfu":
        text = f"{100 * mean:.1f}%" + (f" ± {100 * spread:.1f}" if spread is not None else "")
    elif key == "tokens_per_sec":
        text = f"{mean:,.0f}" + (f" ± {spread:,.0f}" if spread is not None else "")
    elif key == "mem_peak_gb":
        text = f"{mean:.2f}" + (f" ± {spread:.2f}" if spread is not None else "")
    else:
        text = f"{mean:.4f}" + (f" ± {spread:.4f}" if spread is not None else "")
    return text


def to_markdown(results: Dict[str, object]) -> str:
    rows = results["variants"]
    evals = list(dict.fromkeys(k for r in rows for k in r["metrics"] if k not in RUN_METRICS))
    labels = {"final_loss": "final loss", "avg_loss": f"avg loss (last {results['average_last']})",
              "valid_loss": "valid loss", "tokens_per_sec": "tokens/s", "mfu": "MFU", "mem_peak_gb": "peak mem GiB"}
    head = ["variant", "seeds", "params (M)", "GFLOPs/token"] + [labels[k] for k in RUN_METRICS[:3]] + evals \
        + [labels[k] for k in RUN_METRICS[3:]] + ["flags"]
    when = f" as of step {results['at_step']}" if results.get("at_step") is not None else ""
    lines = [f"Sweep `{results['sweep']}`{when}: mean ± sample std over seeds.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        m = r["metrics"]
        none = {"mean": None, "spread": None}
        cells = [r["variant"], ",".join(map(str, r["seeds"])), f"{r['params'] / 1e6:.2f}",
                 f"{r['flops_per_token'] / 1e9:.3f}"]
        cells += [_fmt(m.get(k, none), k) for k in RUN_METRICS[:3]] + [_fmt(m.get(k, none), k) for k in evals]
        cells += [_fmt(m.get(k, none), k) for k in RUN_METRICS[3:]] + ["; ".join(r["flags"]) or ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_losses(sweep: Sweep, out: Path, smooth_window: int = 1, at_step: Optional[int] = None) -> Path:
    """Train loss per variant (mean over seeds, min-max band), validation loss as dots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn = 0
    for variant in [v for v in sweep.variants if v.report]:
        runs, _ = _reported_runs(sweep, variant.name, at_step)
        curves = [dict(zip(*series(run_records(r, at_step), "loss"))) for r in runs]
        if not curves:
            continue
        color = colors[drawn % len(colors)]
        drawn += 1
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        mean = smooth([statistics.fmean(c[s] for c in curves) for s in steps], smooth_window)
        ax.plot(steps, mean, color=color, label=f"{variant.name} ({len(curves)} seed{'s' * (len(curves) > 1)})")
        if len(curves) > 1:
            lo = smooth([min(c[s] for c in curves) for s in steps], smooth_window)
            hi = smooth([max(c[s] for c in curves) for s in steps], smooth_window)
            ax.fill_between(steps, lo, hi, color=color, alpha=0.2)
        valid = [dict(zip(*series(run_records(r, at_step), "valid_loss"))) for r in runs]
        vsteps = sorted(set.intersection(*(set(v) for v in valid))) if valid else []
        if vsteps:
            ax.plot(vsteps, [statistics.fmean(v[s] for v in valid) for s in vsteps], "o", color=color, markersize=5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{sweep.path.stem}: train loss (lines, band = seed min-max), validation loss (dots)"
                 + (f", moving average over {smooth_window}" if smooth_window > 1 else "")
                 + (f", as of step {at_step}" if at_step is not None else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


PLOT_HINT = ("loss_curves.png not drawn: matplotlib is not installed (pip install -e '.[plot]', then "
             "python -m pretrain.ablate SWEEP --report draws it)")


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_report(sweep: Sweep, smooth_window: int = 1, at_step: Optional[int] = None) -> Dict[str, Path]:
    """results.md, results.json and loss_curves.png in the sweep's output directory (as of `at_step`).

    The table is written first and always; the plot needs matplotlib (the `plot` extra): without it the
    plot is left out with one line saying how to get it (`PLOT_HINT`), and "png" is not in the result."""
    results = collect(sweep, at_step)
    out = sweep.output_dir
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out / "results.md", "json": out / "results.json"}
    paths["markdown"].write_text(to_markdown(results), encoding="utf-8")
    paths["json"].write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    if matplotlib_available():
        paths["png"] = plot_losses(sweep, out / "loss_curves.png", smooth_window, at_step)
    else:
        print(PLOT_HINT, flush=True)
    return paths

