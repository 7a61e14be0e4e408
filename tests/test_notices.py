"""The library's one say-once (`pretrain.notices`), the entry points' logging (framework INFO on rank 0, every
rank's warnings, third-party INFO hidden), and a real training run's log: its notices are seen and megatron's
per-layer "Unknown MLP type" noise is not."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from pretrain.notices import FRAMEWORK_LOGGERS, configure_logging, say_once, warn_once

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def restore_logging():
    """configure_logging changes process-wide logger levels and adds a root handler: undo both."""
    root = logging.getLogger()
    names = FRAMEWORK_LOGGERS + ("megatron",)
    saved = (list(root.handlers), root.level, {n: logging.getLogger(n).level for n in names})
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    for name, level in saved[2].items():
        logging.getLogger(name).setLevel(level)


def test_say_once_and_warn_once_say_each_message_once(caplog):
    log = logging.getLogger("pretrain.tests.notices")
    with caplog.at_level(logging.INFO, logger=log.name):
        said = [say_once(log, "path %s taken", "A"), say_once(log, "path %s taken", "A"), say_once(log, "path B")]
    assert said == [True, False, True]
    assert [r.getMessage() for r in caplog.records if r.name == log.name] == ["path A taken", "path B"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            warn_once("tests.notices: a slower path")
    assert [str(w.message) for w in caught] == ["tests.notices: a slower path"]
    assert caught[0].category is RuntimeWarning and caught[0].filename == __file__  # stacklevel 1: the caller


@pytest.mark.parametrize("rank", [0, 1])
def test_configure_logging_shows_framework_info_on_rank_zero_and_warnings_everywhere(rank, capsys, restore_logging):
    configure_logging(rank=rank)
    logging.getLogger("parallel.somewhere").info("framework info")
    logging.getLogger("pretrain.somewhere").warning("framework warning")
    logging.getLogger("megatron.core.somewhere").info("megatron info")
    logging.getLogger("megatron.core.somewhere").warning("megatron warning")
    lines = capsys.readouterr().err.splitlines()
    expected = ([f"[rank {rank}] INFO parallel.somewhere: framework info"] if rank == 0 else []) + [
        f"[rank {rank}] WARNING pretrain.somewhere: framework warning",
        f"[rank {rank}] WARNING megatron.core.somewhere: megatron warning",
    ]
    assert lines == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="the notice checked is the CPU layer's")
def test_training_log_shows_framework_notices_and_no_megatron_noise(tmp_path):
    """`python -m pretrain.train` on glm5-tiny (layer 1 is MoE, which megatron's TransformerLayer does not know by
    name): the CPU layer's INFO notice is in the log once, megatron's "Unknown MLP type" is not."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    cmd = [sys.executable, "-m", "pretrain.train", "--config", "configs/models/glm5-tiny.yaml", "train.train_iters=1",
           "train.eval_interval=null", "optimizer.lr_warmup_iters=0", f"logging.run_dir={tmp_path / 'run'}"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stdout + done.stderr
    assert log.count("[rank 0] INFO pretrain.compat.cpu: no CUDA device: megatron-core runs on the CPU") == 1
    assert "Unknown MLP type" not in log
    assert "step      1 |" in done.stdout
