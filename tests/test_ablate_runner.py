"""The ablation runner's local scheduling: concurrent runs and their ports, continuations after their source,
evaluations of step checkpoints, the MPS check. Runs are stand-ins (no training)."""

import json
import os
from pathlib import Path

from pretrain.ablate.__main__ import main
from pretrain.ablate.runner import mps_running
from pretrain.ablate.sweep import load_sweep
from tests.ablate_helpers import ROOT, write_sweep


def test_parallel_runs_share_the_machine_with_own_ports_and_wait_for_their_source(tmp_path, monkeypatch):
    """`--parallel 2`: never more than two runs at once, concurrent runs on different MASTER_PORTs, a
    continuation starts only after its source run ended, and after a failure no new run starts. The
    runs are stand-ins (no training): each marks itself finished when its command returns."""
    import threading
    import time

    from pretrain.ablate import runner

    path = write_sweep(tmp_path, "overrides: [optimizer.lr_warmup_iters=0]\nvariants:\n  - {name: dense}\n"
                            "  - {name: cont, overrides: ['checkpoint.pretrained={checkpoint:dense}']}\n"
                            "  - {name: other}\n")
    path.write_text(path.read_text().replace("seeds: [1]", "seeds: [1, 2]"))
    sweep = load_sweep(path, tmp_path / "out")
    done, events, lock, fail = {}, [], threading.Lock(), set()

    def execute(cmd, log, extra_env=None):
        name = str(log.parent.relative_to(sweep.output_dir))
        with lock:
            events.append(("start", name, extra_env["MASTER_PORT"], time.monotonic()))
        time.sleep(0.05)
        with lock:
            events.append(("end", name, extra_env["MASTER_PORT"], time.monotonic()))
            if name not in fail:
                done[name] = next(r.train_iters for r in sweep.runs if str(r.run_dir.relative_to(sweep.output_dir)) == name)
        return 1 if name in fail else 0

    monkeypatch.setattr(runner, "_execute", execute)
    monkeypatch.setattr(runner, "finished_iteration",
                        lambda run: done.get(str(run.run_dir.relative_to(sweep.output_dir))))
    assert runner.run_local(sweep, sweep.runs, dry_run=False, say=lambda _: None, parallel=2) == 0
    active, most = {}, 0
    for kind, name, port, _ in events:
        if kind == "start":
            assert port not in active.values(), f"{name} shares port {port} with a running run"
            active[name] = port
            most = max(most, len(active))
        else:
            del active[name]
    assert most == 2 and sorted(done) == sorted(str(r.run_dir.relative_to(sweep.output_dir)) for r in sweep.runs)
    at = {(kind, name): t for kind, name, _, t in events}
    for seed in (1, 2):
        assert at[("start", f"cont/seed{seed}")] >= at[("end", f"dense/seed{seed}")]

    # A failure: the run fails, what runs beside it finishes, nothing new starts.
    done.clear()
    events.clear()
    fail.add("dense/seed1")
    assert runner.run_local(sweep, sweep.runs, dry_run=False, say=lambda _: None, parallel=2) == 1
    failed_at = next(t for kind, name, _, t in events if (kind, name) == ("end", "dense/seed1"))
    assert all(t <= failed_at for kind, _, _, t in events if kind == "start")
    assert {name for kind, name, _, _ in events if kind == "start"} == {"dense/seed1", "other/seed1"}


