"""DSA under TP=2, with and without sequence parallelism, against a single-rank run (spawned gloo ranks).

Each TP rank's indexer scores and trains on half of the query rows (`pretrain.model.dsa.indexer_split`): the LM loss,
every layer's indexer KL and every gradient equal the single-rank run's (fp32, 1e-5), in the sparse mode (sparse
attention, sparse KL formed in backward), the warm-up (dense attention, dense KL) and dense attention with the
sparse KL, with and without packed documents (which cross the ranks' row pieces), and each rank's index scores
cover exactly half of the rows the single rank scores. One spawn of 1 rank and one of 2 run every case.
"""

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
DENSE_SPARSE_KL = ["model.dsa_sparse_attention=false", "model.dsa_indexer_loss_coeff=0.5",
                   "model.dsa_indexer_use_sparse_loss=true"]
NO_MTP = ["model.mtp_num_layers=0"]  # the document cases: the decoder layers are what they test
NO_MOE = ["model.num_moe_experts=null"]  # megatron's MoE layer trains with TP > 1 only under SP
SPLIT = ["model.dsa_indexer_tp_split=true"]  # the parallel runs only: the reference has no TP to split over
TP2_SP = ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true", *SPLIT]
TP2 = ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=false", *SPLIT]
TP_CASES = {
    # name: (model overrides of reference and parallel run, parallel layout); "docs" cases pack documents
    "sparse_tp2_sp": (SPARSE_MODE, TP2_SP),
    "sparse_tp2": (SPARSE_MODE + NO_MOE, TP2),
    "warmup_tp2_sp": (WARMUP_MODE, TP2_SP),
    "warmup_tp2": (WARMUP_MODE + NO_MOE, TP2),
    "sparse_docs_tp2_sp": (SPARSE_MODE + NO_MTP, TP2_SP),
    "warmup_docs_tp2_sp": (WARMUP_MODE + NO_MTP, TP2_SP),
    "dense_sparse_kl_docs_tp2_sp": (DENSE_SPARSE_KL + NO_MTP, TP2_SP),
    # the default, model.dsa_indexer_tp_split=false: every TP rank scores every row (replicated)
    "sparse_replicated_tp2_sp": (SPARSE_MODE, TP2_SP[:2]),
}
# documents per batch row (starts): they cross the 4-row pieces a TP=2 rank scores (rows 0-3 and 12-15 on rank 0)
DOC_STARTS = [[0, 3, 9], [0, 6, 13]]
TP_PARAMS = list(TP_CASES)


def _tp_config(case: str, parallel: bool):
    from pretrain.config import load_config
    from tests.parallel_helpers import BASE_OVERRIDES, TINY

    model, layout = TP_CASES[case]
    return load_config(TINY, BASE_OVERRIDES + model + (layout if parallel else []))


def _documents(case: str, b: int, s: int):
    """(position ids, attention_mask argument): packed documents' layout with restarting positions, or none."""
    if "docs" not in case:
        return positions(b, s), None
    from pretrain.model.documents import document_layout

    cu = torch.tensor([row * s + st for row, starts in enumerate(DOC_STARTS) for st in starts] + [b * s])
    pos = torch.stack([torch.cat([torch.arange(e - a) for a, e in zip(st, st[1:] + [s])]) for st in DOC_STARTS])
    return pos, document_layout(cu, pos, b, s)


def _count_scored_rows(counts: dict) -> None:
    """Count the query rows given to the index-score functions (the top-k's and the KL's) in `counts`."""
    import pretrain.model.dsa.indexer as indexer
    import pretrain.model.dsa.indexer_loss as indexer_loss

    def counting(fn, key):
        def wrapped(q, *args, **kwargs):
            counts[key] = counts.get(key, 0) + q.shape[0] * q.shape[1]
            return fn(q, *args, **kwargs)

        wrapped.counted = fn
        return wrapped

    for module, name in ((indexer, "index_scores"), (indexer_loss, "index_scores"),
                         (indexer_loss, "index_scores_at")):
        fn = getattr(module, name)
        setattr(module, name, counting(getattr(fn, "counted", fn), name))


