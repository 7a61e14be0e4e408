"""The table of megatron-core workarounds (`pretrain.compat.WORKAROUNDS`) and its front door `install()`."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pretrain import compat

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="default")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_table_is_gathered_from_every_concern_module():
    gathered = []
    for concern in compat.CONCERNS:
        module = importlib.import_module(f"pretrain.compat.{concern}")
        assert module.WORKAROUNDS, f"pretrain/compat/{concern}.py lists no Workaround"
        for w in module.WORKAROUNDS:
            assert isinstance(w, compat.Workaround)
            assert hasattr(module, w.name), f"{concern}.WORKAROUNDS names {w.name}, which {concern}.py does not define"
            assert w.install is None or w.install is getattr(module, w.name), w.name
            assert w.when in ("always", "cpu", "triton_interpreter"), w.name
            assert w.reason and w.target and w.upstream, w.name
        gathered += module.WORKAROUNDS
    assert list(compat.WORKAROUNDS) == gathered
    names = [w.name for w in gathered]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("workaround", compat.WORKAROUNDS, ids=lambda w: w.name)
def test_every_workaround_names_an_existing_test(workaround):
    path, sep, function = workaround.test.partition("::")
    assert sep and path.startswith("tests/test_") and path.endswith(".py"), workaround.test
    source = ROOT / path
    assert source.is_file(), f"{workaround.name}: {path} does not exist"
    tree = ast.parse(source.read_text())
    defined = {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assert function in defined, f"{workaround.name}: {path} has no test {function}"


def test_version_mismatch_is_named(monkeypatch):
    import megatron.core

    monkeypatch.setattr(megatron.core, "__version__", "0.17.0")
    with pytest.warns(compat.MegatronVersionWarning) as record:
        message = compat.check_megatron_version()
    assert len(record) == 1 and str(record[0].message) == message
    assert "megatron-core 0.17.0 is installed" in message and "target megatron-core 0.16.1" in message
    assert "applied anyway" in message


def test_target_version_gives_no_warning(monkeypatch, recwarn):
    import megatron.core

    monkeypatch.setattr(megatron.core, "__version__", compat.MEGATRON_CORE_VERSION)
    assert compat.check_megatron_version() is None
    assert not [w for w in recwarn if issubclass(w.category, compat.MegatronVersionWarning)]


def test_install_warns_once_on_another_version_and_still_applies():
    """A fresh process: install() twice with a faked megatron-core version."""
    result = _run(
        "import megatron.core; megatron.core.__version__ = '0.15.0'\n"
        "from pretrain import compat\n"
        "compat.install(); compat.install()\n"
        "from megatron.core.transformer.moe import moe_utils\n"
        "from megatron.core.tensor_parallel import mappings\n"
        "print('applied', compat.installed(), hasattr(moe_utils, 'te_general_gemm'), mappings._reduce.__module__)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("megatron-core 0.15.0 is installed") == 1, result.stderr
    assert "target megatron-core 0.16.1" in result.stderr
    assert "applied True True pretrain.compat.tensor_parallel" in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer is what a CPU host needs before process groups")
def test_process_groups_without_install_fail_with_a_clear_message():
    result = _run("from parallel.initialize import init_distributed\ninit_distributed()\n")
    assert result.returncode != 0
    assert "call pretrain.compat.install() once before initializing process groups" in result.stderr


def test_cpu_layer_is_entered_by_install_on_a_cpu_host():
    cpu = [w for w in compat.WORKAROUNDS if w.when == "cpu"]
    assert [w.name for w in cpu] == ["use_thread_async_caller", "hold_storage_of_pending_sends", "install_cpu_support"]
    assert compat.applies("cpu") == (not torch.cuda.is_available())
    if not torch.cuda.is_available():  # conftest called install(), as every entry point does
        assert torch.cuda.current_device() == "cpu"
        assert torch.empty(1, device="cuda").device.type == "cpu"
