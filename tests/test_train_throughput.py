"""The throughput benchmark's point runner on the tiny model: its row carries the trainer's own numbers."""

from __future__ import annotations

from pathlib import Path

from benchmarks.train_runs import read_metrics
from benchmarks.train_throughput import markdown, run_point

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs/models/glm5-tiny.yaml"


def test_point_reports_the_trainers_metrics_and_a_breakdown(tmp_path):
    run_dir = tmp_path / "run"
    point = run_point(TINY, "adam", seq=64, micro_batch_size=2, tokens_per_step=4 * 64, steps=2, warmup=1,
                      overrides=["model.mtp_num_layers=1"], profile_step=2, artifacts=tmp_path / "profiles",
                      timeout=300, run_dir=str(run_dir), keep_trace=True)
    assert "error" not in point, point
    rows = read_metrics(run_dir)
    # the profile window (steps 2-3) needs a steady step after it: 4 steps, only step 4 is steady
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and point["steady_steps"] == [4]
    steady = rows[3]
    assert point["global_batch_size"] == 4 and point["tokens_per_step"] == 256
    assert point["tokens_per_sec"] == steady["tokens_per_sec"] > 0
    assert point["tflops_per_gpu"] == steady["tflops_per_gpu"] > 0
    assert point["step_ms"] == 1e3 * steady["step_time_s"]
    assert 0 < point["optimizer_ms"] == 1e3 * steady["optimizer_time_s"] < point["step_ms"]
    assert point["mem_peak_gb"] == max(r["mem_peak_gb"] for r in rows)
    assert point["mfu"] is None  # no GPU peak to compare with on CPU
    table = Path(point["breakdown"]).read_text()
    assert (tmp_path / "profiles" / "adamw_seq64_mbs2_trace.json").exists()
    assert "ProfilerStep#2, ProfilerStep#3" in table and "expert GEMMs" in table
    report = markdown({"device": "CPU", "config": TINY.name, "tokens_per_step": 256, "points": [point]})
    assert f"| AdamW | 64 | 2 | 4 | {point['tokens_per_sec']:,.0f} |" in report


def test_batch_that_does_not_split_is_reported_without_a_run(tmp_path):
    point = run_point(TINY, "muon", seq=64, micro_batch_size=3, tokens_per_step=4 * 64, steps=2,
                      run_dir=str(tmp_path))
    assert "not a multiple of micro-batch size 3" in point["error"]
    assert not (tmp_path / "metrics.jsonl").exists()
