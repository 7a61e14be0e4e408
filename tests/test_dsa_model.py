"""DSA (DeepSeek Sparse Attention) in the whole model: sparse attention, the indexer loss, index
sharing, packing, tensor parallelism and MTP (pretrain/model/dsa/layer.py).

Every check compares against something the code under test does not compute itself:

* transformers' `GlmMoeDsaForCausalLM` (sparse regime: index_topk below the sequence length), for
  whole-model logits, single-document logits of packed batches, THD-packed attention layers and the
  indexer's top-k selection;
* naive float64 formulas (MLA attention, the lightning indexer, the dense / sparse KL) written here
  from the GLM-5 / DeepSeek-V3.2 definitions, for the indexer loss and its gradient;
* a single-rank run, for TP=2 with and without sequence parallelism (spawned gloo ranks).

Regression: sparse attention under TP=2 without sequence parallelism once lost the other ranks'
share of the KV latent's gradient (megatron-core 0.16.1's `_reduce` returns a non-contiguous input
unreduced; pretrain/compat/ fixes it).

fp32 on CPU. Tolerances are relative max-abs errors (max|out - ref| / max|ref|).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import pytest
import torch
import torch.nn.functional as F

from pretrain.convert import load_hf_model
from pretrain.model.dsa import DSAMetrics, IndexerLossAutoScaler
from tests.distributed import run_ranks
from tests.hf_fixtures import tiny_hf_model, write_hf_checkpoint

TOL = 1e-5  # fp32 vs fp32 (transformers, single rank)
TOL64 = 1e-4  # fp32 model vs float64 formula
INDEXER = ".core_attention.indexer."
# An index score is sum_j w_j ReLU(q_j . k): with few index heads all ReLUs of a key are often 0, and
# keys tied at 0 straddle the top-k boundary. torch.topk breaks such ties by position, so a document
# at an offset inside a packed row (or a float64 recomputation) may select other, equally scored keys.
# With 32 index heads an all-zero score has probability 2^-32 per key and ties do not occur.
NO_TIE_INDEX_HEADS = 32


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.abs().max().item()
    diff = (out - ref).abs().max().item()
    return diff / scale if scale > 0 else diff


def is_indexer(name: str) -> bool:
    return INDEXER in name


@pytest.fixture(autouse=True)
def _clean_dsa_globals():
    """The indexer-loss scale and the metrics table are process-wide: reset them around each test."""
    IndexerLossAutoScaler.main_loss_backward_scale = None
    DSAMetrics.clear()
    yield
    IndexerLossAutoScaler.main_loss_backward_scale = None
    DSAMetrics.clear()


def hf_checkpoint(path, seed: int, **kw):
    """A random tiny `GlmMoeDsaForCausalLM` saved to `path`; returns the HF model (eval, fp32)."""
    hf = tiny_hf_model(seed, **kw)
    hf.save_pretrained(str(path))
    return hf


def tokens(seed: int, batch: int, seq: int, vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def positions(batch: int, seq: int) -> torch.Tensor:
    return torch.arange(seq).unsqueeze(0).expand(batch, -1)


def lm_step(model, ids: torch.Tensor, labels: torch.Tensor, scale: Optional[float] = None, mult: float = 1.0):
    """Forward + backward of mult * mean per-token LM loss with the indexer-loss scale `scale`.
    Returns (per-token loss, {name: grad or None}, {layer: recorded indexer loss})."""
    model.zero_grad(set_to_none=True)
    IndexerLossAutoScaler.main_loss_backward_scale = None
    if scale is not None:
        IndexerLossAutoScaler.set_loss_scale(torch.tensor(scale))
    DSAMetrics.clear()
    loss = model(ids, positions(*ids.shape), None, labels=labels)
    (loss.mean() * mult).backward()
    grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
    recorded = {layer: total / count for layer, (total, count) in DSAMetrics.values.get("indexer_loss", {}).items()}
    DSAMetrics.clear()
    return loss.detach(), grads, recorded


# ================================================================================================
# 1. logits parity with transformers in the sparse regime
# ================================================================================================

SPARSE_CASES = [
    # seed, layers, dense-first layers, batch, seq, index_topk, indexer_types, chunk override
    # (32 index heads: no ties at the top-k boundary. transformers selects with torch.topk, whose choice
    # among tied keys is unspecified; ours takes the lowest key indices, tested in test_dsa_ops.py.)
    (10, 3, 1, 2, 24, 6, None, None),
    # every layer MoE; top-k and sparse attention in row chunks of 7
    (11, 2, 0, 1, 33, 5, None, 7),
    (12, 3, 1, 2, 40, 8, ["full", "shared", "full"], None),
    (13, 3, 2, 1, 20, 7, ["full", "shared", "shared"], 6),
]


@pytest.mark.parametrize("seed,layers,dense,batch,seq,topk,types,chunk", SPARSE_CASES)
def test_sparse_logits_match_transformers(tmp_path, seed, layers, dense, batch, seq, topk, types, chunk):
    kw = {"indexer_types": types} if types else {}
    hf = hf_checkpoint(tmp_path, seed, layers=layers, dense=dense, index_topk=topk,
                       index_n_heads=NO_TIE_INDEX_HEADS, **kw)
    assert topk < seq
    ids = tokens(seed, batch, seq)
    with torch.no_grad():
        ref = hf(ids).logits
    overrides = {"dsa_chunk_size": chunk} if chunk else {}
    cfg, model = load_hf_model(str(tmp_path), mtp_num_layers=None, **overrides)
    assert cfg.model.dsa_sparse_attention and cfg.model.dsa_indexer_topk == topk
    assert cfg.model.dsa_indexer_types == types
    with torch.no_grad():
        out = model(ids, positions(batch, seq), None)
    assert out.shape == ref.shape
    assert relative_error(out, ref) <= TOL

    # Sensitivity: the same weights with dense attention are far from the sparse reference, so the
    # comparison above really exercises the sparse path.
    _, dense_model = load_hf_model(str(tmp_path), mtp_num_layers=None, dsa_sparse_attention=False)
    with torch.no_grad():
        dense_out = dense_model(ids, positions(batch, seq), None)
    assert relative_error(dense_out, ref) > 1e-3


# ================================================================================================
# 2. the indexer is detached from the LM, and warm-up trains only the indexer
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
# 3. the indexer gradient against a naive float64 KL
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
# 4. TP=2 (with and without sequence parallelism) against a single rank
# ================================================================================================

SPARSE_MODE = ["model.dsa_sparse_attention=true", "model.dsa_indexer_loss_coeff=0.5",
               "model.dsa_indexer_use_sparse_loss=true"]
WARMUP_MODE = ["model.dsa_sparse_attention=false", "model.dsa_indexer_loss_coeff=0.5",
               "model.dsa_indexer_use_sparse_loss=false"]
NO_MOE = ["model.num_moe_experts=null"]  # megatron's MoE layer trains with TP > 1 only under SP
TP2_SP = ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]
TP2 = ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=false"]
TP_CASES = {
    # name: (model overrides of reference and parallel run, parallel layout)
    "sparse_tp2_sp": (SPARSE_MODE, TP2_SP),
    "sparse_tp2": (SPARSE_MODE + NO_MOE, TP2),
    "warmup_tp2_sp": (WARMUP_MODE, TP2_SP),
    "warmup_tp2": (WARMUP_MODE + NO_MOE, TP2),
}
TP_PARAMS = list(TP_CASES)


def _tp_config(case: str, parallel: bool):
    from pretrain.config import load_config
    from tests.parallel_helpers import BASE_OVERRIDES, TINY

    model, layout = TP_CASES[case]
    return load_config(TINY, BASE_OVERRIDES + model + (layout if parallel else []))


def _tp_step(model, batch: torch.Tensor):
    inputs, labels = batch[:, :-1], batch[:, 1:]
    DSAMetrics.clear()
    loss = model(inputs, positions(*inputs.shape), attention_mask=None, labels=labels)
    loss.mean().backward()
    recorded = {layer: total / count for layer, (total, count) in DSAMetrics.values.get("indexer_loss", {}).items()}
    DSAMetrics.clear()
    return loss.detach(), recorded


def rank_dsa_reference(rank: int, world_size: int, cases: List[str], batch: torch.Tensor) -> dict:
    from parallel.initialize import destroy_parallel, initialize_parallel
    from pretrain.model.builder import build_model
    from tests.parallel_helpers import SEED, grads_of, state_of

    out = {}
    try:
        for case in cases:
            cfg = _tp_config(case, parallel=False)
            initialize_parallel(cfg.parallel, seed=SEED)
            model = build_model(cfg)
            gen = torch.Generator().manual_seed(SEED + 1)
            with torch.no_grad():  # weights large enough for peaked attention and index scores
                for name, p in model.named_parameters():
                    if name.endswith("norm.weight"):
                        p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
                    elif name.endswith("norm.bias"):
                        p.copy_(0.1 * torch.randn(p.shape, generator=gen))
                    elif (is_indexer(name) or ".self_attention." in name) and p.dim() == 2:
                        p.copy_(0.2 * torch.randn(p.shape, generator=gen))
                for name, buf in model.named_buffers():
                    if name.endswith("expert_bias"):
                        buf.copy_(0.05 * torch.randn(buf.shape, generator=gen))
            state = state_of(model)
            loss, recorded = _tp_step(model, batch)
            out[case] = {"state": state, "loss": loss, "indexer_loss": recorded, "grads": grads_of(model)}
        return out
    finally:
        destroy_parallel()


def rank_dsa_parallel(rank: int, world_size: int, cases: List[str], batch: torch.Tensor, states: dict) -> dict:
    from parallel.initialize import destroy_parallel, initialize_parallel
    from pretrain.model.builder import build_model
    from tests.parallel_helpers import SEED, grads_of, param_meta, rank_coords, shard_like

    out = {}
    try:
        for case in cases:
            cfg = _tp_config(case, parallel=True)
            initialize_parallel(cfg.parallel, seed=SEED + 100 + rank)
            coords = dict(rank_coords(), num_experts=cfg.model.num_moe_experts)
            model = build_model(cfg)
            meta = {n: param_meta(p) for n, p in model.named_parameters()}
            ref_state = states[case]
            with torch.no_grad():
                tensors = dict(model.named_parameters())
                tensors.update({n: b for n, b in model.named_buffers() if n.endswith("expert_bias")})
                assert set(tensors) == set(ref_state), set(tensors) ^ set(ref_state)
                for name, t in tensors.items():
                    t.copy_(shard_like(name, ref_state[name], meta.get(name, param_meta(t)), coords))
            loss, recorded = _tp_step(model, batch)
            out[case] = {"coords": coords, "meta": meta, "loss": loss, "indexer_loss": recorded,
                         "grads": grads_of(model), "sp": cfg.parallel.sequence_parallel}
        return out
    finally:
        destroy_parallel()


@pytest.fixture(scope="module")
def tp_runs():
    from tests.parallel_helpers import RANK_ENV, make_batch

    batch = make_batch()
    cases = list(TP_CASES)
    (ref,) = run_ranks(rank_dsa_reference, 1, cases, batch, env=RANK_ENV)
    states = {case: ref[case]["state"] for case in cases}
    par = run_ranks(rank_dsa_parallel, 2, cases, batch, states, env=RANK_ENV)
    return ref, par


@pytest.mark.parametrize("case", TP_PARAMS)
def test_tp2_dsa_matches_single_rank(tp_runs, case):
    from tests.parallel_helpers import SEQ, compare_grads, rel_err, shard_like

    ref_all, par_all = tp_runs
    ref, results = ref_all[case], [r[case] for r in par_all]
    assert all(r["coords"]["tp_size"] == 2 for r in results)
    assert [r["sp"] for r in results] == [case.endswith("_sp")] * 2
    if case.startswith("sparse"):
        assert 0 < int(_tp_config(case, False).model.dsa_indexer_topk) < SEQ
    # The reference is meaningful: indexer losses on every decoder layer and the MTP layer, and
    # non-zero gradients on the indexer and the MLA latent / rope-key weights.
    layers = _tp_config(case, False).model.num_layers
    assert sorted(ref["indexer_loss"]) == list(range(1, layers + 2))
    must_have = [n for n in ref["grads"] if is_indexer(n) or "linear_kv_down_proj" in n or "kv_layernorm" in n]
    assert len(must_have) >= 3 * 7
    for name in must_have:
        assert ref["grads"][name] is not None and ref["grads"][name].abs().max() > 0, name

    for r in results:
        assert rel_err(r["loss"], ref["loss"]) <= TOL
        assert sorted(r["indexer_loss"]) == sorted(ref["indexer_loss"])
        for layer, value in ref["indexer_loss"].items():
            assert rel_err(r["indexer_loss"][layer], value) <= TOL, (layer, r["indexer_loss"][layer], value)
        # replicated indexer: every rank holds the whole single-rank gradient
        for name in must_have:
            if is_indexer(name):
                assert rel_err(r["grads"][name], ref["grads"][name]) <= TOL, name
        # the latent / rope-key projection is TP-sharded: the local gradient is the reference shard
        for name in must_have:
            if "linear_kv_down_proj" in name and r["meta"][name]["tensor_model_parallel"]:
                want = shard_like(name, ref["grads"][name], r["meta"][name], r["coords"])
                assert rel_err(r["grads"][name], want) <= TOL, name
    worst = compare_grads(ref, results, reduce=True)
    print(f"\n{case}: worst relative max-abs gradient error {worst:.2e}")


# ================================================================================================
# 5. packed sequences: documents by a dense mask, and THD packing at the attention module
# ================================================================================================


def document_mask(lengths_per_row: List[List[int]]) -> torch.Tensor:
    """megatron's bool mask [b, 1, s, s], True = masked: block-diagonal causal over documents."""
    rows = []
    for lengths in lengths_per_row:
        seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        s = seg.numel()
        visible = (seg[:, None] == seg[None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
        rows.append(~visible)
    return torch.stack(rows).unsqueeze(1)


def test_dense_document_mask_gives_each_document_its_own_logits(tmp_path):
    """Sparse mode, packed documents under a dense document mask: every document's logits equal
    transformers' logits of that document alone (later documents sit at RoPE offsets; rope scores
    depend only on position differences). Without the mask later documents differ."""
    topk = 5
    hf = hf_checkpoint(tmp_path, 41, layers=3, dense=1, index_topk=topk, indexer_types=["full", "shared", "full"],
                       index_n_heads=NO_TIE_INDEX_HEADS)
    lengths = [[9, 7, 12], [6, 14, 8]]
    seq = sum(lengths[0])
    ids = tokens(41, len(lengths), seq)
    _, model = load_hf_model(str(tmp_path), mtp_num_layers=None)
    mask = document_mask(lengths)
    with torch.no_grad():
        packed = model(ids, positions(*ids.shape), mask)
        unmasked = model(ids, positions(*ids.shape), None)
    later_diffs = []
    for row, row_lengths in enumerate(lengths):
        start = 0
        for n in row_lengths:
            assert n > topk  # the documents themselves are sparse
            with torch.no_grad():
                ref = hf(ids[row : row + 1, start : start + n]).logits[0]
            assert relative_error(packed[row, start : start + n], ref) <= TOL, (row, start)
            if start > 0:
                later_diffs.append(relative_error(unmasked[row, start : start + n], ref))
            start += n
    assert min(later_diffs) > 1e-3, later_diffs


def _hf_attention(attn, rotary, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' attention layer on one document: hidden [s, h] -> [s, h]."""
    s = hidden.shape[0]
    x = hidden.unsqueeze(0)
    cos_sin = rotary(x, torch.arange(s).unsqueeze(0))
    mask = torch.full((s, s), torch.finfo(x.dtype).min).triu(1)[None, None]
    out, _, _ = attn(x, position_embeddings=cos_sin, attention_mask=mask)
    return out[0]


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_thd_packed_attention_matches_documents_alone(tmp_path, sparse):
    """A DSA attention layer called on a THD-packed stream [t, 1, h] with cu_seqlens gives, per
    document, its output on that document alone (RoPE positions restart per document); in sparse
    mode that is also transformers' attention layer on the document."""
    from megatron.core.packed_seq_params import PackedSeqParams

    topk = 4
    hf = hf_checkpoint(tmp_path, 51, layers=2, dense=1, index_topk=topk, index_n_heads=NO_TIE_INDEX_HEADS)
    _, model = load_hf_model(str(tmp_path), mtp_num_layers=None, dsa_sparse_attention=sparse)
    lengths = [7, 11, 5, 9]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    total = int(cu[-1])
    hidden = torch.randn(total, 1, hf.config.hidden_size, generator=torch.Generator().manual_seed(51))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    for index, layer in enumerate(model.decoder.layers):
        attn = layer.self_attention
        with torch.no_grad():
            packed, _ = attn(hidden, None, packed_seq_params=params)
            whole, _ = attn(hidden, None)
        assert packed.shape == hidden.shape
        later_diffs = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            with torch.no_grad():
                alone, _ = attn(hidden[a:b], None)
                ref = _hf_attention(hf.model.layers[index].self_attn, hf.model.rotary_emb, hidden[a:b, 0])
            assert relative_error(packed[a:b], alone) <= TOL, (index, a)
            if sparse:
                assert relative_error(packed[a:b, 0], ref) <= TOL, (index, a)
            if a > 0:
                later_diffs.append(relative_error(whole[a:b], alone))
        assert min(later_diffs) > 1e-3, later_diffs  # without the packing the documents mix


# ================================================================================================
# 6. MTP with DSA, and index sharing
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
    counts = {layer: count for layer, (_, count) in DSAMetrics.values.get("indexer_loss", {}).items()}
    values = {layer: float(total) for layer, (total, _) in DSAMetrics.values.get("indexer_loss", {}).items()}
    loss.mean().backward()
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


def test_shared_layer_reuses_the_full_layers_selection(tmp_path, monkeypatch):
    """dsa_indexer_types ["full", "shared"]: the shared layer owns no indexer, points at layer 1's
    core attention, and attends over exactly layer 1's top-k, which is transformers' selection."""
    from pretrain.model.dsa.backend import ReferenceBackend

    topk, seq = 5, 18
    hf = hf_checkpoint(tmp_path, 71, layers=2, dense=1, index_topk=topk, indexer_types=["full", "shared"])
    cfg, model = load_hf_model(str(tmp_path), mtp_num_layers=None)
    assert cfg.model.dsa_indexer_types == ["full", "shared"]
    names = [n for n, _ in model.named_parameters() if is_indexer(n)]
    assert names and all(n.startswith("decoder.layers.0.") for n in names)
    first, second = (layer.self_attention.core_attention for layer in model.decoder.layers)
    assert second.indexer is None and second.index_source is first

    seen = []
    original = ReferenceBackend.attention_forward

    def recording(self, q, kv, indices, *args, **kwargs):
        seen.append(indices.clone())
        return original(self, q, kv, indices, *args, **kwargs)

    monkeypatch.setattr(ReferenceBackend, "attention_forward", recording)
    hf_indices = []
    hf.model.layers[0].self_attn.register_forward_hook(lambda m, a, out: hf_indices.append(out[2]))
    ids = tokens(71, 2, seq)
    with torch.no_grad():
        model(ids, positions(2, seq), None)
        hf(ids)
    assert len(seen) == 2 and torch.equal(seen[0], seen[1])

    def selected(indices: torch.Tensor) -> torch.Tensor:
        """[b, s, K] -> [b, s, s] bool over causal keys (slots of -1 / masked keys dropped)."""
        b, s, _ = indices.shape
        out = torch.zeros(b, s, s + 1, dtype=torch.bool)
        out.scatter_(-1, torch.where(indices < 0, s, indices.long()), True)
        return out[..., :s] & torch.ones(s, s, dtype=torch.bool).tril()

    ours, theirs = selected(seen[0]), selected(hf_indices[0])
    assert torch.equal(ours, theirs)
    assert torch.equal(ours.sum(-1), torch.arange(1, seq + 1).clamp(max=topk).expand(2, -1))
