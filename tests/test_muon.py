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
    fc1 = ("decoder.layers.0.mlp.linear_fc1.weight", torch.zeros(2 * 40, 64))
    shared_fc1 = ("decoder.layers.1.mlp.shared_experts.linear_fc1.weight", torch.zeros(2 * 16, 64))
    assert param_split(*w1, m, split_glu=True) == MuonSplit(8, (64,), 2, cols=(32, 32))  # each expert's [hidden, gate | up]
    assert param_split(*w2, m) == MuonSplit(8, (32,), 0)
    assert param_split(*fc1, m, split_glu=True) == MuonSplit(1, (40, 40), 0)
    assert param_split(*shared_fc1, m, split_glu=True) == MuonSplit(1, (16, 16), 0)
    assert param_split(*w1, m) == MuonSplit(8, (64,), 2) and param_split(*fc1, m) is None  # the default: whole
    assert param_split(*proj, m) is None and param_split(*indexer, m) is None and param_split(*norm, m) is None
    # this rank's share under TP = 2 (heads) and EP = 2 (experts)
    assert param_split(q_up[0], torch.zeros(2 * 32, 16), m, tp_size=2) == MuonSplit(2, (32,), 0)
    assert param_split(w1[0], torch.zeros(64, 4 * 2 * 32), m, ep_size=2, split_glu=True) == MuonSplit(4, (64,), 2, cols=(32, 32))
    assert param_split(fc1[0], torch.zeros(40, 64), m, tp_size=2, split_glu=True) == MuonSplit(1, (20, 20), 0)  # [gate_r; up_r]
    assert param_split(w2[0], torch.zeros(4 * 32, 64), m, ep_size=2) == MuonSplit(4, (32,), 0)
    # the ablation switch: attention whole, experts still per expert
    assert param_split(*q_up, m, split_attention=False) is None
    assert param_split(*w1, m, split_attention=False, split_glu=True) == MuonSplit(8, (64,), 2, cols=(32, 32))
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


