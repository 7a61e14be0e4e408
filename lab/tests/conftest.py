"""The lab tests' setup, as the product tests' (tests/conftest.py): the Triton interpreter without a GPU (set before
triton is imported), megatron-core's workarounds installed once, `gpu`-marked tests skipped without a GPU."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pretrain.compat import install  # noqa: E402

install()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and str(item.fspath).startswith(os.path.dirname(__file__)):
            item.add_marker(skip)
