"""Behaviour pinned across refactors: the tiny model's loss and grad-norm sequence over 20 steps.

The sequences in `tests/golden/losses.json` come from `python -m tests.golden.record`: first on the code
before the architecture pass (commit 46ed4cc; the Muon variants again when SwiGLU fc1's gate and up began to
be orthogonalized apart, and once more when that became opt-in), on 2026-11-25 on unchanged code, on a CI
machine whose CPU kernels round differently (with its `cpu_fingerprint`), and last the same day when the
sparse indexer loss's target moved to the attention backward (its value moves by ~1e-5 relative; only
muon_dsa_sparse's losses move, from step 12, by <= 2.6e-4 relative, as on a CPU change). They are compared bit for
bit: a restructure that only moves code leaves every float unchanged on CPU. A change that is meant to alter
numerics must re-record them in its own commit and say why.

Each variant runs the user's entry point (`python -m pretrain.train`) in a fresh process.

Bit for bit holds on a CPU like the recording one (`cpu_fingerprint`: torch's ISA level and the AVX-512 / AMX
extensions, which decide the CPU kernels' summation order). On another CPU the test compares within
RELATIVE_TOLERANCE and warns that it did: the tolerances are 5x the largest per-step differences between the
two recording machines on the same code (AdamW and dense Muon: <= 1.5e-7 in loss, <= 2.6e-6 in grad norm;
Muon with DSA sparse grows from step 12, when a top-k tie flips, to 2.4e-4 / 1.2e-2).
"""

import json
import warnings

import pytest

from tests.golden.record import GOLDEN, VARIANTS, cpu_fingerprint, run_variant

# variant: (loss, grad norm) relative tolerance off the recording CPU
RELATIVE_TOLERANCE = {"adamw_dense": (3e-7, 3e-6), "muon_dense": (8e-7, 1.3e-5),
                      "adamw_dsa_sparse": (6e-7, 4e-6), "muon_dsa_sparse": (1.2e-3, 6e-2)}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_losses_unchanged_bit_for_bit(name, tmp_path):
    golden = json.loads(GOLDEN.read_text())
    expected = golden[name]
    got = run_variant(name, tmp_path)
    assert len(got["loss"]) == 20
    if golden["cpu"] == cpu_fingerprint():
        assert [float.hex(x) for x in got["loss"]] == [float.hex(x) for x in expected["loss"]], name
        assert [float.hex(x) for x in got["grad_norm"]] == [float.hex(x) for x in expected["grad_norm"]], name
        return
    warnings.warn(f"golden {name}: this CPU ({cpu_fingerprint()}) is not the recording one ({golden['cpu']}); "
                  "compared within RELATIVE_TOLERANCE instead of bit for bit")
    for key, tol in zip(("loss", "grad_norm"), RELATIVE_TOLERANCE[name]):
        rel = [abs(a - b) / abs(b) for a, b in zip(got[key], expected[key])]
        assert max(rel) <= tol, (name, key, max(rel), tol)
