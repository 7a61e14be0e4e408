"""Tensor- and expert-parallel runs of the tiny GLM-5 give the single-rank loss and gradients.

The model keeps every GLM-5 feature (MLA, MoE with a shared expert and sigmoid + bias routing,
seq_aux_loss with the config's coefficient, 3 depth-shared MTP depths with the config's loss scale,
DSA indexer parameters) at toy sizes, in fp32 without dropout. Tolerance: relative max-abs error
(max|parallel - reference| / max|reference|) <= 1e-5 for every loss and every gradient.

Procedure:

1. Reference: one rank (spawned through `run_ranks`, so no parallel state ever exists in the pytest
   process) builds the model with a fixed seed, randomizes the norm weights and the routers'
   `expert_bias` (so a mixed-up norm or bias cannot pass unnoticed), runs forward + backward of
   `loss.mean()` on a batch of 2 sequences and returns its full state (parameters + `expert_bias`
   buffers), the per-token loss and every parameter's gradient.
2. Parallel runs (world size 2, one spawn for both layouts): each rank builds its part of the model
   with other seeds, loads its shard of the reference state (`shard_like`, written from the
   parameters' `tensor_model_parallel` / `partition_dim` attributes and megatron's layouts), and
   runs forward + backward of the mean loss of its own data twice: on the bare model (local
   gradients) and wrapped in megatron's DistributedDataParallel followed by `finalize_model_grads`
   (the `main_grad`s a training step's optimizer sees).
3. In the pytest process the local gradients are combined by the rules a correct data-, sequence-
   and expert-parallel reduction follows (`reduced_grad`) and compared, shard by shard, with the
   reference gradient cut like the parameter; the DDP gradients are compared directly.

TP=2 (world 2, DP=1), with sequence parallelism, which megatron's MoELayer requires to train with
TP > 1. Both ranks get the same batch; the embedding output is split along the sequence, so each
rank's norms, router and experts (ETP=1: whole on every rank) see half the tokens:

* TP-sharded parameters: the local gradient is the reference shard as is;
* replicated parameters tagged `sequence_parallel` (norms, routers): the local gradient covers the
  rank's half of the sequence; the sum over the TP ranks (finalize_model_grads) is the reference;
* routed experts: also half the tokens each, so the sum over the expert-data-parallel group (here
  the two TP ranks) is the reference. megatron-core 0.16.1's DDP forms that sum only because our
  experts mark their weights expert-parallel when ETP < TP (megatron itself marks them dense
  whenever EP = 1): `test_tp2_megatron_ddp_reduces_expert_grads`;
* seq_aux_loss: token counts are summed over the TP x CP group, each rank's loss covers its own
  tokens' probabilities, and the routers' TP sum adds the halves: exact, no special case.

EP=2 (TP=1, so DP=2; with megatron's all-gather dispatcher, and again with our per-rank all-to-all
`alltoall_dedup`, which also runs as TP=2 + SP x EP=2 on the same 2 ranks under the TP=2 rules): rank r gets
sample r; its loss is the mean over its own 16 tokens, so the reference loss (mean over 32 tokens) is the average
of the two ranks' losses, and

* dense (non-expert) parameters: grad_r = d loss_r / dW, so the average over the DP ranks (DDP's
  sum with scaling 1/DP) is d(mean_r loss_r)/dW = the reference; neither rank's own grad is;
* routed experts: the allgather dispatcher hands rank r's experts the tokens of *both* ranks, and
  each token's output flows back to its own rank, where it enters that rank's loss normalized by
  that rank's token count. So grad_r(expert) = d(loss_0 + loss_1)/dW_e = DP x the reference;
  DDP scales expert grads by 1/DP (`expert_gradient_scaling_factor`) and sums them over the
  expert-data-parallel group (size 1 here): the reference again;
* seq_aux_loss: per sequence, divided by the local batch size, with token counts summed over the
  TP x CP group only (size 1): rank r's aux loss is sequence r's, and the DP average is the
  reference's mean over both sequences. Exact, no special case;
* MTP: each depth's loss is divided by the rank's own (rolled) token count, a per-rank mean again.

Pipeline parallelism (PP=2) is compared against the same reference in test_pipeline_equivalence.py;
the reference run, `shard_like`, `reduced_grad` and `compare_grads` live in tests/parallel_helpers.py.
"""

from __future__ import annotations

import math
from typing import Dict, List

import pytest
import torch

