"""Training metrics: a console line per log interval, `metrics.jsonl`, TensorBoard and wandb.

Only rank 0 writes. Every step appends one JSON object to `<logging.run_dir>/metrics.jsonl` and
flushes it, so a crashed or killed run keeps every step it logged. Each line holds at least

    step, loss, lr, grad_norm, tokens_per_sec, tflops_per_gpu, mfu, mem_peak_gb, skipped

(null when unknown; `mfu` is a fraction of the GPU's dense bf16 peak, null on CPU; `tokens_per_sec`
is the whole job's throughput; memory in GiB), plus whatever else the trainer reports:
`mtp_loss_<d>`, `aux_loss`, `indexer_loss`, `valid_loss`, `step_time_s`, `optimizer_time_s` (clipping
and the update, timed from the read of the gradient norm, which waits for the backward; device-synchronized),
... Non-finite numbers (a NaN-skipped step's loss) are written as null, so every line is strict JSON.

Resume: `MetricsLogger(..., resume_step=k)` first rewrites metrics.jsonl keeping only the lines
with step <= k (and dropping a torn last line), so the steps the resumed run logs again (k + 1, ...)
appear once. Dropped lines go to `metrics.stale.jsonl` next to it, for post-mortems. Pass
resume_step=0 for a fresh start (clears a previous run's lines); None appends without touching.

TensorBoard (`logging.tensorboard_dir`) and wandb (`logging.wandb_project`, mode
`logging.wandb_mode`, "offline" by default) receive the same numbers under grouped keys
(`loss/...`, `throughput/...`, `memory/...`, `lr`); either is skipped with one warning when its
package is missing.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from pretrain.atomic_io import atomic_write_text
from pretrain.training.flops import mfu as compute_mfu

REQUIRED_KEYS = ("loss", "lr", "grad_norm", "tokens_per_sec", "tflops_per_gpu", "mfu", "mem_peak_gb")
METRICS_FILE = "metrics.jsonl"
STALE_FILE = "metrics.stale.jsonl"
_GIB = float(1 << 30)


# ----------------------------------------------------------------------------------- values
def _plain(value: Any) -> Any:
    """Tensors and numpy scalars -> Python numbers; non-finite floats -> None (strict JSON)."""
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    elif hasattr(value, "item") and not isinstance(value, (list, tuple, dict, str)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def grouped_key(name: str) -> str:
    """Metric name -> TensorBoard / wandb key, grouped like torchtitan's."""
    if name == "loss":
        return "loss/lm"
    if name.startswith("mtp_loss_"):
        return f"loss/mtp_{name[len('mtp_loss_'):]}"
    if name.endswith("_loss"):  # aux_loss, indexer_loss, valid_loss, ...
        return f"loss/{name[: -len('_loss')]}"
    if name.startswith(("indexer_loss/", "topk_recall")):  # DSA, per layer
        return f"dsa/{name}"
    if name.startswith("tokens_per_sec") or name in ("tflops_per_gpu", "mfu", "step_time_s", "data_wait_s",
                                                     "data_wait_frac"):
        return f"throughput/{name}"
    if name.startswith("mem_"):
        return f"memory/{name[len('mem_'):]}"
    return name  # lr, grad_norm, skipped, ...


def format_line(record: Dict[str, Any]) -> str:
    """One compact console line: step, losses, lr, grad norm, throughput, MFU, memory."""

    def num(key: str, fmt: str) -> Optional[str]:
        value = record.get(key)
        return None if value is None else format(value, fmt)

    parts = [f"step {record['step']:>6}"]
    loss = num("loss", ".4f")
    parts.append(f"loss {loss if loss is not None else 'nan'}")
    mtp = [record[k] for k in sorted((k for k in record if k.startswith("mtp_loss_")), key=lambda k: int(k.rsplit("_", 1)[1]))]
    if mtp:
        parts.append("mtp " + "/".join("nan" if v is None else f"{v:.3f}" for v in mtp))
    for key, label, fmt in (("aux_loss", "aux", ".2e"), ("indexer_loss", "idx", ".4f"), ("topk_recall", "recall", ".3f")):
        if key in record:
            parts.append(f"{label} {num(key, fmt) or 'nan'}")
    if record.get("valid_loss") is not None:
        parts.append(f"val {record['valid_loss']:.4f}")
    for key, label, fmt in (("lr", "lr", ".3e"), ("grad_norm", "gnorm", ".3f"), ("tokens_per_sec", "tok/s", ",.0f"),
                            ("tflops_per_gpu", "tflops", ".1f")):
        value = num(key, fmt)
        if value is not None:
            parts.append(f"{label} {value}")
    if record.get("mfu") is not None:
        parts.append(f"mfu {record['mfu']:.1%}")
    if record.get("data_wait_frac") is not None:  # the step's share spent waiting for the next batch
        parts.append(f"data wait {record['data_wait_frac']:.1%}")
    if record.get("mem_peak_gb") is not None:
        parts.append(f"mem {record['mem_peak_gb']:.2f}GiB")
    if record.get("skipped"):
        parts.append("SKIPPED (non-finite)")
    return " | ".join(parts)


