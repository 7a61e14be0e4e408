"""The rank-spawning helper (tests/distributed.py): a failing rank is named, ranks see the caller's environment."""

from __future__ import annotations

import pytest

from tests.distributed import RankError, run_ranks


def rank_environment(rank: int, world_size: int) -> dict:
    import os

    import torch._dynamo

    return {"probe": os.environ.get("RUN_RANKS_PROBE"), "cwd": os.getcwd(), "rank": os.environ["RANK"],
            "compile_disabled": torch._dynamo.config.disable}


def rank_fails_on_rank_1(rank: int, world_size: int) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.barrier()  # rank 0 waits in a collective for a peer that is gone
    return rank


def test_run_ranks_reports_the_failing_rank():
    """The rank-spawning helper itself: a rank's exception fails the caller with its traceback, first,
    and the rank blocked in a collective with it does not hang the test."""
    with pytest.raises(RankError) as info:
        run_ranks(rank_fails_on_rank_1, 2, timeout=60)
    message = str(info.value)
    assert message.index("--- rank 1 raised") < message.find("--- rank 0"), message
    assert "ValueError: rank 1 fails on purpose" in message


def test_run_ranks_gives_ranks_the_callers_environment_now(monkeypatch, tmp_path):
    """Ranks are forks of a server started at the first call: they still see the caller's environment
    and working directory at the time of the call, and TORCH_COMPILE_DISABLE as the call sets it."""
    run_ranks(rank_environment, 1)  # the fork server is running from here on
    monkeypatch.setenv("RUN_RANKS_PROBE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    ranks = run_ranks(rank_environment, 2, env={"TORCH_COMPILE_DISABLE": "1"})
    assert [r["rank"] for r in ranks] == ["0", "1"]
    for r in ranks:
        assert r["probe"] == "set after the server started" and r["cwd"] == str(tmp_path) and r["compile_disabled"]
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "0")
    (plain,) = run_ranks(rank_environment, 1)
    assert not plain["compile_disabled"]


def rank_process(rank: int, world_size: int) -> dict:
    import multiprocessing
    import os

    return {"parent": os.getppid(), "start_method": multiprocessing.get_start_method(allow_none=True)}


def test_ranks_are_spawned_on_a_cuda_host(monkeypatch):
    """Where CUDA is available the pytest process (and a fork server) may have touched it, and a fork of such
    a process cannot use CUDA: ranks are then spawned, children of the caller (without CUDA they come from the
    fork server, as in every other test here)."""
    import os

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # in the caller only: the rank is a new process
    (spawned,) = run_ranks(rank_process, 1)
    assert spawned == {"parent": os.getpid(), "start_method": "spawn"}
