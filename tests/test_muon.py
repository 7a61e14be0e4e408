"""Muon and Muon Split (pretrain/optim/muon.py) against float64 references written here."""

import math

import pytest
import torch

from pretrain.config.schema import ModelConfig
from pretrain.optim import Muon, MuonSplit, newton_schulz, param_split


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


def test_param_split_picks_the_up_projections_gqa_groups_and_experts():
    """The one Muon Split rule (the optimizer's): blocks written out here per parameter name."""
    m = ModelConfig(num_attention_heads=4, qk_head_dim=24, qk_pos_emb_head_dim=8, v_head_dim=32, num_moe_experts=8)
    q_up = ("decoder.layers.0.self_attention.linear_q_up_proj.weight", torch.zeros(4 * 32, 16))
    kv_up = ("decoder.layers.0.self_attention.linear_kv_up_proj.weight", torch.zeros(4 * (24 + 32), 16))
    w1 = ("decoder.layers.1.mlp.experts.weight1", torch.zeros(64, 8 * 2 * 32))
    w2 = ("decoder.layers.1.mlp.experts.weight2", torch.zeros(8 * 32, 64))
    proj = ("decoder.layers.0.self_attention.linear_proj.weight", torch.zeros(64, 128))
    indexer = ("decoder.layers.0.self_attention.core_attention.indexer.linear_wq_b.weight", torch.zeros(4 * 32, 16))
    norm = ("decoder.layers.0.input_layernorm.weight", torch.zeros(64))
    assert param_split(*q_up, m) == MuonSplit(4, (32,), 0)
    assert param_split(*q_up, m, q_rope_own_block=True) == MuonSplit(4, (24, 8), 0)
    assert param_split(*kv_up, m) == MuonSplit(4, (24, 32), 0)
    assert param_split(*w1, m) == MuonSplit(8, (64,), 2)
    assert param_split(*w2, m) == MuonSplit(8, (32,), 0)
    assert param_split(*proj, m) is None and param_split(*indexer, m) is None and param_split(*norm, m) is None
    # this rank's share under TP = 2 (heads) and EP = 2 (experts)
    assert param_split(q_up[0], torch.zeros(2 * 32, 16), m, tp_size=2) == MuonSplit(2, (32,), 0)
    assert param_split(w1[0], torch.zeros(64, 4 * 2 * 32), m, ep_size=2) == MuonSplit(4, (64,), 2)
    assert param_split(w2[0], torch.zeros(4 * 32, 64), m, ep_size=2) == MuonSplit(4, (32,), 0)
    # the ablation switch: attention whole, experts still per expert
    assert param_split(*q_up, m, split_attention=False) is None
    assert param_split(*w1, m, split_attention=False) == MuonSplit(8, (64,), 2)
    # GQA: 8 heads in 2 query groups of head dim 16: per group [4 q heads; k; v]
    gqa = ModelConfig(multi_latent_attention=False, num_attention_heads=8, num_query_groups=2, kv_channels=16,
                      num_moe_experts=None)
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert param_split(qkv, torch.zeros(2 * (4 + 2) * 16, 64), gqa) == MuonSplit(2, (64, 16, 16), 0)
    assert param_split(qkv, torch.zeros(1 * (4 + 2) * 16, 64), gqa, tp_size=2) == MuonSplit(1, (64, 16, 16), 0)
    with pytest.raises(ValueError, match="does not fit"):
        MuonSplit(5, (24, 32), 0).blocks(kv_up[1])


def _expert_shards(full1, full2, experts, etp, rank):
    """Expert-tensor-parallel rank `rank`'s slices, as megatron's GroupedMLP holds them: weight1
    [H, E * 2F] viewed [E, H, 2F] keeps each expert's gate and up columns [gate_r; up_r]; weight2
    [E * F, H] viewed [E, F, H] keeps rows F_r of each expert."""
    hidden = full1.shape[0]
    gate, up = full1.view(experts, hidden, -1).chunk(2, dim=-1)
    w1 = torch.cat([gate.chunk(etp, -1)[rank], up.chunk(etp, -1)[rank]], -1).contiguous().view(hidden, -1)
    w2 = full2.view(experts, -1, hidden).chunk(etp, 1)[rank].contiguous().view(-1, hidden)
    return w1, w2


def _sharded_updates(rank, world_size, u1, u2, dense):
    import torch.distributed as dist

    from pretrain.optim import sharded_orthogonalized_update

    dist.init_process_group("gloo")
    experts = 3
    w1, w2 = _expert_shards(u1, u2, experts, world_size, rank)
    group = dist.group.WORLD
    args = (5, torch.float64, 0.2)
    return (sharded_orthogonalized_update(w1, MuonSplit(experts, (w1.shape[0],), 2), 1, group, *args),
            sharded_orthogonalized_update(w2, MuonSplit(experts, (w2.shape[0] // experts,), 0), 0, group, *args),
            sharded_orthogonalized_update(dense.chunk(world_size, 1)[rank], None, 1, group, *args))


def test_sharded_update_is_the_shard_of_the_whole_update():
    """Expert tensor parallelism (ETP = 2): each expert's matrix is orthogonalized gathered, not slice
    by slice; float64 reference: the unsharded weight's update, then sharded the same way."""
    from pretrain.optim import orthogonalized_update
    from tests.distributed import run_ranks

    torch.manual_seed(6)
    experts, hidden, ffn = 3, 6, 8
    u1 = torch.randn(hidden, experts * 2 * ffn, dtype=torch.float64)
    u2 = torch.randn(experts * ffn, hidden, dtype=torch.float64)
    dense = torch.randn(10, 12, dtype=torch.float64)
    want1 = orthogonalized_update(u1, MuonSplit(experts, (hidden,), 2), 5, torch.float64, 0.2)
    want2 = orthogonalized_update(u2, MuonSplit(experts, (ffn,), 0), 5, torch.float64, 0.2)
    want_dense = orthogonalized_update(dense, None, 5, torch.float64, 0.2)
    ranks = run_ranks(_sharded_updates, 2, u1, u2, dense)
    for rank, (got1, got2, got_dense) in enumerate(ranks):
        ref1, ref2 = _expert_shards(want1, want2, experts, 2, rank)
        assert torch.allclose(got1, ref1, atol=1e-12) and torch.allclose(got2, ref2, atol=1e-12), rank
        assert torch.allclose(got_dense, want_dense.chunk(2, 1)[rank], atol=1e-12), rank
    # orthogonalizing each rank's slice on its own is a different update (the test can fail)
    alone1, _ = _expert_shards(u1, u2, experts, 2, 0)
    local = orthogonalized_update(alone1, MuonSplit(experts, (hidden,), 2), 5, torch.float64, 0.2)
    assert not torch.allclose(local, ranks[0][0], atol=1e-3)
    with pytest.raises(ValueError, match="cut through its sections"):
        MuonSplit(4, (24, 32), 0).shard_dim(0)
