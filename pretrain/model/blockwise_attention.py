"""Blockwise attention merged by log-sum-exp: causal attention over keys that end after the queries, at the speed
of plain (top-left) causal and unmasked calls.

A query row i that sees the keys of blocks B_1 .. B_n (disjoint key ranges) is attended block by block,

    o_i^b = sum_{j in B_b} exp(s_ij - l_i^b) v_j,     l_i^b = log sum_{j in B_b} exp(s_ij),     s_ij = scale q_i . k_j

and the blocks are merged exactly by their log-sum-exps (online softmax: Milakov & Gimelshein 2018; FlashAttention,
Dao et al. 2022, section 3.1):

    L_i = log sum_b exp(l_i^b),     o_i = sum_b exp(l_i^b - L_i) o_i^b.

Backward (FlashAttention-2, Dao 2023, algorithm 2): with the merged O and L, P_ij = exp(s_ij - L_i) and
D_i = dO_i . o_i, the gradient of the scores is dS_ij = P_ij (dO_i . v_j - D_i) for every key of every block, so
each block's backward kernel, handed the merged output and log-sum-exp in place of its own, returns exactly that
block's share of dq, dk and dv (what ring attention does, Liu et al. 2023, and torch's own context parallelism,
`torch.distributed.tensor.experimental`).

Why: context parallelism (`parallel.context_parallel`) gives a rank query chunks whose keys begin before them; a
chunk at global rows [g, g + n) sees keys [0, g + n), causal aligned to the last key (bottom-right). SDPA never
sends a bottom-right causal bias to cuDNN (its fastest kernel on Hopper): it takes flash or memory-efficient
attention, 1.55-1.72x an even split of one causal cuDNN call (docs/long_context.md). Split as

    keys [0, g)        non-causal block (no mask: every kernel's fast path)
    keys [g, g + n)    causal square (top-left = bottom-right for a square: plain is_causal)

and merged here, the same pairs are attended by the kernels a single causal call uses.

Kernels (`choose_kernel`: the first that takes the tensors, said once): on CUDA cuDNN
(`aten._scaled_dot_product_cudnn_attention` and its backward), else FlashAttention-2
(`aten._scaled_dot_product_flash_attention`), bf16 / fp16, no dropout; on CPU the flash kernel for CPU
(`aten._scaled_dot_product_flash_attention_for_cpu`), any float dtype. Each returns the log-sum-exp SDPA itself
discards. Where none applies (fp32 on CUDA, attention dropout) the caller keeps its bottom-right SDPA calls and says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

aten = torch.ops.aten

Block = Tuple[int, int, bool]  # keys [k0, k1), causal (then k1 - k0 equals the row count: a square)
Rows = Tuple[int, int, Tuple[Block, ...]]  # query rows [q0, q1) and the key blocks they see (disjoint)


@dataclass(frozen=True)
class Kernel:
    """One backend's attention with log-sum-exp: forward(q, k, v, causal, scale) -> (out, lse [b, h, s] fp32, or
    fp64 for fp64 inputs, aux);
    backward(dout, q, k, v, out, lse, causal, scale, aux) -> (dq, dk, dv). Tensors [b, h, s, d], equal head counts."""

    name: str
    forward: Callable
    backward: Callable
    equal_head_dims: bool  # q / k and v head dims must match (on CPU they are zero-padded to match)


def _cpu_forward(q, k, v, causal, scale):
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, None


def _cpu_backward(dout, q, k, v, out, lse, causal, scale, aux):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal, scale=scale)


def _cudnn_forward(q, k, v, causal, scale):
    out, lse, cu_q, cu_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out, lse.view(lse.shape[:3]), (cu_q, cu_k, max_q, max_k, seed, offset)  # cuDNN's lse is [b, h, s, 1]


def _cudnn_backward(dout, q, k, v, out, lse, causal, scale, aux):
    cu_q, cu_k, max_q, max_k, seed, offset = aux
    return aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse.unsqueeze(-1).contiguous(), seed, offset, None, cu_q, cu_k, max_q, max_k, 0.0, causal,
        scale=scale)[:3]


def _flash_forward(q, k, v, causal, scale):
    out, lse, cu_q, cu_k, max_q, max_k, rng, unused, _ = aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale)
    return out, lse, (cu_q, cu_k, max_q, max_k, rng, unused)


def _flash_backward(dout, q, k, v, out, lse, causal, scale, aux):
    cu_q, cu_k, max_q, max_k, rng, unused = aux
    return aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), cu_q, cu_k, max_q, max_k, 0.0, causal, rng, unused, scale=scale)[:3]


CPU = Kernel("flash attention for CPU", _cpu_forward, _cpu_backward, equal_head_dims=True)
CUDNN = Kernel("cuDNN", _cudnn_forward, _cudnn_backward, equal_head_dims=False)
FLASH = Kernel("FlashAttention-2", _flash_forward, _flash_backward, equal_head_dims=True)


def choose_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float):
    """(kernel, None) for these [b, h, s, d] tensors, or (None, why none applies)."""
    if dropout_p > 0:
        return None, "attention dropout: the merged backward would need each block's dropout mask"
    if not q.is_cuda:
        if q.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            return None, f"no CPU kernel for {q.dtype}"
        return CPU, None
    if q.dtype not in (torch.bfloat16, torch.float16):
        return None, f"cuDNN and FlashAttention take bf16 / fp16, got {q.dtype}"
    from torch.backends import cuda

    def takes(can_use, *qkv, causal: bool) -> bool:
        return can_use(cuda.SDPAParams(*qkv, None, 0.0, causal, qkv[1].shape[1] != qkv[0].shape[1]), False)

    s = q.shape[2]
    square = (q, k[:, :, :s], v[:, :, :s])  # the causal blocks are squares
    if takes(cuda.can_use_cudnn_attention, *square, causal=True) and takes(cuda.can_use_cudnn_attention, q, k, v,
                                                                            causal=False):
        return CUDNN, None
    if q.shape[-1] == v.shape[-1] and q.shape[-1] % 8 == 0 and takes(cuda.can_use_flash_attention, *square,
                                                                      causal=True):
        return FLASH, None
    return None, "neither cuDNN nor FlashAttention takes these tensors (head dims, alignment, GPU or disabled)"


class _Blockwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rows: Sequence[Rows], scale: float, kernel: Kernel):
        b, h, s, _ = q.shape
        out = q.new_empty(b, h, s, v.shape[-1])
        lse = q.new_empty(b, h, s, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
        aux = []
        for q0, q1, blocks in rows:
            acc, acc_lse = None, None
            for k0, k1, causal in blocks:
                o, block_lse, a = kernel.forward(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], causal, scale)
                aux.append(a)
                block_lse = block_lse.to(lse.dtype)
                if acc is None:
                    acc, acc_lse = o, block_lse
                    continue
                merged = torch.logaddexp(acc_lse, block_lse)
                acc = (acc.to(lse.dtype) * (acc_lse - merged).exp().unsqueeze(-1)
                       + o.to(lse.dtype) * (block_lse - merged).exp().unsqueeze(-1))
                acc_lse = merged
            out[:, :, q0:q1] = acc
            lse[:, :, q0:q1] = acc_lse
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.rows, ctx.scale, ctx.kernel, ctx.aux = rows, scale, kernel, aux
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dout = dout.contiguous()  # the strides of `out` (cuDNN reads dO in O's layout)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        aux = iter(ctx.aux)
        for q0, q1, blocks in ctx.rows:
            rows = slice(q0, q1)
            for k0, k1, causal in blocks:
                keys = slice(k0, k1)
                gq, gk, gv = ctx.kernel.backward(dout[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys],
                                                 out[:, :, rows], lse[:, :, rows], causal, ctx.scale, next(aux))
                dq[:, :, rows] += gq
                dk[:, :, keys] += gk
                dv[:, :, keys] += gv
        return dq, dk, dv, None, None, None


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: Sequence[Rows], scale: float,
                        kernel: Kernel) -> torch.Tensor:
    """q [b, h, s, d], k [b, g, t, d], v [b, g, t, dv] (g divides h) -> [b, h, s, dv]: each query row range of `rows`
    attends to its key blocks (a causal block is a square: row q0 + i sees keys k0 .. k0 + i), merged by their
    log-sum-exps. `rows` must cover [0, s); `kernel` from `choose_kernel`. Differentiable in q, k and v."""
    if k.shape[1] != q.shape[1]:  # GQA: the kernels take equal head counts; autograd sums the copies' gradients
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    d, dv = q.shape[-1], v.shape[-1]
    if kernel.equal_head_dims and d != dv:  # zero columns change neither the scores nor the kept output columns
        width = max(d, dv)
        q, k, v = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
        return _Blockwise.apply(q, k, v, tuple(rows), scale, kernel)[..., :dv]
    return _Blockwise.apply(q, k, v, tuple(rows), scale, kernel)


def bottom_right_rows(q0: int, q1: int, k0: int, k1: int) -> Rows:
    """Query rows [q0, q1) at the last q1 - q0 positions of keys [k0, k1), bottom-right causal: a non-causal block
    over the keys before them (when there are any) and a causal square over their own."""
    n = q1 - q0
    if k1 - k0 < n:
        raise ValueError(f"bottom-right causal rows need at least as many keys as queries, got {k1 - k0} < {n}")
    square = (k1 - n, k1, True)
    return (q0, q1, ((k0, k1 - n, False), square) if k1 - n > k0 else (square,))


def attend_bottom_right(q, k, v, scale: float, kernel: Optional[Kernel]) -> torch.Tensor:
    """Bottom-right causal attention of q [b, h, s, d] to k / v [b, g, t, *] (t >= s) through `bottom_right_rows`."""
    return blockwise_attention(q, k, v, (bottom_right_rows(0, q.shape[2], 0, k.shape[2]),), scale, kernel)


__all__ = ["CPU", "CUDNN", "FLASH", "Kernel", "attend_bottom_right", "blockwise_attention", "bottom_right_rows",
           "choose_kernel"]
