"""The step breakdown: GEMM FLOPs by hand, kernel attribution on a synthetic GPU-format trace, and a
real profiled CPU run of the tiny model whose traced GEMM FLOPs match FlopCounterMode's count."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from pretrain.tools.step_breakdown import breakdown, format_kernels, format_table, kernel_rows, main
from pretrain.tools.trace_events import Trace, gemm_flops
from tests.distributed import run_ranks
from tests.trace_helpers import host_event, kernel_event, launch_event

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------- FLOPs
@pytest.mark.parametrize("name, dims, expected", [
    ("aten::mm", [[64, 32], [32, 16]], 2 * 64 * 32 * 16),
    ("aten::addmm", [[16], [64, 32], [32, 16], [], []], 2 * 64 * 32 * 16),
    ("aten::bmm", [[3, 64, 32], [3, 32, 16]], 3 * 2 * 64 * 32 * 16),
    ("aten::baddbmm", [[3, 64, 16], [3, 64, 32], [3, 32, 16], [], []], 3 * 2 * 64 * 32 * 16),
    # 40 routed rows over 4 experts, [40, 32] x [4, 32, 16]: each row meets one expert's matrix
    ("aten::_grouped_mm", [[40, 32], [4, 32, 16], [4]], 2 * 40 * 32 * 16),
    # the weight gradient: [32, 40] x [40, 16] split along the 40 rows -> [4, 32, 16]
    ("aten::_grouped_mm", [[32, 40], [40, 16], [4]], 2 * 32 * 40 * 16),
    ("aten::_grouped_mm", [[4, 10, 32], [4, 32, 16]], 4 * 2 * 10 * 32 * 16),
    ("aten::linear", [[2, 5, 32], [16, 32]], 2 * 10 * 32 * 16),
    ("aten::matmul", [[2, 5, 32], [32, 16]], 2 * 10 * 32 * 16),
    ("aten::add", [[2, 5], [2, 5]], None),
])
def test_gemm_flops_by_hand(name, dims, expected):
    assert gemm_flops(name, dims) == expected


# ----------------------------------------------------------------------------------- synthetic GPU trace
def synthetic_trace():
    """Kineto's layout: host ops on threads 1 (forward) and 2 (autograd), kernels on streams 7 and 8."""
    mm = {"Input Dims": [[64, 32], [32, 16]], "Sequence number": 7, "Fwd thread id": 0}
    ev = [
        host_event("ProfilerStep#5", 0, 1000, cat="user_annotation"),
        host_event("part:mla_proj", 10, 90, cat="user_annotation"),
        host_event("aten::linear", 12, 80, **{"Input Dims": [[64, 32], [16, 32]]}),
        host_event("aten::mm", 15, 60, **mm), launch_event(74, 101),  # the call's clock edge pokes out of its mm
        host_event("part:experts", 110, 90, cat="user_annotation"),
        host_event("aten::_grouped_mm", 115, 60, **{"Input Dims": [[40, 32], [4, 32, 16], [4]]}),
        launch_event(120, 102),
        host_event("part:router", 205, 40, cat="user_annotation"),
        host_event("aten::mul", 210, 20, **{"Sequence number": 9, "Fwd thread id": 0}), launch_event(212, 103),
        host_event("part:mtp", 250, 60, cat="user_annotation"),
        host_event("part:output", 255, 50, cat="user_annotation"),
        host_event("aten::add", 260, 20), launch_event(262, 104),
        # backward on the autograd thread: MmBackward0 linked by a fwdbwd flow, launched via an ac2g flow only
        host_event("autograd::engine::evaluate_function: MmBackward0", 400, 100, tid=2,
                   **{"Sequence number": 7, "Fwd thread id": 1}),
        host_event("MmBackward0", 401, 98, tid=2, **{"Sequence number": 7, "Fwd thread id": 1}),
        host_event("aten::mm", 402, 50, tid=2, **{"Input Dims": [[64, 16], [16, 32]]}),
        launch_event(405, 105, tid=2, with_corr=False),
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 105, "pid": 1, "tid": 2, "ts": 405},
        {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": 105, "pid": 0, "tid": 7, "ts": 600, "bp": "e"},
        {"ph": "s", "cat": "fwdbwd", "name": "fwdbwd", "id": 1, "pid": 1, "tid": 1, "ts": 15},
        {"ph": "f", "cat": "fwdbwd", "name": "fwdbwd", "id": 1, "pid": 1, "tid": 2, "ts": 401, "bp": "e"},
        # MulBackward0 without a flow: found through its sequence number
        host_event("MulBackward0", 510, 30, tid=2, **{"Sequence number": 9, "Fwd thread id": 1}),
        launch_event(515, 106, tid=2),
        host_event("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 545, 20, tid=2),
        launch_event(550, 107, tid=2),
        host_event("Optimizer.step#AdamW.step", 700, 100, cat="user_annotation"),
        launch_event(710, 108),
        launch_event(820, 109),  # under no part: "other"
        host_event("aten::item", 880, 30),
        host_event("cudaStreamSynchronize", 882, 25, cat="cuda_runtime"),  # a host wait
        # kernels (ms): stream 7 in sequence, one on stream 8 overlapping
        kernel_event("sm90_gemm_fwd", 100, 40, 101), kernel_event("grouped_gemm", 140, 60, 102),
        kernel_event("mul_kernel", 200, 10, 103), kernel_event("add_kernel", 300, 10, 104),
        kernel_event("sm90_gemm_bwd", 600, 80, 105), kernel_event("mul_bwd", 680, 10, 106),
        kernel_event("accumulate", 690, 10, 107), kernel_event("adam_kernel", 800, 50, 108),
        kernel_event("mystery_kernel", 850, 30, 109), kernel_event("overlapping_comm", 610, 40, 110, stream=8),
        kernel_event("before_the_step", -50, 10, 111),
    ]
    return {"traceEvents": ev}


def test_synthetic_gpu_trace_is_attributed_by_hand():
    s = breakdown(Trace(synthetic_trace()))
    us = 1e-3
    p = s["parts"]
    assert s["device"] == "gpu" and s["wall_ms"] == pytest.approx(1000 * us)
    assert p["mla_proj"]["fwd"] == pytest.approx(40 * us) and p["mla_proj"]["bwd"] == pytest.approx(80 * us)
    assert p["mla_proj"]["gemm"] == pytest.approx(120 * us)
    assert p["mla_proj"]["flops"] == 2 * (2 * 64 * 32 * 16)  # the linear counts once, through its mm
    assert p["experts"]["fwd"] == pytest.approx(60 * us) and p["experts"]["flops"] == 2 * 40 * 32 * 16
    assert p["router"]["fwd"] == pytest.approx(10 * us) and p["router"]["bwd"] == pytest.approx(10 * us)
    assert p["output"]["fwd"] == pytest.approx(10 * us) and p["output"]["mtp"] == pytest.approx(10 * us)
    assert "mtp" not in p  # the innermost part wins; the MTP range is a column
    assert p["grad_reduce"]["bwd"] == pytest.approx(10 * us)
    assert p["adamw"]["fwd"] == pytest.approx(50 * us)
    assert p["other"]["fwd"] == pytest.approx(70 * us)  # the unlaunched comm kernel and the mystery one
    assert [n for n, _ in s["other_top"]] == ["overlapping_comm", "mystery_kernel"]
    busy = 40 + 60 + 10 + 10 + 80 + 10 + 10 + 50 + 30  # the comm kernel lies under the backward GEMM
    assert s["busy_ms"] == pytest.approx(busy * us)
    assert s["overlap_ms"] == pytest.approx(40 * us)
    assert s["gaps_ms"] == pytest.approx((1000 - busy) * us)
    assert s["gemm_flops"] == 2 * (2 * 64 * 32 * 16) + 2 * 40 * 32 * 16
    table = format_table(s)
    assert "**100.0%**" in table and "forward + backward combined" in table and "mystery_kernel" in table


def test_kernels_by_launching_operator_by_hand(tmp_path):
    """`--kernels`: each kernel of the synthetic trace with its part, direction and the host chain that launched it,
    largest first, as read off the trace by hand."""
    rows = kernel_rows(Trace(synthetic_trace()))
    by_kernel = {r["kernel"]: r for r in rows}
    us = 1e-3
    assert [r["kernel"] for r in rows[:3]] == ["sm90_gemm_bwd", "grouped_gemm", "adam_kernel"]
    bwd = by_kernel["sm90_gemm_bwd"]
    assert (bwd["part"], bwd["direction"], bwd["ms"], bwd["calls"]) == ("mla_proj", "bwd", pytest.approx(80 * us), 1)
    assert bwd["launched_by"] == ("aten::mm < MmBackward0 < autograd::engine::evaluate_function: MmBackward0")
    fwd = by_kernel["sm90_gemm_fwd"]
    assert fwd["direction"] == "fwd"
    assert fwd["launched_by"] == "aten::mm < aten::linear < part:mla_proj < ProfilerStep#5"
    assert by_kernel["mystery_kernel"]["part"] == "other" and "before_the_step" not in by_kernel
    assert sum(r["ms"] for r in rows) == pytest.approx((40 + 60 + 10 + 10 + 80 + 10 + 10 + 50 + 30 + 40) * us)
    text = format_kernels(rows, 2)
    assert "`sm90_gemm_bwd`" in text and "`grouped_gemm`" in text and "adam_kernel" not in text
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps(synthetic_trace()))
    assert main([str(trace), "--kernels", "3", "--json", str(tmp_path / "b.json")]) == 0
    assert [r["kernel"] for r in json.loads((tmp_path / "b.json").read_text())["kernels"]] == [
        "sm90_gemm_bwd", "grouped_gemm", "adam_kernel"]