from tests.distributed import run_ranks
from tests.parallel_helpers import (
    RANK_ENV,
    TOL,
    VOCAB,
    compare_grads,
    is_routed_expert,
    make_batch,
    rank_parallel,
    rank_reference,
    rel_err,
    shard_like,
)


# ------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def batch() -> torch.Tensor:
    return make_batch()


@pytest.fixture(scope="module")
def reference(batch) -> dict:
    (ref,) = run_ranks(rank_reference, 1, batch, env=RANK_ENV)
    return ref


@pytest.fixture(scope="module")
def parallel_runs(batch, reference) -> List[dict]:
    return run_ranks(rank_parallel, 2, ["tp2", "ep2", "ep2_dedup", "tp2ep2_dedup"], batch, reference["state"],
                     env=RANK_ENV)


@pytest.fixture(scope="module")
def tp2(parallel_runs) -> Dict[str, List[dict]]:
    return {kind: [r["tp2"][kind] for r in parallel_runs] for kind in ("local", "ddp")}


@pytest.fixture(scope="module")
def ep2(parallel_runs) -> Dict[str, List[dict]]:
    return {kind: [r["ep2"][kind] for r in parallel_runs] for kind in ("local", "ddp")}


def test_reference_is_meaningful(reference):
    """Preconditions that make the equivalence tests able to fail."""
    grads = reference["grads"]
    assert torch.isfinite(reference["loss"]).all()
    assert math.isclose(reference["loss"].mean().item(), math.log(VOCAB), rel_tol=0.1)
    # Every trainable parameter except the DSA indexer's gets a non-zero gradient. The indexer's get
    # none: the core attention is dense and never calls it (pretrain/model/core_attention.py), so
    # the loss does not depend on it. Once it does, its gradients are compared like all others.
    for name, g in grads.items():
        if ".core_attention.indexer." in name:
            assert g is None, f"{name} now has a gradient; drop this special case"
        else:
            assert g is not None and g.abs().max() > 0, f"{name}: no gradient"
    # The aux loss's share of the router gradient is far above the tolerance, so a mis-reduced aux
    # loss cannot hide inside TOL (the MTP losses' share of every gradient is much larger still).
    for name, without in reference["router_grads_without_aux"].items():
        share = rel_err(without, grads[name])
        assert share > 100 * TOL, f"{name}: the aux loss changes the router grad by only {share:.1e}"


def test_tp2_shards_are_halves(tp2, reference):
    """TP-sharded parameters are halves of the full ones (not replicated), the two ranks hold
    different halves, and everything else is whole on both ranks."""
    results, sharded = tp2["local"], []
    for r in results:
        c = r["coords"]
        assert (c["tp_size"], c["dp_size"], c["ep_size"], c["etp_size"]) == (2, 1, 1, 1)
    for name, full in reference["state"].items():
        meta = results[0]["meta"].get(name)
        if meta is None or is_routed_expert(name) or not meta["tensor_model_parallel"]:
            assert all(r["shapes"][name] == tuple(full.shape) for r in results), name
            continue
        shape = list(full.shape)
        shape[meta["partition_dim"]] //= 2
        for r in results:
            assert r["shapes"][name] == tuple(shape), f"{name}: {r['shapes'][name]} is not half of {tuple(full.shape)}"
        halves = [shard_like(name, full, meta, r["coords"]) for r in results]
        assert not torch.equal(halves[0], halves[1]), name
        sharded.append(name)
    expected = {
        "embedding.word_embeddings.weight",
        "output_layer.weight",
        "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.0.mlp.linear_fc2.weight",
        "decoder.layers.1.mlp.shared_experts.linear_fc1.weight",
        "decoder.layers.1.self_attention.linear_q_down_proj.weight",
        "decoder.layers.1.self_attention.linear_q_up_proj.weight",
        "decoder.layers.1.self_attention.linear_kv_down_proj.weight",
        "decoder.layers.1.self_attention.linear_kv_up_proj.weight",
        "decoder.layers.1.self_attention.linear_proj.weight",
        "mtp.layers.0.eh_proj.weight",
        "mtp.layers.0.transformer_layer.mlp.shared_experts.linear_fc2.weight",
    }
    assert expected <= set(sharded), expected - set(sharded)


