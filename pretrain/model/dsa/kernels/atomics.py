"""fp32 rows added into shared gradient buffers: the key gradients of DSA's sparse kernels (GLM-5 report, DSA
section; DeepSeek-V3.2 section 2).

    dst[idx[n], c0 + i] += x[n, i]     for the rows n with ok[n] and the columns c0 + i < limit

Keys are shared between query tokens, so the sparse attention backward (`sparse_mla`, `sparse_mla_dkv`) and the
indexer loss's backward (`indexer_kl`) sum their per-(token, selected key) rows with fp32 atomics: 576 values per
pair in the attention, 128 in the indexer, the largest cost of the 8-16-head backward. Triton 3.6 lowers
`tl.atomic_add` to one scalar reduction per value (`REDG.E.ADD.F32` in SASS) whatever the layout. Hopper also has
16-byte vector reductions (`red.global.add.v4.f32`, PTX ISA 8.1, sm_90), a quarter of the instructions for the same
bytes; `add_rows` can split a tile's columns into four interleaved tensors (columns 4i .. 4i + 3) and issue one such
reduction per four columns through inline PTX. They measured no faster (the reductions are bound by the L2's atomic
throughput in bytes, not by instruction issue), so the scalar form is the default and the vector form a tuning
switch (`DSAKernelTuning.vector_atomics`). Modes
(`reduction_mode`, a kernel constexpr):

- 0: `tl.atomic_add` (any GPU, any widths; the default);
- 1: the four-column grouping through four `tl.atomic_add`s (the interpreter's stand-in for 2: the CPU tests
  check the grouping's addressing);
- 2: `red.global.add.v4.f32` (sm_90+, every width a multiple of 4, 16-byte aligned rows).

Rounding: each value is still one fp32 add in the reduction's order, so results match mode 0 up to the order of
the adds, as two runs of mode 0 do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pretrain.model.dsa.kernels import interpreting
from pretrain.model.dsa.kernels.common import capability


def reduction_mode(t: torch.Tensor, *widths: int, vector: bool = False) -> int:
    """The `add_rows` mode for fp32 rows of buffer `t`: 0 unless `vector` (`DSAKernelTuning.vector_atomics`); then 2
    on CUDA sm_90+, 1 in the interpreter, 0 otherwise, and 0 unless every width (row stride, column limits) is a
    multiple of 4, so that each group of four columns is one aligned 16-byte word."""
    if not vector or t.dtype != torch.float32 or any(int(w) % 4 for w in widths):
        return 0
    if interpreting():
        return 1
    if not t.is_cuda:
        return 0
    return 2 if capability(t.device) >= (9, 0) else 0


@triton.jit
def _red_v4(ptr, x0, x1, x2, x3, mask):
    # one 16-byte reduction per element of the [rows, groups] tensors; the dummy output keeps the asm an op
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $6, 0; @p red.global.add.v4.f32 [$1], {$2, $3, $4, $5}; mov.u32 $0, 0; }",
        "=r,l,f,f,f,f,r", [ptr.to(tl.int64), x0, x1, x2, x3, mask.to(tl.int32)], dtype=tl.int32, is_pure=False,
        pack=1)


@triton.jit
def add_rows(rows, c0, x, ok, limit, MODE: tl.constexpr):
    """rows[n][c0 + i] += x[n, i] (fp32) where ok[n] and c0 + i < limit; rows: [BN] pointers to each row's
    column 0, x: [BN, W] fp32. Modes: see the module docstring."""
    BN: tl.constexpr = x.shape[0]
    W: tl.constexpr = x.shape[1]
    if MODE == 0:
        c = c0 + tl.arange(0, W)
        tl.atomic_add(rows[:, None] + c[None, :], x, mask=ok[:, None] & (c[None, :] < limit), sem="relaxed")
    else:
        # [BN, W] -> [BN, W / 4, 2, 2]: element [n, i, u, v] is column 4i + 2u + v
        a, b = tl.split(tl.reshape(x, (BN, W // 4, 2, 2)))
        x0, x2 = tl.split(a)
        x1, x3 = tl.split(b)
        c = c0 + 4 * tl.arange(0, W // 4)
        p = rows[:, None] + c[None, :]
        m = ok[:, None] & (c[None, :] < limit)
        if MODE == 2:
            _red_v4(p, x0, x1, x2, x3, m)
        else:
            tl.atomic_add(p, x0, mask=m, sem="relaxed")
            tl.atomic_add(p + 1, x1, mask=m, sem="relaxed")
            tl.atomic_add(p + 2, x2, mask=m, sem="relaxed")
            tl.atomic_add(p + 3, x3, mask=m, sem="relaxed")
