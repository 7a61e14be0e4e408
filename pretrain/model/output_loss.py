"""Sequence-chunked output projection and cross-entropy (GLM-5 report, section on training infrastructure).

The output layer of a large-vocabulary model materializes `[tokens, vocab]` logits (GLM-5: 154,880
columns; 32K tokens x 155K x 4 bytes = 20 GB in fp32) and their gradient. GLM-5 computes logits and
loss chunk by chunk along the sequence, each chunk's forward and backward before the next, so the full
logits never exist. Per chunk c of n tokens with hidden states h [n, H], this rank's vocabulary slice
W [V/tp, H] (rows v0..v1 of the vocabulary under tensor parallelism), labels y and per-token loss
weights m (loss mask x any scaling):

    z      = h W^T                                    [n, V/tp], in the weight's dtype
    lse_i  = log sum_v exp z_iv                        max and sum all-reduced over the TP group
    loss_i = lse_i - z_{i, y_i}                        the target logit all-reduced (one rank holds it)
    dz     = m_i (softmax(z)_iv - [v = y_i])           the gradient of sum_i m_i loss_i
    dh    += dz W,  dW += dz^T h                       dh is this rank's partial sum (see below)

which is megatron-core's vocab-parallel cross-entropy, done per chunk with its gradient. The function
returns `sum_i m_i loss_i` (a scalar: its gradient is known at forward time up to the scalar the
backward brings) and the per-token losses, detached, for logging.

Two implementations of the chunk loop. On CUDA (bf16 / fp16 / fp32) the Triton kernels of
`pretrain.model.output_loss_kernels` read each chunk's logits once in the GEMM's dtype for max, sum of
exponentials and target, and once more to write dz over them in place; dW sums in fp32 inside the GEMM
(`torch.addmm(..., out_dtype=float32)`). Memory above the inputs and their gradients: one chunk's logits
in the weight's dtype, plus dW's fp32 sum (4 bytes x V/tp x H) unless `fp32_grad_weight=False` sums it
in the weight's dtype as Liger does (its error grows with the number of chunks:
tests/test_output_loss_kernels.py). Elsewhere (CPU, float64, no triton) a PyTorch loop does the same
in fp32 (float64 for float64) with elementwise passes over an fp32 copy of the logits.

Under tensor parallelism `hidden` must be the output layer's input as each rank sees it (after
megatron's copy-to-TP region or the sequence-parallel all-gather): the partial dh returned here is
summed over TP by that region's backward, as for the unchunked ColumnParallelLinear.
"""

from __future__ import annotations

import importlib.util
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from pretrain.model.notices import warn_once


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _warn_once(reason: str) -> None:
    warn_once(f"chunked output loss: {reason}", stacklevel=3)


