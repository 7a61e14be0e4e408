"""Parallel layouts against one GPU: losses, gradient norms and the weights after 10 steps.

    python -m benchmarks.multi_gpu_compare OUT_DIR --config MODEL.yaml --overrides "..." --runs floor tp2 ...

Reads the runs of `benchmarks/multi_gpu.sh` (OUT_DIR/<run>/metrics.jsonl and OUT_DIR/<run>/ckpt) and writes
OUT_DIR/summary.json and OUT_DIR/summary.md. Each run is compared with its reference: `ref` (one GPU, same
initial checkpoint, same global batches), or, for a run resumed from another run's checkpoint
(`z2_resume_*`), that run, over the steps after the resume.

Measures, per run against its reference:
- `loss_step1`: |loss - loss_ref| at the first compared step (same weights: the forward's reduction order alone);
- `loss_max`: the largest |loss - loss_ref| over the compared steps;
- `grad_norm_max`: the largest |g - g_ref| / g_ref of the gradient norm before clipping;
- `drift`: ||W - W_ref|| / ||W_ref - W_0|| over all parameters (Frobenius, fp32 of the bf16 weights saved at
  the end), W_0 the run's starting weights: the weights' disagreement as a fraction of what training moved them.

The pass rule, fixed before the first run on GPUs: bf16 arithmetic in another order is the only difference a
correct layout may make. `floor` (one GPU, micro-batch 2 instead of 1: the same sums in another order) measures
how far that alone moves each quantity in 10 steps. A run passes when every measure is within
max(3 x floor's value, minimum), minimum = 5e-3 on the losses (0.05% of the starting loss), 3e-2 on the
gradient norm and 5e-2 on the drift; `floor` itself is reported, not judged.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # run as a script from anywhere

MINIMUM = {"loss_step1": 5e-3, "loss_max": 5e-3, "grad_norm_max": 3e-2, "drift": 5e-2}
FLOOR_FACTOR = 3.0
RESUMED_FROM = {"z2_resume_dp4": "z2_fp32_micro", "z2_resume_dp2": "z2_fp32_micro"}
RESUME_STEP = 5  # multi_gpu.sh's `rewind z2_fp32_micro ... 5`


def read_metrics(run_dir: Path) -> Dict[int, dict]:
    with open(run_dir / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {r["step"]: r for r in rows}


def curve_measures(rows: Dict[int, dict], ref: Dict[int, dict], first: int) -> dict:
    """Loss and gradient-norm differences over the steps both runs logged from `first` on."""
    steps = sorted(s for s in rows if s >= first and s in ref)
    if not steps:
        raise ValueError("no common steps to compare")
    dloss = [abs(rows[s]["loss"] - ref[s]["loss"]) for s in steps]
    dgrad = [abs(rows[s]["grad_norm"] - ref[s]["grad_norm"]) / ref[s]["grad_norm"] for s in steps]
    bitwise = sum(rows[s]["loss"] == ref[s]["loss"] and rows[s]["grad_norm"] == ref[s]["grad_norm"] for s in steps)
    return {"steps": f"{steps[0]}-{steps[-1]}", "loss_step1": dloss[0], "loss_max": max(dloss),
            "grad_norm_max": max(dgrad), "bitwise_steps": bitwise, "n_steps": len(steps)}


def verdict(measures: dict, floor: Optional[dict]) -> dict:
    """Each measure's tolerance (the module docstring's rule) and whether the run is within all of them. The
    drift is judged when it was measured (not with --no-weights); the curves' measures always are."""
    judged = [k for k in MINIMUM if k != "drift" or "drift" in measures]
    tol = {k: max(FLOOR_FACTOR * (floor or {}).get(k, 0.0), MINIMUM[k]) for k in judged}
    ok = all(measures[k] <= tol[k] for k in judged)
    return {"tolerance": tol, "pass": ok}


class WeightReader:
    """Loads checkpoints into one single-rank model (dist_checkpointing reshards any layout's files)."""

    def __init__(self, config: str, overrides: List[str]):
        from parallel.initialize import ensure_single_rank
        from pretrain import compat
        from pretrain.config import load_config
        from pretrain.training.loop import build_model_chunks

        compat.install()
        cfg = load_config(config, overrides)
        ensure_single_rank(cfg.train.seed)
        self.chunks = build_model_chunks(cfg)

    def weights(self, ckpt: Path) -> Dict[str, "object"]:
        from megatron.core.utils import unwrap_model

        from pretrain.training.pretrained import load_pretrained_weights

        load_pretrained_weights(str(ckpt), self.chunks)
        out = {}
        for chunk in unwrap_model(self.chunks):
            for name, p in chunk.named_parameters():
                out[name] = p.detach().float().clone()
        return out

    def distance(self, a: dict, b: dict) -> float:
        return math.sqrt(sum(float((a[k] - b[k]).double().pow(2).sum()) for k in a))


def compare(out: Path, runs: List[str], reader: Optional[WeightReader]) -> List[dict]:
    needed = {"ref", *runs, *(RESUMED_FROM[n] for n in runs if n in RESUMED_FROM)}
    metrics = {name: read_metrics(out / name) for name in needed}
    weights = {}
    if reader is not None:
        weights["init"] = reader.weights(out / "init" / "ckpt")
        weights["ref"] = reader.weights(out / "ref" / "ckpt")
    table, floor = [], None
    for name in runs:
        source = RESUMED_FROM.get(name, "ref")
        row = {"run": name, "reference": source}
        row.update(curve_measures(metrics[name], metrics[source], RESUME_STEP + 1 if name in RESUMED_FROM else 1))
        if reader is not None:
            if source not in weights:
                weights[source] = reader.weights(out / source / "ckpt")
            mine = reader.weights(out / name / "ckpt")
            row["drift"] = reader.distance(mine, weights[source]) / reader.distance(weights[source], weights["init"])
            if name in RESUMED_FROM.values():  # a resumed run's reference: keep it
                weights[name] = mine
        if name == "floor":
            floor = row
        else:
            row.update(verdict(row, floor))
        table.append(row)
    return table


def markdown(table: List[dict]) -> str:
    lines = ["| run | against | steps | step-1 abs(loss diff) | max abs(loss diff) | max grad-norm rel. diff | "
             "drift | bitwise steps | pass |", "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in table:
        drift = f"{r['drift']:.2e}" if r.get("drift") is not None else "-"
        ok = "-" if "pass" not in r else ("yes" if r["pass"] else "**no**")
        lines.append(f"| {r['run']} | {r['reference']} | {r['steps']} | {r['loss_step1']:.2e} | {r['loss_max']:.2e} "
                     f"| {r['grad_norm_max']:.2e} | {drift} | {r['bitwise_steps']}/{r['n_steps']} | {ok} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--config", required=True)
    parser.add_argument("--overrides", default="", help="the runs' model overrides, space-separated")
    parser.add_argument("--runs", nargs="+", required=True, help="floor first, then the runs to judge")
    parser.add_argument("--no-weights", action="store_true", help="losses and gradient norms only")
    args = parser.parse_args(argv)
    if args.runs[0] != "floor":
        parser.error("--runs must start with floor (the noise every other run is judged against)")
    reader = None if args.no_weights else WeightReader(args.config, args.overrides.split())
    table = compare(args.out, args.runs, reader)
    (args.out / "summary.json").write_text(json.dumps(table, indent=2) + "\n")
    text = markdown(table)
    (args.out / "summary.md").write_text(text)
    print(text, end="")
    return 0 if all(r.get("pass", True) for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
