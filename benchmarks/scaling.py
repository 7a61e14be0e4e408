"""Weak scaling of a config on one host of N GPUs (2 or 4): every parallel layout against one GPU, in one call.

    python benchmarks/scaling.py --out OUT_DIR                       # every run this host can make
    python benchmarks/scaling.py --out OUT_DIR --only dispatch,tp2  # groups or runs (their baselines run too)
    python benchmarks/scaling.py --out OUT_DIR --dry-run             # the plan and the torchrun commands, no GPU

Each run trains `--config` (default glm5-proxy, mock tokens, its own optimizer and micro-batch size: the config's
best single-GPU setting) for `--iters` steps with the same work per data-parallel rank as the 1-GPU baseline:
M micro-batches per step per data-parallel rank (per pipeline for PP). The runs and groups, with what each sets, are
listed in `benchmarks/scaling_runs.py`.

`--only` takes run names or groups (baseline, dp, dispatch, overlaps, balance, pp, tp, cp, glm5_width, cp_long);
the 1-GPU baselines a selected run is compared with run in the same call. Every run is one
`torchrun ... -m pretrain.train`; a run that fails is reported and the others go on. Reported per run, from rank
0's metrics.jsonl (medians over steps 3 .. iters; the last two steps of every EP run are profiled and left out):
tokens/s per GPU from the step times, its ratio to the baseline, MFU, peak memory (rank 0), and the share of the
step in the layout's collective: for EP runs NCCL all-to-all kernel time, for CP runs NCCL all-gather kernel time
(the latent and DSA key gathers; the CP runs but cp2_32k_zero2 keep ZeRO-2 off, so no parameter gather counts),
over the profiled steps, overlapped or not: compare it with the tokens/s to see how much of it is hidden. The mock
data's documents (megatron's mock dataset: lengths uniform in 1 .. 4096) are what the `docs` runs isolate.
Results merge into OUT_DIR/scaling.json and OUT_DIR/scaling.md (command, GPU, date) after every run, so runs split
over several calls (`--only`) fill one table. The runs use the first GPUs of CUDA_VISIBLE_DEVICES when it is set,
so two calls with apart `--port`s can share a host of 4 (two 2-GPU halves). On 2 GPUs, about 6 runs fit 10
minutes. `--breakdown` profiles every run's last two steps, the 1-GPU baselines too (or only the runs named:
`--breakdown pp2,tp2`), and writes OUT_DIR/<run>.breakdown.md (`pretrain.tools.step_breakdown`: the step by
model part, with its largest kernels), so a ratio below 1 comes with where the time went.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gzip
import io
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from benchmarks.scaling_runs import DEFAULT_CONFIG, GROUPS, Run, plan_runs, select  # noqa: E402

def calibrated_kind(name: str) -> Optional[str]:
    """The layout planner's calibration for a GPU name ("4 x NVIDIA H200" -> "h200"), None without one."""
    return next((kind for kind in ("h100", "h200") if kind in name.lower()), None)


def balanced_pp_layout(config: str, microbatches: int, extra: List[str], gpu: Optional[str] = None,
                       closed_form: bool = False) -> List[str]:
    """PP = 2 x VPP = 2 overrides from `python -m pretrain.tools.pipeline_split` (its last line), the entries
    weighed by the planner's calibration for `gpu` (FLOPs without one): the shortest simulated schedule (layout and
    micro-batch group), or with `closed_form` the closed-form balance."""
    cmd = [sys.executable, "-m", "pretrain.tools.pipeline_split", "--config", config, "--pp", "2", "--vpp", "2",
           "--microbatches", str(microbatches)] + (["--gpu", gpu] if gpu else []) + (
        ["--closed-form"] if closed_form else []) + extra
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout.strip().splitlines()
    line = out[-1]
    assert line.startswith("overrides: "), out
    return [word.replace("'", "") for word in shlex.split(line[len("overrides: "):], posix=False)]


