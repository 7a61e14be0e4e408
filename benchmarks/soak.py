"""A long run without drift: memory, file handles, threads and tokens/s per step, and the time each
checkpoint save blocks training.

    python benchmarks/soak.py --out soak.json                     # glm5-ablate, 1,000 steps, one GPU
    python benchmarks/soak.py --config configs/quickstart/glm5-proxy-stdlib.yaml --data data/stdlib \
        --tokenizer data/tokenizer.json --out soak_proxy.json train.global_batch_size=4 train.eval_iters=2 \
        checkpoint.keep_last=1                                    # the proxy on real data, about 10 minutes
    python benchmarks/soak.py --config configs/models/glm5-proxy.yaml --steps 360 --interval 120 --no-eval \
        --async-save false --out save_sync.json train.global_batch_size=4   # seconds blocked per save, synchronous
    torchrun --nproc-per-node 2 benchmarks/soak.py --config configs/models/glm5-proxy.yaml --steps 360 \
        --interval 120 --no-eval --async-save true --out save_async_2gpu.json train.global_batch_size=8

The run is the ordinary trainer (`pretrain.training.loop.Trainer`) in this process, with an evaluation
and a checkpoint every `--interval` steps (`checkpoint.async_save` from `--async-save`). After every
step rank 0 records: GPU memory allocated and reserved, host RSS, open file descriptors and threads of
the process (from /proc), and the step's tokens/s; after every save, the seconds the save blocked
training (`Trainer.save_blocked_s`) and its two parts: `waited_s`, waiting for the previous save's background
write and pruning to finish (`Trainer.save_waited_s`: near 0 unless `--interval` is shorter than one background
write), and `staged_s`, this save's own work (`Trainer.save_staged_s`: staging the tensors when async, the whole
write when synchronous). The JSON has the median of each; to measure what an asynchronous save itself costs,
choose an `--interval` longer than one write (then `waited_s` stays near 0).
Without `--data` the tokens are synthetic (`data.mock=true`); with `--data PREFIX --tokenizer FILE` they
are the preprocessed files.

Verdict, after the warm-up: GPU allocated, GPU reserved and host RSS may grow by at most `--max-growth`
(1%) from the first tenth of the remaining steps to the last tenth (maxima of each window), file handles
and threads not at all, and the median tokens/s of the last tenth must be within `--max-slowdown` (5%) of
the first tenth's. The warm-up is the first evaluation-and-save cycle, up to the step the first checkpoint
is published (an asynchronous save's background write and its finalization included: they open the
writer's queues and files once), and 10 steps more; `--warmup N` makes it at least N steps. Each step
records whether a save is in flight; the open descriptors are compared by what they point to, so a growth
names its files, pipes or sockets (`verdict.checks.open_files.added`). Beside the first-to-last change,
`verdict.checks.tokens_per_sec.window_medians` has every window's median, the run's own spread. The JSON holds
every sample (with its `unix_time`, to line steps up with a GPU-clock or host-load log, and the host's share of
the step: `wall_s`, the main thread's CPU seconds `main_thread_cpu_s`, and `gc_s` / `gc_collections`, Python's
garbage collections; `host_units_per_s`, the speed of the core the trainer's thread is on, from
`benchmarks/host_speed.py`: a slower step on a slower core is the machine, not more host work), the windows and the
verdict; it is rewritten every `--interval` steps with what was recorded so far (`complete: false`), so a run
cut short leaves its samples. A PNG of the curves is written beside it when matplotlib is installed (else one
line says so). Exit code 0 when the verdict passes, 1 when not.

Which model: judge tokens/s on one whose step the GPU bounds. glm5-ablate's steps of 8K tokens take 0.17 s on
an H200 with the GPU busy about half of it; their tokens/s follows the speed of the host core the trainer runs
on (`host_units_per_s`), which on a virtual machine switches between two speeds about 2x apart, so its first and
last windows can differ by up to 25% in either direction with no drift (benchmarks/results/soak_h200/
host_rss_and_phases/). glm5-proxy at 16K tokens per step stays within 1.6%.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # run as a script from anywhere

from benchmarks import host_speed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GROWING = ("gpu_allocated_gib", "gpu_reserved_gib", "host_rss_gib")  # may grow by --max-growth
FIXED = ("open_files", "threads")  # must not grow
SAVE_PARTS = ("waited_s", "staged_s", "blocked_s")  # per save: waited for the previous one + its own = blocked


def _median_and_all(values: List[float]) -> dict:
    return {"median": statistics.median(values) if values else None, "all": values}


def proc_status(field: str) -> int:
    """A field of /proc/self/status in its unit (kB for memory, a count for threads); 0 when absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def open_descriptors() -> List[str]:
    """What each open descriptor of this process points to (a path, `pipe:[..]`, `socket:[..]`, ...)."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # closed meanwhile (the listing's own descriptor, a writer thread's file)
            pass
    return targets


def descriptor_kind(target: str) -> str:
    """A descriptor's target without the inode number that tells equal pipes or sockets apart (paths are kept)."""
    if target.endswith("]") and ":[" in target:
        return target.split(":[")[0] + ":[]"  # pipe:[123] -> pipe:[]
    return target