def test_tp2_matches_single_rank(tp2, reference):
    results = tp2["local"]
    for r in results:  # same batch on both ranks: the full per-token loss everywhere
        assert rel_err(r["loss"], reference["loss"]) <= TOL
    # TP-sharded parameters need no reduction at all: the local gradient is the reference shard.
    for r in results:
        for name, meta in r["meta"].items():
            if meta["tensor_model_parallel"] and not is_routed_expert(name):
                want = shard_like(name, reference["grads"][name], meta, r["coords"])
                assert rel_err(r["grads"][name], want) <= TOL, name
    worst = compare_grads(reference, results, reduce=True)
    print(f"\nTP=2 + SP: worst relative max-abs error {worst:.2e}")


def test_tp2_megatron_ddp_matches_single_rank(tp2, reference):
    """Through megatron's DDP + finalize_model_grads: every non-expert gradient is the reference's."""
    worst = compare_grads(reference, tp2["ddp"], reduce=False, skip=is_routed_expert)
    print(f"\nTP=2 + SP through megatron DDP (routed experts aside): worst relative max-abs error {worst:.2e}")


def test_tp2_megatron_ddp_reduces_expert_grads(tp2, reference):
    compare_grads(reference, tp2["ddp"], reduce=False, skip=lambda name: not is_routed_expert(name))


def test_ep2_matches_single_rank(ep2, reference):
    results = ep2["local"]
    ref_loss = reference["loss"]
    for rank, r in enumerate(results):
        c = r["coords"]
        assert (c["tp_size"], c["ep_size"], c["dp_size"], c["dp_rank"], c["ep_rank"]) == (1, 2, 2, rank, rank)
        for name in ("decoder.layers.1.mlp.experts.weight1", "mtp.layers.0.transformer_layer.mlp.experts.weight2"):
            assert math.prod(r["shapes"][name]) * 2 == reference["state"][name].numel(), name
            assert not r["meta"][name]["allreduce"], f"{name} is not marked expert-parallel"
        # rank r's per-token loss is the reference's for sample r
        assert rel_err(r["loss"], ref_loss[rank : rank + 1]) <= TOL
    mean_of_rank_means = sum(r["loss"].mean() for r in results) / len(results)
    assert abs(mean_of_rank_means - ref_loss.mean()) <= TOL * ref_loss.mean()

    worst = compare_grads(reference, results, reduce=True)
    # The expert rule on raw gradients: rank r's experts' gradient / DP is the reference's.
    for r in results:
        for name, g in r["grads"].items():
            if is_routed_expert(name):
                want = shard_like(name, reference["grads"][name], r["meta"][name], r["coords"])
                assert rel_err(g / r["coords"]["dp_size"], want) <= TOL, name
    # The dense rule needs the DP average: neither rank's own router gradient is the reference's.
    name = "decoder.layers.1.mlp.router.weight"
    own = [rel_err(r["grads"][name], reference["grads"][name]) for r in results]
    assert min(own) > 100 * TOL, f"a single rank's router gradient should differ from the reference: {own}"
    print(f"\nEP=2: worst relative max-abs error {worst:.2e}")


def test_ep2_megatron_ddp_matches_single_rank(ep2, reference):
    """Through megatron's DDP + finalize_model_grads: every gradient is the reference's."""
    worst = compare_grads(reference, ep2["ddp"], reduce=False)
    print(f"\nEP=2 through megatron DDP: worst relative max-abs error {worst:.2e}")


@pytest.mark.parametrize("layout", ["ep2_dedup", "tp2ep2_dedup"])
def test_dedup_dispatch_matches_single_rank(parallel_runs, reference, layout):
    """The per-rank EP dispatch (`model.moe_token_dispatcher_type=alltoall_dedup`, pretrain/model/ep_dispatch.py):
    EP=2 (DP=2, the EP=2 rules above) and TP=2 + SP x EP=2 on the same 2 ranks (DP=1: each rank's experts see both
    ranks' sequence halves; the TP=2 rules above), locally and through megatron's DDP."""
    for rank, r in enumerate(parallel_runs):
        local = r[layout]["local"]
        assert local["coords"]["ep_size"] == 2 and local["coords"]["tp_size"] == (2 if layout.startswith("tp2") else 1)
        want = reference["loss"] if layout.startswith("tp2") else reference["loss"][rank : rank + 1]
        assert rel_err(local["loss"], want) <= TOL
    worst = compare_grads(reference, [r[layout]["local"] for r in parallel_runs], reduce=True)
    worst_ddp = compare_grads(reference, [r[layout]["ddp"] for r in parallel_runs], reduce=False)
    print(f"\n{layout}: worst relative max-abs error {worst:.2e} (local), {worst_ddp:.2e} (megatron DDP)")
