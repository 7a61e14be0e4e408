"""CPU checks of the DSA building blocks against independent float64 references.

Covers `pretrain.model.dsa.indexer` (lightning indexer, visibility, top-k), `pretrain.model.dsa.sparse_mla`
(sparse absorbed attention) and `pretrain.model.dsa.indexer_loss` (dense / sparse KL losses). Every
reference below is written from the math (naive Python loops or dense masked formulas); none of
them calls the code under test. The last tests measure peak live tensor memory with a
TorchDispatchMode to check that the reference path is linear in the sequence length.
"""

from __future__ import annotations

import itertools
import math
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pretrain.model.dsa.indexer import (
    LightningIndexer,
    VisibleKeys,
    gather_keys,
    hadamard_transform,
    index_scores,
    index_scores_at,
    indexer_topk,
    segment_ids_from_cu_seqlens,
    select_topk,
)
from pretrain.model.dsa.indexer_loss import dense_target, indexer_kl_dense, indexer_kl_sparse, sparse_target
from pretrain.model.dsa.sparse_mla import absorb_query, expand_values, sparse_mla_attention

F64 = torch.float64
NEG_INF = float("-inf")


# --------------------------------------------------------------------------------------------
# Independent references
# --------------------------------------------------------------------------------------------


def docs_from_lengths(lengths):
    """Document id of every position of a packed stream of documents with these lengths."""
    out = []
    for i, n in enumerate(lengths):
        out += [i] * n
    return out


def naive_visible(b, S, T, docs=None):
    """bool [b, S, T]: query row t sits at absolute position t + T - S; it sees key s iff
    s <= that position and (when documents are given) both are in the same document."""
    vis = torch.zeros(b, S, T, dtype=torch.bool)
    for bi in range(b):
        for t in range(S):
            pos = t + T - S
            for s in range(T):
                ok = s <= pos
                if docs is not None:
                    ok = ok and docs[bi][s] == docs[bi][pos]
                vis[bi, t, s] = ok
    return vis


def naive_index_scores(q, k, w, vis):
    """Python loops: I[b,t,s] = sum_j w[b,t,j] * max(0, sum_e q[b,t,j,e] k[b,s,e] / sqrt(d)), -inf if invisible."""
    b, S, H, d = q.shape
    T = k.shape[1]
    ql, kl, wl, vl = q.tolist(), k.tolist(), w.tolist(), vis.tolist()
    inv = 1.0 / math.sqrt(d)
    out = []
    for bi in range(b):
        rows = []
        for t in range(S):
            row = []
            for s in range(T):
                if not vl[bi][t][s]:
                    row.append(NEG_INF)
                    continue
                total = 0.0
                for j in range(H):
                    dot = 0.0
                    for e in range(d):
                        dot += ql[bi][t][j][e] * kl[bi][s][e]
                    total += wl[bi][t][j] * max(dot * inv, 0.0)
                row.append(total)
            rows.append(row)
        out.append(rows)
    return torch.tensor(out, dtype=F64)


def ref_topk(scores, topk):
    """The documented selection by a naive sort of each row of the [b, S, T] matrix: the k largest
    finite scores, ties to the lower key index, listed in ascending key order, -1 padded."""
    k = min(topk, scores.shape[-1])
    out = []
    for row in scores.reshape(-1, scores.shape[-1]).tolist():
        finite = [i for i, v in enumerate(row) if v != NEG_INF]
        chosen = sorted(sorted(finite, key=lambda i: (-row[i], i))[:k])
        out.append(chosen + [-1] * (k - len(chosen)))
    return torch.tensor(out, dtype=torch.long).view(*scores.shape[:-1], k)


def dense_index_scores(q, k, w):
    """Differentiable dense formula of the index scores (no mask): [b, S, T]."""
    d = q.shape[-1]
    dots = (q.unsqueeze(2) * k[:, None, :, None, :]).sum(-1) / math.sqrt(d)  # [b, S, T, H]
    return (w.unsqueeze(2) * torch.clamp(dots, min=0.0)).sum(-1)


def mask_from_indices(idx, T):
    """bool [b, S, T], True at each row's selected keys (-1 slots ignored), by loops."""
    b, S, K = idx.shape
    sel = torch.zeros(b, S, T, dtype=torch.bool)
    for bi, t, j in itertools.product(range(b), range(S), range(K)):
        i = int(idx[bi, t, j])
        if i >= 0:
            sel[bi, t, i] = True
    return sel


