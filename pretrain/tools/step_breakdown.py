"""Where a training step's time goes: a per-part table from a profiler window's Chrome trace.

    python -m pretrain.tools.step_breakdown runs/x/profile/trace_rank0_steps5-7.json [--steps 2] [--out table.md]
        [--kernels 40]

The trace comes from the trainer's profile window (`logging.profile_step_start/end`,
`pretrain.training.profiler`), which opens `part:<name>` ranges around the model's parts and the
step's gradient and optimizer work (`pretrain.training.profile_scopes`). Each GPU kernel is
attributed through the operator that launched it (`pretrain.tools.trace_events`): to the innermost
part range around it, or, for a backward kernel, to the part of the forward operator that created
its autograd node. Kernels under no part are "other kernels", with their names listed. A trace
without GPU kernels (a CPU run) is read the same way with each operator's own CPU time in place of
kernel time.

Per part: forward and backward milliseconds per step (activation recompute counts as backward),
their sum, the share of the step's wall time, the time of the part's GEMM kernels and their
achieved TFLOP/s (FLOPs from the GEMM operators' recorded shapes), and how much of it ran in the
MTP depths. "host-side gaps" is wall time minus device-busy time (the union of kernel intervals);
kernels overlapping on several streams are subtracted once as "stream overlap", so the shares sum
to 100%. `--kernels N` adds the N largest kernels by part and the operator chain that launched them,
which names the code behind a part's time (e.g. a copy inside core attention and the function that made it).
A GPU trace also lists the host's waits on the device (synchronizing CUDA calls, by the ranges around them):
with "host-side gaps", they tell a step whose host cannot run ahead (syncs) from one bound by launching kernels.
It ends with `pretrain.tools.device_idle`'s two tables: the GPU's idle stretches by the host code that ran
during them, and the stretches where only NCCL kernels ran (waiting for a peer) by what followed.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

from pretrain.tools import device_idle
from pretrain.tools.trace_events import Trace, end, merge_intervals, write_report
from pretrain.training.profile_scopes import MODEL_PARTS, PARTS, PREFIX

OTHER = "other"
OPTIMIZER_ANNOTATIONS = {"AdamW": "adamw", "Adam": "adamw", "Muon": "muon"}


# ----------------------------------------------------------------------------------- attribution
class Attribution:
    """(part, backward?, in MTP?, leaf GEMM operator) for host events, memoized."""

    def __init__(self, trace: Trace):
        self.trace = trace
        self._memo: Dict[int, Tuple[str, bool, bool, Optional[dict]]] = {}

    def of(self, e: Optional[dict]) -> Tuple[str, bool, bool, Optional[dict]]:
        if e is None:
            return OTHER, False, False, None
        key = id(e)
        if key not in self._memo:
            self._memo[key] = OTHER, False, False, None  # a cycle through bad links ends as "other"
            self._memo[key] = self._resolve(e)
        return self._memo[key]

    def _resolve(self, e: dict) -> Tuple[str, bool, bool, Optional[dict]]:
        part, backward, mtp, gemm = None, False, False, None
        cur = e
        while cur is not None:
            name = cur["name"]
            if gemm is None and cur.get("_leaf_gemm"):
                gemm = cur
            if name.startswith(PREFIX):
                mtp |= name == PREFIX + "mtp"
                part = part or name[len(PREFIX):]
            elif part is None and name.startswith("Optimizer.step#"):
                part = OPTIMIZER_ANNOTATIONS.get(name.split("#", 1)[1].split(".")[0], "optimizer")
            elif part is None and name.startswith("Optimizer.zero_grad#"):
                part = "grad_reduce"
            elif self.trace.is_backward(cur):
                backward = True
                if part is None:
                    if "AccumulateGrad" in name:
                        part = "grad_reduce"
                    else:
                        fwd = self.trace.forward_of(cur)
                        fwd_part, _, fwd_mtp, _ = self.of(fwd)
                        return fwd_part, True, fwd_mtp or mtp, gemm
            cur = cur["_parent"]
        return part or OTHER, backward, mtp, gemm


# ----------------------------------------------------------------------------------- work items
def _items_gpu(trace: Trace, step: dict) -> List[Tuple[float, float, Optional[dict], str]]:
    """(start, duration, launching host event, kernel name) of the kernels that ran inside `step`."""
    out = []
    for k in trace.kernels:
        if step["ts"] <= k["ts"] <= end(step):
            out.append((k["ts"], k.get("dur", 0.0), trace.launcher_of(k), k["name"]))
    return out


def _items_cpu(trace: Trace, step: dict) -> List[Tuple[float, float, Optional[dict], str]]:
    """(start, own time, operator, name) of the operators nested in `step` on its thread."""
    evs = trace.host[(step["pid"], step["tid"])]
    inside = [e for e in evs if e["ts"] >= step["ts"] and end(e) <= end(step) + 1e-3 and e is not step]
    child_time: Dict[int, float] = defaultdict(float)
    for e in inside:
        if e["_parent"] is not None:
            child_time[id(e["_parent"])] += e.get("dur", 0.0)
    return [(e["ts"], max(e.get("dur", 0.0) - child_time[id(e)], 0.0), e, e["name"])
            for e in inside if e.get("cat") == "cpu_op"]


def _union(intervals: List[Tuple[float, float]]) -> float:
    return sum(b - a for a, b in merge_intervals(intervals))


# ----------------------------------------------------------------------------------- summary
def breakdown(trace: Trace, steps: Optional[int] = None) -> dict:
    """Per-step averages (ms) per part; see the module docstring. Uses the last `steps` profiled steps."""
    all_steps = trace.steps()
    if not all_steps:
        raise ValueError("the trace has no ProfilerStep#<n> range: was it written by the trainer's profile window?")
    chosen = all_steps[-steps:] if steps else all_steps
    device = "gpu" if trace.kernels else "cpu"
    attribution = Attribution(trace)
    rows: Dict[str, Dict[str, float]] = defaultdict(lambda: defaultdict(float))
    other_names: Dict[str, float] = defaultdict(float)
    wall = busy = overlap = flops_total = 0.0
    for step in chosen:
        items = _items_gpu(trace, step) if device == "gpu" else _items_cpu(trace, step)
        step_wall = step["dur"]
        intervals = [(max(s, step["ts"]), min(s + d, end(step))) for s, d, _, _ in items]
        step_busy = _union(intervals) if device == "gpu" else sum(d for _, d, _, _ in items)
        wall += step_wall
        busy += step_busy
        overlap += sum(b - a for a, b in intervals) - step_busy if device == "gpu" else 0.0
        for _, dur, host, name in items:
            part, backward, mtp, gemm = attribution.of(host)
            row = rows[part]
            row["bwd" if backward else "fwd"] += dur
            if mtp:
                row["mtp"] += dur
            if gemm is not None:
                row["gemm"] += dur
            if part == OTHER:
                other_names[name] += dur
        for evs in trace.host.values():  # FLOPs of the leaf GEMM operators that ran in the step
            for e in evs:
                if e.get("_leaf_gemm") and step["ts"] <= e["ts"] <= end(step):
                    flops = trace.leaf_gemm_flops(e) or 0
                    rows[attribution.of(e)[0]]["flops"] += flops
                    flops_total += flops
    n = len(chosen)
    scale = 1e-3 / n  # us summed over steps -> ms per step
    table = {part: {k: v * scale if k != "flops" else v / n for k, v in row.items()} for part, row in rows.items()}
    return {
        "device": device, "steps": [s["name"] for s in chosen],
        "wall_ms": wall * scale, "busy_ms": busy * scale, "overlap_ms": overlap * scale,
        "gaps_ms": (wall - busy) * scale, "gemm_flops": flops_total / n, "parts": table,
        "other_top": sorted(((k, v * scale) for k, v in other_names.items()), key=lambda kv: -kv[1])[:10],
    }


def kernel_rows(trace: Trace, steps: Optional[int] = None, depth: int = 4) -> List[dict]:
    """GPU ms per step by (part, direction, kernel name, launching operator chain), largest first: where each
    kernel of a part comes from. The chain names the operator that launched the kernel and up to depth - 1 of its
    enclosing host ranges, innermost first."""
    chosen = trace.steps()[-steps:] if steps else trace.steps()
    attribution = Attribution(trace)
    ms: Dict[tuple, float] = defaultdict(float)
    calls: Dict[tuple, int] = defaultdict(int)
    for step in chosen:
        for _, dur, host, name in _items_gpu(trace, step):
            part, backward, _, _ = attribution.of(host)
            chain, cur = [], host
            while cur is not None and len(chain) < depth:
                chain.append(cur["name"])
                cur = cur["_parent"]
            key = (part, "bwd" if backward else "fwd", name, " < ".join(chain))
            ms[key] += dur
            calls[key] += 1
    n = max(len(chosen), 1)
    rows = [{"part": k[0], "direction": k[1], "kernel": k[2], "launched_by": k[3], "ms": v * 1e-3 / n,
             "calls": calls[k] / n} for k, v in ms.items()]
    return sorted(rows, key=lambda r: -r["ms"])


# CUDA runtime / driver calls that return only when the device has caught up: while the host sits in one it
# queues no kernels, so the GPU idles once the queue drains (`.item()`, `.cpu()`, `torch.cuda.synchronize()`,
# a data-sized output such as `nonzero`).
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpyDtoH_v2")


def host_waits(trace: Trace, steps: Optional[int] = None, depth: int = 4) -> List[dict]:
    """Host ms per step in synchronizing CUDA calls (SYNC_CALLS), by call and the host ranges around it
    (innermost first), largest first: what keeps the host from running ahead of the GPU."""
    chosen = trace.steps()[-steps:] if steps else trace.steps()
    ms: Dict[tuple, float] = defaultdict(float)
    calls: Dict[tuple, int] = defaultdict(int)
    for step in chosen:
        for evs in trace.host.values():
            for e in evs:
                if e["name"] not in SYNC_CALLS or not step["ts"] <= e["ts"] <= end(step):
                    continue
                chain, cur = [], e["_parent"]
                while cur is not None and len(chain) < depth:
                    chain.append(cur["name"])
                    cur = cur["_parent"]
                key = (e["name"], " < ".join(chain))
                ms[key] += e.get("dur", 0.0)
                calls[key] += 1
    n = max(len(chosen), 1)
    rows = [{"call": k[0], "inside": k[1], "ms": v * 1e-3 / n, "calls": calls[k] / n} for k, v in ms.items()]
    return sorted(rows, key=lambda r: -r["ms"])


def format_waits(rows: List[dict], top: int) -> str:
    """The `top` largest `host_waits` as a Markdown table (or one line when there are none)."""
    total, count = sum(r["ms"] for r in rows), sum(r["calls"] for r in rows)
    lines = ["", f"Host waits on the device (synchronizing CUDA calls): {count:g} per step, {total:.2f} ms per step. "
                 "While the host waits it queues nothing, so each one drains the GPU's queue.", ""]
    if rows:
        lines += ["| ms/step | calls/step | call | inside (innermost first) |", "|---:|---:|---|---|"]
        lines += [f"| {r['ms']:.2f} | {r['calls']:g} | `{r['call']}` | {r['inside'][:160]} |" for r in rows[:top]]
    return "\n".join(lines) + "\n"


def format_kernels(rows: List[dict], top: int) -> str:
    """The `top` largest `kernel_rows` as a Markdown table."""
    lines = ["", f"Largest kernels by part and launching operator (ms per step, top {top}):", "",
             "| ms/step | calls/step | part | fwd/bwd | kernel | launched by (innermost first) |",
             "|---:|---:|---|---|---|---|"]
    for r in rows[:top]:
        lines.append(f"| {r['ms']:.2f} | {r['calls']:g} | {r['part']} | {r['direction']} | `{r['kernel'][:90]}` | "
                     f"{r['launched_by'][:160]} |")
    return "\n".join(lines) + "\n"


def _tflops(flops: float, ms: float) -> str:
    if not flops or ms <= 0:
        return ""
    tflops = flops / (ms * 1e-3) / 1e12
    return f"{tflops:.1f}" if tflops >= 10 else f"{tflops:.3g}"


def format_table(summary: dict) -> str:
    """The Markdown report of `breakdown()`."""
    wall = summary["wall_ms"]
    unit = "GPU kernel time" if summary["device"] == "gpu" else "CPU operator self time (no GPU kernels in the trace)"
    lines = [
        f"Step breakdown over {', '.join(summary['steps'])}: {wall:.2f} ms per step (wall), {unit}.",
        "",
        "fwd / bwd split the model's parts (activation recompute counts as bwd); **ms/step is forward + "
        "backward combined**. TFLOP/s = the part's GEMM FLOPs / its GEMM kernels' time.",
        "",
        "| part | fwd ms | bwd ms | ms/step (fwd+bwd) | share | GEMM ms | GEMM TFLOP/s | in MTP depths ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    parts = summary["parts"]
    total_share = 0.0

    def add(label: str, ms: float, fwd: str = "", bwd: str = "", gemm_ms: float = 0.0, flops: float = 0.0,
            mtp: str = "") -> None:
        nonlocal total_share
        share = ms / wall if wall else 0.0
        total_share += share
        lines.append(f"| {label} | {fwd} | {bwd} | {ms:.2f} | {share:.1%} | "
                     f"{gemm_ms:.2f} | {_tflops(flops, gemm_ms)} | {mtp} |" if gemm_ms else
                     f"| {label} | {fwd} | {bwd} | {ms:.2f} | {share:.1%} |  |  | {mtp} |")

    for part, label in [*PARTS.items(), (OTHER, "other kernels (names below)")]:
        row = parts.get(part)
        if not row:
            continue
        fwd, bwd = row.get("fwd", 0.0), row.get("bwd", 0.0)
        split = part in MODEL_PARTS or part == OTHER
        add(label, fwd + bwd, f"{fwd:.2f}" if split else "", f"{bwd:.2f}" if split else "", row.get("gemm", 0.0),
            row.get("flops", 0.0), f"{row['mtp']:.2f}" if row.get("mtp") else "")
    if summary["overlap_ms"] > 0:
        add("stream overlap (kernels running concurrently, counted once)", -summary["overlap_ms"])
    add("host-side gaps (wall - device busy)", summary["gaps_ms"])
    lines.append(f"| **step (wall)** |  |  | **{wall:.2f}** | **{total_share:.1%}** |  |  |  |")
    mtp_ms = sum(r.get("mtp", 0.0) for r in parts.values())
    gemm_ms = sum(r.get("gemm", 0.0) for r in parts.values())
    lines += ["", "*DSA layers up-project keys/values inside core attention (its row); the output row holds the "
              "main head and every MTP depth's head; the MTP column covers the MTP layers themselves.",
              "", f"MTP depths (all parts inside them): {mtp_ms:.2f} ms per step ({mtp_ms / wall:.1%})." if wall else "",
              f"All GEMMs: {summary['gemm_flops'] / 1e12:.3f} TFLOP per step in {gemm_ms:.2f} ms: "
              f"{_tflops(summary['gemm_flops'], gemm_ms) or '-'} TFLOP/s."]
    if summary["other_top"]:
        lines += ["", "Top kernels in \"other\" (ms per step):", ""]
        lines += [f"- `{name[:120]}`: {ms:.3f}" for name, ms in summary["other_top"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="Chrome trace JSON written by the trainer's profile window")
    parser.add_argument("--steps", type=int, default=None, help="average over the last N profiled steps (default all)")
    parser.add_argument("--out", help="also write the Markdown table here")
    parser.add_argument("--json", help="also write the numbers as JSON here")
    parser.add_argument("--kernels", type=int, default=0, metavar="N",
                        help="also list the N largest kernels by part and launching operator (GPU traces)")
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.kernels < 0:
        parser.error(f"--kernels must be >= 0, got {args.kernels}")
    with open(args.trace, encoding="utf-8") as f:
        trace = Trace(json.load(f))
    summary = breakdown(trace, args.steps)
    table = format_table(summary)
    if args.kernels:
        rows = kernel_rows(trace, args.steps)
        summary["kernels"] = rows[:args.kernels]
        table += format_kernels(rows, args.kernels)
    if summary["device"] == "gpu":
        waits = host_waits(trace, args.steps)
        summary["host_waits"] = waits[:12]
        table += format_waits(waits, 12)
        gaps = device_idle.idle(trace, args.steps)
        summary["device_idle"] = {k: v[:12] if isinstance(v, list) else v for k, v in gaps.items()}
        table += device_idle.format_idle(gaps, 12)
    write_report(table, summary, args.out, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
