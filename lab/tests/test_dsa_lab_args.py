"""The DSA lab's GPU probes and sweeps refuse bad arguments in one line before any GPU work (they run here, without a
GPU, as far as their argument checks)."""

import importlib
import sys

import pytest


@pytest.mark.parametrize("module, argv, message", [
    ("dsa_heads_sweep", ["--key-partition-mib", "x"], "--key-partition-mib takes numbers"),
    ("dsa_heads_sweep", ["--key-partition-mib", "-1"], "--key-partition-mib values must be >= 0"),
    ("dsa_heads_sweep", ["--dkv-modes", "bogus"], "unknown --dkv-modes"),
    ("dsa_heads_sweep", ["--atomics", "vector,bogus"], "unknown --atomics"),
    ("dsa_heads_sweep", ["--ws", "off,maybe"], "unknown --ws"),
    ("dsa_topk_sweep", ["--select", "5"], "--select entries are"),
    ("dsa_topk_sweep", ["--score-configs", "4x64x8"], "--score-configs entries are"),
    ("dsa_first_pass_probe", ["--dq-configs", "64x2x1"], "--dq-configs entries are"),
])
def test_bad_arguments_are_refused_before_gpu_work(monkeypatch, capsys, module, argv, message):
    mod = importlib.import_module(f"lab.dsa.{module}")
    monkeypatch.setattr(sys, "argv", [f"{module}.py", *argv])
    with pytest.raises(SystemExit) as err:
        mod.main()
    assert err.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(lines) == 1 and message in lines[0]