def dense_masked_attention(q, kv, sel, scale, v_dim):
    """q [b,S,h,D], kv [b,T,D], sel bool [b,S,T] -> out [b,S,h,v_dim], lse [b,S,h]."""
    scores = (q.unsqueeze(3) * kv[:, None, None, :, :]).sum(-1) * scale  # [b, S, h, T]
    scores = scores.masked_fill(~sel[:, :, None, :], NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.unsqueeze(-1))
    out = (p.unsqueeze(-1) * kv[:, None, None, :, :v_dim]).sum(3)
    return out, lse


def random_indices(b, S, T, K, gen, p_empty=0.3, visible=None):
    """[b, S, K] distinct keys per row (from the visible ones when given), some slots -1 (anywhere
    in the row, never all of them)."""
    idx = torch.full((b, S, K), -1, dtype=torch.long)
    for bi in range(b):
        for t in range(S):
            pool = torch.arange(T) if visible is None else visible[bi, t].nonzero().flatten()
            pool = pool[torch.randperm(len(pool), generator=gen)][:K]
            slots = torch.randperm(K, generator=gen)[: len(pool)]
            idx[bi, t, slots] = pool
            drop = torch.rand(K, generator=gen) < p_empty
            keep = (idx[bi, t] >= 0) & ~drop
            if not bool(keep.any()):
                keep[(idx[bi, t] >= 0).nonzero()[0]] = True
            idx[bi, t] = torch.where(keep, idx[bi, t], torch.full_like(idx[bi, t], -1))
    return idx


def sylvester_hadamard(d):
    h = torch.ones(1, 1, dtype=F64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def naive_kl_rows(p, logits, valid):
    """Per-row KL(p || softmax(logits over valid)) over valid entries; p already zero outside valid."""
    logq = torch.log_softmax(logits.masked_fill(~valid, NEG_INF), dim=-1)
    use = valid & (p > 0)
    p_safe = torch.where(use, p, torch.ones_like(p))
    logq_safe = torch.where(valid, logq, torch.zeros_like(logq))
    return torch.where(use, p_safe * (torch.log(p_safe) - logq_safe), torch.zeros_like(p)).sum(-1)


def naive_dense_target(query, key, scale, vis):
    """Head-summed causal softmax probabilities, L1-normalized: query [b,S,h,d], key [b,T,h,d] -> [b,S,T]."""
    scores = (query.unsqueeze(3) * key.permute(0, 2, 1, 3)[:, None]).sum(-1) * scale  # [b, S, h, T]
    probs = torch.softmax(scores.masked_fill(~vis[:, :, None, :], NEG_INF), dim=-1)
    summed = probs.sum(2)
    return summed / summed.sum(-1, keepdim=True)


# --------------------------------------------------------------------------------------------
# 1. Index scores, visibility and top-k
# --------------------------------------------------------------------------------------------


def _visibility_case(mode, b, S, T):
    """(VisibleKeys, naive visibility [b, S, T]) for one visibility mode."""
    if mode == "causal":
        return VisibleKeys(S, T, "cpu"), naive_visible(b, S, T)
    assert S == T
    if mode in ("mask", "mask_nocausal", "mask_shared"):
        lengths = [[4, 1, 6, S - 11], [S - 7, 7]]
        docs = [docs_from_lengths(lengths[0 if mode == "mask_shared" else bi % 2]) for bi in range(b)]
        mb = 1 if mode == "mask_shared" else b  # [1, 1, s, s]: one mask broadcast over the batch
        mask = torch.zeros(mb, 1, S, S, dtype=torch.bool)
        for bi, t, s in itertools.product(range(mb), range(S), range(S)):
            same = docs[bi][t] == docs[bi][s]
            mask[bi, 0, t, s] = not same if mode == "mask_nocausal" else not (same and s <= t)
        return VisibleKeys(S, T, "cpu", attention_mask=mask), naive_visible(b, S, T, docs)
    if mode == "segments":
        lengths = [3, 1, 2, S - 6]
        cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)
        seg = segment_ids_from_cu_seqlens(cu, S)
        docs = docs_from_lengths(lengths)
        assert seg.shape == (1, S)
        return VisibleKeys(S, T, "cpu", segment_ids=seg), naive_visible(b, S, T, [docs] * b)
    raise ValueError(mode)


@pytest.mark.parametrize("cu_lengths", [[5], [3, 4, 6], [1, 1, 2, 1, 7]])
def test_segment_ids_from_cu_seqlens(cu_lengths):
    total = sum(cu_lengths)
    cu = torch.tensor([0] + list(itertools.accumulate(cu_lengths)), dtype=torch.int32)
    seg = segment_ids_from_cu_seqlens(cu, total)
    docs = docs_from_lengths(cu_lengths)
    assert seg.shape == (1, total)
    for i, j in itertools.product(range(total), range(total)):
        assert bool(seg[0, i] == seg[0, j]) == (docs[i] == docs[j]), (i, j)


