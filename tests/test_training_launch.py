"""Launch-level behaviour through real processes: kill -9 and resume, torchrun multi-node, restarts."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.distributed import free_port, run_command_line
from tests.test_training import ROOT, read_metrics, tiny_overrides

TRAIN = [sys.executable, "-m", "pretrain.train", "--config", "configs/models/glm5-tiny.yaml"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def overrides(data, run_dir, ckpt, iters=10, *extra):
    return tiny_overrides(data, run_dir, f"train.train_iters={iters}", "train.eval_interval=null",
                          f"checkpoint.save={ckpt}", "checkpoint.save_interval=4", *extra)


def losses(run_dir: Path):
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), [r["step"] for r in rows]
    return [r["loss"] for r in rows]


def wait_for_step(run_dir: Path, step: int, proc, timeout=240):
    deadline = time.time() + timeout
    path = run_dir / "metrics.jsonl"
    while time.time() < deadline:
        if path.exists():
            lines = [line for line in path.read_text().splitlines() if line.strip()]
            if lines and json.loads(lines[-1])["step"] >= step:
                return
        if proc.poll() is not None:
            raise AssertionError(f"training exited early with {proc.returncode}")
        time.sleep(0.05)
    raise TimeoutError(f"step {step} not reached")


def _train_forked(args):
    """`python -m pretrain.train ARGS` (TRAIN[3:] + overrides) as its main in a single-threaded process forked like
    a rank (`run_command_line`: torch and megatron-core already imported, ~9 s less than a new interpreter)."""
    got = run_command_line("pretrain.train", args, {"OMP_NUM_THREADS": "1"}, cwd=str(ROOT), timeout=600, threads=1)
    assert got["code"] == 0, got["stderr"][-3000:]
    return got["stdout"]


def test_kill9_then_resume_reproduces_the_losses_bitwise(stdlib_data, tmp_path):
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    # The reference runs beside the interrupted run (each is one single-threaded process: two share the 2 cores);
    # only the killed run is a new interpreter (it must die whole), the reference and the restart run forked.
    with ThreadPoolExecutor(1) as pool:
        ref = pool.submit(_train_forked, TRAIN[3:] + overrides(stdlib_data, reference, tmp_path / "ckpt_a"))
        kill_at = random.Random().randint(5, 7)  # after the step-4 checkpoint, at least 3 steps before the end
        args = overrides(stdlib_data, interrupted, tmp_path / "ckpt_b")
        proc = subprocess.Popen(TRAIN + args, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for_step(interrupted, kill_at, proc)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        resumed = _train_forked(TRAIN[3:] + args)
        ref.result()
    assert "resumed from" in resumed
    assert losses(interrupted) == losses(reference), f"killed at step {kill_at}"


def test_two_torchrun_nodes_match_one_node(stdlib_data, one_node_two_ranks, tmp_path):
    two = tmp_path / "two"
    port = str(free_port())
    nodes = [  # through the launch script, as a user starts each node
        subprocess.Popen(["bash", "launch/train.sh", "--config", "configs/models/glm5-tiny.yaml"]
                         + overrides(stdlib_data, two, tmp_path / "c2", 6), cwd=ROOT,
                         env={**ENV, "NNODES": "2", "NODE_RANK": str(rank), "NPROC_PER_NODE": "1",
                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for rank in (0, 1)
    ]
    for node in nodes:
        _, err = node.communicate(timeout=600)
        assert node.returncode == 0, err[-3000:]
    a, b = one_node_two_ranks, losses(two)
    assert len(a) == 6
    assert a == pytest.approx(b, rel=1e-6, abs=0)


def test_killed_rank_is_restarted_and_the_run_finishes(stdlib_data, tmp_path):
    run_dir = tmp_path / "run"
    cmd = ["bash", "launch/train.sh", "--config", "configs/models/glm5-tiny.yaml"]
    env = {**ENV, "NPROC_PER_NODE": "2", "MAX_RESTARTS": "1", "MASTER_PORT": str(free_port())}
    # launch/train.sh execs torchrun, so proc.pid is the torchrun agent and its children the ranks
    proc = subprocess.Popen(cmd + overrides(stdlib_data, run_dir, tmp_path / "ckpt", 8), cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_step(run_dir, 5, proc)
        workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(workers) == 2, workers
        os.kill(int(workers[1]), signal.SIGKILL)  # one rank dies mid-run
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert "resumed from" in out
    assert len(losses(run_dir)) == 8
