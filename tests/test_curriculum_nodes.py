"""The curriculum on several nodes: node 0 alone decides that a stage finished (after checking its final
checkpoint); the other nodes wait for that verdict and stop with it. Two nodes are two threads running
the same plan; each stage's training run is replaced by a stub (`runner._launch`)."""

import threading
import time

import pytest

from pretrain.curriculum import load_plan, runner
from tests.test_curriculum import stage, write_plan


def _two_nodes(plan, monkeypatch, last_checkpoint, node0_delay=0.3):
    """Run `plan` on nodes 0 and 1 at once; node 0's run ends `node0_delay` s after node 1's. Returns
    {node: the exception it stopped with, or None}, and what node 1 saw on disk when its run ended."""
    seen = {}
    rendezvous = threading.Barrier(2)  # a stage's run starts once every node has launched it

    def launch(stage, launcher, config_path):
        rendezvous.wait(timeout=30)
        if threading.current_thread().name == "node0":
            time.sleep(node0_delay)
        else:
            seen["done_file_when_run_ended"] = (stage.directory / runner.DONE_FILE).exists()
        return 0

    monkeypatch.setattr(runner, "_launch", launch)
    monkeypatch.setattr(runner, "_last_checkpoint", last_checkpoint)
    monkeypatch.setattr(runner, "VERDICT_TIMEOUT_S", 30.0)
    outcome = {}

    def node(rank):
        try:
            runner.run_plan(plan, "torchrun", log=lambda _: None, node_rank=rank)
            outcome[rank] = None
        except Exception as exc:  # noqa: BLE001 - reported to the test
            outcome[rank] = exc

    threads = [threading.Thread(target=node, args=(r,), name=f"node{r}") for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return outcome, seen


def test_other_nodes_stop_when_node_0_finds_no_final_checkpoint(tmp_path, monkeypatch):
    plan = load_plan(write_plan(tmp_path, [stage("a"), stage("b")]))
    outcome, seen = _two_nodes(plan, monkeypatch, last_checkpoint=lambda s: None)
    assert isinstance(outcome[0], runner.StageFailed) and isinstance(outcome[1], runner.StageFailed)
    assert "without a checkpoint of its last step" in str(outcome[1])  # node 0's reason, on node 1
    assert not (plan.stages[0].directory / runner.DONE_FILE).exists()  # nobody marked the stage done
    assert runner.finished_iterations(plan.stages[0]) is None  # a rerun trains stage a again


def test_other_nodes_wait_for_node_0s_verdict_then_go_on(tmp_path, monkeypatch):
    plan = load_plan(write_plan(tmp_path, [stage("a"), stage("b")]))
    outcome, seen = _two_nodes(plan, monkeypatch, last_checkpoint=lambda s: s.train_iters)
    assert outcome == {0: None, 1: None}
    assert seen["done_file_when_run_ended"] is False  # node 1's run ended first: it had to wait for node 0
    for s in plan.stages:
        assert runner.finished_iterations(s) == s.train_iters


def test_a_stale_failure_verdict_does_not_stop_the_rerun(tmp_path, monkeypatch):
    plan = load_plan(write_plan(tmp_path, [stage("a")]))
    plan.stages[0].directory.mkdir(parents=True)
    (plan.stages[0].directory / runner.FAILED_FILE).write_text('{"reason": "an earlier attempt"}')
    outcome, _ = _two_nodes(plan, monkeypatch, last_checkpoint=lambda s: s.train_iters, node0_delay=0.0)
    assert outcome == {0: None, 1: None}


@pytest.mark.parametrize("code", [1])
def test_a_failed_run_on_node_1_does_not_wait(tmp_path, monkeypatch, code):
    plan = load_plan(write_plan(tmp_path, [stage("a")]))
    monkeypatch.setattr(runner, "_launch", lambda *a: code)
    with pytest.raises(runner.StageFailed, match="failed on node 1"):
        runner.run_plan(plan, "torchrun", log=lambda _: None, node_rank=1)


def test_a_preempted_stage_stops_the_plan_with_exit_code_75(tmp_path, monkeypatch):
    from pretrain.curriculum.__main__ import main

    path = write_plan(tmp_path, [stage("a"), stage("b")])
    monkeypatch.setattr(runner, "_launch", lambda *a: 75)  # the stage's ranks saved and exited on a signal
    assert main(["--plan", path, "--launcher", "inline", "--skip-data-check"]) == 75
    plan = load_plan(path)
    assert runner.finished_iterations(plan.stages[0]) is None and "preempted" in (
        plan.stages[0].directory / runner.FAILED_FILE).read_text()