@pytest.mark.parametrize("mode", ["causal", "mask", "mask_nocausal", "mask_shared", "segments"])
@pytest.mark.parametrize("ties", [False, True])
def test_indexer_scores_and_topk(mode, ties):
    gen = torch.Generator().manual_seed(100 * len(mode) + int(ties))
    b, H, d = 2, 3, 4
    S = 16
    T = 19 if mode == "causal" else S  # plain causal also covers a key prefix (T > S)
    q = torch.randn(b, S, H, d, generator=gen, dtype=F64)
    k = torch.randn(b, T, d, generator=gen, dtype=F64)
    w = torch.randn(b, S, H, generator=gen, dtype=F64)
    if ties:
        k[:, ::2] = 0.0  # every other key scores exactly 0 for every query
        w[:, 1::4] = 0.0  # every fourth query row scores exactly 0 on all its keys
        q[:, 2::5] = -q[:, 2::5].abs()  # rows whose ReLU is 0 on the positive keys too
        k[:, 1::4] = k[:, 1::4].abs()
    keys, vis = _visibility_case(mode, b, S, T)
    ref = naive_index_scores(q, k, w, vis)

    # the visibility rows
    for r0, r1 in [(0, S), (3, 7), (S - 1, S)]:
        rows = keys.rows(r0, r1)
        assert rows.dtype == torch.bool and rows.shape[1:] == (r1 - r0, T)
        assert torch.equal(rows.expand(b, -1, -1), vis[:, r0:r1])

    # the raw scores, on a chunk of rows
    got = index_scores(q[:, 2:9], k, w[:, 2:9], keys.rows(2, 9))
    assert got.dtype == F64
    assert torch.equal(torch.isinf(got), ~vis[:, 2:9].expand_as(got))
    torch.testing.assert_close(got[vis[:, 2:9]], ref[:, 2:9][vis[:, 2:9]], rtol=1e-12, atol=1e-12)

    if ties:
        zeros_per_row = ((ref == 0) & vis).sum(-1)
        assert int((zeros_per_row >= 2).sum()) >= b * S // 2  # the tie case really has many ties
        # rows where top-3 has to break a tie among zeros (the 3rd and 4th largest are both 0)
        third_fourth = torch.sort(ref, dim=-1, descending=True).values[..., 2:4]
        assert int(((third_fourth == 0).all(-1)).sum()) >= 2

    n_visible = vis.sum(-1)
    for topk, chunk in itertools.product([3, 5, 100], [1, 3, S + 4]):
        got = indexer_topk(q, k, w, topk, keys, chunk)
        want = ref_topk(ref, topk)
        assert got.dtype == torch.int32 and got.shape == (b, S, min(topk, T))
        assert torch.equal(got, want), (topk, chunk)
        # k = min(topk, #visible) selected keys per row; all distinct and visible
        n_sel = (got >= 0).sum(-1)
        assert torch.equal(n_sel, torch.clamp(n_visible, max=topk))
        for bi, t in itertools.product(range(b), range(S)):
            chosen = got[bi, t][got[bi, t] >= 0]
            assert len(set(chosen.tolist())) == len(chosen)
            assert bool(vis[bi, t, chosen].all())


