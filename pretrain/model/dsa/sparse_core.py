"""DSA's sparse core attention as one autograd function: absorb, sparse attention, expand.

GLM-5 report, DSA section; DeepSeek-V3.2 section 2. With W_UK, W_UV the per-head slices of MLA's
key/value up-projection (`sparse_mla`):

    q_abs_h = [W_UK_h^T q_nope_h ; q_rope_h]          [h, 576] per token at GLM-5's shapes
    o_lat_h = sum_{s in S_t} softmax(scale q_abs_h . kv_s) kv_s[:512]     kv_s = [c_s ; k_rope(s)]
    out_h   = W_UV_h o_lat_h

Composed from separate autograd operations this keeps, per token and layer, the absorbed query
(h x 576), q_nope a second time (the absorption's own input) and o_lat (h x 512) until backward:
more than dense attention keeps (q, k, v and the output at h x 256 each). `SparseMLACore` keeps
only what backward cannot rebuild cheaply:

- q_nope (h x d_nope) and the roped q_rope (h x 64): the absorbed query is recomputed in backward
  (2 h d_nope 512 FLOPs per token, ~4% of the sparse forward's at K = 2048);
- kv [T, 576], the top-k indices (int16 up to 65,535 keys, `indexer.pack_indices`), the weight (a parameter);
- o_lat and the log-sum-exp (h x 512 and h fp32), unless `recompute` is set: then backward first
  runs the sparse forward once more and keeps neither. That costs one extra sparse forward,
  2 h K (576 + 512) FLOPs per token (the backward's matrix products are 2 h K (576 + 512 + 576 +
  576 + 512): the extra forward adds ~28% of the sparse attention's FLOPs), and saves h x 512 x 2 bytes per token (16 KiB at 16 heads). o_lat is needed for dW_UV and
  for Delta = rowsum(dO_lat * o_lat) of the attention backward.

Measured with saved-tensor hooks (tests/test_dsa_memory.py) for one proxy-model layer (16 heads,
d_nope 192, rope 64, v 256, latent 512, indexer 16 x 128), bf16, per token: dense attention keeps
47.7 KB; the sparse path with its indexer loss 41.7 KB + 2 K bytes of int16 indices (45.8 KB at K = 2048;
with more than 65,535 keys 4 K bytes, 49.9 KB), with `recompute` 16.4 KB less (29.3 KB at K = 2048). The
separate operations kept 65.3 KB + 4 K (73.5 KB at K = 2048).

The top-k selection is an input: recompute never repeats the indexer. The layer turns `recompute` on
for megatron's selective recompute of the core attention (`recompute_modules: [core_attn]`) on its
sparse layers. Results are those of the composed operations up to floating-point summation order.
"""

from __future__ import annotations

import torch

from pretrain.model.dsa.indexer import pack_indices, unpack_indices


def _absorbed(q_nope, q_pe, w_uk):
    """q_nope [s, b, h, dn], q_pe [s, b, h, dr] -> q_abs [b, s, h, c + dr] (a view of an [s, b, ...] tensor).

    One GEMM per head writes W_UK_h^T q_nope_h straight into the latent columns of q_abs (cuBLAS takes the row
    stride h (c + dr)), and q_pe is copied into the rope columns: no product followed by a cat, in forward and
    again in backward."""
    s, b, h, dn = q_nope.shape
    c, dr = w_uk.shape[-1], q_pe.shape[-1]
    q_abs = q_nope.new_empty(s, b, h, c + dr)
    rows = q_abs.view(s * b, h, c + dr)
    torch.bmm(q_nope.reshape(s * b, h, dn).transpose(0, 1), w_uk, out=rows.transpose(0, 1)[..., :c])
    rows[..., c:].copy_(q_pe.reshape(s * b, h, dr))
    return q_abs.transpose(0, 1)


def _expanded(o_lat, w_uv):
    """o_lat [b, s, h, c], w_uv [h, dv, c] -> out [s, b, h * dv], out_h = W_UV_h o_lat_h: one GEMM per head into
    [b, s, h, dv] rows, so that with b = 1 the [s, b, h * dv] result is a view, not a copy (0.34 ms per layer at 32K
    as a head-major product then a reshape)."""
    b, s, h, c = o_lat.shape
    dv = w_uv.shape[1]
    out = o_lat.new_empty(b, s, h, dv)
    torch.bmm(o_lat.reshape(b * s, h, c).transpose(0, 1), w_uv.transpose(1, 2),
              out=out.view(b * s, h, dv).transpose(0, 1))
    return out.transpose(0, 1).reshape(s, b, h * dv)


def _query_gradient(dq_lat, w_uk):
    """dq_lat [b, s, h, c] (a view of the absorbed query's gradient), w_uk [h, dn, c] -> dq_nope [s, b, h, dn]
    contiguous: one GEMM per head into [s, b, h, dn] rows. As an einsum the result came head-major, and the
    q projection's split backward then concatenated it with dq_pe from that layout, about 4x slower than from two
    contiguous inputs."""
    b, s, h, c = dq_lat.shape
    dn = w_uk.shape[1]
    out = dq_lat.new_empty(s, b, h, dn)
    rows = dq_lat[0] if b == 1 else dq_lat.transpose(0, 1).reshape(s * b, h, c)  # b = 1: a view, no copy
    torch.bmm(rows.transpose(0, 1), w_uk.transpose(1, 2), out=out.view(s * b, h, dn).transpose(0, 1))
    return out


