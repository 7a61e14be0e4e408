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

On a CPU kind not recorded the test compares with the recording of the same ISA level (else the first), step by
step: each step within 3x the largest relative difference measured between the recorded CPU kinds on the same code
up to that step (`cross_cpu_tolerances`; at least `TOLERANCE_FLOOR`, 8 float32 ulps), and warns that it did. The
recordings (AVX-512 + AMX, AVX2, AVX-512 without AMX, added on 2026-11-29 on unchanged code) differ by <= 1.5e-7 in
loss and <= 3.8e-6 in grad norm for AdamW, dense Muon and AdamW with DSA sparse. Muon with DSA sparse agrees as
closely until a near-tie in the indexer's top-k flips between the kernels (step 9 between AVX-512 and the others,
step 15 between AMX and AVX2), after which the runs drift apart: up to 6.7e-4 in loss and 1.8e-2 in grad norm by
step 20. So a change of the numerics shows in the first steps of every variant, at ~1e-6. A CPU kind whose flip
comes earlier than any recorded one's fails at that step: record it (`python -m tests.golden.record`).
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
TOLERANCE_FLOOR = 1e-6  # relative: 8 float32 ulps, where the recorded kinds happen to agree bit for bit


def cross_cpu_tolerances(by_cpu: Dict[str, dict], name: str, key: str) -> List[float]:
    """Per step: TOLERANCE_FACTOR x the largest relative difference between any two recorded CPU kinds at that step
    or before (the kinds drift apart once they do; never less than TOLERANCE_FLOOR)."""
    if len(by_cpu) < 2:
        raise ValueError("one recorded CPU kind: no cross-CPU difference is measured; record this CPU kind with "
                         "python -m tests.golden.record")
    pairs = list(itertools.combinations(by_cpu.values(), 2))
    steps = len(next(iter(by_cpu.values()))[name][key])
    out, worst = [], 0.0
    for i in range(steps):
        worst = max([worst] + [abs(x[name][key][i] - y[name][key][i]) / abs(y[name][key][i]) for x, y in pairs])
        out.append(max(TOLERANCE_FACTOR * worst, TOLERANCE_FLOOR))
    return out


def reference_cpu(by_cpu: Dict[str, dict], fingerprint: str) -> str:
    """The recording to compare with: this CPU kind's, else one of the same ISA level, else the first."""
    if fingerprint in by_cpu:
        return fingerprint
    level = fingerprint.split(":", 1)[0]
    return next((fp for fp in by_cpu if fp.split(":", 1)[0] == level), next(iter(by_cpu)))


def differences(got: dict, by_cpu: Dict[str, dict], name: str, fingerprint: str) -> List[str]:
    """What is off: bit for bit on a recorded CPU kind, within `cross_cpu_tolerances` elsewhere."""
    ref = by_cpu[reference_cpu(by_cpu, fingerprint)][name]
    if fingerprint in by_cpu:
        return [f"{name} {key}: {got[key]} != {ref[key]}" for key in KEYS
                if [float.hex(x) for x in got[key]] != [float.hex(x) for x in ref[key]]]
    out = []
    for key in KEYS:
        for step, (a, b, tol) in enumerate(zip(got[key], ref[key], cross_cpu_tolerances(by_cpu, name, key)), 1):
            if abs(a - b) / abs(b) > tol:
                out.append(f"{name} {key} step {step}: relative difference {abs(a - b) / abs(b):.3g} > {tol:.3g} "
                           "(3x the cross-CPU one so far)")
                break
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
    """On an unrecorded CPU kind each step's bound is 3x the cross-CPU difference measured so far: a recorded
    sequence with one step moved by 2/3 of its bound passes, by 4/3 fails, and in the first 8 steps (before any
    recorded kinds drift apart) every variant's bound is <= 1.2e-5, so a change of the numerics from the start cannot
    pass (a 6% grad-norm change could, when the bound was one number for the whole sequence)."""
    by_cpu = load_goldens()
    assert len(by_cpu) >= 3
    unrecorded = "AVX2:unrecorded"
    for name in VARIANTS:
        ref = by_cpu[reference_cpu(by_cpu, unrecorded)][name]
        for key in KEYS:
            tols = cross_cpu_tolerances(by_cpu, name, key)
            assert all(0 < t <= 1.2e-5 for t in tols[:8]), (name, key, tols[:8])
            for step in (0, 7, len(tols) - 1):
                for factor, ok in ((2 / 3, True), (4 / 3, False)):
                    got = {k: list(v) for k, v in ref.items()}
                    got[key][step] *= 1 + factor * tols[step]
                    assert (differences(got, by_cpu, name, unrecorded) == []) == ok, (name, key, step, factor)
