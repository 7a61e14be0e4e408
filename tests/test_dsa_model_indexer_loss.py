"""The DSA indexer loss in the whole model: detached from the LM, warm-up, gradient vs a float64 KL, loss scale, MTP."""

# The naive float64 KL (MLA attention, the lightning indexer, the dense / sparse KL) is written here
# from the GLM-5 / DeepSeek-V3.2 definitions with transformers' layer weights.
# fp32 on CPU. Tolerances are relative max-abs errors (max|out - ref| / max|ref|).

from __future__ import annotations

import math
from typing import Dict

import pytest
import torch
import torch.nn.functional as F

from pretrain.convert import load_hf_model
from pretrain.model.dsa import DSAMetrics
from tests.dsa_helpers import (  # noqa: F401  (clean_dsa_globals: an autouse fixture)
    NO_TIE_INDEX_HEADS,
    clean_dsa_globals,
    hf_checkpoint,
    is_indexer,
    lm_step,
    positions,
    relative_error,
    tokens,
)
from tests.hf_fixtures import write_hf_checkpoint

TOL64 = 1e-4  # fp32 model vs float64 formula

# ================================================================================================
# 1. the indexer is detached from the LM, and warm-up trains only the indexer
# ================================================================================================


@pytest.fixture(scope="module")
def sparse_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsa_sparse")
    hf_checkpoint(path, 21, layers=3, dense=1, index_topk=6)
    return path


def test_lm_and_indexer_gradients_are_disjoint(sparse_dir):
    """Sparse mode with the sparse indexer loss.

    (a) LM loss alone (indexer-loss scale 0): no gradient reaches any indexer parameter, and every
        other gradient equals that of the same model built without an indexer loss at all;
    (b) indexer loss alone (scale 1 minus scale 0, same LM loss): zero on every non-indexer
        parameter, non-zero on every indexer parameter.
    """
    ids_all = tokens(5, 2, 25)
    ids, labels = ids_all[:, :-1], ids_all[:, 1:]
    _, model = load_hf_model(str(sparse_dir), mtp_num_layers=None, dsa_indexer_loss_coeff=1.0,
                             dsa_indexer_use_sparse_loss=True)
    loss0, lm_only, _ = lm_step(model, ids, labels, scale=0.0)
    loss1, full, recorded = lm_step(model, ids, labels, scale=1.0)
    assert torch.equal(loss0, loss1)
    assert sorted(recorded) == [1, 2, 3] and all(v > 0 for v in recorded.values())

    _, plain = load_hf_model(str(sparse_dir), mtp_num_layers=None)  # dsa_indexer_loss_coeff = 0
    loss_plain, plain_grads, plain_recorded = lm_step(plain, ids, labels)
    assert not plain_recorded
    assert relative_error(loss1, loss_plain) <= 1e-6

    indexer_names = [n for n in full if is_indexer(n)]
    assert len(indexer_names) == 3 * 5
    for name, g in full.items():
        if is_indexer(name):
            assert lm_only[name] is None or not lm_only[name].any(), f"{name}: LM loss reaches the indexer"
            assert plain_grads[name] is None, f"{name}: trained without an indexer loss"
            assert g is not None and g.abs().max() > 0, f"{name}: no indexer-loss gradient"
        else:
            assert g is not None and g.abs().max() > 0, name
            assert torch.equal(g - lm_only[name], torch.zeros_like(g)), f"{name}: the indexer loss reaches it"
            assert relative_error(lm_only[name], plain_grads[name]) <= 1e-6, name