KL_CHANNEL = 10  # the position of `kl_channel` among SparseMLACore.forward's inputs


class SparseMLACore(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_nope, q_pe, latent, k_pe, weight, indices, backend, scale: float, chunk: int,
                recompute: bool, kl_channel, kept_indices):
        s, b, h, dn = q_nope.shape
        c = latent.shape[-1]
        w = weight.view(h, -1, c)
        q_abs = _absorbed(q_nope, q_pe, w[:, :dn])
        kv = torch.cat([latent, k_pe[:, :, 0]], dim=-1).transpose(0, 1)  # [b, t, c + dr]
        o_lat, lse = backend.attention_forward(q_abs, kv, indices, scale, c, chunk)
        out = _expanded(o_lat, w[:, dn:])
        kept = () if recompute else (o_lat, lse)
        # q_nope is a view of the q projection (q_nope and the pre-rope q_pe): keep only its part
        if kept_indices is None:
            kept_indices = pack_indices(indices, kv.shape[1])
        ctx.save_for_backward(q_nope.contiguous(), q_pe, kv, kept_indices, weight, *kept)
        ctx.backend, ctx.scale, ctx.chunk, ctx.recompute = backend, scale, chunk, recompute
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q_nope, q_pe, kv, indices, weight, *kept = ctx.saved_tensors
        indices = unpack_indices(indices)
        backend, scale, chunk = ctx.backend, ctx.scale, ctx.chunk
        s, b, h, dn = q_nope.shape
        c = kv.shape[-1] - q_pe.shape[-1]
        w = weight.view(h, -1, c)
        w_uk, w_uv = w[:, :dn], w[:, dn:]
        q_abs = _absorbed(q_nope, q_pe, w_uk)
        o_lat, lse = backend.attention_forward(q_abs, kv, indices, scale, c, chunk) if ctx.recompute else kept
        grad_out = grad_out.reshape(s, b, h, -1).transpose(0, 1)  # [b, s, h, dv]
        d_w_uv = torch.einsum("bshv,bshc->hvc", grad_out, o_lat) if ctx.needs_input_grad[4] else None
        grad_lat = torch.einsum("bshv,hvc->bshc", grad_out, w_uv)
        # The indexer loss's target rides back as the gradient of `kl_channel` (see sparse_mla_core).
        head_sums = None
        if ctx.needs_input_grad[KL_CHANNEL]:
            head_sums = torch.zeros(indices.shape, dtype=torch.float32, device=kv.device)
        dq_abs, dkv = backend.attention_backward(q_abs, kv, indices, lse, grad_lat, o_lat, scale, c, chunk,
                                                 head_sums=head_sums)
        del q_abs, o_lat, grad_lat
        dq_lat, dq_pe = dq_abs[..., :c], dq_abs[..., c:]
        dq_nope = _query_gradient(dq_lat, w_uk)
        d_weight = None
        if ctx.needs_input_grad[4]:
            d_w_uk = torch.einsum("sbhd,bshc->hdc", q_nope, dq_lat)
            d_weight = torch.cat([d_w_uk, d_w_uv], dim=1).view(weight.shape)
        dkv = dkv.transpose(0, 1)  # [t, b, c + dr]
        return (dq_nope, dq_pe.transpose(0, 1), dkv[..., :c], dkv[..., c:].unsqueeze(2), d_weight,
                None, None, None, None, None, head_sums, None)


def sparse_mla_core(q_nope, q_pe, latent, k_pe, weight, indices, backend, scale: float, chunk: int,
                    recompute: bool = False, kl_channel=None, kept_indices=None):
    """q_nope [s, b, h, dn], q_pe [s, b, h, dr] (roped), latent [t, b, c], k_pe [t, b, 1, dr] (roped),
    weight [h * (dn + dv), c] (MLA's key/value up-projection), indices [b, s, K] int32 (-1 = empty),
    `backend` (`pretrain.model.dsa.backend`) ->
    (out [s, b, h * dv], lse [b, s, h] fp32); lse carries no gradient.

    `kl_channel` ([b, s, K], from `indexer_loss.kl_from_attention_backward`): backward then returns the
    head-summed probabilities sum_h P_h(t, j) at the selected keys as its gradient, which the attention
    backward forms at no extra gather or product; they are the sparse indexer loss's target.

    The indices are kept for backward as `indexer.pack_indices` packs them (int16 up to 65,535 keys), or as
    `kept_indices`, that packing done once by the caller for several functions to keep one storage."""
    return SparseMLACore.apply(q_nope, q_pe, latent, k_pe, weight, indices, backend, float(scale), int(chunk),
                               bool(recompute), kl_channel, kept_indices)


__all__ = ["SparseMLACore", "sparse_mla_core"]
