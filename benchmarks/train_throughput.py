"""Training throughput and MFU of glm5-proxy on one GPU: AdamW and Muon, 4K and 16K tokens per sequence.

    python benchmarks/train_throughput.py --out throughput.json
    python benchmarks/train_throughput.py --seqs 4096 --optimizers muon --micro-batch-sizes 1,2,4 --profile-step 4

Each (optimizer, sequence length, micro-batch size) point is a real training run through
`python -m pretrain.train` (`benchmarks/train_runs.py`): bf16, mock tokens, a fixed number of tokens per
step (`--tokens-per-step`, 8 x 4096 by default: 8 sequences at 4K, 2 at 16K) split into micro-batches,
`--steps` steps. The numbers are the trainer's own from metrics.jsonl: tokens/s, TFLOP/s per GPU, MFU
(against the GPU's dense bf16 peak) and step time as medians over the steps after `--warmup` (profiled
steps excluded), the peak memory over all steps, the optimizer's time when the trainer logs it.

`--profile-step N` also records steps N and N+1 with the trainer's profile window and writes the
per-part breakdown (`python -m pretrain.tools.step_breakdown`) next to `--out` (the trace too with
`--keep-traces`); the profiled steps are left out of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # run as a script from anywhere

from benchmarks.train_runs import ROOT, launch, point_overrides, steady_state  # noqa: E402

OPTIMIZER_NAMES = {"adam": "AdamW", "muon": "Muon"}
DEFAULT_TOKENS_PER_STEP = 8 * 4096


def _ints(text: str) -> List[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def run_point(config, optimizer: str, seq: int, micro_batch_size: int, tokens_per_step: int, steps: int,
              warmup: int = 1, overrides: Optional[List[str]] = None, profile_step: Optional[int] = None,
              artifacts: Optional[Path] = None, timeout: int = 1800, run_dir: Optional[str] = None,
              keep_trace: bool = False) -> dict:
    """One point: train, read the trainer's metrics, optionally break the profiled steps down.

    Keeps the run in `run_dir` when given (a temporary directory otherwise)."""
    global_batch = tokens_per_step // seq
    point = {"optimizer": OPTIMIZER_NAMES.get(optimizer, optimizer), "seq": seq, "micro_batch_size": micro_batch_size,
             "global_batch_size": global_batch, "tokens_per_step": global_batch * seq}
    if global_batch < 1 or global_batch % micro_batch_size:
        return {**point, "error": f"{tokens_per_step} tokens per step = {global_batch} sequences of {seq}, "
                                  f"not a multiple of micro-batch size {micro_batch_size}"}
    profiled = {profile_step, profile_step + 1} if profile_step else set()
    steps = max(steps, profile_step + 2) if profile_step else steps  # at least one steady step after the window
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = run_dir or tmp
        extra = [f"optimizer.optimizer={optimizer}", *(overrides or [])]
        if profile_step:
            extra += [f"logging.profile_step_start={profile_step}", f"logging.profile_step_end={profile_step + 1}"]
        result = launch(config, [*point_overrides(seq, micro_batch_size, global_batch, steps, run_dir), *extra],
                        run_dir, timeout)
        if not result.ok:
            return {**point, "oom": result.oom, "error": result.error()}
        point.update(steady_state(result.rows, skip=set(range(1, warmup + 1)) | profiled))
        if profile_step:
            point["breakdown"] = _breakdown(Path(run_dir), artifacts or Path.cwd(), _label(point), keep_trace)
    return point


def _label(point: dict) -> str:
    return f"{point['optimizer'].lower()}_seq{point['seq']}_mbs{point['micro_batch_size']}"


def _breakdown(run_dir: Path, artifacts: Path, label: str, keep_trace: bool) -> str:
    """Write the per-part table (and its numbers) of the run's trace into `artifacts`, the trace too
    with `keep_trace` (hundreds of MB for glm5-proxy); returns the table's path."""
    from pretrain.tools.step_breakdown import main as step_breakdown

    traces = sorted((run_dir / "profile").glob("trace_rank0_*.json"))
    if not traces:
        return "no trace written"
    artifacts.mkdir(parents=True, exist_ok=True)
    trace = traces[-1]
    if keep_trace:
        trace = Path(shutil.copyfile(trace, artifacts / f"{label}_trace.json"))
    table = artifacts / f"{label}_breakdown.md"
    step_breakdown([str(trace), "--out", str(table), "--json", str(artifacts / f"{label}_breakdown.json")])
    return str(table)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(results: dict) -> str:
    lines = [f"Training throughput on {results['device']} ({results['config']}, {results['tokens_per_step']:,} "
             f"tokens per step, medians of the steady steps):", "",
             "| optimizer | seq | micro-batch | sequences/step | tokens/s | TFLOP/s per GPU | MFU | peak mem GiB "
             "| step ms | optimizer ms |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in results["points"]:
        head = f"| {p['optimizer']} | {p['seq']} | {p['micro_batch_size']} | {p['global_batch_size']} |"
        if "error" in p:
            lines.append(f"{head} {'OOM' if p.get('oom') else 'failed'}: {p['error'][:80]} | | | | | |")
            continue
        mfu = "-" if p["mfu"] is None else f"{p['mfu']:.1%}"
        lines.append(f"{head} {_fmt(p['tokens_per_sec'], ',.0f')} | {_fmt(p['tflops_per_gpu'], '.1f')} | {mfu} | "
                     f"{_fmt(p['mem_peak_gb'], '.1f')} | {_fmt(p['step_ms'], '.0f')} | "
                     f"{_fmt(p.get('optimizer_ms'), '.0f')} |")
    tables = [p["breakdown"] for p in results["points"] if p.get("breakdown")]
    if tables:
        lines += ["", "Per-part breakdowns: " + ", ".join(tables)]
    return "\n".join(lines) + "\n"


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no GPU)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs/models/glm5-proxy.yaml"))
    parser.add_argument("--seqs", default="4096,16384")
    parser.add_argument("--optimizers", default="adam,muon", help="optimizer.optimizer values: adam (AdamW), muon")
    parser.add_argument("--micro-batch-sizes", default="1")
    parser.add_argument("--tokens-per-step", type=int, default=DEFAULT_TOKENS_PER_STEP)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    parser.add_argument("--overrides", default="", help="extra config overrides, space separated")
    parser.add_argument("--profile-step", type=int, default=None, help="profile steps N and N+1 and break them down")
    parser.add_argument("--keep-traces", action="store_true", help="with --profile-step: keep the traces too")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per point")
    parser.add_argument("--out", help="results JSON (breakdowns and traces are written beside it)")
    args = parser.parse_args(argv)
    optimizers = args.optimizers.split(",")
    bad = [o for o in optimizers if o not in OPTIMIZER_NAMES]
    if bad:
        parser.error(f"--optimizers: unknown {bad}; choose from {sorted(OPTIMIZER_NAMES)}")
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if args.profile_step is not None and args.profile_step <= args.warmup:
        parser.error(f"--profile-step ({args.profile_step}) must come after the warm-up steps (--warmup {args.warmup})")
    out = Path(args.out) if args.out else None
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
    artifacts = (out.parent / f"{out.stem}_profiles") if out else Path.cwd() / "train_throughput_profiles"
    results = {"device": _device_name(), "config": Path(args.config).name, "tokens_per_step": args.tokens_per_step,
               "steps": args.steps, "warmup": args.warmup, "overrides": args.overrides.split(), "points": []}
    print(f"device: {results['device']}", flush=True)
    for optimizer in optimizers:
        for seq in _ints(args.seqs):
            for mbs in _ints(args.micro_batch_sizes):
                point = run_point(args.config, optimizer, seq, mbs, args.tokens_per_step, args.steps, args.warmup,
                                  results["overrides"], args.profile_step, artifacts, args.timeout,
                                  keep_trace=args.keep_traces)
                results["points"].append(point)
                print(json.dumps(point), flush=True)
                if out:
                    out.write_text(json.dumps(results, indent=2))
    print(markdown(results), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