def use_kernels(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the chunk loop takes the Triton path (`pretrain.model.output_loss_kernels`): CUDA tensors in
    bf16 / fp16 / fp32 with triton installed. CPU tensors take the PyTorch path; a CUDA run that cannot
    use the kernels says why, once."""
    if hidden.device.type != "cuda":
        return False
    if importlib.util.find_spec("triton") is None:
        _warn_once("triton is not installed, so the loss runs its PyTorch path on CUDA (fp32 copies of each "
                   "chunk's logits, about 2x slower); install triton")
        return False
    if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32) or hidden.dtype != weight.dtype:
        _warn_once(f"hidden {hidden.dtype} / weight {weight.dtype} have no Triton path (it takes one of bf16, fp16, "
                   "fp32 for both), so the loss runs its PyTorch path")
        return False
    return True


_FUSED_FP32_ADDMM = [True]  # until cuBLAS refuses bf16 x bf16 -> fp32 with an fp32 addend in place


def grad_weight_accumulation() -> str:
    """How an fp32 dW sums bf16 / fp16 products on CUDA in this process so far: inside the GEMM, or
    through a product temporary (after torch refused the former)."""
    return "fp32 in the GEMM" if _FUSED_FP32_ADDMM[0] else "fp32, adding a bf16 product temporary"


def accumulate_grad_weight(grad_weight: torch.Tensor, dz: torch.Tensor, h: torch.Tensor) -> None:
    """grad_weight += dz^T h. An fp32 `grad_weight` with bf16/fp16 operands accumulates in the GEMM's
    epilogue (`torch.addmm(..., out_dtype=torch.float32)`, cuBLAS on CUDA) without a product temporary;
    where torch has no such kernel, the product in the operands' dtype is added in fp32 (logged once)."""
    if grad_weight.dtype == dz.dtype:
        grad_weight.addmm_(dz.t(), h)
        return
    if _FUSED_FP32_ADDMM[0] and grad_weight.is_cuda:
        try:
            torch.addmm(grad_weight, dz.t(), h, out_dtype=grad_weight.dtype, out=grad_weight)
            return
        except (RuntimeError, TypeError, NotImplementedError) as err:
            _FUSED_FP32_ADDMM[0] = False
            _warn_once(f"torch {torch.__version__} has no in-place {dz.dtype} x {dz.dtype} -> "
                       f"{grad_weight.dtype} addmm ({str(err).splitlines()[0]}); dW adds a {dz.dtype} product "
                       "temporary per chunk")
    grad_weight += dz.t() @ h


def _chunks_torch(hidden, weight, labels, loss_weights, chunk_size, vocab_start, tp_group, grad_weight,
                  need_grad_hidden, acc):
    """The reference loop: elementwise passes in `acc` (dW's summing dtype) over each chunk's logits.
    Without `grad_weight` and `need_grad_hidden` (evaluation) no softmax gradient or GEMM of the backward runs."""
    n_tokens = hidden.shape[0]
    need_dz = grad_weight is not None or need_grad_hidden
    grad_hidden = torch.empty_like(hidden) if need_grad_hidden else None
    losses = torch.empty(n_tokens, dtype=acc, device=hidden.device)
    vocab_local = weight.shape[0]
    for start in range(0, n_tokens, chunk_size):
        end = min(start + chunk_size, n_tokens)
        h, y, m = hidden[start:end], labels[start:end], loss_weights[start:end].to(acc)
        z = (h @ weight.t()).to(acc)
        zmax = _all_reduce(z.max(dim=1).values, dist.ReduceOp.MAX, tp_group)
        z.sub_(zmax[:, None])
        exp = z.exp()
        sumexp = _all_reduce(exp.sum(dim=1), dist.ReduceOp.SUM, tp_group)
        local = y - vocab_start
        own = (local >= 0) & (local < vocab_local)
        idx = torch.where(own, local, torch.zeros_like(local))
        target = torch.where(own, z.gather(1, idx[:, None]).squeeze(1), torch.zeros_like(zmax))
        target = _all_reduce(target, dist.ReduceOp.SUM, tp_group)
        losses[start:end] = sumexp.log() - target
        if not need_dz:
            continue
        dz = exp.div_(sumexp[:, None])  # softmax, in place of exp
        rows = torch.arange(end - start, device=dz.device)
        dz[rows[own], idx[own]] -= 1.0
        dz.mul_(m[:, None])
        dz = dz.to(weight.dtype)
        if need_grad_hidden:
            grad_hidden[start:end] = (dz @ weight).to(hidden.dtype)
        if grad_weight is not None:
            accumulate_grad_weight(grad_weight, dz, h)
    return grad_hidden, losses


def _chunks_triton(hidden, weight, labels, loss_weights, chunk_size, vocab_start, tp_group, grad_weight,
                   need_grad_hidden):
    """Each chunk's logits in the weight's dtype: one kernel pass for the statistics, one writing dz over
    the logits in place, then the two GEMMs (dh straight into its rows of grad_hidden). Without
    `grad_weight` and `need_grad_hidden` (evaluation) only the statistics pass runs."""
    from pretrain.model import output_loss_kernels as kernels

    def all_reduce_max(t):
        return _all_reduce(t, dist.ReduceOp.MAX, tp_group)

    def all_reduce_sum(t):
        return _all_reduce(t, dist.ReduceOp.SUM, tp_group)

    n_tokens = hidden.shape[0]
    need_dz = grad_weight is not None or need_grad_hidden
    grad_hidden = torch.empty_like(hidden) if need_grad_hidden else None
    losses = torch.empty(n_tokens, dtype=torch.float32, device=hidden.device)
    labels = labels.contiguous()
    buffer = torch.empty(min(chunk_size, n_tokens), weight.shape[0], dtype=weight.dtype, device=weight.device)
    for start in range(0, n_tokens, chunk_size):
        end = min(start + chunk_size, n_tokens)
        h, y = hidden[start:end], labels[start:end]
        z = torch.mm(h, weight.t(), out=buffer[:end - start])
        row_max, row_sum, target = kernels.row_stats(z, y, vocab_start)
        lse, losses[start:end] = kernels.combine_rank_stats(row_max, row_sum, target, all_reduce_max,
                                                            all_reduce_sum)
        if not need_dz:
            continue
        dz = kernels.softmax_grad_(z, y, lse, loss_weights[start:end], vocab_start)
        if need_grad_hidden:
            torch.mm(dz, weight, out=grad_hidden[start:end])
        if grad_weight is not None:
            accumulate_grad_weight(grad_weight, dz, h)
    return grad_hidden, losses


def grad_weight_buffer(weight: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """dW's running sum over the chunks, zeros in `acc`."""
    return torch.zeros(weight.shape, dtype=acc, device=weight.device)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_i m_i CE(h_i W^T, y_i), chunk by chunk along the tokens, vocabulary-parallel over `tp_group`."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, loss_weights, chunk_size: int, vocab_start: int, tp_group,
                kernels: bool = False, fp32_grad_weight: bool = True, grad_enabled: bool = True):
        # the gradients are computed here, so only those autograd will ask for: none under no_grad (the
        # caller's grad mode: inside forward it is always off, and needs_input_grad ignores it) and none for
        # frozen inputs. Evaluation runs the forward statistics alone, with no dW buffer.
        need_dh, need_dw = (grad_enabled and ctx.needs_input_grad[i] for i in (0, 1))
        wide = torch.float64 if weight.dtype == torch.float64 else torch.float32
        acc = wide if fp32_grad_weight else weight.dtype
        grad_weight = grad_weight_buffer(weight, acc) if need_dw else None
        args = (hidden, weight, labels, loss_weights, chunk_size, vocab_start, tp_group, grad_weight, need_dh)
        grad_hidden, losses = _chunks_triton(*args) if kernels else _chunks_torch(*args, acc)
        # held on ctx, not saved: the backward scales them in place (no second copy of dW)
        ctx.grads = [grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype)]
        del grad_weight
        loss = (losses * loss_weights.to(losses.dtype)).sum()
        ctx.mark_non_differentiable(losses)
        return loss, losses

    @staticmethod
    def backward(ctx, grad_loss, _grad_losses):
        if ctx.grads is None:
            raise RuntimeError("chunked output loss: backward ran twice through one forward (retain_graph)")
        grad_hidden, grad_weight = ctx.grads
        ctx.grads = None
        if grad_hidden is not None:
            grad_hidden.mul_(grad_loss.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight.mul_(grad_loss.to(grad_weight.dtype))
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    loss_weights: torch.Tensor,
    chunk_size: int,
    vocab_start: int = 0,
    tp_group: Optional[dist.ProcessGroup] = None,
    impl: str = "auto",
    fp32_grad_weight: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sum_i m_i loss_i, per-token losses) for hidden [..., H], weight [V/tp, H], labels / weights [...].

    `impl`: "auto" (the Triton kernels on CUDA, see `use_kernels`; PyTorch elsewhere), "triton" or "torch".
    `fp32_grad_weight`: dW summed over chunks in fp32 (default), or in the weight's dtype as Liger does
    (saves 4 bytes x V/tp x H; each chunk's product is rounded into a bf16 running sum)."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be auto, triton or torch, got {impl!r}")
    kernels = use_kernels(hidden, weight) if impl == "auto" else impl == "triton"
    shape = labels.shape
    loss, losses = ChunkedLinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), loss_weights.reshape(-1), chunk_size,
        vocab_start, tp_group, kernels, fp32_grad_weight, torch.is_grad_enabled(),
    )
    return loss, losses.view(shape)


