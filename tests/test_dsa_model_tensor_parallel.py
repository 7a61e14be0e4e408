"""DSA under TP=2, with and without sequence parallelism, against a single-rank run (spawned gloo ranks)."""

# Regression: sparse attention under TP=2 without sequence parallelism once lost the other ranks'
# share of the KV latent's gradient (megatron-core 0.16.1's `_reduce` returns a non-contiguous input
# unreduced; pretrain/compat/ fixes it).
# fp32 on CPU. Tolerances are relative max-abs errors (max|out - ref| / max|ref|).

from __future__ import annotations

from typing import List

import pytest
import torch

from pretrain.model.dsa import DSAMetrics
from tests.distributed import run_ranks
from tests.dsa_helpers import TOL, clean_dsa_globals, is_indexer, positions  # noqa: F401  (autouse fixture)

# ================================================================================================
# TP=2 (with and without sequence parallelism) against a single rank
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
