"""Reading a torch.profiler Chrome trace: operator nesting, kernel launches, forward-backward links, GEMM FLOPs.

The trace (`profiler.export_chrome_trace`, Kineto's format) holds, per host thread, complete events
(`"ph": "X"`) for operators (`cat` "cpu_op"), `record_function` ranges ("user_annotation") and CUDA
runtime calls ("cuda_runtime" / "cuda_driver"), and per GPU stream the kernels ("kernel",
"gpu_memcpy", "gpu_memset"). The links used here:

- nesting: on one thread an event encloses the events that start and end inside it, so the
  operators around a point in time are a stack;
- kernel -> launch: a kernel's `args.correlation` equals that of the runtime call that launched it
  (`cudaLaunchKernel`, ...); the same pair is also drawn as an "ac2g" flow (`"ph": "s"` at the call,
  `"ph": "f"` at the kernel, `id` = correlation), used when a call carries no correlation;
- backward -> forward: an autograd node's operator (`MmBackward0`, a custom Function's
  `...Backward`) carries the `Sequence number` of the forward operator that created it, and torch
  draws a "fwdbwd" flow from that forward operator (`"s"`) to the backward one (`"f"`). Forward
  operators have `Fwd thread id` 0, backward ones the id of the forward thread. Without the flow,
  the last forward operator with the same sequence number before the backward one is taken (the
  counter moves on when an autograd node is created, so it is the operator that created the node).

GEMM FLOPs from an operator's recorded `Input Dims`: 2 m n k per product (m x k times k x n), times
the batch for bmm; for `_grouped_mm` the groups' rows are summed: a [M, K] x b [G, K, N] is 2 M K N.
"""

from __future__ import annotations

import bisect
import json
import math
from pathlib import Path
from typing import Dict, List, Optional, Tuple

HOST_CATS = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function")
RUNTIME_CATS = ("cuda_runtime", "cuda_driver")
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
EPS_US = 1e-3  # timestamps are microseconds with 3 decimals
EVALUATE = "autograd::engine::evaluate_function: "


# ----------------------------------------------------------------------------------- GEMM FLOPs
def _prod(xs) -> int:
    return math.prod(int(x) for x in xs) if xs else 1


def gemm_flops(name: str, dims: List[List[int]]) -> Optional[int]:
    """FLOPs of one GEMM operator from its input shapes, or None when `name` is not a GEMM."""
    try:
        if name in ("aten::mm", "aten::_scaled_mm"):
            (m, k), (_, n) = dims[0], dims[1]
            return 2 * m * n * k
        if name in ("aten::addmm", "aten::_addmm_activation"):
            (m, k), (_, n) = dims[1], dims[2]
            return 2 * m * n * k
        if name == "aten::bmm":
            (b, m, k), (_, _, n) = dims[0], dims[1]
            return 2 * b * m * n * k
        if name == "aten::baddbmm":
            (b, m, k), (_, _, n) = dims[1], dims[2]
            return 2 * b * m * n * k
        if name == "aten::_grouped_mm":
            a, b = dims[0], dims[1]
            m, k, n = a[-2], a[-1], b[-1]
            groups = a[0] if len(a) == 3 and len(b) == 3 else 1  # ragged (2d) operands sum their groups
            return 2 * groups * m * n * k
        if name == "aten::linear":
            x, w = dims[0], dims[1]
            return 2 * _prod(x[:-1]) * x[-1] * w[0]
        if name == "aten::matmul":
            a, b = dims[0], dims[1]
            if len(a) == 1 or len(b) == 1:
                return 2 * _prod(a) * (b[-1] if len(b) > 1 else 1)
            batch = _prod(a[:-2]) if len(a) >= len(b) else _prod(b[:-2])
            return 2 * batch * a[-2] * a[-1] * b[-1]
    except (IndexError, TypeError, ValueError):
        return None
    return None


GEMM_OPS = ("aten::mm", "aten::_scaled_mm", "aten::addmm", "aten::_addmm_activation", "aten::bmm", "aten::baddbmm",
            "aten::_grouped_mm", "aten::linear", "aten::matmul")


# ----------------------------------------------------------------------------------- the trace
def end(e: dict) -> float:
    return e["ts"] + e.get("dur", 0.0)