# ----------------------------------------------------------------------------------- resume
def truncate_metrics(path: Path, resume_step: int) -> int:
    """Keep the lines of `path` with step <= resume_step; move the others (and unreadable ones,
    such as a line torn by a crash) to metrics.stale.jsonl. Atomic. Returns the lines dropped."""
    path = Path(path)
    if not path.exists():
        return 0
    keep, drop = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            drop.append(line)
            continue
        (keep if step <= resume_step else drop).append(line)
    if not drop:
        return 0
    with open(path.with_name(STALE_FILE), "a", encoding="utf-8") as stale:
        stale.write("".join(line + "\n" for line in drop))
    atomic_write_text(path, "".join(line + "\n" for line in keep))
    return len(drop)


# ----------------------------------------------------------------------------------- logger
class MetricsLogger:
    """Writes each step's metrics on rank 0; a no-op on every other rank.

    log_step(step, values) takes the trainer's numbers (floats or 0-d tensors) under the key names
    of the module docstring; `close()` flushes and closes every sink. Usable as a context manager.
    """

    def __init__(self, cfg, rank: int = 0, world_size: int = 1, resume_step: Optional[int] = None):
        log = cfg.logging
        self.enabled = rank == 0
        self.world_size = world_size
        self.log_interval = max(1, log.log_interval)
        self._file = self._tb = self._wandb = None
        if not self.enabled:
            return
        self.run_dir = Path(log.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        if resume_step is not None:
            truncate_metrics(self.path, resume_step)
        self._file = open(self.path, "a", encoding="utf-8")
        self._print = _console_printer()
        if log.tensorboard_dir:
            self._tb = _tensorboard_writer(log.tensorboard_dir)
        if log.wandb_project and log.wandb_mode != "disabled":
            self._wandb = _wandb_run(cfg)

    def log_step(self, step: int, values: Dict[str, Any]) -> Dict[str, Any]:
        """Record one step; returns the record as written (rank 0) or as given (other ranks)."""
        record: Dict[str, Any] = {"step": int(step)}
        record.update({k: None for k in REQUIRED_KEYS})
        record["skipped"] = False
        record.update({k: _plain(v) for k, v in values.items()})
        record["skipped"] = bool(record["skipped"])
        if not self.enabled:
            return record
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()  # one line per step survives a crash or SIGKILL of this process
        if step % self.log_interval == 0 or record["skipped"] or step == 1:
            self._print(format_line(record))
        scalars = {grouped_key(k): float(v) for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=int(step))
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _console_printer():
    try:
        from rich.console import Console

        console = Console(highlight=False, soft_wrap=True)
        return lambda line: console.print(line, markup=False)
    except ImportError:
        return lambda line: print(line, flush=True)


def _tensorboard_writer(log_dir: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        warnings.warn(
            f"logging.tensorboard_dir={log_dir!r} is set but the tensorboard package is not installed "
            "(pip install tensorboard); TensorBoard logging is skipped",
            stacklevel=3,
        )
        return None
    return SummaryWriter(log_dir=log_dir)


def _wandb_run(cfg):
    try:
        import wandb
    except ImportError:
        warnings.warn(
            f"logging.wandb_project={cfg.logging.wandb_project!r} is set but wandb is not installed "
            "(pip install wandb); wandb logging is skipped",
            stacklevel=3,
        )
        return None
    import dataclasses

    log = cfg.logging
    return wandb.init(
        project=log.wandb_project,
        mode=log.wandb_mode,
        dir=log.run_dir,
        name=Path(log.run_dir).name,
        config=dataclasses.asdict(cfg),
        resume="allow",
    )


# ----------------------------------------------------------------------------------- throughput
def _cuda_active() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def synchronize() -> None:
    """Wait for queued GPU work, so wall time covers it (no-op on CPU)."""
    if _cuda_active():
        torch.cuda.synchronize()


def device_name() -> Optional[str]:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def flops_caveat(cfg) -> Optional[str]:
    """What the logged TFLOP/s and MFU leave out for this config, or None: the FLOP counter
    (`pretrain.training.flops`, like megatron-LM's) counts every window as one causal sequence."""
    if not cfg.data.reset_attention_mask:
        return None
    return (f"TFLOP/s and MFU count every {cfg.data.seq_length}-token window as one causal sequence; attention within "
            "packed documents (data.reset_attention_mask) does less work, so both overstate it")


class StepTimer:
    """Wall time of a step (synchronized with the GPU) -> tokens/s, TFLOP/s per GPU, MFU and the
    peak memory so far; the trainer logs these for every step.

        timer = StepTimer(flops_per_step, tokens_per_step, world_size)
        timer.start(); train_step(); values.update(timer.stop())
    """

    def __init__(self, flops_per_step: float, tokens_per_step: int, world_size: int = 1, device: Optional[str] = None):
        self.flops_per_step = flops_per_step
        self.tokens_per_step = tokens_per_step
        self.world_size = world_size
        self.device = device if device is not None else device_name()
        self._start: Optional[float] = None

    def start(self) -> None:
        synchronize()
        self._start = time.perf_counter()

    def stop(self) -> Dict[str, Optional[float]]:
        if self._start is None:
            raise RuntimeError("StepTimer.stop() called before start()")
        synchronize()
        elapsed, self._start = time.perf_counter() - self._start, None
        return {**self.throughput(elapsed), "mem_peak_gb": memory_stats()["mem_peak_gb"]}

    def throughput(self, seconds: float) -> Dict[str, Optional[float]]:
        per_gpu = self.flops_per_step / seconds / self.world_size
        tokens_per_sec = self.tokens_per_step / seconds
        return {
            "tokens_per_sec": tokens_per_sec,
            "tokens_per_sec_per_gpu": tokens_per_sec / self.world_size,
            "tflops_per_gpu": per_gpu / 1e12,
            "mfu": compute_mfu(per_gpu, self.device),
            "step_time_s": seconds,
        }


def memory_stats(reset_peak: bool = False) -> Dict[str, float]:
    """Peak memory in GiB: CUDA max allocated / reserved on this rank's GPU, else the process's
    peak resident set size (`mem_reserved_gb` then equals the RSS peak)."""
    if _cuda_active():
        stats = {
            "mem_peak_gb": torch.cuda.max_memory_allocated() / _GIB,
            "mem_reserved_gb": torch.cuda.max_memory_reserved() / _GIB,
        }
        if reset_peak:
            torch.cuda.reset_peak_memory_stats()
        return stats
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak_bytes = peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB
    return {"mem_peak_gb": peak_bytes / _GIB, "mem_reserved_gb": peak_bytes / _GIB}


def allocated_grad_bytes(chunks) -> int:
    """Bytes of the distinct storages behind every gradient tensor allocated on this rank now: each
    parameter's `.main_grad` and `.grad`, megatron DDP's buffers, ZeRO-2's bucket buffers. Measured from
    the tensors, not derived from any ownership map."""
    tensors = []
    for chunk in chunks:
        for p in chunk.module.parameters():
            tensors += [getattr(p, "main_grad", None), p.grad]
        if isinstance(getattr(chunk, "buffers", None), list):  # megatron DDP (nn.Module.buffers otherwise)
            tensors += [buf.grad_data for buf in [*chunk.buffers, *chunk.expert_parallel_buffers]]
        for b in getattr(chunk, "buckets", []):  # ZeRO-2: owned accumulation, local and in-flight buffers
            tensors += [b.grad, b.local, b.comm]
    storages = {}
    for t in tensors:
        if t is not None and t.untyped_storage().nbytes():
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())
