"""MetricsLogger (JSONL, console, resume truncation, TensorBoard, wandb), throughput and memory
helpers, the profiler window, and `python -m pretrain.tools.plot`."""

import json
import math
import sys

import pytest
import torch

from pretrain.config.errors import ConfigError
from pretrain.config.schema import GLM5Config, LoggingConfig
from pretrain.training.metrics import (
    REQUIRED_KEYS,
    MetricsLogger,
    StepTimer,
    format_line,
    grouped_key,
    memory_stats,
)
from pretrain.training.profiler import ProfilerWindow


def make_cfg(tmp_path, **logging):
    logging.setdefault("run_dir", str(tmp_path / "run"))
    return GLM5Config(logging=LoggingConfig(**logging))


def step_values(step, **extra):
    values = {"loss": 5.0 - 0.1 * step, "lr": 1e-3, "grad_norm": torch.tensor(0.5), "tokens_per_sec": 1000.0 + step,
              "tflops_per_gpu": 1.5, "mfu": None, "mem_peak_gb": 0.25, "mtp_loss_1": 5.1, "mtp_loss_2": 5.2,
              "aux_loss": 1e-4, "indexer_loss": 0.7}
    values.update(extra)
    return values


def read_lines(path):
    def reject(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    return [json.loads(line, parse_constant=reject) for line in path.read_text().splitlines()]


def test_jsonl_lines_console_and_skipped_steps(tmp_path, capsys):
    cfg = make_cfg(tmp_path, log_interval=2)
    with MetricsLogger(cfg, rank=0, world_size=1, resume_step=0) as logger:
        for step in range(1, 6):
            extra = {"loss": float("nan"), "grad_norm": float("inf"), "skipped": True} if step == 3 else {}
            logger.log_step(step, step_values(step, **extra))
    records = read_lines(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    for r in records:
        assert set(REQUIRED_KEYS) | {"step", "skipped", "mtp_loss_1", "mtp_loss_2", "aux_loss", "indexer_loss"} <= set(r)
    assert records[0]["grad_norm"] == 0.5 and records[0]["mfu"] is None
    assert records[2]["skipped"] is True and records[2]["loss"] is None and records[2]["grad_norm"] is None
    assert not records[1]["skipped"]
    lines = capsys.readouterr().out.strip().splitlines()
    # step 1 (first), 2 and 4 (interval), 3 (skipped)
    assert [line.split("|")[0].split()[1] for line in lines] == ["1", "2", "3", "4"]
    assert "mtp 5.100/5.200" in lines[0] and "aux" in lines[0] and "idx" in lines[0] and "tok/s" in lines[0]
    assert "SKIPPED" in lines[2]


def test_only_rank_zero_writes(tmp_path):
    cfg = make_cfg(tmp_path)
    logger = MetricsLogger(cfg, rank=1, world_size=2, resume_step=0)
    logger.log_step(1, step_values(1))
    logger.close()
    assert not (tmp_path / "run").exists()


def test_resume_drops_steps_after_the_checkpoint(tmp_path):
    cfg = make_cfg(tmp_path)
    path = tmp_path / "run" / "metrics.jsonl"
    with MetricsLogger(cfg, resume_step=0) as logger:
        for step in range(1, 11):
            logger.log_step(step, step_values(step))
    with open(path, "a") as f:
        f.write('{"step": 11, "loss"')  # a line torn by SIGKILL
    # the run died after step 10 (plus a torn line); its last checkpoint was step 6
    with MetricsLogger(cfg, resume_step=6) as logger:
        assert [r["step"] for r in read_lines(path)] == [1, 2, 3, 4, 5, 6]
        for step in range(7, 9):
            logger.log_step(step, step_values(step, loss=1.0))
    records = read_lines(path)
    assert [r["step"] for r in records] == list(range(1, 9))
    assert records[6]["loss"] == 1.0  # the resumed run's value, not the stale one
    stale = (tmp_path / "run" / "metrics.stale.jsonl").read_text().splitlines()
    assert len(stale) == 5 and stale[-1].startswith('{"step": 11')
    # a fresh start (resume_step=0) clears everything; None appends untouched
    MetricsLogger(cfg, resume_step=None).close()
    assert len(read_lines(path)) == 8
    MetricsLogger(cfg, resume_step=0).close()
    assert path.read_text() == ""


def test_grouped_keys_and_line_format():
    assert grouped_key("loss") == "loss/lm" and grouped_key("mtp_loss_2") == "loss/mtp_2"
    assert grouped_key("aux_loss") == "loss/aux" and grouped_key("valid_loss") == "loss/valid"
    assert grouped_key("tokens_per_sec") == "throughput/tokens_per_sec" and grouped_key("mfu") == "throughput/mfu"
    assert grouped_key("mem_peak_gb") == "memory/peak_gb" and grouped_key("lr") == "lr"
    line = format_line({"step": 7, "loss": 2.5, "lr": 3e-4, "grad_norm": 1.0, "tokens_per_sec": 12345.6,
                        "tflops_per_gpu": 400.0, "mfu": 0.404, "mem_peak_gb": 16.3})
    assert line.startswith("step      7 | loss 2.5000") and "tok/s 12,346" in line and "mfu 40.4%" in line


def test_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = make_cfg(tmp_path, tensorboard_dir=str(tmp_path / "tb"))
    with MetricsLogger(cfg, resume_step=0) as logger:
        for step in range(1, 4):
            logger.log_step(step, step_values(step))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss/lm", "loss/mtp_1", "loss/aux", "loss/indexer", "throughput/tokens_per_sec", "memory/peak_gb", "lr"} <= tags
    assert [e.step for e in events.Scalars("loss/lm")] == [1, 2, 3]


def test_missing_tensorboard_warns_once_and_continues(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import raises ImportError
    cfg = make_cfg(tmp_path, tensorboard_dir=str(tmp_path / "tb"))
    with pytest.warns(UserWarning, match="tensorboard") as caught:
        with MetricsLogger(cfg, resume_step=0) as logger:
            logger.log_step(1, step_values(1))
            logger.log_step(2, step_values(2))
    assert len([w for w in caught if "tensorboard" in str(w.message)]) == 1
    assert len(read_lines(tmp_path / "run" / "metrics.jsonl")) == 2


def test_wandb_disabled_is_never_imported(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    cfg = make_cfg(tmp_path, wandb_project="glm5", wandb_mode="disabled")
    with MetricsLogger(cfg, resume_step=0) as logger:
        logger.log_step(1, step_values(1))
    assert "wandb" not in sys.modules


def test_missing_wandb_warns_and_continues(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = make_cfg(tmp_path, wandb_project="glm5", wandb_mode="offline")
    with pytest.warns(UserWarning, match="wandb is not installed"):
        logger = MetricsLogger(cfg, resume_step=0)
    logger.log_step(1, step_values(1))
    logger.close()
    assert len(read_lines(tmp_path / "run" / "metrics.jsonl")) == 1


def test_step_timer_and_memory():
    timer = StepTimer(flops_per_step=4e15, tokens_per_step=8192, world_size=4, device="NVIDIA H200")
    out = timer.throughput(2.0)
    assert out["tokens_per_sec"] == 4096 and out["tokens_per_sec_per_gpu"] == 1024
    assert out["tflops_per_gpu"] == pytest.approx(500.0)
    assert out["mfu"] == pytest.approx(500e12 / 989.4e12)
    cpu = StepTimer(1e9, 100, device="cpu")
    cpu.start()
    measured = cpu.stop()
    assert measured["mfu"] is None and measured["step_time_s"] > 0 and math.isfinite(measured["tokens_per_sec"])
    assert 0 < measured["mem_peak_gb"] < 1024  # the trainer logs the peak with each step's timing
    with pytest.raises(RuntimeError):
        cpu.stop()
    mem = memory_stats()
    assert 0 < mem["mem_peak_gb"] < 1024


def test_profiler_window_writes_a_chrome_trace(tmp_path):
    cfg = make_cfg(tmp_path, profile_step_start=2, profile_step_end=3)
    profiler = ProfilerWindow(cfg, rank=0)
    x = torch.randn(64, 64)
    for step in range(1, 6):
        with profiler.step(step):
            x = torch.tanh(x @ x)
    profiler.close()
    traces = list((tmp_path / "run" / "profile").glob("trace_*.json"))
    assert [t.name for t in traces] == ["trace_rank0_steps2-3.json"]
    names = {e.get("name") for e in json.loads(traces[0].read_text())["traceEvents"]}
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names and "ProfilerStep#4" not in names


def test_profiler_window_profiles_the_listed_ranks(tmp_path):
    """logging.profile_ranks: only the listed global ranks write a trace (e.g. both ends of a pipeline)."""
    cfg = make_cfg(tmp_path, profile_step_start=1, profile_step_end=1, profile_ranks=[1, 3])
    for rank in range(4):
        window = ProfilerWindow(cfg, rank=rank)
        with window.step(1):
            torch.ones(4).sum()
        window.close()
    traces = sorted(t.name for t in (tmp_path / "run" / "profile").glob("trace_*.json"))
    assert traces == ["trace_rank1_steps1-1.json", "trace_rank3_steps1-1.json"]


def test_profile_ranks_are_checked_before_launch(tmp_path):
    from pretrain.config import validate_config

    with pytest.raises(ConfigError, match="profile_ranks"):
        validate_config(make_cfg(tmp_path, profile_ranks=[]))
    with pytest.raises(ConfigError, match="profile_ranks names ranks \\[1\\] of a world of 1"):
        validate_config(make_cfg(tmp_path, profile_step_start=1, profile_step_end=2, profile_ranks=[0, 1]),
                        world_size=1)
    validate_config(make_cfg(tmp_path, profile_step_start=1, profile_step_end=2, profile_ranks=[0]), world_size=1)


def test_flops_caveat_names_documents(tmp_path):
    """Packed documents: the logged MFU counts whole causal windows, and the run says so."""
    from pretrain.training.metrics import flops_caveat

    cfg = make_cfg(tmp_path)
    assert flops_caveat(cfg) is None
    cfg.data.reset_attention_mask = True
    cfg.data.seq_length = 131072
    assert "every 131072-token window as one causal sequence" in flops_caveat(cfg)


def test_profiler_off_and_misconfigured(tmp_path):
    off = ProfilerWindow(make_cfg(tmp_path), rank=0)
    with off.step(1):
        pass
    off.close()
    assert not (tmp_path / "run" / "profile").exists()
    with pytest.raises(ValueError, match="both"):
        ProfilerWindow(make_cfg(tmp_path, profile_step_start=3), rank=0)
    with pytest.raises(ValueError, match="profile_step_start"):
        ProfilerWindow(make_cfg(tmp_path, profile_step_start=5, profile_step_end=2), rank=0)


def test_plot_writes_png(tmp_path, capsys):
    try:
        import matplotlib  # noqa: F401  (the dev extra installs it; a skip would hide an untested tool)
    except ImportError:
        pytest.fail("matplotlib is not installed, so pretrain.tools.plot is untested: pip install -e '.[dev]'")
    from pretrain.tools import plot

    runs = []
    for name, offset in (("a", 0.0), ("b", 0.3)):
        cfg = make_cfg(tmp_path, run_dir=str(tmp_path / name))
        with MetricsLogger(cfg, resume_step=0) as logger:
            for step in range(1, 30):
                logger.log_step(step, step_values(step, loss=5.0 / step + offset, valid_loss=4.0 if step == 20 else None))
        runs.append(str(tmp_path / name))
    out = tmp_path / "curves.png"
    plot.main([*runs, "--out", str(out), "--smooth", "5"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit) as exc:
        plot.main([str(tmp_path / "no_such_run"), "--out", str(out)])
    assert exc.value.code == 2
    assert "metrics.jsonl not found" in capsys.readouterr().err
