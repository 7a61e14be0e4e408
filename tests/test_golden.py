"""Behaviour pinned across refactors: the tiny model's loss and grad-norm sequence over 20 steps.

The sequences in `tests/golden/losses.json` were recorded by `python -m tests.golden.record` on the
code before the architecture pass (commit 46ed4cc; the Muon variants again when SwiGLU fc1's gate and
up began to be orthogonalized apart, and once more when that became opt-in) and are compared bit for bit: a restructure that
only moves code leaves every float unchanged on CPU. A change that is meant to alter numerics must
re-record them in its own commit and say why.

Each variant runs the user's entry point (`python -m pretrain.train`) in a fresh process.
"""

import json

import pytest

from tests.golden.record import GOLDEN, VARIANTS, run_variant


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_losses_unchanged_bit_for_bit(name, tmp_path):
    expected = json.loads(GOLDEN.read_text())[name]
    got = run_variant(name, tmp_path)
    assert len(got["loss"]) == 20
    assert [float.hex(x) for x in got["loss"]] == [float.hex(x) for x in expected["loss"]], name
    assert [float.hex(x) for x in got["grad_norm"]] == [float.hex(x) for x in expected["grad_norm"]], name
