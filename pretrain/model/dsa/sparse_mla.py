"""Sparse MLA attention over the indexer's top-k keys, in MLA's absorbed ("MQA") form.

GLM-5 report, DSA section; DeepSeek-V3.2 section 2. With W_UK [h, d_nope, c] and W_UV [h, d_v, c]
the per-head slices of MLA's key/value up-projection and c_s the normalized KV latent of token s:

    k_h(s) . q_h(t) = (W_UK_h^T q_nope_h(t)) . c_s  +  q_rope_h(t) . k_rope(s)
    o_h(t) = W_UV_h  sum_{s in S_t} p_h(t, s) c_s,      p_h(t, .) = softmax_{s in S_t}(scale * k_h(s) . q_h(t))

so every head attends over the same 576-dim keys [c_s ; k_rope(s)] (at GLM-5's shapes) with the
latent c_s (512 dims) as values, and W_UV is applied after attention. All heads of token t share
the selection S_t. FLOPs per query: 2 * h * K * (576 + 512).

`sparse_mla_attention` is the reference implementation (CPU, and the oracle of the GPU kernels): a
custom autograd function that runs `chunk` query rows at a time and keeps only q, kv, the indices,
the output and the log-sum-exp for backward, which recomputes each chunk's probabilities. Memory is
O(S * (h * D + K)) and never a [S, T] block. Its forward and backward passes are also plain functions
(`sparse_mla_forward`, `sparse_mla_backward`), which `sparse_core` builds on.
"""

from __future__ import annotations

import torch

from pretrain.model.dsa.indexer import gather_keys, upcast


def _chunk_probs(q_c, kv, idx, scale, lse_c=None):
    """Selected keys [b, c, K, D] and probabilities [b, c, h, K] (fp32) of one row chunk."""
    sel = upcast(gather_keys(kv, idx))
    scores = torch.einsum("bchd,bckd->bchk", upcast(q_c), sel) * scale
    scores = scores.masked_fill((idx < 0)[:, :, None, :], float("-inf"))
    if lse_c is None:
        lse_c = torch.logsumexp(scores, dim=-1)
    return sel, torch.exp(scores - lse_c[..., None]), lse_c


def sparse_mla_forward(q, kv, indices, scale: float, v_dim: int, chunk: int):
    """(out [b, s, h, v_dim] in q's dtype, lse [b, s, h] fp32) of absorbed sparse attention."""
    b, s, h, _ = q.shape
    out = q.new_empty(b, s, h, v_dim)
    lse = torch.empty(b, s, h, dtype=upcast(q).dtype, device=q.device)
    for r0 in range(0, s, chunk):
        r1 = min(s, r0 + chunk)
        sel, p, lse_c = _chunk_probs(q[:, r0:r1], kv, indices[:, r0:r1], scale)
        out[:, r0:r1] = torch.einsum("bchk,bckd->bchd", p, sel[..., :v_dim]).to(q.dtype)
        lse[:, r0:r1] = lse_c
    return out, lse


def output_delta(grad_out: torch.Tensor, out: torch.Tensor, rows: int = 1024) -> torch.Tensor:
    """Delta = rowsum(dO * O) [b, s, h] in fp32 (at least), `rows` query rows at a time."""
    b, s, h = out.shape[:3]
    delta = torch.empty(b, s, h, dtype=upcast(out).dtype, device=out.device)
    for r0 in range(0, s, rows):
        r1 = min(s, r0 + rows)
        delta[:, r0:r1] = (upcast(grad_out[:, r0:r1]) * upcast(out[:, r0:r1])).sum(-1)
    return delta


def sparse_mla_backward(q, kv, indices, lse, delta, grad_out, scale: float, v_dim: int, chunk: int,
                        head_sums=None):
    """(dq, dkv) of absorbed sparse attention from the forward's lse and Delta = rowsum(dO * O);
    `head_sums` [b, s, K], if given, receives sum_h P_h(t, j) (0 on empty slots)."""
    b, s, h, d = q.shape
    acc = upcast(q).dtype
    dq = torch.empty(q.shape, dtype=acc, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
    for r0 in range(0, s, chunk):
        r1 = min(s, r0 + chunk)
        idx, q_c = indices[:, r0:r1], upcast(q[:, r0:r1])
        sel, p, _ = _chunk_probs(q_c, kv, idx, scale, lse[:, r0:r1])
        if head_sums is not None:
            head_sums[:, r0:r1] = p.sum(2)
        do = upcast(grad_out[:, r0:r1])
        dp = torch.einsum("bchd,bckd->bchk", do, sel[..., :v_dim])
        ds = p * (dp - delta[:, r0:r1, :, None]) * scale
        dq[:, r0:r1] = torch.einsum("bchk,bckd->bchd", ds, sel)
        dsel = torch.einsum("bchk,bchd->bckd", ds, q_c)
        dsel[..., :v_dim] += torch.einsum("bchk,bchd->bckd", p, do)
        c, k = idx.shape[1], idx.shape[2]
        flat = idx.clamp(min=0).long().reshape(b, c * k, 1).expand(-1, -1, d)
        # Slots without a key (-1) have p = ds = 0, so adding them at key 0 changes nothing.
        dkv.scatter_add_(1, flat, dsel.reshape(b, c * k, d))
    return dq.to(q.dtype), dkv.to(kv.dtype)


class _SparseMLA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, indices, scale: float, v_dim: int, chunk: int):
        out, lse = sparse_mla_forward(q, kv, indices, scale, v_dim, chunk)
        ctx.save_for_backward(q, kv, indices, out, lse)
        ctx.scale, ctx.v_dim, ctx.chunk = scale, v_dim, chunk
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, kv, indices, out, lse = ctx.saved_tensors
        delta = output_delta(grad_out, out, ctx.chunk)
        dq, dkv = sparse_mla_backward(q, kv, indices, lse, delta, grad_out, ctx.scale, ctx.v_dim, ctx.chunk)
        return dq, dkv, None, None, None, None


def sparse_mla_attention(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, v_dim: int, chunk: int = 256
):
    """Absorbed sparse attention.

    q [b, s, h, D] (absorbed no-rope part, then the rope part), kv [b, T, D] (latent, then the rope
    key), indices [b, s, K] int32 or int64 (-1 = empty slot; every row needs at least one key) ->
    (out [b, s, h, v_dim] = probabilities x kv[..., :v_dim], lse [b, s, h] fp32).
    """
    return _SparseMLA.apply(q, kv, indices, float(scale), int(v_dim), max(1, int(chunk)))


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [..., h, d_nope], W_UK [h, d_nope, c] -> [..., h, c]."""
    return torch.einsum("...hd,hdc->...hc", q_nope, w_uk)


def expand_values(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o_latent [..., h, c], W_UV [h, d_v, c] -> [..., h, d_v]."""
    return torch.einsum("...hc,hvc->...hv", o_latent, w_uv)