class HostClock:
    """The host's share of each step, to tell host-bound phases apart: the main thread's CPU seconds (what
    Python and the launches cost; a step whose wall time grows with it is slower on the host, not waiting on
    the GPU), and the seconds and count of Python's garbage collections (`gc.callbacks`), since the last `take`."""

    def __init__(self):
        self.gc_s, self.gc_collections, self._gc_start = 0.0, 0, None
        self._cpu, self._wall = time.thread_time(), time.perf_counter()
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            self.gc_s += time.perf_counter() - self._gc_start
            self.gc_collections += 1
            self._gc_start = None

    def take(self) -> Dict[str, float]:
        cpu, wall = time.thread_time(), time.perf_counter()
        out = {"wall_s": wall - self._wall, "main_thread_cpu_s": cpu - self._cpu, "gc_s": self.gc_s,
               "gc_collections": self.gc_collections}
        self._cpu, self._wall, self.gc_s, self.gc_collections = cpu, wall, 0.0, 0
        return out

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)


def pinned_pool_bytes() -> int:
    """Bytes of pinned host blocks PyTorch's caching host allocator owns (handed out and cached)."""
    import torch

    return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))


def sample(values: Dict[str, float], save_in_flight: bool, previous: Optional[List[str]] = None) -> Dict:
    """This process now: memory, descriptors, threads; the step's tokens/s from the trainer; whether a
    checkpoint is being written in the background; the speed of the core the trainer's thread runs on (20
    units of `host_speed.unit`, about 1 ms). `previous`: the last sample's descriptors, shared when unchanged
    (a new list of ~140 paths per step would grow this process by ~10 KB a step, the soak measuring itself)."""
    import torch

    gpu = torch.cuda.is_available()
    descriptors = open_descriptors()
    if previous is not None and descriptors == previous:
        descriptors = previous
    return {
        "gpu_allocated_gib": torch.cuda.memory_allocated() / 2**30 if gpu else 0.0,
        "gpu_reserved_gib": torch.cuda.memory_reserved() / 2**30 if gpu else 0.0,
        "host_rss_gib": proc_status("VmRSS") / 2**20,
        # RSS's parts: anonymous (the heap, pinned buffers: where a leak shows) and file-backed (memory-mapped
        # dataset and library pages, which the kernel can drop and which stop growing once every page was read)
        "host_rss_anon_gib": proc_status("RssAnon") / 2**20,
        "host_rss_file_gib": (proc_status("RssFile") + proc_status("RssShmem")) / 2**20,
        # PyTorch's pinned host pool (loader batches pinned for the copy, kept save staging): part of the anonymous RSS
        "host_pinned_pool_gib": pinned_pool_bytes() / 2**30 if gpu else 0.0,
        "open_files": len(descriptors),
        "threads": proc_status("Threads") or threading.active_count(),
        "tokens_per_sec": values.get("tokens_per_sec"),
        "save_in_flight": save_in_flight,
        "unix_time": time.time(),  # to line the steps up with a GPU-clock or host-load log of the same run
        "host_units_per_s": host_speed.rate(20),  # a slower step with a slower core: the machine, not the trainer
        "descriptors": descriptors,  # compared by `verdict`, not written to the JSON
    }