def auto_chunk_size(tokens: int, vocab_local: int, element_bytes: int = 2, budget_bytes: int = 1 << 30) -> int:
    """Tokens per chunk so that one chunk's logits [n, V/tp] take at most about `budget_bytes`: the tokens
    split into equal chunks, each a multiple of 128 rows (whole GEMM tiles)."""
    per_chunk = max(1, budget_bytes // (vocab_local * element_bytes))
    chunks = -(-tokens // per_chunk)
    n = -(-tokens // chunks)
    return max(1, min(tokens, -(-n // 128) * 128))


OUTPUT_LOSS_BACKENDS = ("unfused", "chunked", "liger")


def per_token_view(loss_sum: torch.Tensor, per_token: Optional[torch.Tensor], loss_weights: torch.Tensor):
    """Per-token losses [...] whose masked sum has `loss_sum`'s value and gradient.

    megatron's schedules expect the model to return per-token losses that the loss function multiplies by
    the loss mask and sums. The fused paths hold d(sum_i m_i loss_i)/d(inputs) already; this returns
    `per_token + (loss_sum - loss_sum.detach()) * c` with sum_i m_i c_i = 1, so the values are the
    per-token losses and sum_i m_i out_i back-propagates `loss_sum`'s gradient. A backend that yields only
    the sum (Liger) spreads it as `loss_sum * c`."""
    m = loss_weights.float()
    c = m / (m * m).sum().clamp_min(torch.finfo(torch.float32).tiny)
    base = per_token.detach().float() if per_token is not None else loss_sum.detach().float() * c
    return base + (loss_sum.float() - loss_sum.detach().float()) * c


def liger_linear_cross_entropy(hidden, weight, labels, loss_weights) -> torch.Tensor:
    """Liger's fused linear cross-entropy (TP = 1): sum_i m_i loss_i for a 0/1 mask m (Liger's ignored labels).

    Liger computes the gradients in its forward, chunked by its own memory budget."""
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    flat_w, flat_y = loss_weights.reshape(-1), labels.reshape(-1)
    binary = ((flat_w == 0) | (flat_w == 1)).all()
    if flat_w.is_cuda:  # checked on the device: a host sync here would stall the launch queue once per head call
        torch._assert_async(binary, "output_loss_backend 'liger' takes a 0/1 loss mask")
    elif not bool(binary):
        raise ValueError("output_loss_backend 'liger' takes a 0/1 loss mask")
    masked = torch.where(flat_w > 0, flat_y, torch.full_like(flat_y, -100))
    out = LigerFusedLinearCrossEntropyFunction.apply(hidden.reshape(-1, hidden.shape[-1]), weight, masked, None,
                                                     None, -100, 0.0, 0.0, "sum")
    return out[0] if isinstance(out, tuple) else out


def head_loss(output_layer, hidden: torch.Tensor, labels: torch.Tensor, loss_mask: Optional[torch.Tensor],
              backend: str, chunk_size: Optional[int], weight: Optional[torch.Tensor] = None,
              fp32_grad_weight: bool = True):
    """The output layer and cross-entropy fused: (sum_i m_i loss_i, per-token losses [b, s] carrying its gradient).

    `output_layer` is megatron's ColumnParallelLinear (its weight, or `weight` when tied); `hidden` [s, b, h]
    as the output layer would see it. Its input preparation is the layer's own: the sequence-parallel
    all-gather (reduce-scatter in backward) or the copy to the TP region (all-reduce of dh in backward)."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    weight = output_layer.weight if weight is None else weight
    group = output_layer.tp_group
    tp = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    if output_layer.sequence_parallel and tp > 1:
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=group)
    elif tp > 1:
        hidden = copy_to_tensor_model_parallel_region(hidden, group=group)
    s, b, h = hidden.shape
    mask = torch.ones_like(labels, dtype=torch.float32) if loss_mask is None else loss_mask.float()
    rows_y, rows_m = labels.t().reshape(-1), mask.t().reshape(-1)  # s-major rows, as hidden's
    x = hidden.reshape(s * b, h)
    if backend == "chunked":
        rank = dist.get_rank(group) if tp > 1 else 0
        loss_sum, per_token = chunked_linear_cross_entropy(x, weight, rows_y, rows_m, chunk_size,
                                                           rank * weight.shape[0], group if tp > 1 else None,
                                                           fp32_grad_weight=fp32_grad_weight)
    elif backend == "liger":
        loss_sum, per_token = liger_linear_cross_entropy(x, weight, rows_y, rows_m), None
    else:
        raise ValueError(f"head_loss backend must be chunked or liger, got {backend!r}")
    out = per_token_view(loss_sum, per_token, rows_m)
    return loss_sum, out.view(s, b).t()
