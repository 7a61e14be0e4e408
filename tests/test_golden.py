"""Behaviour pinned across refactors: the tiny model's loss and grad-norm sequence over 20 steps.

The sequences in `tests/golden/losses.json` come from `python -m tests.golden.record`, one recording per CPU
kind (`cpu_fingerprint`: torch's ISA level and the AVX-512 / AMX extensions, which decide the CPU kernels'
summation order). History: first on the code before the architecture pass (commit 46ed4cc; the Muon variants
again when SwiGLU fc1's gate and up began to be orthogonalized apart, and once more when that became opt-in),
on 2026-11-25 on unchanged code, and the same day when the sparse indexer loss's target moved to the attention
backward (its value moves by ~1e-5 relative; only muon_dsa_sparse's losses moved, from step 12, by <= 2.6e-4
relative). The AVX-512 + AMX recording is that one; the AVX2 recording was added on 2026-11-28 at commit
5dcaf30 (code unchanged in numerics since).

On a recorded CPU kind the sequences are compared bit for bit: a restructure that only moves code leaves every
float unchanged on CPU. A change that is meant to alter numerics must re-record them in its own commit, on every
recorded CPU kind it can (`--drop-other-cpus` forgets the others), and say why.

On a CPU kind not recorded the test compares with the recording of the same ISA level (else the first), each
quantity within 3x the largest per-step relative difference measured between the recorded CPU kinds on the same
code (`cross_cpu_tolerance`), and warns that it did. Between the AVX-512 + AMX and the AVX2 recordings that
difference is <= 1.5e-7 in loss and <= 2.6e-6 in grad norm for AdamW and dense Muon, and 2.1e-4 / 6.0e-4 for
Muon with DSA sparse (it grows from step 12, when a top-k tie flips between the kernels).

Each variant runs the user's entry point, `pretrain.train`'s `main`, in a fresh single-threaded process forked like a
rank (`tests.distributed.run_ranks`: torch and megatron-core already imported, ~9 s less per variant than a new
interpreter; the recordings come from new interpreters, and match these bit for bit).
"""

import itertools
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List

import pytest

from tests.distributed import run_ranks
from tests.golden.record import VARIANTS, cpu_fingerprint, load_goldens, read_run, variant_argv

KEYS = ("loss", "grad_norm")
TOLERANCE_FACTOR = 3.0  # times the measured cross-CPU difference


def cross_cpu_tolerance(by_cpu: Dict[str, dict], name: str, key: str) -> float:
    """TOLERANCE_FACTOR x the largest per-step relative difference between any two recorded CPU kinds."""
    if len(by_cpu) < 2:
        raise ValueError("one recorded CPU kind: no cross-CPU difference is measured; record this CPU kind with "
                         "python -m tests.golden.record")
    diff = max(abs(a - b) / abs(b) for x, y in itertools.combinations(by_cpu.values(), 2)
               for a, b in zip(x[name][key], y[name][key]))
    return TOLERANCE_FACTOR * diff


def reference_cpu(by_cpu: Dict[str, dict], fingerprint: str) -> str:
    """The recording to compare with: this CPU kind's, else one of the same ISA level, else the first."""
    if fingerprint in by_cpu:
        return fingerprint
    level = fingerprint.split(":", 1)[0]
    return next((fp for fp in by_cpu if fp.split(":", 1)[0] == level), next(iter(by_cpu)))


def differences(got: dict, by_cpu: Dict[str, dict], name: str, fingerprint: str) -> List[str]:
    """What is off: bit for bit on a recorded CPU kind, within `cross_cpu_tolerance` elsewhere."""
    ref = by_cpu[reference_cpu(by_cpu, fingerprint)][name]
    if fingerprint in by_cpu:
        return [f"{name} {key}: {got[key]} != {ref[key]}" for key in KEYS
                if [float.hex(x) for x in got[key]] != [float.hex(x) for x in ref[key]]]
    out = []
    for key in KEYS:
        tol = cross_cpu_tolerance(by_cpu, name, key)
        worst = max(abs(a - b) / abs(b) for a, b in zip(got[key], ref[key]))
        if worst > tol:
            out.append(f"{name} {key}: relative difference {worst:.3g} > {tol:.3g} (3x the cross-CPU one)")
    return out


def _train(rank, world_size, argv):
    from pretrain.train import main

    return main(argv)


def run_variant(name: str, run_dir) -> dict:
    """`python -m pretrain.train` of variant `name` in one rank with one intra-op thread (as OMP_NUM_THREADS=1)."""
    code = run_ranks(_train, 1, variant_argv(name, run_dir), threads_per_rank=1, env={"OMP_NUM_THREADS": "1"},
                     timeout=900)[0]
    assert code == 0, f"{name}: pretrain.train exited with {code}"
    return read_run(run_dir)


@pytest.fixture(scope="module")
def variant_runs(tmp_path_factory):
    """Every variant's run, as many at once as there are cores: each is one single-threaded process
    (one intra-op thread, which fixes its summation order), so runs side by side change no bit. {name: future}: a
    variant that fails raises in its own test."""
    root = tmp_path_factory.mktemp("golden")
    with ThreadPoolExecutor(max(1, min(len(VARIANTS), os.cpu_count() or 1))) as pool:
        return {name: pool.submit(run_variant, name, root / name) for name in sorted(VARIANTS)}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_losses_unchanged_bit_for_bit(name, variant_runs):
    by_cpu, fingerprint = load_goldens(), cpu_fingerprint()
    got = variant_runs[name].result()
    assert len(got["loss"]) == 20
    if fingerprint not in by_cpu:
        warnings.warn(f"golden {name}: this CPU kind ({fingerprint}) has no recording; compared with "
                      f"{reference_cpu(by_cpu, fingerprint)} within 3x the measured cross-CPU difference")
    assert differences(got, by_cpu, name, fingerprint) == []


def test_off_a_recorded_cpu_a_small_regression_fails():
    """On an unrecorded CPU kind the bound is 3x the measured cross-CPU difference: a recorded sequence with
    one step moved by 2x that difference passes, by 4x it fails (a 6% grad-norm change can no longer pass)."""
    by_cpu = load_goldens()
    assert len(by_cpu) >= 2
    unrecorded = "AVX2:unrecorded"
    for name in VARIANTS:
        ref = by_cpu[reference_cpu(by_cpu, unrecorded)][name]
        for key in KEYS:
            tol = cross_cpu_tolerance(by_cpu, name, key)
            assert 0 < tol < 2e-2, (name, key, tol)
            for factor, ok in ((2 / 3, True), (4 / 3, False)):
                got = {k: list(v) for k, v in ref.items()}
                got[key][-1] *= 1 + factor * tol
                assert (differences(got, by_cpu, name, unrecorded) == []) == ok, (name, key, factor)