def merge_intervals(intervals: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """The union of (start, end) intervals as sorted, disjoint intervals."""
    out: List[Tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


class Trace:
    """A loaded trace with the nesting of every host thread's events and the links described above."""

    def __init__(self, trace: dict):
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        self.host: Dict[Tuple, List[dict]] = {}
        self.kernels: List[dict] = []
        self.runtime_by_corr: Dict[int, dict] = {}
        flows: Dict[str, Dict[int, Dict[str, dict]]] = {"fwdbwd": {}, "ac2g": {}}
        for e in events:
            ph, cat = e.get("ph"), e.get("cat")
            if ph == "X" and cat in HOST_CATS:
                self.host.setdefault((e["pid"], e["tid"]), []).append(e)
                if cat in RUNTIME_CATS and "correlation" in e.get("args", {}):
                    self.runtime_by_corr[e["args"]["correlation"]] = e
            elif ph == "X" and cat in DEVICE_CATS:
                self.kernels.append(e)
            elif ph in ("s", "f") and cat in flows:
                flows[cat].setdefault(e["id"], {})[ph] = e
        self._starts: Dict[Tuple, List[float]] = {}
        for key, evs in self.host.items():
            evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0.0)))
            self._nest(evs)
            self._starts[key] = [e["ts"] for e in evs]
        self._ac2g = {i: f["s"] for i, f in flows["ac2g"].items() if "s" in f}
        self._bwd_to_fwd: Dict[int, dict] = {}
        for pair in flows["fwdbwd"].values():
            if "s" in pair and "f" in pair:
                fwd = self._at(pair["s"], prefer_sequence=True)
                bwd = self._at(pair["f"], prefer_sequence=True)
                if fwd is not None and bwd is not None:
                    self._bwd_to_fwd[id(bwd)] = fwd
        self._fwd_by_seq: Dict[int, List[dict]] = {}
        for evs in self.host.values():
            for e in evs:
                a = e.get("args", {})
                if a.get("Sequence number") is not None and not self.is_backward(e):
                    self._fwd_by_seq.setdefault(a["Sequence number"], []).append(e)
        self._mark_leaf_gemms()

    @staticmethod
    def _nest(evs: List[dict]) -> None:
        open_: List[dict] = []
        for e in evs:
            while open_ and not (e["ts"] >= open_[-1]["ts"] and end(e) <= end(open_[-1]) + EPS_US):
                open_.pop()
            e["_parent"] = open_[-1] if open_ else None
            open_.append(e)

    def _at(self, point: dict, prefer_sequence: bool) -> Optional[dict]:
        """The host event a flow point is bound to: one starting at its time on its thread."""
        key = (point["pid"], point["tid"])
        evs, starts = self.host.get(key), self._starts.get(key)
        if not evs:
            return None
        i = bisect.bisect_left(starts, point["ts"] - EPS_US)
        same = []
        while i < len(evs) and evs[i]["ts"] <= point["ts"] + EPS_US:
            same.append(evs[i])
            i += 1
        if prefer_sequence:
            with_seq = [e for e in same if e.get("args", {}).get("Sequence number") is not None
                        and not e["name"].startswith(EVALUATE)]
            same = with_seq or same
        return same[0] if same else None

    def enclosing(self, pid, tid, ts: float) -> Optional[dict]:
        """The innermost operator or range (not a runtime call) on (pid, tid) that contains time `ts`.

        Runtime calls are skipped, so a call whose clock edge pokes out of its operator still
        resolves to that operator."""
        key = (pid, tid)
        starts = self._starts.get(key)
        if not starts:
            return None
        evs = self.host[key]
        i = bisect.bisect_right(starts, ts + EPS_US) - 1
        while i >= 0 and evs[i].get("cat") in RUNTIME_CATS:
            i -= 1
        e = evs[i] if i >= 0 else None
        while e is not None and (end(e) + EPS_US < ts or e.get("cat") in RUNTIME_CATS):
            e = e["_parent"]
        return e

    def launcher_of(self, kernel: dict) -> Optional[dict]:
        """The host operator or range around the runtime call that launched a kernel: found by the
        kernel's correlation id, else by its "ac2g" flow; None when neither is in the trace."""
        corr = kernel.get("args", {}).get("correlation")
        call = self.runtime_by_corr.get(corr)
        if call is not None:
            return self.enclosing(call["pid"], call["tid"], call["ts"] + call.get("dur", 0.0) / 2)
        point = self._ac2g.get(corr)
        if point is not None:
            return self.enclosing(point["pid"], point["tid"], point["ts"])
        return None

    @staticmethod
    def is_backward(e: dict) -> bool:
        a = e.get("args", {})
        return e["name"].startswith(EVALUATE) or a.get("Fwd thread id") not in (None, 0)

    def forward_of(self, bwd: dict) -> Optional[dict]:
        """The forward operator whose autograd node a backward operator runs."""
        fwd = self._bwd_to_fwd.get(id(bwd))
        if fwd is not None:
            return fwd
        seq = bwd.get("args", {}).get("Sequence number")
        candidates = [e for e in self._fwd_by_seq.get(seq, ()) if e["ts"] < bwd["ts"]]
        return max(candidates, key=lambda e: e["ts"]) if candidates else None

    def _mark_leaf_gemms(self) -> None:
        """A GEMM operator counts its FLOPs unless a GEMM runs inside it (linear -> matmul -> mm)."""
        for evs in self.host.values():
            for e in evs:
                if e["name"] in GEMM_OPS:
                    e.setdefault("_leaf_gemm", True)
                    p = e["_parent"]
                    while p is not None:
                        if p["name"] in GEMM_OPS:
                            p["_leaf_gemm"] = False
                        p = p["_parent"]

    def leaf_gemm_flops(self, e: dict) -> Optional[int]:
        if not e.get("_leaf_gemm"):
            return None
        return gemm_flops(e["name"], e.get("args", {}).get("Input Dims") or [])

    def steps(self) -> List[dict]:
        """The `ProfilerStep#<n>` ranges, in order."""
        out = [e for evs in self.host.values() for e in evs
               if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")]
        return sorted(out, key=lambda e: e["ts"])


def write_report(text: str, summary: dict, out: Optional[str] = None, json_path: Optional[str] = None) -> None:
    """What the trace tools' command lines end with: the table printed, and written to `out` and the numbers as JSON
    to `json_path` where given."""
    print(text, end="")
    if out:
        Path(out).write_text(text, encoding="utf-8")
    if json_path:
        Path(json_path).write_text(json.dumps(summary, indent=2), encoding="utf-8")