def _tp_step(model, batch: torch.Tensor, case: str):
    inputs, labels = batch[:, :-1], batch[:, 1:]
    pos, mask = _documents(case, *inputs.shape)
    DSAMetrics.clear()
    counts = {}
    _count_scored_rows(counts)
    loss = model(inputs, pos, attention_mask=mask, labels=labels)
    loss.mean().backward()
    recorded = {layer: total / count for layer, (total, count) in DSAMetrics.values.get("indexer_loss", {}).items()}
    DSAMetrics.clear()
    return loss.detach(), recorded, dict(counts)


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
            loss, recorded, counts = _tp_step(model, batch, case)
            out[case] = {"state": state, "loss": loss, "indexer_loss": recorded, "grads": grads_of(model),
                         "scored_rows": counts}
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
            loss, recorded, counts = _tp_step(model, batch, case)
            out[case] = {"coords": coords, "meta": meta, "loss": loss, "indexer_loss": recorded,
                         "grads": grads_of(model), "sp": cfg.parallel.sequence_parallel, "scored_rows": counts}
        out["row_split"] = _row_split_collectives()
        return out
    finally:
        destroy_parallel()


def _row_split_collectives() -> dict:
    """RowSplit's gather and reduce over the TP group against naive ones, for one sequence per micro-batch (the
    training case, which the model cases' two do not take) and two, int32 and int16 (packed) selections."""
    from megatron.core import parallel_state as ps

    from pretrain.model.dsa.indexer_split import RowSplit

    group, rank = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank()
    out = {}
    for b in (1, 2):
        s, k = 16, 3
        split = RowSplit.create(s, group, "cpu")
        gen = torch.Generator().manual_seed(b)
        partials = [torch.randn(b, s, k, generator=gen) for _ in range(2)]
        out[f"reduce_b{b}"] = torch.equal(split.reduce(partials[rank].clone()),
                                          (partials[0] + partials[1]).index_select(1, split.rows))
        every = torch.arange(b * s * k, dtype=torch.int32).view(b, s, k)
        for dtype in (torch.int32, torch.int16):
            mine = every.to(dtype).index_select(1, split.rows)
            out[f"gather_b{b}_{dtype}"] = torch.equal(split.gather(mine), every.to(dtype))
    return out


@pytest.fixture(scope="module")
def tp_runs():
    from tests.parallel_helpers import RANK_ENV, make_batch

    batch = make_batch()
    cases = list(TP_CASES)  # the last case leaves TP=2 initialized for the collectives' check
    (ref,) = run_ranks(rank_dsa_reference, 1, cases, batch, env=RANK_ENV)
    states = {case: ref[case]["state"] for case in cases}
    par = run_ranks(rank_dsa_parallel, 2, cases, batch, states, env=RANK_ENV)
    return ref, par


def test_row_split_collectives(tp_runs):
    """The selections' all-gather and the KL target's reduce-scatter put every row where it belongs."""
    for r in tp_runs[1]:
        assert r["row_split"] and all(r["row_split"].values()), r["row_split"]


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
    model_cfg = _tp_config(case, False).model
    layers = model_cfg.num_layers + (1 if model_cfg.mtp_num_layers else 0)
    assert sorted(ref["indexer_loss"]) == list(range(1, layers + 1))
    must_have = [n for n in ref["grads"] if is_indexer(n) or "linear_kv_down_proj" in n or "kv_layernorm" in n]
    assert len(must_have) >= layers * 7
    for name in must_have:
        assert ref["grads"][name] is not None and ref["grads"][name].abs().max() > 0, name

    # The indexer's work falls as 1/TP: each rank scores half of the query rows (top-k, KL), none twice;
    # replicated, each rank scores all of them.
    assert ref["scored_rows"].get("index_scores", 0) > 0
    share = 1 if "replicated" in case else 2
    for r in results:
        assert {k: share * v for k, v in r["scored_rows"].items()} == ref["scored_rows"], (r["scored_rows"],
                                                                                          ref["scored_rows"])
    for r in results:
        assert rel_err(r["loss"], ref["loss"]) <= TOL
        assert sorted(r["indexer_loss"]) == sorted(ref["indexer_loss"])
        for layer, value in ref["indexer_loss"].items():
            assert rel_err(r["indexer_loss"][layer], value) <= TOL, (layer, r["indexer_loss"][layer], value)
        # replicated indexer weights, trained on half of the rows per rank: every rank holds the whole
        # single-rank gradient (summed over the TP group by the loss itself, not by a sequence-parallel tag)
        for name in must_have:
            if is_indexer(name):
                assert not r["meta"][name]["sequence_parallel"], name
                assert rel_err(r["grads"][name], ref["grads"][name]) <= TOL, name
        # the latent / rope-key projection is TP-sharded: the local gradient is the reference shard
        for name in must_have:
            if "linear_kv_down_proj" in name and r["meta"][name]["tensor_model_parallel"]:
                want = shard_like(name, ref["grads"][name], r["meta"][name], r["coords"])
                assert rel_err(r["grads"][name], want) <= TOL, name
    worst = compare_grads(ref, results, reduce=True)
    print(f"\n{case}: worst relative max-abs gradient error {worst:.2e}")
