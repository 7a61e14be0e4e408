"""Where the GPU waits: the idle stretches of a profiler window, named by the host code that ran during them.

    python -m pretrain.tools.device_idle runs/x/profile/trace_rank0_steps7-8.json [--steps 2] [--top 15]

`pretrain.tools.step_breakdown` gives the step's "host-side gaps" (wall time minus device-busy time) as one
number; this splits it, and the time the GPU only waited for a peer, by cause. Inside the chosen
`ProfilerStep#<n>` ranges of a Chrome trace (`pretrain.tools.trace_events`):

- **device idle**: no kernel, copy or memset on any stream. Each stretch is named by what the host
  thread that launches the next kernel was doing at the stretch's midpoint (the innermost operators and
  ranges around that time, innermost first), and by the operator that launched the kernel that ended it.
  A stretch after a synchronizing call is the host's time between the sync's return and its next launch:
  Python, the data loader, logging. So the table says which host code the GPU waited for.
- **communication only**: NCCL kernels run and nothing else does (the GPU spins on a receive or a
  collective while its peer is not ready, or a transfer is not hidden), named by the NCCL kernel and by
  the operator that launched the next non-NCCL kernel (what the rank could not start before it).

Stretches shorter than `--min-us` (default 20 microseconds: a kernel launch) are counted, not named.
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections import defaultdict
from typing import Dict, List, Optional, Tuple

from pretrain.tools.trace_events import Trace, end, merge_intervals, write_report

DEPTH = 4  # host operators/ranges per chain, innermost first
SHORT = "(stretches shorter than the threshold)"


def _chain(e: Optional[dict], depth: int = DEPTH) -> str:
    names = []
    while e is not None and len(names) < depth:
        names.append(e["name"])
        e = e["_parent"]
    return " < ".join(names) if names else "(no host operator)"


def _is_nccl(k: dict) -> bool:
    return "nccl" in k.get("name", "").lower()


def _complement(busy: List[Tuple[float, float]], lo: float, hi: float) -> List[Tuple[float, float]]:
    """The stretches of [lo, hi] that no interval of the merged `busy` covers."""
    out, t = [], lo
    for a, b in busy:
        if b <= lo or a >= hi:
            continue
        if a > t:
            out.append((t, a))
        t = max(t, b)
    if t < hi:
        out.append((t, hi))
    return out


def _subtract(spans: List[Tuple[float, float]], busy: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """The parts of the merged `spans` that the merged `busy` does not cover."""
    out = []
    for a, b in spans:
        out += _complement(busy, a, b)
    return out


class _Next:
    """The first kernel (of a filtered, time-sorted list) starting at or after a time."""

    def __init__(self, kernels: List[dict]):
        self.kernels = kernels
        self.starts = [k["ts"] for k in kernels]

    def at(self, t: float) -> Optional[dict]:
        i = bisect.bisect_left(self.starts, t - 1e-3)
        return self.kernels[i] if i < len(self.kernels) else None


def idle(trace: Trace, steps: Optional[int] = None, min_us: float = 20.0) -> dict:
    """Device-idle and communication-only stretches of the last `steps` profiled steps, aggregated per step."""
    chosen = trace.steps()[-steps:] if steps else trace.steps()
    kernels = sorted(trace.kernels, key=lambda k: k["ts"])
    compute = [k for k in kernels if not _is_nccl(k)]
    nccl = [k for k in kernels if _is_nccl(k)]
    next_any, next_compute = _Next(kernels), _Next(compute)
    rows: Dict[str, Dict[Tuple[str, str], List[float]]] = {"idle": defaultdict(lambda: [0.0, 0]),
                                                           "comm": defaultdict(lambda: [0.0, 0])}
    totals = {"idle": 0.0, "comm": 0.0, "wall": 0.0}
    all_busy = merge_intervals([(k["ts"], end(k)) for k in kernels])
    compute_busy = merge_intervals([(k["ts"], end(k)) for k in compute])
    nccl_busy = merge_intervals([(k["ts"], end(k)) for k in nccl])
    for step in chosen:
        lo, hi = step["ts"], end(step)
        totals["wall"] += hi - lo
        for kind, stretches in (("idle", _complement(all_busy, lo, hi)),
                                ("comm", _subtract(merge_intervals([(max(a, lo), min(b, hi)) for a, b in nccl_busy
                                                           if b > lo and a < hi]), compute_busy))):
            for a, b in stretches:
                totals[kind] += b - a
                key = (SHORT, "")
                if b - a >= min_us:
                    key = _name(trace, kind, a, b, next_any if kind == "idle" else next_compute, nccl)
                rows[kind][key][0] += b - a
                rows[kind][key][1] += 1
    n = max(len(chosen), 1)
    out = {"steps": [s["name"] for s in chosen], "wall_ms": totals["wall"] / n * 1e-3}
    for kind in ("idle", "comm"):
        out[f"{kind}_ms"] = totals[kind] / n * 1e-3
        out[kind] = sorted(({"during": k[0], "then": k[1], "ms": v[0] / n * 1e-3, "count": v[1] / n}
                            for k, v in rows[kind].items()), key=lambda r: -r["ms"])
    return out


def _name(trace: Trace, kind: str, a: float, b: float, following: _Next, nccl: List[dict]) -> Tuple[str, str]:
    """(what ran during the stretch, the launcher of the kernel that ended it)."""
    nxt = following.at(b)
    launcher = trace.launcher_of(nxt) if nxt is not None else None
    then = _chain(launcher, 2) if launcher is not None else "(nothing launched after it)"
    if kind == "comm":  # the NCCL kernel(s) spinning through the stretch
        names = sorted({k["name"].split("(")[0] for k in nccl if k["ts"] < b and end(k) > a})
        return ", ".join(names)[:120], then
    call = trace.runtime_by_corr.get((nxt or {}).get("args", {}).get("correlation"))
    if call is None:  # the trace lacks the runtime call that launched it: no thread to read
        return "(launching thread unknown)", then
    return _chain(trace.enclosing(call["pid"], call["tid"], (a + b) / 2)), then


def format_idle(summary: dict, top: int = 12) -> str:
    """The two tables of `idle()` as Markdown."""
    wall = summary["wall_ms"] or 1.0
    lines = ["", f"Device idle (no kernel on any stream): {summary['idle_ms']:.2f} ms per step "
                 f"({summary['idle_ms'] / wall:.1%}), by what the launching host thread was doing "
                 "(innermost first) and what it launched next:", ""]
    lines += ["| ms/step | stretches/step | host was in | then launched |", "|---:|---:|---|---|"]
    lines += [f"| {r['ms']:.2f} | {r['count']:g} | {r['during'][:150]} | {r['then'][:90]} |"
              for r in summary["idle"][:top]]
    lines += ["", f"Communication only (NCCL kernels and no other kernel): {summary['comm_ms']:.2f} ms per step "
                  f"({summary['comm_ms'] / wall:.1%}), by NCCL kernel and the compute that followed:", ""]
    lines += ["| ms/step | stretches/step | NCCL kernels | next compute launched by |", "|---:|---:|---|---|"]
    lines += [f"| {r['ms']:.2f} | {r['count']:g} | `{r['during']}` | {r['then'][:120]} |"
              for r in summary["comm"][:top]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="Chrome trace JSON written by the trainer's profile window")
    parser.add_argument("--steps", type=int, default=None, help="the last N profiled steps (default all)")
    parser.add_argument("--top", type=int, default=12, help="rows per table")
    parser.add_argument("--min-us", type=float, default=20.0, help="stretches shorter than this are not named")
    parser.add_argument("--out", help="also write the Markdown here")
    parser.add_argument("--json", help="also write the numbers as JSON here")
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    with open(args.trace, encoding="utf-8") as f:
        trace = Trace(json.load(f))
    summary = idle(trace, args.steps, args.min_us)
    write_report(format_idle(summary, args.top), summary, args.out, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