def test_select_topk_and_gathers():
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(2, 5, 7, generator=gen, dtype=F64)
    scores[0, 1, 3:] = NEG_INF
    scores[1, 4, :] = 0.0
    scores[1, 4, 6] = NEG_INF
    scores[0, 2, :4] = 0.5  # a four-way tie at the top
    scores[0, 2, 4:] = -1.0
    for topk in (2, 5, 7, 10):
        got = select_topk(scores, topk)
        assert got.shape == (2, 5, min(topk, 7))
        assert torch.equal(got, ref_topk(scores, topk)), topk
    assert select_topk(scores, 2)[0, 2].tolist() == [0, 1]  # the lowest indices win the tie

    q = torch.randn(2, 4, 3, 5, generator=gen, dtype=F64)
    k = torch.randn(2, 9, 5, generator=gen, dtype=F64)
    w = torch.randn(2, 4, 3, generator=gen, dtype=F64)
    idx = torch.randint(-1, 9, (2, 4, 6), generator=gen)
    g = gather_keys(k, idx)
    for bi, t, j in itertools.product(range(2), range(4), range(6)):
        assert torch.equal(g[bi, t, j], k[bi, max(int(idx[bi, t, j]), 0)])
    full = naive_index_scores(q, k, w, torch.ones(2, 4, 9, dtype=torch.bool))
    at = index_scores_at(q, g, w)
    want = torch.stack([full[bi, t, idx[bi, t].clamp(min=0)] for bi in range(2) for t in range(4)]).view(2, 4, 6)
    torch.testing.assert_close(at, want, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------------------------
# 2. LightningIndexer.project and the Hadamard rotation
# --------------------------------------------------------------------------------------------


def _indexer_config(hadamard=False):
    return SimpleNamespace(
        dsa_indexer_n_heads=3,
        dsa_indexer_head_dim=8,
        q_lora_rank=6,
        hidden_size=10,
        qk_pos_emb_head_dim=4,
        use_cpu_initialization=True,
        params_dtype=F64,
        perform_initialization=True,
        init_method=lambda wt: torch.nn.init.normal_(wt, std=0.1),
        dsa_indexer_loss_coeff=1.0,
        dsa_indexer_hadamard=hadamard,
    )


def _interleaved_rope(rope_dim, base=10.0):
    """A test RoPE on t [s, b, heads, d]: rotates interleaved pairs (2i, 2i+1) of the first
    rope_dim dims by position * base^(-2i / rope_dim)."""

    def rope(t):
        s = t.shape[0]
        out = t.clone()
        for pos in range(s):
            for i in range(rope_dim // 2):
                ang = pos * base ** (-2 * i / rope_dim) + 0.3  # +0.3: position 0 is rotated too
                c, sn = math.cos(ang), math.sin(ang)
                x0, x1 = t[pos, ..., 2 * i], t[pos, ..., 2 * i + 1]
                out[pos, ..., 2 * i] = c * x0 - sn * x1
                out[pos, ..., 2 * i + 1] = sn * x0 + c * x1
        return out

    return rope


def _naive_project(x, qr, W_qb, W_k, ln_w, ln_b, W_w, H, d, rope, hmat=None):
    """Loop / plain-matmul formula of the indexer projections, in [b, s, ...] layout."""
    s, b = x.shape[0], x.shape[1]
    q = torch.zeros(s, b, H, d, dtype=F64)
    k = torch.zeros(s, b, 1, d, dtype=F64)
    w = torch.zeros(s, b, H, dtype=F64)
    for t, bi in itertools.product(range(s), range(b)):
        qv = W_qb @ qr[t, bi]
        q[t, bi] = qv.view(H, d)
        kv = W_k @ x[t, bi]
        mean = kv.sum() / d
        var = ((kv - mean) ** 2).sum() / d
        k[t, bi, 0] = (kv - mean) / math.sqrt(float(var) + 1e-6) * ln_w + ln_b
        w[t, bi] = (W_w @ x[t, bi]) / math.sqrt(H)
    q, k = rope(q), rope(k)
    if hmat is not None:
        q = q @ hmat.T
        k = k @ hmat.T
    return q.permute(1, 0, 2, 3), k[:, :, 0].transpose(0, 1), w.transpose(0, 1)


@pytest.mark.parametrize("hadamard", [False, True])
@pytest.mark.parametrize("rope_kind", ["identity", "interleaved"])
def test_lightning_indexer_project(hadamard, rope_kind):
    torch.manual_seed(3)
    cfg = _indexer_config(hadamard)
    idx_mod = LightningIndexer(cfg)
    H, d = cfg.dsa_indexer_n_heads, cfg.dsa_indexer_head_dim
    assert idx_mod.linear_wq_b.weight.shape == (H * d, cfg.q_lora_rank)
    assert idx_mod.linear_wk.weight.shape == (d, cfg.hidden_size)
    assert idx_mod.linear_weights_proj.weight.shape == (H, cfg.hidden_size)
    assert idx_mod.k_norm.eps == 1e-6
    with torch.no_grad():  # non-trivial LayerNorm affine parameters
        idx_mod.k_norm.weight.copy_(torch.rand(d, dtype=F64) + 0.5)
        idx_mod.k_norm.bias.copy_(torch.randn(d, dtype=F64) * 0.2)
    s, b = 5, 2
    x = torch.randn(s, b, cfg.hidden_size, dtype=F64)
    qr = torch.randn(s, b, cfg.q_lora_rank, dtype=F64)
    rope = (lambda t: t) if rope_kind == "identity" else _interleaved_rope(cfg.qk_pos_emb_head_dim)
    with torch.no_grad():
        q, k, w = idx_mod.project(x, qr, rope)
    assert q.shape == (b, s, H, d) and k.shape == (b, s, d) and w.shape == (b, s, H)
    hmat = sylvester_hadamard(d) / math.sqrt(d) if hadamard else None
    rq, rk, rw = _naive_project(
        x, qr, idx_mod.linear_wq_b.weight.detach(), idx_mod.linear_wk.weight.detach(),
        idx_mod.k_norm.weight.detach(), idx_mod.k_norm.bias.detach(), idx_mod.linear_weights_proj.weight.detach(),
        H, d, rope, hmat,
    )
    torch.testing.assert_close(q, rq, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(k, rk, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w, rw, rtol=1e-10, atol=1e-12)
    if rope_kind == "interleaved":
        # the rope is not a no-op here: without it on either q or k the result would differ
        nq, nk, _ = _naive_project(
            x, qr, idx_mod.linear_wq_b.weight.detach(), idx_mod.linear_wk.weight.detach(),
            idx_mod.k_norm.weight.detach(), idx_mod.k_norm.bias.detach(),
            idx_mod.linear_weights_proj.weight.detach(), H, d, lambda t: t, hmat,
        )
        assert (q - nq).abs().max() > 1e-3 and (k - nk).abs().max() > 1e-3


@pytest.mark.parametrize("d", [1, 2, 4, 8, 16, 64])
def test_hadamard_transform(d):
    eye = torch.eye(d, dtype=F64)
    h = hadamard_transform(eye)  # rows: the transform of each basis vector, i.e. the matrix H^T
    torch.testing.assert_close(h @ h.T, eye, rtol=0, atol=1e-12)
    torch.testing.assert_close(h, sylvester_hadamard(d).T / math.sqrt(d), rtol=0, atol=1e-12)
    x = torch.randn(3, 2, 5, d, dtype=F64)
    want = torch.einsum("...e,fe->...f", x, sylvester_hadamard(d)) / math.sqrt(d)
    torch.testing.assert_close(hadamard_transform(x), want, rtol=1e-12, atol=1e-12)
    # non-contiguous inputs (a permuted view; a strided slice of the last dim)
    xt = x.permute(2, 0, 1, 3)
    torch.testing.assert_close(hadamard_transform(xt), want.permute(2, 0, 1, 3), rtol=1e-12, atol=1e-12)
    wide = torch.randn(4, 2 * d, dtype=F64)
    want_s = wide[:, ::2] @ sylvester_hadamard(d).T / math.sqrt(d)
    torch.testing.assert_close(hadamard_transform(wide[:, ::2]), want_s, rtol=1e-12, atol=1e-12)


def test_hadamard_rejects_non_power_of_two():
    with pytest.raises(ValueError):
        hadamard_transform(torch.zeros(2, 6))


# --------------------------------------------------------------------------------------------
# 3. Sparse MLA attention vs dense masked attention; absorbed form
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_sparse_mla_matches_dense_masked(chunk):
    gen = torch.Generator().manual_seed(11)
    b, S, T, h, D, v_dim, K = 2, 7, 10, 3, 6, 4, 5
    q = torch.randn(b, S, h, D, generator=gen, dtype=F64)
    kv = torch.randn(b, T, D, generator=gen, dtype=F64)
    idx = random_indices(b, S, T, K, gen, p_empty=0.35)
    idx[0, 2] = torch.tensor([-1, -1, 4, -1, -1])  # a row with a single key
    idx[1, 5] = torch.tensor([9, 0, 3, 7, 1])  # a full row
    assert bool((idx < 0).any())
    scale = 0.7
    sel = mask_from_indices(idx, T)

    qa, kva = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out, lse = sparse_mla_attention(qa, kva, idx, scale, v_dim, chunk)
    qr, kvr = q.clone().requires_grad_(), kv.clone().requires_grad_()
    ref_out, ref_lse = dense_masked_attention(qr, kvr, sel, scale, v_dim)
    assert out.shape == (b, S, h, v_dim) and lse.shape == (b, S, h)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)

    g = torch.randn(b, S, h, v_dim, generator=gen, dtype=F64)
    out.backward(g)
    ref_out.backward(g)
    torch.testing.assert_close(qa.grad, qr.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(kva.grad, kvr.grad, rtol=1e-10, atol=1e-12)
    assert kvr.grad.abs().sum() > 0


@pytest.mark.parametrize("chunk", [1, 4, 32])
def test_absorbed_equals_unabsorbed_mla(chunk):
    gen = torch.Generator().manual_seed(5)
    b, S, T, h, dn, dr, dc, dv, K = 2, 6, 8, 3, 4, 2, 5, 3, 4
    leaves = dict(
        q_nope=torch.randn(b, S, h, dn, generator=gen, dtype=F64),
        q_pe=torch.randn(b, S, h, dr, generator=gen, dtype=F64),
        c=torch.randn(b, T, dc, generator=gen, dtype=F64),
        k_pe=torch.randn(b, T, dr, generator=gen, dtype=F64),
        w_uk=torch.randn(h, dn, dc, generator=gen, dtype=F64) * 0.5,
        w_uv=torch.randn(h, dv, dc, generator=gen, dtype=F64) * 0.5,
    )
    idx = random_indices(b, S, T, K, gen, p_empty=0.3)
    sel = mask_from_indices(idx, T)
    scale = (dn + dr) ** -0.5
    g = torch.randn(b, S, h, dv, generator=gen, dtype=F64)

    A = {n: t.clone().requires_grad_() for n, t in leaves.items()}
    q_abs = torch.cat([absorb_query(A["q_nope"], A["w_uk"]), A["q_pe"]], dim=-1)
    kv = torch.cat([A["c"], A["k_pe"]], dim=-1)
    o_lat, _ = sparse_mla_attention(q_abs, kv, idx, scale, dc, chunk)
    out = expand_values(o_lat, A["w_uv"])
    out.backward(g)

    # un-absorbed MLA, head by head: k_h = [W_UK_h c ; k_pe], v_h = W_UV_h c, masked to the selection
    R = {n: t.clone().requires_grad_() for n, t in leaves.items()}
    heads = []
    for hh in range(h):
        k_h = torch.cat([R["c"] @ R["w_uk"][hh].T, R["k_pe"]], dim=-1)  # [b, T, dn + dr]
        v_h = R["c"] @ R["w_uv"][hh].T  # [b, T, dv]
        q_h = torch.cat([R["q_nope"][:, :, hh], R["q_pe"][:, :, hh]], dim=-1)  # [b, S, dn + dr]
        sc = torch.bmm(q_h, k_h.transpose(1, 2)) * scale
        p = torch.softmax(sc.masked_fill(~sel, NEG_INF), dim=-1)
        heads.append(torch.bmm(p, v_h))
    ref = torch.stack(heads, dim=2)
    ref.backward(g)
    torch.testing.assert_close(out, ref, rtol=1e-11, atol=1e-12)
    for n in leaves:
        torch.testing.assert_close(A[n].grad, R[n].grad, rtol=1e-10, atol=1e-11, msg=n)


# --------------------------------------------------------------------------------------------
# 4. gradcheck
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 3])
def test_gradcheck_sparse_mla(chunk):
    gen = torch.Generator().manual_seed(7)
    b, S, T, h, D, v_dim, K = 1, 4, 5, 2, 3, 2, 3
    q = torch.randn(b, S, h, D, generator=gen, dtype=F64, requires_grad=True)
    kv = torch.randn(b, T, D, generator=gen, dtype=F64, requires_grad=True)
    idx = random_indices(b, S, T, K, gen, p_empty=0.3)
    assert torch.autograd.gradcheck(
        lambda q_, kv_: sparse_mla_attention(q_, kv_, idx, 0.8, v_dim, chunk)[0], (q, kv), eps=1e-6, atol=1e-7
    )


def _kl_inputs(gen, b=1, S=4, H=2, d=2, h=2, dq=3):
    q = torch.randn(b, S, H, d, generator=gen, dtype=F64)
    k = torch.randn(b, S, d, generator=gen, dtype=F64)
    w = torch.randn(b, S, H, generator=gen, dtype=F64)
    query = torch.randn(b, S, h, dq, generator=gen, dtype=F64)
    key = torch.randn(b, S, h, dq, generator=gen, dtype=F64)
    return q, k, w, query, key


@pytest.mark.parametrize("chunk", [1, 3])
def test_gradcheck_indexer_kl_dense(chunk):
    gen = torch.Generator().manual_seed(8)
    q, k, w, query, key = _kl_inputs(gen)
    S = q.shape[1]
    keys = VisibleKeys(S, S, "cpu")
    target = dense_target(query, key, 0.6)
    args = tuple(t.clone().requires_grad_() for t in (q, k, w))
    assert torch.autograd.gradcheck(
        lambda a, b_, c: indexer_kl_dense(a, b_, c, keys, target, 2, chunk)[0], args, eps=1e-6, atol=1e-7
    )


@pytest.mark.parametrize("chunk", [1, 3])
def test_gradcheck_indexer_kl_sparse(chunk):
    gen = torch.Generator().manual_seed(9)
    q, k, w, query, _ = _kl_inputs(gen)
    b, S = q.shape[0], q.shape[1]
    kv = torch.randn(b, S, 3, generator=gen, dtype=F64)
    idx = random_indices(b, S, S, 3, gen, p_empty=0.3, visible=naive_visible(b, S, S))
    target = sparse_target(query, kv, 0.6)
    args = tuple(t.clone().requires_grad_() for t in (q, k, w))
    assert torch.autograd.gradcheck(
        lambda a, b_, c: indexer_kl_sparse(a, b_, c, idx, target, chunk)[0], args, eps=1e-6, atol=1e-7
    )


# --------------------------------------------------------------------------------------------
# 5. KL losses vs naive formulas (values, recall, gradients)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["causal", "segments", "mask"])
@pytest.mark.parametrize("chunk", [1, 3, 32])
def test_indexer_kl_dense_matches_naive(mode, chunk):
    gen = torch.Generator().manual_seed(21)
    b, S, H, d, h, dq, topk = 2, 16, 3, 4, 3, 5, 4
    q, k, w, query, key = _kl_inputs(gen, b, S, H, d, h, dq)
    keys, vis = _visibility_case(mode, b, S, S)
    scale = 0.5
    target = dense_target(query, key, scale)

    args = tuple(t.clone().requires_grad_() for t in (q, k, w))
    loss, recall = indexer_kl_dense(*args, keys, target, topk, chunk)
    (2.5 * loss).backward()

    ref_args = tuple(t.clone().requires_grad_() for t in (q, k, w))
    p = naive_dense_target(query, key, scale, vis).detach()
    logits = dense_index_scores(*ref_args)
    ref_loss = naive_kl_rows(p, logits, vis).mean()
    (2.5 * ref_loss).backward()

    # recall: share of p on the top-min(topk, T) keys of the naive (loop) scores
    naive_I = naive_index_scores(q, k, w, vis)
    sel = ref_topk(naive_I, topk)
    ref_recall = sum(
        float(p[bi, t, j]) for bi, t in itertools.product(range(b), range(S)) for j in sel[bi, t].tolist() if j >= 0
    ) / (b * S)

    assert loss.shape == () and ref_loss.item() > 1e-3
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-11, atol=1e-12)
    assert abs(float(recall) - ref_recall) < 1e-11
    assert 0.0 < ref_recall < 1.0
    for name, a, r in zip("qkw", args, ref_args):
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("index_source", ["topk", "random"])
@pytest.mark.parametrize("chunk", [1, 3, 32])
def test_indexer_kl_sparse_matches_naive(index_source, chunk):
    gen = torch.Generator().manual_seed(22)
    b, S, H, d, h, D, K = 2, 14, 3, 4, 3, 6, 5
    q, k, w, _, _ = _kl_inputs(gen, b, S, H, d)
    q_abs = torch.randn(b, S, h, D, generator=gen, dtype=F64)
    kv = torch.randn(b, S, D, generator=gen, dtype=F64)
    vis = naive_visible(b, S, S)
    if index_source == "topk":  # causal top-k: the first rows have empty (-1) slots
        idx = ref_topk(naive_index_scores(q, k, w, vis), K)
    else:
        idx = random_indices(b, S, S, K, gen, p_empty=0.3, visible=vis)
    assert bool((idx < 0).any())
    scale = 0.45
    sel = mask_from_indices(idx, S)
    target = sparse_target(q_abs, kv, scale)

    args = tuple(t.clone().requires_grad_() for t in (q, k, w))
    loss, psum = indexer_kl_sparse(*args, idx, target, chunk)
    (0.75 * loss).backward()

    ref_args = tuple(t.clone().requires_grad_() for t in (q, k, w))
    scores = (q_abs.unsqueeze(3) * kv[:, None, None]).sum(-1) * scale  # [b, S, h, T]
    probs = torch.softmax(scores.masked_fill(~sel[:, :, None], NEG_INF), dim=-1).sum(2)
    p = (probs / probs.sum(-1, keepdim=True)).detach()
    ref_loss = naive_kl_rows(p, dense_index_scores(*ref_args), sel).mean()
    (0.75 * ref_loss).backward()

    assert ref_loss.item() > 1e-3
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-11, atol=1e-12)
    torch.testing.assert_close(psum, p.sum() / (b * S), rtol=1e-12, atol=1e-12)
    for name, a, r in zip("qkw", args, ref_args):
        torch.testing.assert_close(a.grad, r.grad, rtol=1e-9, atol=1e-12, msg=name)