def _sharded_updates(rank, world_size, u1, u2, dense, fc1):
    import torch.distributed as dist

    from pretrain.optim import sharded_orthogonalized_update

    dist.init_process_group("gloo")
    experts = 3
    w1, w2 = _expert_shards(u1, u2, experts, world_size, rank)
    group = dist.group.WORLD
    args = (5, torch.float64, 0.2)
    half = w1.shape[1] // (2 * experts)
    gate, up = fc1.chunk(2, 0)  # a column-parallel fc1 shard is [gate_r; up_r]
    fc1_shard = torch.cat([gate.chunk(world_size, 0)[rank], up.chunk(world_size, 0)[rank]])
    return (sharded_orthogonalized_update(w1, MuonSplit(experts, (w1.shape[0],), 2), 1, group, *args),
            sharded_orthogonalized_update(w2, MuonSplit(experts, (w2.shape[0] // experts,), 0), 0, group, *args),
            sharded_orthogonalized_update(dense.chunk(world_size, 1)[rank], None, 1, group, *args),
            sharded_orthogonalized_update(w1, MuonSplit(experts, (w1.shape[0],), 2, cols=(half, half)), 1, group, *args),
            sharded_orthogonalized_update(fc1_shard, MuonSplit(1, (fc1_shard.shape[0] // 2,) * 2, 0), 0, group, *args))


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
    # gate and up apart (SwiGLU split), cut through by TP / ETP: reference from whole gate and up matrices
    fc1 = torch.randn(2 * 10, 6, dtype=torch.float64)
    want_glu1 = torch.cat([newton_schulz(h, 5, torch.float64) * 0.2 * math.sqrt(max(hidden, ffn))
                           for h in u1.view(experts, hidden, 2 * ffn).chunk(2, -1)], -1).view(hidden, -1)
    want_fc1 = torch.cat([newton_schulz(h, 5, torch.float64) * 0.2 * math.sqrt(10) for h in fc1.chunk(2, 0)])
    ranks = run_ranks(_sharded_updates, 2, u1, u2, dense, fc1)
    for rank, (got1, got2, got_dense, got_glu1, got_fc1) in enumerate(ranks):
        ref1, ref2 = _expert_shards(want1, want2, experts, 2, rank)
        assert torch.allclose(got1, ref1, atol=1e-12) and torch.allclose(got2, ref2, atol=1e-12), rank
        assert torch.allclose(got_dense, want_dense.chunk(2, 1)[rank], atol=1e-12), rank
        assert torch.allclose(got_glu1, _expert_shards(want_glu1, want2, experts, 2, rank)[0], atol=1e-12), rank
        gate, up = want_fc1.chunk(2, 0)
        assert torch.allclose(got_fc1, torch.cat([gate.chunk(2, 0)[rank], up.chunk(2, 0)[rank]]), atol=1e-12), rank
    # orthogonalizing each rank's slice on its own is a different update (the test can fail)
    alone1, _ = _expert_shards(u1, u2, experts, 2, 0)
    local = orthogonalized_update(alone1, MuonSplit(experts, (hidden,), 2), 5, torch.float64, 0.2)
    assert not torch.allclose(local, ranks[0][0], atol=1e-3)
    assert not torch.allclose(ranks[0][3], ranks[0][0], atol=1e-3)  # gate and up apart is a different update
    with pytest.raises(ValueError, match="only along its columns"):
        MuonSplit(4, (24,), 2).shard_dim(0)


def test_grouped_expert_gate_and_up_are_orthogonalized_apart():
    """cols: expert e's [hidden, 2F] matrix (the e-th chunk of memory) is cut into its gate and up
    halves, each orthogonalized and scaled on its own."""
    torch.manual_seed(7)
    hidden, experts, ffn = 6, 3, 4
    u = torch.randn(hidden, experts * 2 * ffn, dtype=torch.float64)
    from pretrain.optim import orthogonalized_update

    out = orthogonalized_update(u, MuonSplit(experts, (hidden,), 2, cols=(ffn, ffn)), 5, torch.float64, 0.2)
    for e in range(experts):
        for half in (slice(0, ffn), slice(ffn, 2 * ffn)):
            ref = newton_schulz(u.reshape(experts, hidden, 2 * ffn)[e][:, half], 5, torch.float64)
            got = out.reshape(experts, hidden, 2 * ffn)[e][:, half]
            assert torch.allclose(got, ref * 0.2 * math.sqrt(hidden), atol=1e-12)
    with pytest.raises(ValueError, match="do not fit"):
        MuonSplit(experts, (hidden,), 2, cols=(ffn, ffn + 1)).blocks(u)


def _reference_blocks(kind, shape):
    """Block index sets of a matrix, written out from the layouts (not from MuonSplit): each a function
    from the 2-D tensor to a view."""
    rows, cols = shape
    if kind == "whole":
        return [lambda t: t]
    if kind == "kv_up":  # 2 heads of [dk = 3; dv = 5] rows
        return [lambda t, r=r: t[r] for h in range(2) for r in (slice(8 * h, 8 * h + 3), slice(8 * h + 3, 8 * h + 8))]
    if kind == "experts_glu":  # 3 experts, memory chunks [hidden = rows, 2F = 8]: gate | up
        return [lambda t, e=e, c=c: t.view(3, rows, 8)[e][:, c] for e in range(3) for c in (slice(0, 4), slice(4, 8))]
    raise ValueError(kind)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("batch_elements", [1, 1 << 20])
def test_batched_step_matches_per_block_reference(nesterov, batch_elements):
    """One optimizer over matrices of mixed shapes, orientations, splits and parameter groups: blocks of
    one shape are batched across parameters (or go one by one with a 1-element cap); every weight
    equals the float64 formula applied block by block, over three steps."""
    torch.manual_seed(8)
    specs = [("whole", (12, 20)), ("whole", (20, 12)), ("whole", (12, 20)), ("kv_up", (16, 7)),
             ("kv_up", (16, 7)), ("experts_glu", (5, 24))]
    splits = {"kv_up": MuonSplit(2, (3, 5), 0), "experts_glu": MuonSplit(3, (5,), 2, cols=(4, 4))}
    params = [torch.nn.Parameter(torch.randn(*shape, dtype=torch.float64)) for _, shape in specs]
    groups = [{"params": params[:3], "lr": 0.02, "weight_decay": 0.1},
              {"params": params[3:], "lr": 0.01, "weight_decay": 0.0}]
    opt = Muon(groups, momentum=0.9, nesterov=nesterov, ns_dtype=torch.float64, ns_batch_elements=batch_elements,
               splits={p: splits[k] for p, (k, _) in zip(params, specs) if k in splits})
    weights = [p.detach().clone() for p in params]
    bufs = [torch.zeros_like(w) for w in weights]
    lrs, wds = [0.02] * 3 + [0.01] * 3, [0.1] * 3 + [0.0] * 3
    for step in range(3):
        grads = [torch.randn_like(w) for w in weights]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for i, ((kind, shape), g) in enumerate(zip(specs, grads)):
            bufs[i] = 0.9 * bufs[i] + g
            u = g + 0.9 * bufs[i] if nesterov else bufs[i]
            update = torch.zeros_like(u)
            for view in _reference_blocks(kind, shape):
                ub = view(u)
                view(update).copy_(newton_schulz(ub, 5, torch.float64) * 0.2 * math.sqrt(max(ub.shape)))
            weights[i] = weights[i] * (1 - lrs[i] * wds[i]) - lrs[i] * update
            assert torch.allclose(params[i].detach(), weights[i], atol=1e-12), (step, i, kind)


def test_stage_batches_group_equal_shapes_under_the_cap():
    from pretrain.optim.muon import stage_batches

    shapes = [(4, 8, 16), (1, 2, 3), (4, 8, 16), (2, 8, 16), (8, 8, 16)]
    assert stage_batches(shapes, 10 * 8 * 16) == [[0, 2, 3], [4], [1]]
    assert stage_batches(shapes, 1) == [[0], [2], [3], [4], [1]]  # over the cap: one block per batch
    assert sorted(i for b in stage_batches(shapes, 1 << 30) for i in b) == list(range(5))