def test_dense_warmup_trains_only_the_indexer(sparse_dir):
    """DSA warm-up: dense attention, dense KL; every non-indexer parameter frozen. AdamW steps on
    the indexer loss change every indexer tensor, leave all other tensors bitwise untouched (and so
    the LM loss), and lower the dense KL recorded in DSAMetrics."""
    ids_all = tokens(6, 2, 25)
    ids, labels = ids_all[:, :-1], ids_all[:, 1:]
    _, model = load_hf_model(str(sparse_dir), mtp_num_layers=None, dsa_sparse_attention=False,
                             dsa_indexer_loss_coeff=1.0, dsa_indexer_use_sparse_loss=False)
    for name, p in model.named_parameters():
        p.requires_grad_(is_indexer(name))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == 3 * 5
    opt = torch.optim.AdamW(trainable, lr=3e-2, weight_decay=0.0)
    kls, lm_losses = [], []
    for _ in range(6):
        opt.zero_grad(set_to_none=True)
        loss, grads, recorded = lm_step(model, ids, labels)
        assert sorted(recorded) == [1, 2, 3]
        for name, g in grads.items():
            assert (g is not None) == is_indexer(name), name
        kls.append(sum(float(v) for v in recorded.values()))
        lm_losses.append(loss)
        opt.step()
    for name, p in model.named_parameters():
        if is_indexer(name):
            assert not torch.equal(p, before[name]), f"{name}: not trained"
        else:
            assert torch.equal(p, before[name]), f"{name}: changed while frozen"
    assert all(torch.equal(lm_losses[0], l) for l in lm_losses), "dense attention must not depend on the indexer"
    assert all(b < a for a, b in zip(kls, kls[1:])), f"the dense KL does not decrease: {kls}"
    assert kls[-1] < 0.9 * kls[0], kls


# ================================================================================================
# 2. the indexer gradient against a naive float64 KL
# ================================================================================================


