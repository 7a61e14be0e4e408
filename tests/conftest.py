"""Shared pytest setup: the `gpu` marker, quiet megatron-core import warnings, `pretrain.compat.install()`."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

# Without a GPU the DSA Triton kernels run in Triton's interpreter (tests/test_dsa_kernels.py). Triton
# decides interpreter vs compiler when it is imported, so this must precede any import of triton. The
# "auto" DSA backend still picks the PyTorch reference for CPU tensors.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")

# The test session is an entry point: megatron-core's workarounds (and on CPU its CPU layer) are
# installed once, after TRITON_INTERPRET is set, as pretrain.train does before it builds anything.
from pretrain.compat import install  # noqa: E402

install()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run with -m gpu on a GPU machine)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def stdlib_data(tmp_path_factory):
    """A small real corpus: part of the standard library, BPE-tokenized and preprocessed."""
    import sysconfig

    out = tmp_path_factory.mktemp("data")
    src = os.path.join(sysconfig.get_paths()["stdlib"], "json")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    subprocess.run([sys.executable, "-m", "data_pipeline.train_tokenizer", "--input", src, "--vocab-size", "1024",
                    "--output", str(out / "tokenizer.json")], check=True, env=env, capture_output=True)
    subprocess.run([sys.executable, "-m", "data_pipeline.preprocess", "--input", src, "--extensions", ".py",
                    "--tokenizer", str(out / "tokenizer.json"), "--output-prefix", str(out / "json"),
                    "--append-eod", "--workers", "1"], check=True, env=env, capture_output=True)
    return out


@pytest.fixture(scope="session")
def kern():
    """The DSA kernel modules; on CPU they are interpreted (TRITON_INTERPRET=1 is set above, before triton is
    imported)."""
    from pretrain.model.dsa.kernels import interpreting

    if not torch.cuda.is_available() and not interpreting():
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")
    import importlib

    return {name: importlib.import_module(f"pretrain.model.dsa.kernels.{name}")
            for name in ["segment_sum", "sparse_mla", "sparse_mla_dkv", "indexer_kl", "indexer_topk", "radix_select",
                         "packed_indices"]}


@pytest.fixture(scope="session")
def one_node_two_ranks(stdlib_data, tmp_path_factory):
    """The losses of 6 steps of the tiny model on `stdlib_data`, one node of 2 ranks through torchrun, no checkpoint
    before the end: the uninterrupted reference of tests/test_preemption.py and tests/test_training_launch.py (the
    same run: one launch serves both)."""
    from tests.distributed import free_port
    from tests.test_training import ROOT
    from tests.test_training_launch import ENV, TORCHRUN, losses, overrides

    root = tmp_path_factory.mktemp("one_node_two_ranks")
    args = [a for a in overrides(stdlib_data, root / "run", root / "ckpt", 6) if "save_interval" not in a]
    cmd = TORCHRUN + ["--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "pretrain.train", "--config",
                      "configs/models/glm5-tiny.yaml", *args]
    done = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return losses(root / "run")
