"""Calibration tables of the layout planner's time model, one JSON file per GPU kind (`h100.json`, `h200.json`).

Each entry is {"value", "unit", "kind", "source", "derivation"}: `kind` is "measured" (read from a benchmark
result), "derived" (arithmetic on measured numbers, written out in "derivation") or "assumption" (not measured
on that GPU kind; the planner's stated fallback). `source` names the committed result file, the command that
produced it and its date. Tables (attention at each sequence and heads per rank, ...) are lists of points, read
by `Calibration.lookup`: the points of the nearest key in log space, linear in log(seq) between them, clamped
at the ends (a clamped read is reported as a note, so a prediction outside the measured range says so).
"""

from __future__ import annotations

import json
import math
import os
from typing import Dict, Iterable, List, Optional, Tuple

_DIR = os.path.dirname(os.path.abspath(__file__))


class Calibration:
    """One GPU kind's calibration table: scalar entries by name, tables by name and key."""

    def __init__(self, table: Dict, path: str = "") -> None:
        self.gpu_kind: str = table["gpu_kind"]
        self.device_name: str = table["device_name"]
        self.peak_bf16_flops: float = table["peak_bf16_flops"]
        self.entries: Dict[str, Dict] = table["entries"]
        self.path = path

    def __getitem__(self, name: str):
        if name not in self.entries:
            raise KeyError(f"calibration {self.gpu_kind}: no entry {name!r} in {self.path or 'the table'}")
        return self.entries[name]["value"]

    def kind(self, name: str) -> str:
        return self.entries[name]["kind"]

    def lookup(self, name: str, field: str, seq: Optional[float] = None, **key: float) -> Tuple[float, Optional[str]]:
        """(value, note) of table `name` at `seq` and the nearest `key` (e.g. heads=16); note says when clamped."""
        points: List[Dict] = self[name]
        for k, want in key.items():  # nearest available key value, in log space
            have = sorted({p[k] for p in points if p.get(k) is not None})
            if not have:
                continue
            best = min(have, key=lambda v: abs(math.log(v) - math.log(max(want, 1e-9))))
            points = [p for p in points if p.get(k) == best]
        if seq is None:
            return points[0][field], None
        by_seq: Dict[float, List[float]] = {}
        for p in points:
            by_seq.setdefault(p["seq"], []).append(p[field])
        seqs = sorted(by_seq)
        vals = [sum(by_seq[s]) / len(by_seq[s]) for s in seqs]  # two measurements of one point: their mean
        note = None
        if seq <= seqs[0] or seq >= seqs[-1]:
            edge = 0 if seq <= seqs[0] else -1
            if seq != seqs[edge]:
                note = f"{name} at seq {int(seq)} clamped to the measured {int(seqs[edge])}"
            return vals[edge], note
        i = next(i for i, s in enumerate(seqs) if s >= seq)
        a, b = seqs[i - 1], seqs[i]
        t = (math.log(seq) - math.log(a)) / (math.log(b) - math.log(a))
        return vals[i - 1] + t * (vals[i] - vals[i - 1]), None

    def assumptions(self) -> Iterable[str]:
        return (k for k, v in self.entries.items() if v["kind"] == "assumption")


def calibration_path(gpu_kind: str) -> str:
    return os.path.join(_DIR, f"{gpu_kind}.json")


def load_calibration(gpu_kind: str) -> Calibration:
    """The committed calibration of `gpu_kind` ("h100", "h200"); one-line error naming it when there is none."""
    path = calibration_path(gpu_kind)
    if not os.path.exists(path):
        have = sorted(f[:-5] for f in os.listdir(_DIR) if f.endswith(".json") and not f.startswith("checks"))
        raise ValueError(f"no layout calibration for GPU kind {gpu_kind!r} (have: {', '.join(have)}); measure one with "
                         f"the layout calibration benchmark (docs/layout.md)")
    with open(path) as f:
        return Calibration(json.load(f), path)