def warmup_steps(samples: List[dict], save_steps: List[int], at_least: int) -> int:
    """Steps before the verdict's windows: until the first save is published, 10 more, and `at_least`."""
    if not save_steps:
        return at_least
    first = save_steps[0]
    published = next((s["step"] for s in samples if s["step"] > first and not s["save_in_flight"]), None)
    if published is None:  # still in flight at the end: no window after it
        return max(at_least, samples[-1]["step"] if samples else 0)
    return max(at_least, published + 10)


def verdict(samples: List[dict], warmup: int, max_growth: float, max_slowdown: float) -> dict:
    post = [s for s in samples if s["step"] > warmup]
    if len(post) < 2:
        return {"pass": False, "why": f"only {len(post)} steps after the warm-up of {warmup}"}
    width = max(1, len(post) // 10)
    first, last = post[:width], post[-width:]
    checks, failed = {}, []
    for key in GROWING + FIXED:
        a, b = max(s[key] for s in first), max(s[key] for s in last)
        growth = (b - a) / a if a else (0.0 if b == a else float("inf"))
        limit = max_growth if key in GROWING else 0.0
        checks[key] = {"first": a, "last": b, "growth": growth, "limit": limit}
        if key == "open_files" and all("descriptors" in s for s in first + last):
            checks[key].update(descriptor_change(max(first, key=lambda s: s[key])["descriptors"],
                                                 max(last, key=lambda s: s[key])["descriptors"]))
        if growth > limit:
            added = checks[key].get("added")
            failed.append(f"{key} grew {growth:+.2%} ({a:.4g} -> {b:.4g}; limit {limit:.0%})"
                          + (f", new: {added}" if added else ""))
    speeds = [[s["tokens_per_sec"] for s in w if s["tokens_per_sec"]] for w in (first, last)]
    if all(speeds):
        a, b = statistics.median(speeds[0]), statistics.median(speeds[1])
        # the run's own spread beside the first-to-last change: consecutive windows from the first, then the last
        between = [post[i:i + width] for i in range(width, len(post) - 2 * width + 1, width)]
        medians = [a, *(statistics.median(v) for v in ([s["tokens_per_sec"] for s in w if s["tokens_per_sec"]]
                                                        for w in between) if v), b]
        checks["tokens_per_sec"] = {"first": a, "last": b, "change": b / a - 1, "limit": -max_slowdown,
                                    "window_medians": medians}
        if b / a - 1 < -max_slowdown:
            failed.append(f"tokens/s fell {b / a - 1:+.2%} ({a:.0f} -> {b:.0f}; the medians of the windows between "
                          f"ranged {min(medians[1:-1] or [a]):.0f}-{max(medians[1:-1] or [a]):.0f})")
    return {"pass": not failed, "why": "; ".join(failed) or "no growth beyond the limits", "window_steps": width,
            "first_window": [first[0]["step"], first[-1]["step"]], "last_window": [last[0]["step"], last[-1]["step"]],
            "checks": checks}


def descriptor_change(before: List[str], after: List[str]) -> Dict[str, Dict[str, int]]:
    """Descriptors by kind (`descriptor_kind`) that `after` has more of than `before`, and fewer."""
    a, b = Counter(map(descriptor_kind, before)), Counter(map(descriptor_kind, after))
    return {"added": dict(b - a), "removed": dict(a - b)}


def partial_result(header: dict, samples: List[dict], saves: List[dict]) -> dict:
    """What a run has recorded so far (`complete: false`, no verdict), per-step descriptors left out."""
    return {**header, "complete": False, "saves": list(saves), "samples": without_descriptors(samples)}


def without_descriptors(samples: List[dict]) -> List[dict]:
    """The samples as written to the JSON: the verdict names what grew, a descriptor list per step would bloat it."""
    return [{k: v for k, v in s.items() if k != "descriptors"} for s in samples]


def display_path(path: str) -> str:
    """`path` relative to the repository when inside it (the default config is given absolute), as users type it."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return path


def write_json(path: Path, result: dict) -> None:
    """Replace `path` whole (written beside it, then renamed): a run killed while writing leaves the last copy."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, path)


def plot(result: dict, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no curve: matplotlib is not installed (pip install matplotlib)"
    steps = [s["step"] for s in result["samples"]]
    keys = GROWING + FIXED + ("tokens_per_sec",)
    fig, axes = plt.subplots(len(keys), 1, figsize=(8, 2 * len(keys)), sharex=True)
    for ax, key in zip(axes, keys):
        ax.plot(steps, [s[key] or float("nan") for s in result["samples"]], lw=0.8)
        ax.set_ylabel(key, fontsize=8)
        ax.axvline(result["warmup"], color="grey", ls=":")
        for save in result["saves"]:
            ax.axvline(save["step"], color="tab:red", lw=0.4, alpha=0.5)
    axes[-1].set_xlabel("step (dotted: end of warm-up; red: checkpoints)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"curve: {path}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs/models/glm5-ablate.yaml"))
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--interval", type=int, default=200, help="steps between evaluations and checkpoints")
    parser.add_argument("--no-eval", action="store_true", help="checkpoints only (the save-time measurement)")
    parser.add_argument("--async-save", choices=("true", "false"), default="true", help="checkpoint.async_save")
    parser.add_argument("--warmup", type=int, default=None, help="at least this many steps before the verdict's "
                        "windows (default: until the first save is published, and 10 steps more)")
    parser.add_argument("--data", help="preprocessed dataset prefix (default: synthetic tokens)")
    parser.add_argument("--tokenizer", help="its tokenizer.json (with --data)")
    parser.add_argument("--max-growth", type=float, default=0.01)
    parser.add_argument("--max-slowdown", type=float, default=0.05)
    parser.add_argument("--run-dir", help="checkpoints and metrics (default: a folder beside --out)")
    parser.add_argument("--out", required=True, help="results JSON (the PNG goes beside it)")
    parser.add_argument("--heap-profile", help="a memray capture of the host allocations of --heap-window's steps "
                        "(benchmarks/heap_profile.py; needs memray): what those steps allocate and keep")
    parser.add_argument("--heap-window", default=None, help="START:STOP steps tracked by --heap-profile")
    parser.add_argument("overrides", nargs="*", help="extra config overrides, e.g. train.micro_batch_size=2")
    args = parser.parse_args(argv)
    if bool(args.data) != bool(args.tokenizer):
        parser.error("--data and --tokenizer go together")
    heap = None
    if args.heap_profile:
        from benchmarks.heap_profile import HeapWindow, parse_window

        try:
            start, stop = parse_window(args.heap_window or "")
        except ValueError as e:
            parser.error(str(e))
        if stop > args.steps:
            parser.error(f"--heap-window ends at step {stop}, after --steps {args.steps}")
        try:
            heap = HeapWindow(args.heap_profile, start, stop)
        except ImportError:
            parser.error("--heap-profile needs memray (pip install memray)")
    from pretrain import compat
    from pretrain.config import load_config
    from pretrain.training.loop import Trainer

    compat.install()
    out = Path(args.out)
    run_dir = Path(args.run_dir or out.with_suffix(""))
    data = ([f"data.data_path=[{args.data}]", f"data.tokenizer={args.tokenizer}", "data.mock=false"] if args.data
            else ["data.mock=true", "data.data_path=[]", "data.tokenizer=null"])
    cfg = load_config(args.config, [
        f"train.train_iters={args.steps}", f"train.eval_interval={'null' if args.no_eval else args.interval}",
        f"checkpoint.save={run_dir / 'checkpoints'}", f"checkpoint.save_interval={args.interval}",
        "checkpoint.auto_resume=false", f"checkpoint.async_save={args.async_save}", f"logging.run_dir={run_dir}",
        f"logging.log_interval={args.interval}", *data, *args.overrides])
    trainer = Trainer(cfg)
    import torch

    header = {"config": display_path(args.config), "steps": args.steps, "interval": args.interval,
              "async_save": args.async_save == "true", "data": args.data or "synthetic (data.mock=true)",
              "world_size": trainer.world_size,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    samples: List[dict] = []
    saves: List[dict] = []
    log_step, save = trainer.metrics.log_step, trainer.save
    host = HostClock()

    def logged(iteration, values):
        log_step(iteration, values)
        queue = trainer.async_queue  # a save written in the background until finalized (after this step)
        in_flight = bool(queue and queue.get_num_unfinalized_calls())
        previous = samples[-1]["descriptors"] if samples else None
        samples.append({"step": iteration, **sample(values, in_flight, previous), **host.take()})
        if heap is not None:
            heap.after_step(iteration)
        if trainer.rank == 0 and iteration % args.interval == 0:  # a run cut short still leaves its samples
            write_json(out, partial_result(header, samples, saves))

    def saved():
        path = save()
        saves.append({"step": trainer.iteration, "waited_s": trainer.save_waited_s,
                      "staged_s": trainer.save_staged_s, "blocked_s": trainer.save_blocked_s})
        return path

    trainer.metrics.log_step, trainer.save = logged, saved
    try:
        trainer.train()
    finally:
        host.close()  # the gc callback goes with the run, whatever ends it
        if heap is not None:
            heap.close()
    if trainer.rank != 0:
        return 0
    if heap is not None and heap.done:
        from benchmarks.heap_profile import write

        print(write(args.heap_profile, heap.stop - heap.start))

    # the first save cycle allocates once (pinned host buffers, the writer process and its queues, an async
    # save's copies), published a step or, when asynchronous, many steps after the save
    warmup = warmup_steps(samples, [s["step"] for s in saves], args.warmup if args.warmup is not None else 0)
    result = {
        **header, "complete": True, "warmup": warmup,
        **{f"save_{part}": _median_and_all([s[part] for s in saves]) for part in SAVE_PARTS},
        "saves": saves, "samples": without_descriptors(samples),
    }
    result["verdict"] = verdict(samples, warmup, args.max_growth, args.max_slowdown)
    by_step = {s["step"]: s for s in samples}
    if saves and saves[0]["step"] in by_step and warmup + 1 in by_step:  # what the first save cycle opened, kept
        result["first_save_cycle_descriptors"] = descriptor_change(by_step[saves[0]["step"]]["descriptors"],
                                                                   by_step[warmup + 1]["descriptors"])
    write_json(out, result)
    print(plot(result, out.with_suffix(".png")))
    v = result["verdict"]
    median = {part: result[f"save_{part}"]["median"] for part in SAVE_PARTS}
    print(f"soak {'PASS' if v['pass'] else 'FAIL'}: {v['why']}; checkpoints block training a median "
          f"{median['blocked_s']} s ({'async' if result['async_save'] else 'sync'}: waiting for the previous save "
          f"{median['waited_s']} s, this save's own {median['staged_s']} s); {out}")
    return 0 if v["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