def _share_column(table: str):
    shares = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 8 and cells[4].endswith("%") and not cells[0].startswith("**"):
            shares[cells[0]] = (float(cells[3]), float(cells[4].rstrip("%")))
    return shares


# ----------------------------------------------------------------------------------- real CPU run
def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs):
    """Independent of the tool: 2 x (output elements) x (contracted length per output element)."""
    if len(a_shape) == 2 and len(b_shape) == 2:  # ragged K: out [G, M, N], each group sums its share of K
        return 2 * out_shape[-2] * out_shape[-1] * a_shape[-1]
    return 2 * math.prod(out_shape) * a_shape[-1]


def _profiled_run(rank, world_size, overrides):
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from pretrain.config import load_config
    from pretrain.training.loop import Trainer

    class CountingTrainer(Trainer):
        """Step 4 (after the profiled steps 2-3) runs under FlopCounterMode, without the profiler."""

        def train_step(self):
            if self.iteration != 3:
                return super().train_step()
            with FlopCounterMode(display=False, custom_mapping={torch.ops.aten._grouped_mm: _grouped_mm_flops}) as fc:
                values = super().train_step()
            self.flop_counts = {str(k): v for k, v in fc.get_flop_counts()["Global"].items()}
            return values

    from pretrain.optim import muon

    def hooks():
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in trainer.model[0].modules())

    originals = (muon.newton_schulz_lowp, muon.Muon._muon_updates, muon.Muon._adamw_update)
    trainer = CountingTrainer(load_config(str(ROOT / "configs/models/glm5-tiny.yaml"), overrides))
    before = hooks()
    trainer.train()
    # the window's ranges are gone once it closed: no hook, no patched method left behind
    assert hooks() == before
    assert (muon.newton_schulz_lowp, muon.Muon._muon_updates, muon.Muon._adamw_update) == originals
    unwrapped = trainer.model[0].module.module if hasattr(trainer.model[0].module, "module") else trainer.model[0].module
    assert "_head_loss" not in vars(unwrapped)
    return trainer.flop_counts


