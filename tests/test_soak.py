"""benchmarks/soak.py on CPU with the tiny model and a few steps: it runs, records every step and every
save, and its verdict flags growth (checked on made-up samples against hand-computed windows)."""

import json
import sys

import pytest

from tests.distributed import run_command_line
from tests.test_training import ROOT


def test_soak_smoke_on_cpu(tmp_path):
    out = tmp_path / "soak.json"
    # `python benchmarks/soak.py ...` as its main() in a process forked like a rank (torch and megatron-core imported)
    argv = ["--config", "configs/models/glm5-tiny.yaml", "--steps", "4", "--interval", "2", "--warmup", "1",
            "--out", str(out), "optimizer.lr_warmup_iters=1", "data.seq_length=64"]
    proc = run_command_line("benchmarks.soak", argv, {"OMP_NUM_THREADS": "1"}, cwd=str(ROOT))
    assert proc["code"] in (0, 1), proc["stderr"][-3000:]
    result = json.loads(out.read_text())
    assert [s["step"] for s in result["samples"]] == [1, 2, 3, 4]
    assert [s["step"] for s in result["saves"]] == [2, 4] and all(s["blocked_s"] > 0 for s in result["saves"])
    for s in result["saves"]:  # blocked = waiting for the previous save + this save's own (`Trainer.save` splits it)
        assert s["waited_s"] >= 0 and s["staged_s"] > 0
        assert s["blocked_s"] == pytest.approx(s["waited_s"] + s["staged_s"])
    for part in ("waited_s", "staged_s", "blocked_s"):
        values = [s[part] for s in result["saves"]]
        assert result[f"save_{part}"] == {"median": pytest.approx(sum(values) / 2), "all": values}
    assert result["async_save"] is True and result["verdict"]["pass"] == (proc["code"] == 0)
    for s in result["samples"]:
        assert s["host_rss_gib"] > 0 and s["open_files"] > 0 and s["threads"] > 0 and s["tokens_per_sec"] > 0
    assert "soak PASS" in proc["stdout"] or "soak FAIL" in proc["stdout"]
    assert f"waiting for the previous save {result['save_waited_s']['median']} s" in proc["stdout"]


def test_verdict_windows_and_limits():
    sys.path.insert(0, str(ROOT))
    from benchmarks.soak import verdict

    def samples(rss_last, threads_last, speed_last):
        rows = []
        for step in range(1, 41):  # warm-up 20: windows of 2 steps, 21-22 and 39-40
            late = step >= 39
            rows.append({"step": step, "gpu_allocated_gib": 1.0, "gpu_reserved_gib": 2.0,
                         "host_rss_gib": rss_last if late else 10.0, "open_files": 30,
                         "threads": threads_last if late else 12, "tokens_per_sec": speed_last if late else 100.0})
        return rows

    flat = verdict(samples(10.05, 12, 97.0), 20, 0.01, 0.05)
    assert flat["pass"] and flat["first_window"] == [21, 22] and flat["last_window"] == [39, 40]
    grown = verdict(samples(10.2, 12, 100.0), 20, 0.01, 0.05)
    assert not grown["pass"] and "host_rss_gib grew +2.00%" in grown["why"]
    assert "threads grew" in verdict(samples(10.0, 13, 100.0), 20, 0.01, 0.05)["why"]
    assert "tokens/s fell -10.00%" in verdict(samples(10.0, 12, 90.0), 20, 0.01, 0.05)["why"]
