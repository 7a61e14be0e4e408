"""A torch.profiler window over training steps `logging.profile_step_start` .. `profile_step_end`.

    profiler = ProfilerWindow(cfg)            # a no-op unless both bounds are set
    for step in range(first, last + 1):
        with profiler.step(step):
            train_step()
    profiler.close()                          # exports a window the run ended inside

The window records CPU and (when present) CUDA activity of the steps start..end inclusive, one
`ProfilerStep#<step>` range per step, then writes a Chrome trace (open it in chrome://tracing or
https://ui.perfetto.dev) and a table of the most expensive operators to
`<logging.run_dir>/profile/`. Given the model chunks, the window also opens `part:<name>` ranges
around the model's parts while it records (`pretrain.training.profile_scopes`), which
`python -m pretrain.tools.step_breakdown TRACE.json` turns into a per-part table; each profiled step
ends with a device synchronize, so its kernels lie inside its `ProfilerStep#<step>` range. Only rank 0 profiles unless `all_ranks=True`: every profiled rank
writes its own files, named by rank.

With `logging.profile_memory: true` the window also records every CUDA allocation with its stack
(`torch.cuda.memory._record_memory_history`) and writes the snapshot (`memory_<name>.pickle`, for
pytorch.org/memory_viz or `python -m pretrain.tools.memory_report`) and the peak report beside it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Optional

import torch


class ProfilerWindow:
    def __init__(self, cfg, rank: Optional[int] = None, all_ranks: bool = False, model=None):
        log = cfg.logging
        self._model = model
        self._scopes = None
        start, end = log.profile_step_start, log.profile_step_end
        if (start is None) != (end is None):
            raise ValueError(
                "set both logging.profile_step_start and logging.profile_step_end (or neither), "
                f"got start={start}, end={end}"
            )
        if start is not None and not 1 <= start <= end:
            raise ValueError(f"logging.profile_step_start={start} must be >= 1 and <= profile_step_end={end}")
        if rank is None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.rank = rank
        self.start, self.end = start, end
        self.enabled = start is not None and (all_ranks or rank in log.profile_ranks)
        self.out_dir = Path(log.run_dir) / "profile"
        self._profiler: Optional[torch.profiler.profile] = None
        self._first: Optional[int] = None
        self._last: Optional[int] = None
        self.trace_path: Optional[Path] = None
        self.profile_memory = bool(getattr(log, "profile_memory", False)) and self.enabled
        if self.profile_memory and not torch.cuda.is_available():
            print("profiler: logging.profile_memory records CUDA allocations; this run has no GPU, so it is off",
                  flush=True)
            self.profile_memory = False
        self._baseline_bytes = 0

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Wrap training step `step`; records it when it lies in the window."""
        inside = self.enabled and self.start <= step <= self.end and self.trace_path is None
        if inside and self._profiler is None:
            self._begin(step)
        try:
            if inside:
                with torch.profiler.record_function(f"ProfilerStep#{step}"):
                    yield
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()  # the step's kernels finish inside its range
            else:
                yield
        finally:
            if inside:
                self._last = step
                if step == self.end:
                    self._export()

    def _begin(self, step: int) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True, with_stack=False)
        self._profiler.start()
        if self._model is not None:
            from pretrain.training.profile_scopes import ModelScopes

            self._scopes = ModelScopes(self._model)
        self._first = step
        if self.profile_memory:
            torch.cuda.synchronize()
            self._baseline_bytes = torch.cuda.memory_allocated()
            torch.cuda.memory._record_memory_history(stacks="python", max_entries=2_000_000)

    def _export(self) -> None:
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        if self._scopes is not None:
            self._scopes.remove()
            self._scopes = None
        profiler.stop()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        name = f"rank{self.rank}_steps{self._first}-{self._last}"
        self.trace_path = self.out_dir / f"trace_{name}.json"
        profiler.export_chrome_trace(str(self.trace_path))
        sort_by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        table = profiler.key_averages().table(sort_by=sort_by, row_limit=40)
        (self.out_dir / f"ops_{name}.txt").write_text(table + "\n", encoding="utf-8")
        print(f"profiler: steps {self._first}-{self._last} written to {self.trace_path}", flush=True)
        if self.profile_memory:
            self._export_memory(name)

    def _export_memory(self, name: str) -> None:
        import pickle

        from pretrain.training.memory_snapshot import format_report, peak_breakdown

        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        snapshot["baseline_bytes"] = self._baseline_bytes
        path = self.out_dir / f"memory_{name}.pickle"
        with open(path, "wb") as f:
            pickle.dump(snapshot, f)
        device = torch.cuda.current_device()
        peak, sites = peak_breakdown(snapshot["device_traces"][device], self._baseline_bytes)
        report = format_report(peak, sites, self._baseline_bytes)
        (self.out_dir / f"memory_{name}.txt").write_text(report + "\n", encoding="utf-8")
        print(f"profiler: memory snapshot {path}\n{report}", flush=True)

    def close(self) -> None:
        """Export a window that the run left before its last step (no-op otherwise)."""
        self._export()

    def __enter__(self) -> "ProfilerWindow":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