def _rms(t, w, eps):
    return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope_pairs(t: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate consecutive pairs (2i, 2i+1) of t [b, s, heads, d] by pos * theta^(-2i/d)."""
    d = t.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None]  # [s, d/2]
    cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]
    x0, x1 = t[..., 0::2], t[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


def naive_indexer_kl(attn, x: torch.Tensor, theta: float, sparse_attention: bool, sparse_loss: bool, topk: int,
                     leaves: Dict[str, torch.Tensor]):
    """float64 KL(target || softmax(index scores)) averaged over query tokens, written from the
    definitions with transformers' layer `attn` (GlmMoeDsaAttention) weights.

    x [b, s, hidden]: the attention input (after the input norm). `leaves`: the indexer's weights
    (HF names) as float64 leaves. The attention runs over every causal key or (sparse_attention)
    over the top-k keys of the index scores; the KL runs over every causal key or (sparse_loss) over
    the top-k keys. Target: the attention probabilities summed over heads, L1-normalized over the
    KL's keys."""
    d = lambda t: t.detach().double()  # noqa: E731
    b, s, _ = x.shape
    pos = torch.arange(s)
    H, dn, dr, dv = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim
    c = attn.kv_lora_rank
    qc = _rms(x @ d(attn.q_a_proj.weight).T, d(attn.q_a_layernorm.weight), attn.q_a_layernorm.variance_epsilon)
    q = (qc @ d(attn.q_b_proj.weight).T).view(b, s, H, dn + dr)
    kv = x @ d(attn.kv_a_proj_with_mqa.weight).T
    latent = _rms(kv[..., :c], d(attn.kv_a_layernorm.weight), attn.kv_a_layernorm.variance_epsilon)
    k_pe = _rope_pairs(kv[..., c:].unsqueeze(2), pos, theta)
    k_nope = (latent @ d(attn.kv_b_proj.weight).T).view(b, s, H, dn + dv)[..., :dn]
    query = torch.cat([q[..., :dn], _rope_pairs(q[..., dn:], pos, theta)], dim=-1)
    key = torch.cat([k_nope, k_pe.expand(-1, -1, H, -1)], dim=-1)
    visible = torch.ones(s, s, dtype=torch.bool).tril()
    scores = torch.einsum("bshd,bthd->bhst", query, key) * attn.scaling  # [b, H, s, t]

    n_heads, head_dim = attn.config.index_n_heads, attn.config.index_head_dim
    qi = (qc @ leaves["wq_b"].T).view(b, s, n_heads, head_dim)
    qi = torch.cat([_rope_pairs(qi[..., :dr], pos, theta), qi[..., dr:]], dim=-1)
    ki = F.layer_norm(x @ leaves["wk"].T, (head_dim,), leaves["k_norm.weight"], leaves["k_norm.bias"], eps=1e-6)
    ki = torch.cat([_rope_pairs(ki[..., :dr].unsqueeze(2), pos, theta)[:, :, 0], ki[..., dr:]], dim=-1)
    w = (x @ leaves["weights_proj"].T) * n_heads**-0.5
    index = torch.einsum("bsj,bsjt->bst", w, torch.relu(torch.einsum("bsjd,btd->bsjt", qi, ki) * head_dim**-0.5))
    index = index.masked_fill(~visible, float("-inf"))

    values, sel = index.detach().topk(min(topk, s), dim=-1)
    selected = torch.zeros(b, s, s, dtype=torch.bool).scatter(-1, sel, values > float("-inf"))
    visible = visible.expand(b, -1, -1)
    attended = selected if sparse_attention else visible
    keep = selected if sparse_loss else visible
    probs = scores.masked_fill(~attended[:, None], float("-inf")).softmax(-1).sum(1)  # [b, s, t]
    probs = probs.masked_fill(~keep, 0.0)
    p = probs / probs.sum(-1, keepdim=True)
    logq = index.masked_fill(~keep, float("-inf")).log_softmax(-1)
    kl = torch.where(keep, torch.xlogy(p, p) - p * torch.where(keep, logq, 0.0), 0.0).sum(-1)
    return kl.mean()


HF_INDEXER = {"wq_b": "linear_wq_b.weight", "wk": "linear_wk.weight", "k_norm.weight": "k_norm.weight",
              "k_norm.bias": "k_norm.bias", "weights_proj": "linear_weights_proj.weight"}


@pytest.mark.parametrize("sparse, sparse_loss", [(False, False), (True, True), (False, True)],
                         ids=["dense_kl", "sparse_kl", "dense_attention_sparse_kl"])
def test_indexer_gradient_matches_naive_kl(tmp_path, sparse, sparse_loss):
    """For every layer: the recorded indexer loss and coeff x its gradient on the indexer weights
    (through the LM backward, scale 1) equal a float64 KL computed from the layer's own inputs.
    dsa_indexer_use_sparse_loss selects the KL: with dense attention, the selected-keys KL is
    checked and differs from the all-keys KL of the same inputs (the flag is not ignored)."""
    coeff, topk = 0.7, 5
    hf = hf_checkpoint(tmp_path, 31, layers=2, dense=1, index_topk=topk, index_n_heads=NO_TIE_INDEX_HEADS)
    _, model = load_hf_model(str(tmp_path), mtp_num_layers=None, dsa_sparse_attention=sparse,
                             dsa_indexer_loss_coeff=coeff, dsa_indexer_use_sparse_loss=sparse_loss)
    captured = {}

    def capture(layer):
        def hook(module, args, kwargs):
            captured[layer] = (args[0] if args else kwargs["hidden_states"]).detach().clone()
        return hook

    for i, layer in enumerate(model.decoder.layers):
        layer.self_attention.register_forward_pre_hook(capture(i), with_kwargs=True)
    ids_all = tokens(7, 2, 19)
    _, grads, recorded = lm_step(model, ids_all[:, :-1], ids_all[:, 1:], scale=1.0)
    theta = hf.config.rope_parameters["rope_theta"]
    for i, hf_layer in enumerate(hf.model.layers):
        attn = hf_layer.self_attn
        ix = attn.indexer
        leaves = {"wq_b": ix.wq_b.weight, "wk": ix.wk.weight, "k_norm.weight": ix.k_norm.weight,
                  "k_norm.bias": ix.k_norm.bias, "weights_proj": ix.weights_proj.weight}
        leaves = {k: v.detach().double().requires_grad_() for k, v in leaves.items()}
        x = captured[i].transpose(0, 1).double()
        kl = naive_indexer_kl(attn, x, theta, sparse, sparse_loss, topk, leaves)
        assert abs(float(recorded[i + 1]) - kl.item()) <= TOL64 * kl.item(), (i, float(recorded[i + 1]), kl.item())
        if sparse_loss and not sparse:
            other = naive_indexer_kl(attn, x, theta, False, False, topk, leaves).item()
            assert abs(float(recorded[i + 1]) - other) > 100 * TOL64 * other, (i, float(recorded[i + 1]), other)
        ref_grads = torch.autograd.grad(coeff * kl, list(leaves.values()))
        for hf_name, ref in zip(leaves, ref_grads):
            ours = grads[f"decoder.layers.{i}.self_attention.core_attention.indexer.{HF_INDEXER[hf_name]}"]
            assert ref.abs().max() > 0
            assert relative_error(ours.double(), ref) <= TOL64, (i, hf_name, relative_error(ours.double(), ref))


def test_indexer_gradient_follows_the_loss_scale(sparse_dir):
    """IndexerLossAutoScaler: scale 0.5 gives half the indexer gradient of scale 1, and the indexer
    gradient ignores how the LM loss is scaled (3 x loss gives the same indexer gradient)."""
    ids_all = tokens(8, 2, 21)
    ids, labels = ids_all[:, :-1], ids_all[:, 1:]
    _, model = load_hf_model(str(sparse_dir), mtp_num_layers=None, dsa_indexer_loss_coeff=1.0,
                             dsa_indexer_use_sparse_loss=True)
    _, one, _ = lm_step(model, ids, labels, scale=1.0)
    _, half, _ = lm_step(model, ids, labels, scale=0.5)
    _, triple_lm, _ = lm_step(model, ids, labels, scale=1.0, mult=3.0)
    for name, g in one.items():
        if is_indexer(name):
            assert g.abs().max() > 0
            assert relative_error(half[name], 0.5 * g) <= 1e-6, name
            assert relative_error(triple_lm[name], g) <= 1e-6, name
        else:
            assert relative_error(triple_lm[name], 3 * g) <= 1e-5, name


# ================================================================================================
# 3. MTP with DSA
# ================================================================================================


def test_mtp_layer_trains_its_indexer(tmp_path):
    """3 depths sharing one MTP layer, sparse attention and the sparse indexer loss: forward and
    backward run, the MTP layer's indexer gets a gradient, and DSAMetrics holds an indexer loss for
    every decoder layer (once) and for the MTP slot num_layers + 1 (once per depth)."""
    layers = 2
    write_hf_checkpoint(str(tmp_path), 61, layers=layers, dense=1, mtp=True)
    cfg, model = load_hf_model(str(tmp_path), dsa_indexer_topk=6, dsa_indexer_loss_coeff=1.0,
                               dsa_indexer_use_sparse_loss=True)
    assert cfg.model.mtp_num_layers == 3 and cfg.model.mtp_use_repeated_layer and cfg.model.dsa_sparse_attention
    ids_all = tokens(61, 2, 21)
    model.train()
    DSAMetrics.clear()
    loss = model(ids_all[:, :-1], positions(2, 20), None, labels=ids_all[:, 1:])
    loss.mean().backward()  # under sparse attention the KL is formed (and recorded) in backward
    counts = {layer: count for layer, (_, count) in DSAMetrics.values.get("indexer_loss", {}).items()}
    values = {layer: float(total) for layer, (total, _) in DSAMetrics.values.get("indexer_loss", {}).items()}
    assert counts == {1: 1, 2: 1, layers + 1: cfg.model.mtp_num_layers}
    assert all(math.isfinite(v) and v > 0 for v in values.values())
    mtp_indexer = {n: p for n, p in model.named_parameters() if n.startswith("mtp.") and is_indexer(n)}
    assert len(mtp_indexer) == 5
    for name, p in mtp_indexer.items():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().max() > 0, name
    # DSAMetrics.collect reports the MTP slot under its own label, averaged over the depths
    report = DSAMetrics.collect(layers + 1)
    assert {"indexer_loss/layer_01", "indexer_loss/layer_02", "indexer_loss/mtp"} <= set(report)
    assert math.isclose(report["indexer_loss/mtp"], values[layers + 1] / cfg.model.mtp_num_layers, rel_tol=1e-6)
    assert math.isclose(report["indexer_loss/layer_01"], values[1], rel_tol=1e-6)