def test_two_sweeps_on_one_machine_take_different_ports(tmp_path, monkeypatch):
    """Two sweeps started at once on one machine, each with `--parallel 2`: every run's torchrun can listen on
    its MASTER_PORT (the stand-in binds it for the run's duration, as torchrun's rendezvous store does), so
    no run fails on a port another sweep holds. With MASTER_PORT set, runs take MASTER_PORT + 1 + slot."""
    import errno
    import socket
    import threading
    import time

    from pretrain.ablate import runner

    monkeypatch.delenv("MASTER_PORT", raising=False)
    path = write_sweep(tmp_path, "overrides: [optimizer.lr_warmup_iters=0]\nvariants:\n  - {name: a}\n  - {name: b}\n")
    sweeps = [load_sweep(path, tmp_path / f"out{i}") for i in range(2)]
    done, ports, lock = {}, [], threading.Lock()
    start = threading.Barrier(2)

    def execute(cmd, log, extra_env=None):
        port = int(extra_env["MASTER_PORT"])
        with lock:
            ports.append(port)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError as err:
                assert err.errno == errno.EADDRINUSE
                return 1
            sock.listen()
            time.sleep(0.3)
        done[log.parent] = 1
        return 0

    monkeypatch.setattr(runner, "_execute", execute)
    monkeypatch.setattr(runner, "finished_iteration", lambda run: done.get(run.run_dir))
    results = [None, None]

    def sweep_thread(i):
        start.wait()
        results[i] = runner.run_local(sweeps[i], sweeps[i].runs, dry_run=False, say=lambda _: None, parallel=2)

    threads = [threading.Thread(target=sweep_thread, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [0, 0] and len(ports) == 4 and len(set(ports)) == 4, ports

    monkeypatch.setenv("MASTER_PORT", "31000")
    done.clear()
    ports.clear()
    assert runner.run_local(sweeps[0], sweeps[0].runs, dry_run=False, say=lambda _: None, parallel=2) == 0
    assert sorted(ports) == [31001, 31002]


def test_evaluate_at_runs_each_evaluation_on_the_step_checkpoint(tmp_path, monkeypatch, capsys):
    """`--evaluate-at N`: every run that has a step-N checkpoint gets its evaluations on that checkpoint, into
    eval_<name>_step<N>.json; a run without one is named and skipped; then the report as of step N."""
    from pretrain.ablate import runner

    path = write_sweep(tmp_path, "overrides: [optimizer.lr_warmup_iters=0]\nreport: {evals: {retrieval: [--samples, '2']}}\n"
                            "variants:\n  - {name: a}\n  - {name: b}\n")
    path.write_text(path.read_text().replace("tokens: 1024", "tokens: 10240"))  # 10 steps: step 2 is mid-run
    sweep = load_sweep(path, tmp_path / "out")
    a, b = sweep.runs
    (a.checkpoint_dir / "iter_0000002").mkdir(parents=True)
    b.checkpoint_dir.mkdir(parents=True)
    for run in (a, b):
        run.run_dir.joinpath("metrics.jsonl").write_text("".join(
            json.dumps({"step": k, "loss": 5.0 - k}) + "\n" for k in range(1, 3)))
    calls = []

    def execute(cmd, log, extra_env=None):
        calls.append(cmd)
        out = Path(cmd[cmd.index("--json") + 1])
        (out if out.is_absolute() else ROOT / out).write_text(json.dumps({"metrics": {"retrieval@64": 0.5}}))
        return 0

    monkeypatch.setattr(runner, "_execute", execute)
    monkeypatch.setattr(runner, "rel", lambda p: str(p))
    assert main([str(path), "--output-dir", str(tmp_path / "out"), "--evaluate-at", "2"]) == 0
    printed = capsys.readouterr().out
    assert len(calls) == 1 and calls[0][calls[0].index("--checkpoint") + 1] == str(a.checkpoint_dir / "iter_0000002")
    assert calls[0][calls[0].index("--json") + 1] == str(a.run_dir / "eval_retrieval_step2.json")
    assert f"{b.name}: no checkpoint at step 2, not evaluated" in printed
    rows = {r["variant"]: r for r in json.loads((tmp_path / "out/results.json").read_text())["variants"]}
    assert rows["a"]["metrics"]["retrieval@64"]["mean"] == 0.5 and "retrieval@64" not in rows["b"]["metrics"]
    assert main([str(path), "--output-dir", str(tmp_path / "out"), "--evaluate-at", "2"]) == 0  # nothing missing
    assert len(calls) == 1


def test_mps_daemon_is_found_by_its_control_pipe(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert not mps_running()
    os.mkfifo(tmp_path / "control")  # what nvidia-cuda-mps-control -d creates
    assert mps_running()
