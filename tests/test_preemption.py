"""Preemption: a signal stops every rank after the same step with a checkpoint and exit code 75; the run
started again continues the uninterrupted run's losses bitwise (real processes through launch/train.sh)."""

import os
import re
import signal
import subprocess
from datetime import timedelta

import pytest

from tests.distributed import free_port
from tests.test_training import ROOT
from tests.test_training_launch import ENV, losses, overrides, wait_for_step

TRAIN_SH = ["bash", "launch/train.sh", "--config", "configs/models/glm5-tiny.yaml"]
ITERS = 6


def _launch(args, **popen):
    env = {**ENV, "NPROC_PER_NODE": "2", "MASTER_PORT": str(free_port())}
    return subprocess.Popen(TRAIN_SH + args, cwd=ROOT, env=env, text=True, **popen)


def _run(args):
    proc = _launch(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = proc.communicate(timeout=600)
    return proc.returncode, out


def test_signal_to_one_rank_stops_both_at_the_same_step_and_resumes_bitwise(stdlib_data, one_node_two_ranks,
                                                                             tmp_path):
    interrupted = tmp_path / "interrupted"
    reference = one_node_two_ranks  # the uninterrupted losses of the same 2-rank run (tests/conftest.py)
    assert len(reference) == ITERS
    # No periodic checkpoint: the only one before the end is the one the signal asks for.
    args = [a for a in overrides(stdlib_data, interrupted, tmp_path / "ckpt_b", ITERS) if "save_interval" not in a]
    proc = _launch(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for_step(interrupted, 3, proc)
        # launch/train.sh execs the agent (parallel.torchrun): its children are the ranks. Only rank 1's
        # process is signalled; the ranks must still agree and stop after the same step.
        ranks = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(ranks) == 2, ranks
        os.kill(int(sorted(ranks, key=int)[1]), signal.SIGUSR1)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, out[-3000:]
    stopped = re.findall(r"preempted: stopped by SIGUSR1 after step (\d+): saved checkpoint (\S+);", out)
    assert len(stopped) == 1, out[-3000:]  # one line, from rank 0
    step = int(stopped[0][0])
    assert 3 <= step < ITERS and stopped[0][1].endswith(f"iter_{step:07d}")
    assert len(losses(interrupted)) == step  # every rank stopped after this step: no later step was logged
    code, out = _run(args)
    assert code == 0, out[-3000:]
    assert f"at iteration {step}" in out
    assert losses(interrupted) == reference, f"stopped at step {step}"


def test_unknown_exit_signal_is_refused_by_name():
    from pretrain.config import ConfigError
    from tests.config_helpers import tiny

    with pytest.raises(ConfigError, match=r"train.exit_signals has \['SIGFOO'\]"):
        tiny("train.exit_signals=[SIGTERM,SIGFOO]")


def _init_with_timeout(rank, world_size, minutes):
    import torch.distributed as dist

    from parallel import initialize
    from pretrain.config.schema import ParallelConfig

    seen = {"init": [], "groups": set()}
    real_init, real_group = dist.init_process_group, dist.new_group

    def init(*args, **kwargs):
        seen["init"].append(kwargs.get("timeout"))
        return real_init(*args, **kwargs)

    def new_group(*args, **kwargs):
        seen["groups"].add(kwargs.get("timeout"))
        return real_group(*args, **kwargs)

    dist.init_process_group, dist.new_group = init, new_group
    try:
        initialize.initialize_parallel(ParallelConfig(distributed_timeout_minutes=minutes), seed=0)
    finally:
        dist.init_process_group, dist.new_group = real_init, real_group
    return seen


def test_distributed_timeout_reaches_init_process_group():
    from tests.distributed import run_ranks

    results = run_ranks(_init_with_timeout, 2, 7)
    for seen in results:
        assert seen["init"] == [timedelta(minutes=7)]
        # megatron's TP/PP/DP/... groups: the same bound where it passes one
        assert seen["groups"] - {None} == {timedelta(minutes=7)}