def test_profiled_tiny_run_breakdown(tmp_path):
    overrides = ["data.mock=true", "data.seq_length=64", "train.micro_batch_size=2", "train.global_batch_size=4",
                 "train.train_iters=4", "train.eval_interval=null", "optimizer.lr_warmup_iters=1",
                 f"logging.run_dir={tmp_path}", "logging.profile_step_start=2", "logging.profile_step_end=3"]
    counts = run_ranks(_profiled_run, 1, overrides, timeout=300)[0]
    trace = tmp_path / "profile" / "trace_rank0_steps2-3.json"
    out = tmp_path / "table.md"
    assert main([str(trace), "--out", str(out), "--json", str(tmp_path / "b.json")]) == 0
    summary = json.loads((tmp_path / "b.json").read_text())
    parts = summary["parts"]
    for part in ("core_attn", "experts", "router", "output", "adamw", "mla_proj", "dispatch", "embedding"):
        assert parts[part]["fwd"] + parts[part].get("bwd", 0.0) > 0, part
    for part in ("core_attn", "experts", "mla_proj", "output"):
        assert parts[part]["bwd"] > 0, part  # backward reaches its forward's part
    assert parts["experts"]["mtp"] > 0 and parts["mtp"]["fwd"] > 0  # the MTP layer's MoE and its own projection
    shares = _share_column(out.read_text())
    assert abs(sum(share for _, share in shares.values()) - 100.0) < 0.05 * len(shares)
    ms = sum(v for v, _ in shares.values())
    assert ms == pytest.approx(summary["wall_ms"], rel=1e-3, abs=0.01 * len(shares))
    # GEMM FLOPs of one traced step against FlopCounterMode on a whole later step (AdamW: no GEMMs)
    counted = sum(v for k, v in counts.items() if re.search(r"(^|\.)(mm|addmm|bmm|baddbmm|_grouped_mm)(\.|$)", k))
    assert counted > 0
    assert summary["gemm_flops"] == pytest.approx(counted, rel=0.01), (summary["gemm_flops"], counts)


def test_host_waits_are_the_synchronizing_calls():
    from pretrain.tools.step_breakdown import format_waits, host_waits

    rows = host_waits(Trace(synthetic_trace()))
    assert rows == [{"call": "cudaStreamSynchronize", "inside": "aten::item < ProfilerStep#5", "ms": 25e-3,
                     "calls": 1}]  # the kernel launches are not waits
    text = format_waits(rows, 5)
    assert "1 per step, 0.03 ms per step" in text and "| 0.03 | 1 | `cudaStreamSynchronize` | aten::item" in text

