"""The DSA kernels' tuning: every launch parameter and kernel switch in one frozen object (`DSAKernelTuning`).

The defaults are the measured choices (docs/dsa.md has the kernel table). The DSA backend holds one tuning and hands
it to every kernel call; a script that times another choice builds its own (`dataclasses.replace(DEFAULT_TUNING,
...)`) and passes it, so no module state is ever changed from outside. Which kernels a tuning runs for a given layer
shape and GPU is `plan.kernel_plan`'s answer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional, Tuple


class KeyGradient(enum.Enum):
    """How the sparse MLA backward forms the key/value gradient (the value is the backward kernel's DKV constexpr).

    FUSED: next to dq in the first pass, rows added by fp32 atomics (the default below 32 heads per rank);
    DETERMINISTIC: per-(token, slot) rows summed per key in a fixed order (`segment_sum`; megatron's
    deterministic_mode); SEPARATE: the first pass stores dS and P per (token, slot) and a pass of its own
    (`sparse_mla_dkv`) forms the gradient (the default from 32 heads per rank). The TIMING_ modes exist to time parts
    of the backward and leave dkv wrong: the fused first pass without key gradient (NONE) or with its key-side
    products but no write (UNWRITTEN), and SEPARATE's first pass without its key-gradient pass (FIRST_PASS)."""

    FUSED = 0
    DETERMINISTIC = 1
    TIMING_NONE = 2
    TIMING_UNWRITTEN = 3
    SEPARATE = 5
    TIMING_FIRST_PASS = 6

    @property
    def timing_only(self) -> bool:
        return self in (KeyGradient.TIMING_NONE, KeyGradient.TIMING_UNWRITTEN, KeyGradient.TIMING_FIRST_PASS)

    @property
    def dkv(self) -> int:
        """The backward kernel's DKV constexpr."""
        return KeyGradient.SEPARATE.value if self is KeyGradient.TIMING_FIRST_PASS else self.value


@dataclass(frozen=True)
class SelectTuning:
    """The radix top-k selection (`radix_select`): `block` keys per load and `warps` per row program; `prefetch`:
    each pass loads its next block while it works on this one; `sample`: a sampled threshold first (rows of 8K keys
    or more), `sample_chunks` chunks of n / 1,024 keys, at most `sample_chunk`, at least `sample_min_chunk`;
    `capacity`: candidates kept per row after two radix passes, in multiples of K; `scratch_bytes`: the candidates'
    scratch, rows beyond it are selected in further launches."""

    block: int = 512
    warps: int = 4
    prefetch: bool = True
    sample: bool = True
    sample_chunks: int = 64
    sample_chunk: int = 128
    sample_min_chunk: int = 8
    capacity: int = 2
    scratch_bytes: int = 64 << 20


@dataclass(frozen=True)
class DSAKernelTuning:
    """What the DSA kernels run and how they launch. Fields:

    gluon_forward, gluon_forward_keys_m, gluon_first_pass: the Hopper (sm_90) Gluon kernels may run (the 64-head
    forward with heads as the MMA's M, the 8-32-head forward with the selected keys as M, the 64-head backward's
    first pass); False: the Triton kernels there too.
    key_gradient: force a `KeyGradient` (None: the plan's choice; a forced mode runs the Triton first pass).
    key_partition_bytes: bytes of kv + fp32 dkv rows per key partition of the backward (0: one pass; None: the
    fused kernel's `fused_partition_bytes`, none on the separate pass). `dq32_bytes`: the fp32 query-gradient
    accumulator of a partitioned fused backward (blocks of query rows within it); `dkv_scratch_bytes`: the
    separate pass's [dS | P] buffer (blocks of query rows within it).
    vector_atomics: fp32 row adds as 16-byte vector reductions on sm_90+ (four-column groups in the interpreter).
    triton_tiles: (BN, num_warps, num_stages, CC) of the Triton sparse MLA kernels (None: by heads, `kernel_config`);
    dkv_tiles: (BN, DS, num_warps, num_stages) of the key-gradient pass (None: `dkv_config`).
    gluon_forward_tiles, keys_m_tiles, dq_tiles: (BN keys per block, NBUF stages) of the Gluon forwards and the
    query-gradient kernel; first_pass_tiles: (BN,) of the score kernel (two stages).
    score_tiles: (BM tokens, BN keys, num_warps, num_stages, keys as the MMA's M) of the top-k's score kernel (BM 0:
    128 // heads); kl_tiles: (BN slots, num_warps, num_stages, slots as the MMA's M) of the sparse indexer loss.
    select: the top-k selection's `SelectTuning`."""

    gluon_forward: bool = True
    gluon_forward_keys_m: bool = True
    gluon_first_pass: bool = True
    key_gradient: Optional[KeyGradient] = None
    key_partition_bytes: Optional[int] = None
    fused_partition_bytes: int = 96 << 20
    dq32_bytes: int = 1 << 28
    dkv_scratch_bytes: int = 1 << 30
    vector_atomics: bool = False
    triton_tiles: Optional[Tuple[int, int, int, int]] = None
    dkv_tiles: Optional[Tuple[int, int, int, int]] = None
    gluon_forward_tiles: Tuple[int, int] = (64, 2)
    keys_m_tiles: Tuple[int, int] = (64, 2)
    first_pass_tiles: Tuple[int] = (32,)
    dq_tiles: Tuple[int, int] = (64, 2)
    score_tiles: Tuple[int, int, int, int, bool] = (0, 64, 4, 3, True)
    kl_tiles: Tuple[int, int, int, int] = (64, 4, 2, 1)
    select: SelectTuning = field(default_factory=SelectTuning)

    def __post_init__(self):
        if self.key_gradient is not None and not isinstance(self.key_gradient, KeyGradient):
            raise ValueError(f"DSAKernelTuning.key_gradient must be a KeyGradient or None, got {self.key_gradient!r}")
        if self.key_partition_bytes is not None and int(self.key_partition_bytes) < 0:
            raise ValueError(f"DSAKernelTuning.key_partition_bytes must be >= 0, got {self.key_partition_bytes}")


DEFAULT_TUNING = DSAKernelTuning()

__all__ = ["DEFAULT_TUNING", "DSAKernelTuning", "KeyGradient", "SelectTuning"]
