"""Which DSA attention kernels run (`pretrain.model.dsa.kernels.plan.kernel_plan`) for each heads per rank and GPU,
against a table written out by hand from the rules in docs/dsa.md: the Gluon kernels only on Hopper (sm_90) at
GLM-5's head dims, the keys-as-M forward at 8-32 heads, the heads-as-M forward and the Gluon first pass at 64, the
separate key-gradient pass from 32 heads, the fused kernel's 96 MiB key partitions below. Pure Python: no GPU, no
Triton launch."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from pretrain.model.dsa.kernels.plan import kernel_plan, key_partitions
from pretrain.model.dsa.kernels.tuning import DEFAULT_TUNING, DSAKernelTuning, KeyGradient

MIB96 = 96 << 20
F, S = KeyGradient.FUSED, KeyGradient.SEPARATE
ARCHS = {"sm_80": (8, 0), "sm_90": (9, 0), "sm_100": (10, 0), "cpu": None}

# (heads, arch) -> (forward, backward first pass, key gradient, partition bytes) at C = 512, R = 64, 32K keys
EXPECTED = {
    (8, "sm_90"): ("gluon-keys-as-M", "triton", F, MIB96),
    (16, "sm_90"): ("gluon-keys-as-M", "triton", F, MIB96),
    (32, "sm_90"): ("gluon-keys-as-M", "triton", S, 0),
    (64, "sm_90"): ("gluon-heads-as-M", "gluon", S, 0),
}
for _arch in ("sm_80", "sm_100", "cpu"):
    EXPECTED.update({(8, _arch): ("triton", "triton", F, MIB96), (16, _arch): ("triton", "triton", F, MIB96),
                     (32, _arch): ("triton", "triton", S, 0), (64, _arch): ("triton", "triton", S, 0)})


@pytest.mark.parametrize("heads,arch", sorted(EXPECTED, key=str))
def test_plan_by_heads_and_arch(heads, arch):
    plan = kernel_plan(heads, 512, 64, 32768, ARCHS[arch])
    assert (plan.forward, plan.first_pass, plan.key_gradient, plan.partition_bytes) == EXPECTED[heads, arch]


def test_plan_log_line():
    assert kernel_plan(16, 512, 64, 32768, (9, 0)).describe() == (
        "DSA kernels: 16 heads/rank sm_90 -> forward=gluon-keys-as-M, backward=triton, "
        "dkv=fused, partitioned(96 MiB)")
    assert kernel_plan(64, 512, 64, 4096, None).describe() == (
        "DSA kernels: 64 heads/rank cpu -> forward=triton, backward=triton, dkv=separate")


def test_plan_follows_config_and_tuning():
    hopper = (9, 0)
    # megatron's deterministic_mode: the fixed-order reduction, no partitions, the Triton first pass
    det = kernel_plan(64, 512, 64, 32768, hopper, deterministic=True)
    assert (det.key_gradient, det.partition_bytes, det.first_pass) == (KeyGradient.DETERMINISTIC, 0, "triton")
    # model.dsa_key_partition_mib: 0 is one pass, a budget applies to the separate pass too
    assert kernel_plan(16, 512, 64, 32768, hopper, key_partition_bytes=0).partition_bytes == 0
    assert kernel_plan(64, 512, 64, 32768, hopper, key_partition_bytes=1 << 20).partition_bytes == 1 << 20
    # the argument before the tuning's budget
    tuned = DSAKernelTuning(key_partition_bytes=5 << 20)
    assert kernel_plan(16, 512, 64, 32768, hopper, tuned).partition_bytes == 5 << 20
    assert kernel_plan(16, 512, 64, 32768, hopper, tuned, key_partition_bytes=0).partition_bytes == 0
    # the Gluon switches; a forced key-gradient mode times the Triton first pass
    off = DSAKernelTuning(gluon_forward=False, gluon_forward_keys_m=False, gluon_first_pass=False)
    for h in (8, 16, 32, 64):
        assert (kernel_plan(h, 512, 64, 32768, hopper, off).forward,
                kernel_plan(h, 512, 64, 32768, hopper, off).first_pass) == ("triton", "triton")
    forced = kernel_plan(64, 512, 64, 32768, hopper, replace(DEFAULT_TUNING, key_gradient=KeyGradient.SEPARATE))
    assert (forced.forward, forced.first_pass) == ("gluon-heads-as-M", "triton")
    timing = kernel_plan(16, 512, 64, 32768, hopper, DSAKernelTuning(key_gradient=KeyGradient.TIMING_NONE))
    assert timing.key_gradient.timing_only and timing.partition_bytes == 0
    # the separate pass's first pass alone: the Gluon one where the plan would take it
    first = kernel_plan(64, 512, 64, 32768, hopper, DSAKernelTuning(key_gradient=KeyGradient.TIMING_FIRST_PASS))
    assert (first.first_pass, first.partition_bytes, first.key_gradient.dkv) == ("gluon", 0, KeyGradient.SEPARATE.dkv)
    # other head dims: C 256 / R 32 take the Gluon kernels, others the Triton ones; other head counts Triton
    assert kernel_plan(64, 256, 32, 4096, hopper).forward == "gluon-heads-as-M"
    assert kernel_plan(16, 192, 64, 4096, hopper).forward == "triton"
    assert kernel_plan(5, 512, 64, 4096, hopper).forward == "triton"
    assert kernel_plan(48, 512, 64, 4096, hopper).key_gradient is KeyGradient.SEPARATE


def test_key_partitions_cover_the_keys_evenly():
    assert key_partitions(37, 32, 0) == [(0, 37)] and key_partitions(37, 32, None) == [(0, 37)]
    assert key_partitions(37, 32, 6 * 32 * 10) == [(0, 10), (10, 20), (20, 30), (30, 37)]
    parts = key_partitions(32768, 576, MIB96)  # 96 MiB of bf16 kv + fp32 dkv rows: 29,127 keys, two partitions
    assert parts == [(0, 16384), (16384, 32768)]


def test_bad_tuning_is_refused():
    with pytest.raises(ValueError, match="key_gradient"):
        DSAKernelTuning(key_gradient=5)
    with pytest.raises(ValueError, match="key_partition_bytes"):
        DSAKernelTuning(key_partition_bytes=-1)
    with pytest.raises(Exception):
        DEFAULT_TUNING.vector_atomics = True  # frozen


def test_backend_says_its_plan_once(caplog):
    """The Triton backend's plan for the inputs it is given, at INFO, once however many layers ask (CPU tensors: the
    interpreter's plan; no kernel runs here)."""
    import torch

    from pretrain.model.dsa.backend import TritonBackend
    from pretrain.notices import forget_said

    forget_said()
    q, kv = torch.zeros(1, 4, 64, 576), torch.zeros(1, 4, 576)
    line = "DSA kernels: 64 heads/rank cpu -> forward=triton, backward=triton, dkv=separate"
    with caplog.at_level(logging.INFO, logger="pretrain.model.dsa.backend"):
        for _ in range(3):
            assert TritonBackend().plan(q, kv, 512).describe() == line
    assert [r.getMessage() for r in caplog.records] == [line]
