"""`pretrain.tools.device_idle` on a hand-built trace, against stretches worked out by hand."""

from __future__ import annotations

import json

import pytest

from pretrain.tools.device_idle import idle, main
from pretrain.tools.trace_events import Trace
from tests.trace_helpers import host_event, kernel_event, launch_event


def idle_trace():
    """One step [0, 1000] us: a forward range launching a GEMM, then an NCCL receive with no compute beside it,
    the optimizer's host sync, the optimizer's next kernel, and logging after the last kernel."""
    return {"traceEvents": [
        host_event("ProfilerStep#3", 0, 1000, cat="user_annotation"),
        host_event("part:forward", 0, 100, cat="user_annotation"), launch_event(10, 1), launch_event(40, 3),
        host_event("part:optimizer", 400, 500, cat="user_annotation"),
        host_event("aten::item", 400, 60), host_event("cudaStreamSynchronize", 401, 58, cat="cuda_runtime"),
        host_event("muon_step", 470, 200), launch_event(600, 2),
        host_event("log_metrics", 905, 90),
        kernel_event("gemm", 20, 280, 1),  # [20, 300]
        kernel_event("ncclDevKernel_SendRecv(args)", 250, 100, 3, stream=9),  # [250, 350]: alone over [300, 350]
        kernel_event("ns_gemm", 610, 190, 2),  # [610, 800]
    ]}


def test_idle_stretches_by_hand(tmp_path):
    out = idle(Trace(idle_trace()), min_us=5.0)
    # device idle: [0, 20] (forward, then the gemm), [350, 610] (optimizer, midpoint 480 in muon_step),
    # [800, 1000] (nothing after it); communication only: [300, 350]
    assert out["wall_ms"] == pytest.approx(1.0)
    assert out["idle_ms"] == pytest.approx((20 + 260 + 200) * 1e-3)
    assert out["comm_ms"] == pytest.approx(50 * 1e-3)
    rows = {(r["during"], r["then"]): r["ms"] for r in out["idle"]}
    assert rows[("part:forward < ProfilerStep#3", "part:forward < ProfilerStep#3")] == pytest.approx(0.020)
    assert rows[("muon_step < part:optimizer < ProfilerStep#3",
                 "muon_step < part:optimizer")] == pytest.approx(0.260)
    assert sum(r["ms"] for r in out["idle"] if r["then"] == "(nothing launched after it)") == pytest.approx(0.2)
    (comm,) = out["comm"]
    assert comm["during"] == "ncclDevKernel_SendRecv" and comm["then"] == "muon_step < part:optimizer"
    path = tmp_path / "t.json"
    path.write_text(json.dumps(idle_trace()))
    assert main([str(path), "--out", str(tmp_path / "idle.md")]) == 0
    assert "Communication only" in (tmp_path / "idle.md").read_text()


def test_short_stretches_are_counted_not_named():
    out = idle(Trace(idle_trace()), min_us=30.0)  # [0, 20] is below the threshold
    short = [r for r in out["idle"] if r["during"].startswith("(stretches shorter")]
    assert len(short) == 1 and short[0]["ms"] == pytest.approx(0.020)