def torchrun_command(run: Run, args, port: int) -> List[str]:
    common = [f"train.train_iters={args.iters}", "train.eval_interval=null", "optimizer.lr_warmup_iters=2",
              "logging.log_interval=1", "checkpoint.save=null", f"logging.run_dir={args.out}/{run.name}",
              f"data.data_cache_path={args.out}/data_cache"]
    if run.profile or broken_down(run, args):  # the last two steps on rank 0: the collective's share, the breakdown
        common += [f"logging.profile_step_start={args.iters - 1}", f"logging.profile_step_end={args.iters}"]
        if broken_down(run, args) and is_pipelined(run):  # the last rank holds the last stage: both ends of the pipe
            common.append(f"logging.profile_ranks=[0,{run.gpus - 1}]")
    return (["torchrun", "--nproc-per-node", str(run.gpus), "--master-port", str(port), "-m", "pretrain.train",
             "--config", run.config or args.config] + common + run.overrides + args.extra)


def is_pipelined(run: Run) -> bool:
    return any(o.startswith("parallel.pipeline_model_parallel_size=") and not o.endswith("=1") for o in run.overrides)


def broken_down(run: Run, args) -> bool:
    """Whether `--breakdown` asks for this run's step breakdown."""
    return args.breakdown == "all" or run.name in args.breakdown.split(",")


def check_configs(commands) -> None:
    """Every run's config loads and passes the layout checks for its world size (CPU, before any launch)."""
    from pretrain.config import ConfigError, load_config, validate_config

    for run, cmd in commands:
        config, overrides = cmd[cmd.index("--config") + 1], cmd[cmd.index("--config") + 2:]
        try:
            validate_config(load_config(config, overrides), world_size=run.gpus)
        except ConfigError as err:
            raise SystemExit(f"run {run.name}: {err}") from None


COLLECTIVE_KERNELS = {"a2a": ("AllToAll", "SendRecv"), "allgather": ("AllGather",)}


def collective_share(run_dir: Path, kind: str) -> Optional[float]:
    """NCCL kernel time of the collective `kind` (COLLECTIVE_KERNELS) / the profiled steps' time, from rank 0's
    Chrome trace (None without one)."""
    traces = sorted((run_dir / "profile").glob("trace_rank0_*.json*"))
    if not traces:
        return None
    opener = gzip.open if traces[-1].suffix == ".gz" else open
    with opener(traces[-1], "rt") as f:
        events = json.load(f).get("traceEvents", [])
    step = sum(e.get("dur", 0) for e in events if str(e.get("name", "")).startswith("ProfilerStep#")
               and e.get("cat") == "user_annotation")
    comm = sum(e.get("dur", 0) for e in events if e.get("cat") == "kernel"
               and "nccl" in e.get("name", "").lower()
               and any(k in e.get("name", "") for k in COLLECTIVE_KERNELS[kind]))
    return comm / step if step else None


