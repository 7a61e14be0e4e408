"""DeepSeek Sparse Attention (DSA): the lightning indexer and its top-k selection.

GLM-5 report, section on DSA (following DeepSeek-V3.2, section 2.1). Per query token t, with
H_I index heads of d_I dims:

    q_I = W_qb(qr_t)            viewed [H_I, d_I]     (qr: the MLA query latent after its RMSNorm)
    k_I = LayerNorm(W_k x_s)    [d_I], one key head shared by all index heads (eps 1e-6)
    interleaved RoPE on the first qk_pos_emb_head_dim dims of q_I and k_I
    w   = W_w(x_t) * H_I^-1/2                               (fp32)
    I[t, s] = sum_j w[t, j] * ReLU(q_I[t, j] . k_I[s] * d_I^-1/2)   for visible s (causal, same document)
    S_t = topk(min(K, #visible), I[t, :])     (ties: the lowest key indices; `select_topk`)

Visible keys are s <= t within t's document. Every attention head of token t attends only to
S_t (`pretrain.model.dsa.sparse_mla`). DeepSeek's Hadamard rotation of q_I / k_I only serves FP8
and is off (GLM-5 trains without it); `dsa_indexer_hadamard` turns it on.

Memory is linear in the sequence length: scores are formed for `chunk` query rows at a time
([b, chunk, H_I, T] at most), and top-k runs on each chunk's rows, which selects exactly what
torch.topk selects on the whole [S, T] score matrix (rows are independent). Selected slots that
fall on invisible keys (rows with fewer than K visible keys) carry index -1.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from pretrain.model.dsa.kernels import triton_available
from pretrain.model.dsa.kernels.ranges import ranges_move_backwards


class LightningIndexer(nn.Module):
    """The indexer's parameters, named as the checkpoint converter maps them to Hugging Face's
    (`wq_b`, `wk`, `k_norm`, `weights_proj`). They train only through the indexer loss."""

    def __init__(self, config):
        super().__init__()
        n_heads, head_dim = config.dsa_indexer_n_heads, config.dsa_indexer_head_dim
        # None follows the default device (CPU, or meta when counting parameters).
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        dtype = config.params_dtype

        def linear(out_features: int, in_features: int) -> nn.Linear:
            layer = nn.Linear(in_features, out_features, bias=False, device=device, dtype=dtype)
            if config.perform_initialization:
                config.init_method(layer.weight)
            return layer

        self.linear_wq_b = linear(n_heads * head_dim, config.q_lora_rank)
        self.linear_wk = linear(head_dim, config.hidden_size)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6, device=device, dtype=dtype)
        self.linear_weights_proj = linear(n_heads, config.hidden_size)
        self.n_heads, self.head_dim = n_heads, head_dim
        self.rope_dim = config.qk_pos_emb_head_dim
        self.hadamard = bool(getattr(config, "dsa_indexer_hadamard", False))
        # Without an indexer loss no computation reads the indexer: its weights then take no
        # gradient (megatron's DDP waits for a gradient from every trainable parameter).
        self.requires_grad_(bool(getattr(config, "dsa_indexer_loss_coeff", 0.0)))

    def project(self, x: torch.Tensor, qr: torch.Tensor, rope: Callable[[torch.Tensor], torch.Tensor],
                split=None):
        """x [s, b, hidden], qr [s, b, q_lora_rank] (both detached by the caller) ->
        q_I [b, n, H_I, d_I], k_I [b, s, d_I] with RoPE applied, w [b, n, H_I] fp32 (with H_I^-1/2): n = s, or
        with `split` (`indexer_split.RowSplit`) the TP rank's query rows only (keys: all s).

        `rope(t)` rotates the first rope dims of t [s, b, heads, d] (interleaved pairs, megatron's
        MLA layout)."""
        s, b = x.shape[0], x.shape[1]
        # a split's rows: qr copied (narrower than q_I), w projected from x's two row pieces in place
        qr = qr if split is None else split.take(qr, 0)
        q = self.linear_wq_b(qr).view(qr.shape[0], b, self.n_heads, self.head_dim)
        k = self.k_norm(self.linear_wk(x)).view(s, b, 1, self.head_dim)
        q, k = (rope(q) if split is None else split.rope(rope, q)), rope(k)
        if self.hadamard:
            q, k = hadamard_transform(q), hadamard_transform(k)
        w = self.linear_weights_proj(x) if split is None else split.take(x, 0, self.linear_weights_proj)
        w = upcast(w) * self.n_heads**-0.5
        return q.permute(1, 0, 2, 3), k[:, :, 0].transpose(0, 1), w.transpose(0, 1)


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform over the last dim (a power of two)."""
    d = x.shape[-1]
    if d & (d - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two head dim, got {d}")
    shape = x.shape
    y = x.reshape(-1, d)
    h = 1
    while h < d:
        y = y.view(-1, d // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
        h *= 2
    return y.reshape(shape) * d**-0.5


class VisibleKeys:
    """Which keys each query row may see: causal, within its document.

    Documents come from a megatron dense mask (`attention_mask` [b|1, 1, s, t] bool, True =
    masked; read one row chunk at a time, never copied whole) or from segment ids [b, t]
    (packed sequences given by cu_seqlens). Without either, plain causal.
    """

    def __init__(self, s: int, t: int, device, attention_mask=None, segment_ids=None, query_positions=None):
        self.s, self.t, self.device = s, t, device
        self.attention_mask, self.segment_ids = attention_mask, segment_ids
        # Key position of each query row: the last s of the t keys, or (context parallelism) the
        # global positions of this rank's tokens (`parallel.context_parallel.local_positions`).
        self.query_positions = (torch.arange(s, device=device) + (t - s) if query_positions is None
                                else query_positions.to(device))

    def subset(self, rows: torch.Tensor) -> "VisibleKeys":
        """The same keys for the query rows `rows` (int64 [n], ascending) only: row i of the result is row
        rows[i] of this one (the TP rank's rows of the indexer, `indexer_split`)."""
        rows = rows.to(self.device)
        mask = self.attention_mask
        if mask is not None:
            mask = mask.index_select(2, rows)
        return VisibleKeys(rows.numel(), self.t, self.device, attention_mask=mask, segment_ids=self.segment_ids,
                           query_positions=self.query_positions.index_select(0, rows))

    def rows(self, r0: int, r1: int) -> torch.Tensor:
        """[b | 1, r1 - r0, t] bool, True = visible."""
        q = self.query_positions[r0:r1]
        k = torch.arange(self.t, device=self.device)
        visible = (k[None, :] <= q[:, None]).unsqueeze(0)
        if self.attention_mask is not None:
            visible = visible & ~self.attention_mask[:, 0, r0:r1, :]
        if self.segment_ids is not None:
            seg = self.segment_ids
            visible = visible & (seg[:, None, :] == seg[:, q, None])
        return visible

    def ranges(self, chunk: int = 1024):
        """(lo, hi) int32 [b | 1, s]: each query row's visible keys as one range [lo, hi) (what the
        Triton kernels take), neither moving backwards along the sequence: causal and cu_seqlens
        ranges are so by construction (query positions increase, under context parallelism too), a
        dense mask's are checked. Raises ValueError if a dense mask gives some row non-contiguous
        keys or ranges that move backwards."""
        causal_hi = self.query_positions + 1
        if self.attention_mask is None and self.segment_ids is None:
            return torch.zeros(1, self.s, dtype=torch.int32, device=self.device), causal_hi.clamp(max=self.t).int()[None]
        if self.attention_mask is None:  # cu_seqlens segments (non-decreasing ids over the t keys)
            seg = self.segment_ids.contiguous()
            lo = torch.searchsorted(seg, seg[:, self.query_positions])
            return lo.int(), causal_hi.clamp(max=self.t).int()[None].expand(seg.shape[0], -1).contiguous()
        los, his = [], []
        keys = torch.arange(self.t, device=self.device)
        for r0 in range(0, self.s, chunk):
            vis = self.rows(r0, min(self.s, r0 + chunk))
            count = vis.sum(-1)
            lo = torch.where(count > 0, (keys + (~vis) * self.t).amin(-1), 0)
            hi = torch.where(count > 0, (keys * vis).amax(-1) + 1, 0)
            if not bool((hi - lo == count).all()):
                raise ValueError("the DSA Triton kernels need every query's visible keys to form one contiguous "
                                 "range (causal attention within documents); this attention mask does not. Set "
                                 "model.dsa_kernel_backend=reference")
            los.append(lo)
            his.append(hi)
        lo, hi = torch.cat(los, 1).int(), torch.cat(his, 1).int()
        if ranges_move_backwards(lo, hi):
            raise ValueError("the DSA Triton kernels need visible-key ranges that never move backwards along the "
                             "sequence (causal attention within documents); this attention mask's do. Set "
                             "model.dsa_kernel_backend=reference")
        return lo, hi


def segment_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """cu_seqlens [n + 1] over a packed stream of `total` tokens -> segment id per token [1, total]."""
    positions = torch.arange(total, device=cu_seqlens.device)
    return torch.bucketize(positions, cu_seqlens[1:-1].to(positions.dtype), right=True).unsqueeze(0)


def is_indexer_parameter(name: str) -> bool:
    """Whether a model parameter name belongs to a DSA lightning indexer."""
    return ".core_attention.indexer." in name


def upcast(t: torch.Tensor) -> torch.Tensor:
    """fp32 for half types, unchanged for fp32 / fp64 (float64 checks stay exact)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def index_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, visible: Optional[torch.Tensor],
                 k_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """I = sum_j w_j ReLU(q_j . k * d^-1/2): q [b, c, H, d], k [b, T, d], w [b, c, H] -> [b, c, T] fp32,
    -inf where not visible; `k_scale` [b, T] (> 0) multiplies each key's column (the FP8 selection's s_k,
    `indexer_fp8`)."""
    scores = torch.einsum("bchd,btd->bcht", upcast(q), upcast(k)) * q.shape[-1] ** -0.5
    out = torch.einsum("bch,bcht->bct", upcast(w), torch.relu(scores))
    if k_scale is not None:
        out = out * k_scale[:, None, :]
    if visible is not None:
        out = out.masked_fill(~visible, float("-inf"))
    return out


def index_scores_at(q: torch.Tensor, k_sel: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Index scores at gathered keys: q [b, c, H, d], k_sel [b, c, K, d], w [b, c, H] -> [b, c, K]."""
    scores = torch.einsum("bchd,bckd->bchk", upcast(q), upcast(k_sel)) * q.shape[-1] ** -0.5
    return torch.einsum("bch,bchk->bck", upcast(w), torch.relu(scores))


def select_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """The k = min(topk, T) largest scores of each row (last dim) -> their key indices, ascending.

    Tie rule (the Triton kernel's too): keys scoring above the k-th largest value are all taken;
    among keys equal to it, the lowest indices. Rows with fewer than k finite scores take all of
    them and pad with -1 (-inf marks invisible keys)."""
    t = scores.shape[-1]
    k = min(topk, t)
    kth = scores.topk(k, dim=-1).values[..., -1:]
    above = scores > kth
    tie = (scores == kth) & (kth > float("-inf"))
    need = k - above.sum(-1, keepdim=True)
    take = above | (tie & (tie.cumsum(-1) <= need))
    positions = torch.arange(t, device=scores.device)
    key = torch.where(take, positions, t)
    chosen = key.topk(k, dim=-1, largest=False, sorted=True).values
    return chosen.masked_fill(chosen == t, -1)


@torch.no_grad()
def indexer_topk(q, k, w, topk: int, keys: VisibleKeys, chunk: int, k_scale=None) -> torch.Tensor:
    """Top-k key indices [b, s, min(topk, T)] (int32, as the kernel's: they are kept for backward;
    -1 = no key), `chunk` query rows at a time; `k_scale`: see `index_scores`."""
    b, s = q.shape[0], q.shape[1]
    out = torch.empty(b, s, min(topk, keys.t), dtype=torch.int32, device=q.device)
    for r0 in range(0, s, chunk):
        r1 = min(s, r0 + chunk)
        scores = index_scores(q[:, r0:r1], k, w[:, r0:r1], keys.rows(r0, r1), k_scale)
        out[:, r0:r1] = select_topk(scores, topk)
    return out


def pack_indices(indices: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Top-k indices as kept for backward: with at most 65,535 keys, int16 holding each index as an unsigned
    16-bit value (-1, an empty slot, is 0xFFFF), half of int32's bytes; with more keys, unchanged."""
    if num_keys > 65535 or indices.dtype == torch.int16:
        return indices
    return indices.to(torch.int16)  # two's-complement wrap: 32768..65534 become negative


def unpack_indices(packed: torch.Tensor) -> torch.Tensor:
    """`pack_indices`' inverse: int32 indices (-1 on empty slots). On CUDA with triton, one kernel
    (`kernels.packed_indices`) instead of the four passes below."""
    if packed.dtype != torch.int16:
        return packed
    if packed.is_cuda and triton_available():
        from pretrain.model.dsa.kernels.packed_indices import unpack

        return unpack(packed)
    wide = packed.to(torch.int32)
    return torch.where(wide == -1, wide, wide & 0xFFFF)


def gather_keys(kv: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """kv [b, T, d], indices [b, c, K] (-1 allowed) -> [b, c, K, d] (rows of -1 read key 0)."""
    b, c, k = indices.shape
    flat = indices.clamp(min=0).long().reshape(b, c * k, 1).expand(-1, -1, kv.shape[-1])
    return torch.gather(kv, 1, flat).view(b, c, k, kv.shape[-1])


def default_chunk(per_row_elements: int, budget_elements: int = 1 << 26) -> int:
    """Query rows per chunk keeping a chunk's largest fp32 block (`per_row_elements` per query row:
    heads x keys for scores, K x (D + heads) for gathered keys) near `budget_elements`."""
    return max(1, min(4096, budget_elements // max(1, per_row_elements)))


__all__ = [
    "LightningIndexer",
    "VisibleKeys",
    "default_chunk",
    "gather_keys",
    "hadamard_transform",
    "index_scores",
    "index_scores_at",
    "indexer_topk",
    "is_indexer_parameter",
    "pack_indices",
    "segment_ids_from_cu_seqlens",
    "select_topk",
    "unpack_indices",
    "upcast",
]
