"""Triton kernels of the sequence-chunked vocab-parallel cross-entropy (`pretrain.model.output_loss`).

They work on one chunk's logits z = h W^T [n, V_local] in the GEMM's dtype (bf16 on the GPU) and never
make an fp32 copy of them. With this rank's vocabulary slice [v0, v0 + V_local), label y_i and per-token
weight w_i (loss mask x scale x the backward's scalar):

1. `row_stats` (one read of z): per row, the local max and sum of exponentials by the online rule
   (fp32 accumulators; per lane  m' = max(m, z),  s' = s e^{m - m'} + e^{z - m'},  lanes merged at the
   end), and the target logit z_{i, y_i - v0} when this rank owns y_i, else 0.
2. Across tensor-parallel ranks (`combine_rank_stats`, the caller's all-reduces):
       M_i = max_r m_ir,   S_i = sum_r s_ir e^{m_ir - M_i},   t_i = sum_r t_ir
       lse_i = M_i + log S_i,   loss_i = lse_i - t_i.
3. `softmax_grad_` (one read and one write of z): the gradient of sum_i w_i loss_i with respect to z,
       dz_iv = w_i (e^{z_iv - lse_i} - [v = y_i - v0]),
   written over z in place, in z's dtype; the caller then forms dh = dz W and dW += dz^T h.

This is Liger's fused linear cross-entropy (Hsu et al., "Liger Kernel", 2024: logits chunk, softmax
gradient in place, then the two GEMMs) with megatron-core's vocab-parallel statistics.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    # the vocabulary loops have data-dependent bounds, which Triton 3.6's CPU interpreter needs fixed for
    from pretrain.compat.triton_interpreter import patch_triton_interpreter

    patch_triton_interpreter()

DEFAULT_BLOCK_V = 4096
NEG_FLOOR: tl.constexpr = tl.constexpr(-3.0e38)  # below any finite logit, above -inf


def _block(v_local: int, block_v: Optional[int]) -> int:
    return block_v if block_v is not None else min(DEFAULT_BLOCK_V, triton.next_power_of_2(v_local))


@triton.jit
def _row_stats_kernel(z_ptr, y_ptr, max_ptr, sum_ptr, tgt_ptr, stride_z, V, vocab_start,
                      BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * stride_z
    cols = tl.arange(0, BLOCK_V)
    # a finite floor rather than -inf: lanes past V never make (-inf) - (-inf) = nan; exp(floor - z) = 0
    m = tl.full([BLOCK_V], NEG_FLOOR, tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        ok = v0 + cols < V
        z = tl.load(base + v0 + cols, mask=ok, other=NEG_FLOOR).to(tl.float32)
        m_new = tl.maximum(m, z)
        s = s * tl.exp(m - m_new) + tl.where(ok, tl.exp(z - m_new), 0.0)
        m = m_new
    row_max = tl.max(m, axis=0)
    row_sum = tl.sum(s * tl.exp(m - row_max), axis=0)
    local = tl.load(y_ptr + row) - vocab_start
    own = (local >= 0) & (local < V)
    target = tl.load(base + tl.where(own, local, 0), mask=own, other=0.0).to(tl.float32)
    tl.store(max_ptr + row, row_max)
    tl.store(sum_ptr + row, row_sum)
    tl.store(tgt_ptr + row, tl.where(own, target, 0.0))


@triton.jit
def _softmax_grad_kernel(z_ptr, y_ptr, lse_ptr, w_ptr, stride_z, V, vocab_start, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * stride_z
    cols = tl.arange(0, BLOCK_V)
    lse = tl.load(lse_ptr + row)
    w = tl.load(w_ptr + row)
    local = tl.load(y_ptr + row) - vocab_start
    for v0 in range(0, V, BLOCK_V):
        ok = v0 + cols < V
        z = tl.load(base + v0 + cols, mask=ok, other=0.0).to(tl.float32)
        dz = w * tl.exp(z - lse) - tl.where(v0 + cols == local, w, 0.0)
        tl.store(base + v0 + cols, dz.to(z_ptr.dtype.element_ty), mask=ok)


def _check(z: torch.Tensor, labels: torch.Tensor) -> None:
    if z.dim() != 2 or z.stride(1) != 1:
        raise ValueError(f"logits must be [n, V] with contiguous rows, got shape {tuple(z.shape)} "
                         f"strides {z.stride()}")
    if labels.shape != (z.shape[0],):
        raise ValueError(f"labels must be [{z.shape[0]}], got {tuple(labels.shape)}")


def row_stats(z: torch.Tensor, labels: torch.Tensor, vocab_start: int, block_v: Optional[int] = None
              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row max, sum of exp(z - row max), target logit or 0), fp32 [n] each, of logits z [n, V_local]."""
    _check(z, labels)
    n, v = z.shape
    out = torch.empty(3, n, dtype=torch.float32, device=z.device)
    if n:
        _row_stats_kernel[(n,)](z, labels.contiguous(), out[0], out[1], out[2], z.stride(0), v, vocab_start,
                                BLOCK_V=_block(v, block_v), num_warps=8)
    return out[0], out[1], out[2]


def combine_rank_stats(row_max: torch.Tensor, row_sum: torch.Tensor, target: torch.Tensor, all_reduce_max,
                       all_reduce_sum) -> Tuple[torch.Tensor, torch.Tensor]:
    """(lse, loss) fp32 [n] from the ranks' local statistics; `all_reduce_*` reduce a tensor in place
    over the tensor-parallel group (identity with one rank). Two collectives: the max, then the
    rescaled sums and the targets together."""
    global_max = all_reduce_max(row_max.clone())
    sums = torch.stack([row_sum * torch.exp(row_max - global_max), target])
    sums = all_reduce_sum(sums)
    lse = global_max + torch.log(sums[0])
    return lse, lse - sums[1]


def softmax_grad_(z: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, weights: torch.Tensor,
                  vocab_start: int, block_v: Optional[int] = None) -> torch.Tensor:
    """Overwrite logits z [n, V_local] with w_i (softmax(z)_iv - [v = y_i - v0]) and return z."""
    _check(z, labels)
    n, v = z.shape
    if n:
        _softmax_grad_kernel[(n,)](z, labels.contiguous(), lse.float().contiguous(), weights.float().contiguous(),
                                   z.stride(0), v, vocab_start, BLOCK_V=_block(v, block_v), num_warps=8)
    return z
