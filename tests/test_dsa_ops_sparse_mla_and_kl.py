"""CPU checks of DSA sparse MLA attention and the indexer KL losses against dense float64 references and gradcheck."""

# Covers `pretrain.model.dsa.sparse_mla` (sparse absorbed attention) and `pretrain.model.dsa.indexer_loss`
# (dense / sparse KL losses).
# Every reference is written from the math (naive Python loops or dense masked formulas); none of
# them calls the code under test.

from __future__ import annotations

import itertools
import math

import pytest
import torch

from pretrain.model.dsa.indexer import VisibleKeys
from pretrain.model.dsa.indexer_loss import dense_target, indexer_kl_dense, indexer_kl_sparse, sparse_target
from pretrain.model.dsa.sparse_mla import absorb_query, expand_values, sparse_mla_attention
from tests.dsa_references import F64, NEG_INF, naive_index_scores, naive_visible, ref_topk, visibility_case


# --------------------------------------------------------------------------------------------
# Independent references
# --------------------------------------------------------------------------------------------


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
# 1. Sparse MLA attention vs dense masked attention; absorbed form
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
# 2. gradcheck
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
# 3. KL losses vs naive formulas (values, recall, gradients)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["causal", "segments", "mask"])
@pytest.mark.parametrize("chunk", [1, 3, 32])
def test_indexer_kl_dense_matches_naive(mode, chunk):
    gen = torch.Generator().manual_seed(21)
    b, S, H, d, h, dq, topk = 2, 16, 3, 4, 3, 5, 4
    q, k, w, query, key = _kl_inputs(gen, b, S, H, d, h, dq)
    keys, vis = visibility_case(mode, b, S, S)
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