def summarize(run: Run, run_dir: Path, iters: int, profiled: bool = False) -> dict:
    """Medians over steps 3 .. iters (the two profiled last steps left out) of rank 0's metrics.jsonl."""
    with open(run_dir / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    last = iters - 2 if run.profile or profiled else iters
    rows = [r for r in rows if "tokens_per_sec" in r and 3 <= r.get("step", 0) <= last] or rows[-1:]
    mfu = [r["mfu"] for r in rows if r.get("mfu") is not None]
    return {"run": run.name, "gpus": run.gpus, "baseline": run.baseline, "steps": len(rows),
            "tokens_per_sec_per_gpu": statistics.median(r["tokens_per_sec"] for r in rows) / run.gpus,
            "mfu": statistics.median(mfu) if mfu else None,
            "mem_peak_gb": max(r.get("mem_peak_gb") or 0.0 for r in rows),
            "comm": run.profile or None,
            "comm_share": collective_share(run_dir, run.profile) if run.profile else None,
            "overrides": run.overrides}


def write_breakdown(run_dir: Path, path: Path, rank: int = 0) -> None:
    """`python -m pretrain.tools.step_breakdown` of `rank`'s profiled steps (where the step's time goes, by part,
    with the largest kernels) into `path`, next to the tables: small enough to keep when the trace is not."""
    from pretrain.tools import step_breakdown

    traces = sorted((run_dir / "profile").glob(f"trace_rank{rank}_*.json"))
    if not traces:
        path.write_text(f"no rank-{rank} trace under {run_dir / 'profile'}\n")
        return
    with contextlib.redirect_stdout(io.StringIO()):
        step_breakdown.main([str(traces[-1]), "--steps", "2", "--out", str(path), "--kernels", "12"])


def gpu_name() -> str:
    try:
        import torch

        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "unknown"


def write_tables(out: Path, results: List[dict], meta: dict) -> str:
    """Merge into OUT/scaling.json (runs by name) and rewrite OUT/scaling.md; returns the markdown."""
    path = out / "scaling.json"
    old = json.loads(path.read_text()) if path.exists() else {"runs": {}, "calls": []}
    if not old["calls"] or old["calls"][-1] != meta:  # main() records after every run: one call, one entry
        old["calls"].append(meta)
    old["runs"].update({r["run"]: dict(r, call=len(old["calls"]) - 1) for r in results})
    path.write_text(json.dumps(old, indent=2) + "\n")
    lines = ["| run | GPUs | tokens/s per GPU | vs 1 GPU | MFU | peak memory | collective share | call |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    runs = old["runs"]
    for r in runs.values():
        if "error" in r:
            lines.append(f"| {r['run']} | {r['gpus']} | failed: {r['error']} | | | | | {r['call']} |")
            continue
        base = runs.get(r["baseline"], {})
        same_call = base.get("call") == r["call"] and "tokens_per_sec_per_gpu" in base
        ratio = f"{r['tokens_per_sec_per_gpu'] / base['tokens_per_sec_per_gpu']:.2f}" if same_call else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        share = f"{100 * r['comm_share']:.0f}% {r['comm']}" if r.get("comm_share") is not None else "-"
        lines.append(f"| {r['run']} | {r['gpus']} | {r['tokens_per_sec_per_gpu']:,.0f} | {ratio} | {mfu} | "
                     f"{r['mem_peak_gb']:.1f} GiB | {share} | {r['call']} |")
    calls = [f"- call {i}: `{c['command']}` on {c['gpu']}, {c['date']}" for i, c in enumerate(old["calls"])]
    text = "\n".join(["# Weak scaling (benchmarks/scaling.py)", "", *calls, "",
                      "Ratios compare runs with their 1-GPU baseline of the same call.", "", *lines, ""])
    (out / "scaling.md").write_text(text)
    return text


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="results directory (runs, scaling.json, scaling.md)")
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--gpus", type=int, help="GPUs to use, 2 or 4 (default: every visible GPU)")
    parser.add_argument("--only", help="comma-separated runs or groups (" + ", ".join(GROUPS) + ")")
    parser.add_argument("--iters", type=int, default=8, help="steps per run (medians over steps 3 ..)")
    parser.add_argument("--micro-batch", type=int, help="micro-batch size of the 4K runs (default: the config's)")
    parser.add_argument("--run-timeout", type=int, default=300, help="seconds before a run is stopped")
    parser.add_argument("--port", type=int, default=29700,
                        help="first torchrun master port (runs count up from it; two calls on one host need apart ones)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the commands, run nothing")
    parser.add_argument("--breakdown", nargs="?", const="all", default="",
                        help="profile the last two steps of every run (baselines too), or of the comma-separated runs "
                             "given, and write OUT/<run>.breakdown.md: where each step's time goes, by model part "
                             "(pretrain.tools.step_breakdown)")
    parser.add_argument("extra", nargs="*", help="overrides added to every run (section.key=value)")
    args = parser.parse_args(argv)
    if args.gpus is None:
        args.gpus = 2 if args.dry_run else _visible_gpus()
    if args.gpus not in (2, 4):
        parser.error(f"--gpus must be 2 or 4 (got {args.gpus}); the plan is written for one host of 2 or 4 GPUs")
    if args.iters < 6:
        parser.error(f"--iters must be at least 6 (got {args.iters}): steps 1-2 warm up, the last two may be profiled")
    return args


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def visible_devices() -> List[str]:
    """The GPUs this call may use: CUDA_VISIBLE_DEVICES when set (two calls can share a host), else all of them."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given:
        return [d.strip() for d in given.split(",") if d.strip()]
    return [str(g) for g in range(_visible_gpus())]


def main(argv=None) -> int:
    args = parse_args(argv)
    from pretrain.config import load_config

    micro_batch = args.micro_batch or load_config(args.config, args.extra).train.micro_batch_size
    if args.micro_batch:
        args.extra = args.extra + [f"train.micro_batch_size={args.micro_batch}"]
    runs = plan_runs(args.gpus, micro_batch, [])
    chosen = select(runs, args.only)
    if any(is_pipelined(run) for run in chosen):  # every PP run (pp2_chunked alone too) gets the balanced layout
        kind = None if args.dry_run else calibrated_kind(gpu_name())
        if not args.dry_run and kind is None:
            print(f"PP runs: no layout-planner calibration for {gpu_name()}; their stages are balanced by FLOPs")
        layout = balanced_pp_layout(args.config, 8, args.extra, kind)
        closed = balanced_pp_layout(args.config, 8, args.extra, kind, closed_form=True)
        runs = plan_runs(args.gpus, micro_batch, layout, closed)
        chosen = [runs[run.name] for run in chosen]
    print(f"{len(chosen)} runs on {args.gpus} GPUs, {args.iters} steps each, config {args.config}:")
    for run in chosen:
        print(f"  {run.name:<15} {run.gpus} GPU(s), {run.microbatches} micro-batches per DP rank, "
              f"vs {run.baseline}: {' '.join(run.overrides)}")
    out = Path(args.out)
    commands = [(run, torchrun_command(run, args, args.port + i)) for i, run in enumerate(chosen)]
    check_configs(commands)
    if args.dry_run:
        for run, cmd in commands:
            print(f"[{run.name}] " + " ".join(shlex.quote(word) for word in cmd))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python benchmarks/scaling.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
            "gpu": gpu_name(), "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    results, text = [], ""
    devices = visible_devices()
    for run, cmd in commands:
        started = time.time()
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(devices[:run.gpus]))
        log = out / f"{run.name}.log"
        print(f"[{datetime.datetime.now():%H:%M:%S}] {run.name}", flush=True)
        try:
            with open(log, "w") as f:
                proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=args.run_timeout,
                                      cwd=ROOT)
            if proc.returncode:
                raise RuntimeError(f"exit {proc.returncode}, see {log.name}")
            row = summarize(run, out / run.name, args.iters, profiled=broken_down(run, args))
            if broken_down(run, args):
                write_breakdown(out / run.name, out / f"{run.name}.breakdown.md")
                if is_pipelined(run):  # the last stage's rank too: imbalance and waiting show on both ends
                    write_breakdown(out / run.name, out / f"{run.name}.rank{run.gpus - 1}.breakdown.md", run.gpus - 1)
        except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as err:
            row = {"run": run.name, "gpus": run.gpus, "baseline": run.baseline, "error": str(err).splitlines()[0]}
        row["wall_s"] = round(time.time() - started, 1)
        results.append(row)
        print(f"  {json.dumps({k: v for k, v in row.items() if k != 'overrides'})}", flush=True)
        text = write_tables(out, [row], meta)  # after every run: a call stopped midway keeps what it measured
    print(text)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