# --------------------------------------------------------------------------------------------
# 6. Peak live memory is linear in the sequence length
# --------------------------------------------------------------------------------------------


class PeakLiveBytes(TorchDispatchMode):
    """Tracks the bytes of live storages produced by ops run under the mode (each untyped storage
    counted once, by data pointer; released when the storage is freed) and their peak."""

    def __init__(self):
        super().__init__()
        self.live = {}
        self.current = 0
        self.peak = 0
        self._token = itertools.count()

    def _release(self, key, token):
        entry = self.live.get(key)
        if entry is not None and entry[1] == token:
            del self.live[key]
            self.current -= entry[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key, nbytes = st.data_ptr(), st.nbytes()
            if key == 0 or nbytes == 0 or key in self.live:
                continue
            token = next(self._token)
            self.live[key] = (nbytes, token)
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            weakref.finalize(st, self._release, key, token)
        return out


def _peak(fn, *inputs):
    with PeakLiveBytes() as mode:
        fn(*inputs)
    return mode.peak


def _naive_dense_attention(q, k, v):
    """Control: materializes the [S, S] score and probability matrices."""
    S = q.shape[0]
    scores = q @ k.T / math.sqrt(q.shape[-1])
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    p = torch.softmax(scores.masked_fill(~causal, NEG_INF), dim=-1)
    (p @ v).sum().backward()


def _ratios(peaks):
    return [b / a for a, b in zip(peaks, peaks[1:])]


SEQS = (256, 512, 1024, 2048)
CHUNK, H_IDX = 128, 2  # fixed query-row chunk and index heads of the memory runs


def test_peak_tracker_sees_quadratic_control():
    gen = torch.Generator().manual_seed(0)
    peaks = []
    for S in SEQS:
        q, k, v = (torch.randn(S, 16, generator=gen, dtype=F64).requires_grad_() for _ in range(3))
        peaks.append(_peak(_naive_dense_attention, q, k, v))
    # the tracker must see at least one [S, S] float64 block, and its growth
    assert peaks[-1] >= SEQS[-1] ** 2 * 8
    assert all(r >= 3.5 for r in _ratios(peaks)), (peaks, _ratios(peaks))

    # and it releases freed storages: a loop of allocations keeps a flat peak
    def loop():
        for _ in range(50):
            torch.ones(1 << 16, dtype=F64).mul(2.0)

    assert _peak(loop) <= 3 * (1 << 16) * 8


def _sparse_path(S, gen):
    b, H_I, d_I, h, dc, dr, topk, chunk = 1, H_IDX, 8, 2, 16, 4, 16, CHUNK
    qi = torch.randn(b, S, H_I, d_I, generator=gen, dtype=F64)
    ki = torch.randn(b, S, d_I, generator=gen, dtype=F64)
    wi = torch.randn(b, S, H_I, generator=gen, dtype=F64)
    q_abs = torch.randn(b, S, h, dc + dr, generator=gen, dtype=F64)
    kv = torch.randn(b, S, dc + dr, generator=gen, dtype=F64)
    g = torch.randn(b, S, h, dc, generator=gen, dtype=F64)
    leaves = [t.requires_grad_() for t in (qi, ki, wi, q_abs, kv)]

    def run(qi, ki, wi, q_abs, kv):
        keys = VisibleKeys(S, S, "cpu")
        idx = indexer_topk(qi.detach(), ki.detach(), wi.detach(), topk, keys, chunk)
        out, _ = sparse_mla_attention(q_abs, kv, idx, (dc + dr) ** -0.5, dc, chunk)
        target = sparse_target(q_abs.detach(), kv.detach(), (dc + dr) ** -0.5)
        loss, _ = indexer_kl_sparse(qi, ki, wi, idx, target, chunk)
        torch.autograd.backward([out, loss], [g, torch.ones((), dtype=F64)])

    return run, leaves


def _dense_kl_path(S, gen):
    b, H_I, d_I, h, dq, topk, chunk = 1, H_IDX, 8, 2, 8, 16, CHUNK
    qi = torch.randn(b, S, H_I, d_I, generator=gen, dtype=F64)
    ki = torch.randn(b, S, d_I, generator=gen, dtype=F64)
    wi = torch.randn(b, S, H_I, generator=gen, dtype=F64)
    query = torch.randn(b, S, h, dq, generator=gen, dtype=F64)
    key = torch.randn(b, S, h, dq, generator=gen, dtype=F64)
    leaves = [t.requires_grad_() for t in (qi, ki, wi)]

    def run(qi, ki, wi):
        keys = VisibleKeys(S, S, "cpu")
        target = dense_target(query, key, dq**-0.5)
        loss, _ = indexer_kl_dense(qi, ki, wi, keys, target, topk, chunk)
        loss.backward()

    return run, leaves


@pytest.mark.parametrize("path", [_sparse_path, _dense_kl_path], ids=["sparse", "dense_kl"])
def test_reference_path_memory_is_linear(path):
    gen = torch.Generator().manual_seed(0)
    peaks = []
    for S in SEQS:
        run, leaves = path(S, gen)
        peaks.append(_peak(run, *leaves))
        assert all(t.grad is not None for t in leaves)
    ratios = _ratios(peaks)
    assert all(r <= 2.6 for r in ratios), (peaks, ratios)
    # the tracker saw real work: at least the [chunk, heads, S] float64 score block of the last run
    assert peaks[-1] >= CHUNK * H_IDX * SEQS[-1] * 8
