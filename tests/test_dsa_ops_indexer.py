"""CPU checks of the DSA lightning indexer (visibility, scores, top-k, projections, Hadamard) vs float64 references."""

# Covers `pretrain.model.dsa.indexer`.
# Every reference is written from the math (naive Python loops or dense masked formulas); none of
# them calls the code under test.

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from pretrain.model.dsa.indexer import (
    LightningIndexer,
    gather_keys,
    hadamard_transform,
    index_scores,
    index_scores_at,
    indexer_topk,
    pack_indices,
    segment_ids_from_cu_seqlens,
    select_topk,
    unpack_indices,
)
from tests.dsa_references import F64, NEG_INF, docs_from_lengths, naive_index_scores, ref_topk, visibility_case


def sylvester_hadamard(d):
    h = torch.ones(1, 1, dtype=F64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


# --------------------------------------------------------------------------------------------
# 1. Index scores, visibility and top-k
# --------------------------------------------------------------------------------------------


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
    keys, vis = visibility_case(mode, b, S, T)
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


def test_packed_indices_round_trip():
    """Indices kept for backward: int16 (unsigned 16-bit values, -1 empty) up to 65,535 keys, int32 beyond."""
    idx = torch.tensor([[[-1, 0, 1, 32767, 32768, 40000, 65534, -1]]], dtype=torch.int32)
    packed = pack_indices(idx, 65535)
    assert packed.dtype == torch.int16 and packed.element_size() * 2 == idx.element_size()
    back = unpack_indices(packed)
    assert back.dtype == torch.int32 and torch.equal(back, idx)
    wide = torch.tensor([[[65535, 131071, -1]]], dtype=torch.int32)
    assert pack_indices(wide, 131072) is wide and unpack_indices(wide) is wide
