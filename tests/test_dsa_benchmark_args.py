"""The DSA GPU benchmark refuses bad arguments in one line before any GPU work (it runs here, without a GPU, as far
as its argument checks)."""

import sys

import pytest


@pytest.mark.parametrize("module, argv, message", [
    ("dsa_kernels", ["--key-partition-mib", "-2"], "--key-partition-mib must be >= 0"),
    ("dsa_kernels", ["--tp", "2"], "--tp 2 needs >= 2 ranks and torchrun --nproc-per-node 2"),
])
def test_bad_arguments_are_refused_before_gpu_work(monkeypatch, capsys, module, argv, message):
    import importlib

    mod = importlib.import_module(f"benchmarks.{module}")
    monkeypatch.setattr(sys, "argv", [f"{module}.py", *argv])
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # one process, not torchrun's
    with pytest.raises(SystemExit) as err:
        mod.main()
    assert err.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(lines) == 1 and message in lines[0]
