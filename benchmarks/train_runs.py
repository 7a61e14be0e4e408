"""One benchmark point = one real training run through `python -m pretrain.train`, summarized from its metrics.jsonl.

    result = launch(config, ["data.seq_length=4096", ...], run_dir, timeout=900)
    if result.ok:
        row = steady_state(result.rows, skip={1})

Each point is a fresh process (an out-of-memory point cannot disturb the next), on mock data unless the
overrides say otherwise. The numbers are the trainer's own (`pretrain.training.metrics`): tokens/s,
TFLOP/s per GPU and MFU as medians over the steady steps, the peak memory as the maximum over all
steps. Used by `benchmarks/long_context.py` and `benchmarks/train_throughput.py`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class RunResult:
    returncode: Optional[int]
    rows: List[dict] = field(default_factory=list)
    tail: str = ""
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and bool(self.rows)

    @property
    def oom(self) -> bool:
        return "out of memory" in self.tail.lower()

    def error(self) -> str:
        if self.timed_out:
            return self.tail
        lines = self.tail.strip().splitlines()
        return lines[-1] if lines else f"exit code {self.returncode}"


def point_overrides(seq: int, micro_batch_size: int, global_batch_size: int, steps: int, run_dir) -> List[str]:
    """The overrides every benchmark point shares: shape, mock data, no evaluation, a log line per step."""
    return [f"data.seq_length={seq}", f"train.micro_batch_size={micro_batch_size}",
            f"train.global_batch_size={global_batch_size}", f"train.train_iters={steps}", "train.eval_interval=null",
            "data.mock=true", "optimizer.lr_warmup_iters=1", "logging.log_interval=1", f"logging.run_dir={run_dir}"]


def read_metrics(run_dir) -> List[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def launch(config, overrides: Sequence[str], run_dir, timeout: int) -> RunResult:
    """Run `python -m pretrain.train --config <config> <overrides>` in the repository root; read its metrics."""
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    try:
        done = subprocess.run([sys.executable, "-m", "pretrain.train", "--config", str(config), *overrides],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return RunResult(None, read_metrics(run_dir), f"timeout after {timeout}s", timed_out=True)
    return RunResult(done.returncode, read_metrics(run_dir), (done.stderr or done.stdout)[-4000:])


def steady_state(rows: List[dict], skip: Iterable[int] = (1,)) -> dict:
    """Medians over the steps not in `skip` (warm-up, profiled steps); the peak memory over all steps."""
    skip = set(skip)
    steady = [r for r in rows if r["step"] not in skip]
    if not steady:
        raise ValueError(f"no steady step left: {len(rows)} steps logged, steps {sorted(skip)} skipped")

    def med(key: str) -> Optional[float]:
        values = [r[key] for r in steady if r.get(key) is not None]
        return statistics.median(values) if values else None

    out = {"tokens_per_sec": med("tokens_per_sec"), "tflops_per_gpu": med("tflops_per_gpu"), "mfu": med("mfu"),
           "mem_peak_gb": max((r["mem_peak_gb"] for r in rows if r.get("mem_peak_gb") is not None), default=None),
           "step_ms": None if med("step_time_s") is None else 1e3 * med("step_time_s"),
           "loss": rows[-1].get("loss"), "steady_steps": [r["step"] for r in steady]}
    if any("optimizer_time_s" in r for r in steady):
        optimizer = med("optimizer_time_s")
        out["optimizer_ms"] = None if optimizer is None else 1e3 * optimizer
    return out
