"""Which DSA attention kernels run, decided in one place (`kernel_plan`); the DSA backend says it once in the log.

Given the heads per rank, the absorbed head dims (latent C, rope R), the number of keys, the GPU's compute
capability and a `DSAKernelTuning`, the plan names

- the forward: `gluon-heads-as-M` (64 heads on Hopper: the heads are the MMA's M), `gluon-keys-as-M` (8-32 heads on
  Hopper: the selected keys are the MMA's M) or `triton` (any GPU, and the CPU interpreter);
- the backward's first pass (scores, dq): `gluon` (64 heads on Hopper, with the separate key-gradient pass) or
  `triton`;
- the key-gradient pass (`KeyGradient`): fused into the first pass below 32 heads, its own pass from 32 heads,
  deterministic under megatron's deterministic_mode; and the key-partition budget, the bytes of kv + fp32 dkv rows
  that each launch of a partitioned backward keeps in L2 (0: one pass).

The Gluon kernels need sm_90, C in {256, 512} and R in {32, 64}; at run time also bf16 q and kv with 16-byte aligned
kv rows (`hopper.inputs_fit`), else the Triton kernels run. docs/dsa.md lists the kernels' speeds per heads and GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from pretrain.model.dsa.kernels.tuning import DEFAULT_TUNING, DSAKernelTuning, KeyGradient

GLUON_HEADS_AS_M = "gluon-heads-as-M"
GLUON_KEYS_AS_M = "gluon-keys-as-M"
TRITON = "triton"
GLUON = "gluon"

HEADS_AS_M = (64,)  # heads per rank of the 64-head Gluon forward and first pass
KEYS_AS_M = (8, 16, 32)  # heads per rank of the keys-as-M Gluon forward (the N of its MMAs)


@dataclass(frozen=True)
class KernelPlan:
    """`kernel_plan`'s answer; `describe()` is its log line."""

    heads: int
    capability: Optional[Tuple[int, int]]
    forward: str
    first_pass: str
    key_gradient: KeyGradient
    partition_bytes: int

    def describe(self) -> str:
        arch = "cpu" if self.capability is None else f"sm_{self.capability[0]}{self.capability[1]}"
        dkv = self.key_gradient.name.lower().replace("_", "-")
        if self.partition_bytes:
            dkv += f", partitioned({self.partition_bytes / 2**20:g} MiB)"
        return (f"DSA kernels: {self.heads} heads/rank {arch} -> forward={self.forward}, backward={self.first_pass}, "
                f"dkv={dkv}")


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def hopper_shapes(capability, c: int, r: int) -> bool:
    """Whether the Gluon kernels can run on this GPU at these head dims (sm_90, C in {256, 512}, R in {32, 64})."""
    return capability is not None and capability[0] == 9 and c in (256, 512) and r in (32, 64)


def kernel_plan(heads: int, c: int, r: int, seq: int, capability: Optional[Tuple[int, int]],
                tuning: DSAKernelTuning = DEFAULT_TUNING, deterministic: bool = False,
                key_partition_bytes: Optional[int] = None) -> KernelPlan:
    """The kernels of the sparse MLA forward and backward for `heads` heads per rank, latent `c` and rope `r` dims,
    `seq` keys (used by `partitions`, not here), on a GPU of compute `capability` ((major, minor); None: CPU, the
    Triton interpreter). `deterministic`: megatron's deterministic_mode; `key_partition_bytes`: the config's
    `model.dsa_key_partition_mib` in bytes (None: the tuning's, then the default below)."""
    hopper = hopper_shapes(capability, c, r)
    if hopper and tuning.gluon_forward and heads in HEADS_AS_M:
        forward = GLUON_HEADS_AS_M
    elif hopper and tuning.gluon_forward_keys_m and heads in KEYS_AS_M:
        forward = GLUON_KEYS_AS_M
    else:
        forward = TRITON
    if tuning.key_gradient is not None:
        mode = tuning.key_gradient
    elif deterministic:
        mode = KeyGradient.DETERMINISTIC
    else:
        # From 32 heads the separate pass pays (H200: 1.7-1.9x at 64 heads, 1.13x at 32); below, the fused kernel's
        # key-side products are small and hide behind its gathers.
        mode = KeyGradient.SEPARATE if _pow2(heads) >= 32 else KeyGradient.FUSED
    # A forced key-gradient mode times the Triton first pass, but for the separate pass's first pass alone.
    separate_first = ((mode is KeyGradient.SEPARATE and tuning.key_gradient is None)
                      or mode is KeyGradient.TIMING_FIRST_PASS)
    gluon_first = separate_first and hopper and tuning.gluon_first_pass and heads in HEADS_AS_M
    budget = 0
    if mode in (KeyGradient.FUSED, KeyGradient.SEPARATE):
        for given in (key_partition_bytes, tuning.key_partition_bytes):
            if given is not None:
                budget = int(given)
                break
        else:  # the fused kernel gains from partitions past ~16K keys; the separate pass gained nothing measurable
            budget = 0 if mode is KeyGradient.SEPARATE else tuning.fused_partition_bytes
    return KernelPlan(int(heads), None if capability is None else tuple(capability), forward,
                      GLUON if gluon_first else TRITON, mode, budget)


def key_partitions(t: int, d: int, budget=None) -> List[Tuple[int, int]]:
    """[(lo, hi), ...]: `t` keys split evenly into the fewest ranges whose rows take at most `budget` bytes as kv
    (bf16) plus fp32 key gradient, d values each; [(0, t)] without a budget. Past ~16K keys kv and the fp32 key
    gradient outgrow L2 and the backward's per-pair atomics and gathers go to HBM; one launch per partition keeps
    each launch's working set within `budget`."""
    if not budget:
        return [(0, t)]
    per = max(1, int(budget) // (6 * d))
    n = -(-t // per)
    per = -(-t // n)
    return [(i * per, min(t, (i + 1) * per)) for i in range(n)]


__all__ = ["GLUON", "GLUON_HEADS_AS_M", "GLUON_KEYS_AS_M", "KernelPlan", "TRITON", "hopper_shapes", "kernel_plan",
           "key_partitions"]
