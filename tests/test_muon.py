"""Muon and Muon Split (pretrain/optim/muon.py) against float64 references written here."""

import math

import pytest
import torch

from pretrain.optim import Muon, MuonSplit, mla_splits, newton_schulz


def polar(u: torch.Tensor) -> torch.Tensor:
    """The orthogonal polar factor U V^T of u (float64 SVD)."""
    a, _, bt = torch.linalg.svd(u.double(), full_matrices=False)
    return a @ bt


@pytest.mark.parametrize("shape", [(16, 16), (32, 8), (8, 48), (3, 20, 12)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_newton_schulz_lands_in_the_band_around_the_polar_factor(shape, dtype):
    """The quintic iteration maps singular values into roughly [0.7, 1.2] (Jordan et al.) and keeps the
    singular vectors: its output's polar factor equals the input's."""
    torch.manual_seed(0)
    g = torch.randn(*shape, dtype=torch.float64)
    out = newton_schulz(g, steps=5, dtype=dtype).double()
    sv = torch.linalg.svdvals(out)
    assert sv.min() > 0.6 and sv.max() < 1.25, sv
    assert torch.allclose(polar(out), polar(g), atol=0.05 if dtype == torch.bfloat16 else 1e-3)
    # without the iteration (0 steps would be the normalized input) the band is not reached
    assert torch.linalg.svdvals(g / g.norm(dim=(-2, -1), keepdim=True)).max() < 0.6


def naive_muon_step(w, g, buf, lr, wd, mu, nesterov, blocks=None):
    """One Muon step written directly from the formula, float64, blocks as explicit index lists."""
    buf = mu * buf + g
    u = g + mu * buf if nesterov else buf
    new = w * (1 - lr * wd)
    if blocks is None:
        o = newton_schulz(u, 5, torch.float64) * 0.2 * math.sqrt(max(u.shape))
        return new - lr * o, buf
    update = torch.zeros_like(u)
    for rows, cols in blocks:
        ub = u[rows][:, cols]
        ob = newton_schulz(ub, 5, torch.float64) * 0.2 * math.sqrt(max(ub.shape))
        update[torch.as_tensor(rows)[:, None], torch.as_tensor(cols)[None, :]] = ob
    return new - lr * update, buf


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_steps_match_the_naive_formula(nesterov):
    torch.manual_seed(1)
    w0 = torch.randn(12, 20, dtype=torch.float64)
    p = torch.nn.Parameter(w0.clone())
    opt = Muon([p], lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=nesterov, ns_dtype=torch.float64)
    w, buf = w0.clone(), torch.zeros_like(w0)
    for step in range(3):
        g = torch.randn_like(w0)
        p.grad = g.clone()
        opt.step()
        w, buf = naive_muon_step(w, g, buf, 0.02, 0.1, 0.95, nesterov)
        assert torch.allclose(p.detach(), w, atol=1e-12), step
    # the update's RMS is about 0.2 * sqrt(max(m, n)) / sqrt(...) ~ AdamW's
    p.grad = torch.randn_like(w0)
    before = p.detach().clone()
    opt.param_groups[0]["weight_decay"] = 0.0
    opt.step()
    rms = ((p.detach() - before) / 0.02).pow(2).mean().sqrt().item()
    assert 0.15 < rms < 0.25


def test_non_matrices_and_adam_groups_use_adamw():
    torch.manual_seed(2)
    bias = torch.nn.Parameter(torch.randn(7, dtype=torch.float64))
    emb = torch.nn.Parameter(torch.randn(5, 4, dtype=torch.float64))
    opt = Muon([{"params": [bias]}, {"params": [emb], "use_muon": False}], lr=1e-2, weight_decay=0.1,
               adam_betas=(0.9, 0.95), adam_eps=1e-8)
    ref_params = [bias.detach().clone().requires_grad_(), emb.detach().clone().requires_grad_()]
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    for _ in range(3):
        grads = [torch.randn_like(bias), torch.randn_like(emb)]
        for q, g in zip([bias, emb], grads):
            q.grad = g.clone()
        for q, g in zip(ref_params, grads):
            q.grad = g.clone()
        opt.step()
        ref.step()
    assert torch.allclose(bias, ref_params[0], atol=1e-12) and torch.allclose(emb, ref_params[1], atol=1e-12)


def test_split_blocks_are_orthogonalized_independently():
    """MLA kv up-projection [heads * (dk + dv), c]: W_UK and W_UV of each head get their own update,
    each in the Newton-Schulz band, and scaling one head's gradient leaves the others' updates alone."""
    torch.manual_seed(3)
    heads, dk, dv, c = 3, 6, 10, 8
    w0 = torch.randn(heads * (dk + dv), c, dtype=torch.float64)
    split = MuonSplit(heads, (dk, dv), axis=0)
    blocks = []
    for h in range(heads):
        base = h * (dk + dv)
        blocks += [(list(range(base, base + dk)), list(range(c))), (list(range(base + dk, base + dk + dv)), list(range(c)))]
    p = torch.nn.Parameter(w0.clone())
    opt = Muon([p], lr=0.01, weight_decay=0.0, ns_dtype=torch.float64, splits={p: split})
    g = torch.randn_like(w0)
    p.grad = g.clone()
    opt.step()
    w, _ = naive_muon_step(w0, g, torch.zeros_like(w0), 0.01, 0.0, 0.95, True, blocks)
    assert torch.allclose(p.detach(), w, atol=1e-12)
    update = (w0 - p.detach()) / 0.01
    for rows, cols in blocks:
        blk = update[rows][:, cols] / (0.2 * math.sqrt(max(len(rows), c)))
        sv = torch.linalg.svdvals(blk)
        assert sv.min() > 0.6 and sv.max() < 1.25
    # the whole-matrix update is different (the split is real)
    whole, _ = naive_muon_step(w0, g, torch.zeros_like(w0), 0.01, 0.0, 0.95, True)
    assert not torch.allclose(whole, w, atol=1e-6)
    # a head's update depends only on its own gradient
    g2 = g.clone()
    g2[: dk + dv] *= 7.0
    p2 = torch.nn.Parameter(w0.clone())
    opt2 = Muon([p2], lr=0.01, weight_decay=0.0, ns_dtype=torch.float64, splits={p2: split})
    p2.grad = g2
    opt2.step()
    assert torch.allclose(p2.detach()[dk + dv:], p.detach()[dk + dv:], atol=1e-12)


def test_column_split():
    """axis=1: one block per group of columns."""
    torch.manual_seed(4)
    hidden, experts, width = 6, 3, 8
    u = torch.randn(hidden, experts * width, dtype=torch.float64)
    split = MuonSplit(experts, (width,), axis=1)
    from pretrain.optim import orthogonalized_update

    out = orthogonalized_update(u, split, 5, torch.float64, 0.2)
    for e in range(experts):
        cols = slice(e * width, (e + 1) * width)
        ref = newton_schulz(u[:, cols], 5, torch.float64) * 0.2 * math.sqrt(max(hidden, width))
        assert torch.allclose(out[:, cols], ref, atol=1e-12)


def test_memory_chunk_split_for_grouped_experts():
    """megatron GroupedMLP weight1 [hidden, E * 2 * ffn] is used as weight1.view(E, hidden, 2 * ffn):
    expert e's matrix is the e-th chunk of memory (axis=2), which is not the e-th block of columns."""
    torch.manual_seed(5)
    hidden, experts, width = 6, 3, 8
    u = torch.randn(hidden, experts * width, dtype=torch.float64)
    from pretrain.optim import orthogonalized_update

    out = orthogonalized_update(u, MuonSplit(experts, (hidden,), axis=2), 5, torch.float64, 0.2)
    per_expert = u.view(experts, hidden, width)
    for e in range(experts):
        ref = newton_schulz(per_expert[e], 5, torch.float64) * 0.2 * math.sqrt(max(hidden, width))
        assert torch.allclose(out.view(experts, hidden, width)[e], ref, atol=1e-12)
    columns = orthogonalized_update(u, MuonSplit(experts, (width,), axis=1), 5, torch.float64, 0.2)
    assert not torch.allclose(columns, out, atol=1e-3)  # the column reading is a different update


def test_mla_splits_pick_the_up_projections_and_experts():
    params = [
        ("decoder.layers.0.self_attention.linear_q_up_proj.weight", torch.zeros(4 * 32, 16)),
        ("decoder.layers.0.self_attention.linear_kv_up_proj.weight", torch.zeros(4 * (24 + 32), 16)),
        ("decoder.layers.1.mlp.experts.weight1", torch.zeros(64, 8 * 2 * 32)),
        ("decoder.layers.1.mlp.experts.weight2", torch.zeros(8 * 32, 64)),
        ("decoder.layers.0.self_attention.linear_proj.weight", torch.zeros(64, 128)),
    ]
    splits = mla_splits(params, heads=4, qk_head_dim=24, qk_pos_emb_head_dim=8, v_head_dim=32, num_experts=8)
    by_name = {n: splits.get(p) for n, p in params}
    assert by_name["decoder.layers.0.self_attention.linear_q_up_proj.weight"] == MuonSplit(4, (32,), 0)
    assert by_name["decoder.layers.0.self_attention.linear_kv_up_proj.weight"] == MuonSplit(4, (24, 32), 0)
    assert by_name["decoder.layers.1.mlp.experts.weight1"] == MuonSplit(8, (64,), 2)
    assert by_name["decoder.layers.1.mlp.experts.weight2"] == MuonSplit(8, (32,), 0)
    assert by_name["decoder.layers.0.self_attention.linear_proj.weight"] is None
    rope_own = mla_splits(params[:1], 4, 24, 8, 32, q_rope_own_block=True)
    assert list(rope_own.values()) == [MuonSplit(4, (24, 8), 0)]
    with pytest.raises(ValueError, match="does not fit"):
        MuonSplit(5, (24, 32), 0).blocks(params[1][1])
