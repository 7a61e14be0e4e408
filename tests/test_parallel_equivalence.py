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

EP=2 (TP=1, so DP=2): rank r gets sample r; its loss is the mean over its own 16 tokens, so the
reference loss (mean over 32 tokens) is the average of the two ranks' losses, and

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

Pipeline parallelism (PP=2) is compared against the same reference in test_pipeline_equivalence.py.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from tests.distributed import RankError, run_ranks

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "models" / "glm5-tiny.yaml"
SEQ, BATCH, VOCAB = 16, 2, 512
SEED = 1234
TOL = 1e-5  # relative max-abs error: max|parallel - reference| / max|reference|
# megatron's jit_fuser functions (the experts' SwiGLU-with-probs, the expert-bias update) run eagerly
# in every rank: the same math without ~4 s of torch.compile per spawned process. Reference and
# parallel ranks run the same code either way.
RANK_ENV = {"TORCH_COMPILE_DISABLE": "1"}

BASE_OVERRIDES = [
    f"model.vocab_size={VOCAB}",
    f"data.seq_length={SEQ}",
    "model.dsa_indexer_topk=8",  # half the sequence, as the shipped config intends
    "model.moe_token_dispatcher_type=allgather",
    "model.hidden_dropout=0.0",
    "model.attention_dropout=0.0",
    "model.params_dtype=float32",
    "model.bf16=false",
]
LAYOUTS = {
    "ref": [],
    # megatron's MoELayer trains with TP > 1 only with sequence parallelism
    "tp2": ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
    "ep2": ["parallel.expert_model_parallel_size=2"],
}


def config(layout: str):
    from pretrain.config import load_config

    return load_config(TINY, BASE_OVERRIDES + LAYOUTS[layout])


def make_batch() -> torch.Tensor:
    """Token ids [BATCH, SEQ + 1]: inputs are [:, :-1], labels the shifted [:, 1:]."""
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(SEED))


# ------------------------------------------------------------------------------------------------
# sharding a full (single-rank) tensor the way a rank holds it
# ------------------------------------------------------------------------------------------------


def is_routed_expert(name: str) -> bool:
    return ".mlp.experts.weight" in name


def is_swiglu_fc1(name: str) -> bool:
    # Dense MLP and shared expert: megatron's fc1 holds [gate; up], each split across TP.
    return name.endswith("linear_fc1.weight")


def shard_like(name: str, full: torch.Tensor, meta: dict, coords: dict) -> torch.Tensor:
    """This rank's part of the single-rank tensor `full` (a parameter, its gradient or a buffer).

    * Routed experts (grouped GEMM): `weight1` [H, E*2F] is the memory of [E, H, 2F] blocks and
      `weight2` [E*F, H] the memory of [E, F, H]; EP rank r holds experts r*E_l .. (r+1)*E_l - 1;
      expert-TP rank q holds slice q of each expert's gate and up halves (fc1) / of F (fc2).
      Experts ignore the dense TP size (their own `tensor_model_parallel` attribute says "sharded"
      even when the expert-TP size is 1).
    * TP-sharded dense parameters: chunk `partition_dim` into TP parts; SwiGLU fc1 chunks gate and
      up separately and concatenates [gate_r; up_r].
    * Everything else (norms, router, DSA indexer, expert_bias) is replicated.
    """
    if is_routed_expert(name):
        n_exp, ep, ep_rank = coords["num_experts"], coords["ep_size"], coords["ep_rank"]
        etp, etp_rank = coords["etp_size"], coords["etp_rank"]
        local = n_exp // ep
        experts = slice(ep_rank * local, (ep_rank + 1) * local)
        if name.endswith("weight1"):
            hidden = full.shape[0]
            blocks = full.reshape(n_exp, hidden, -1)[experts]  # [E_l, H, 2F]
            gate, up = blocks.chunk(2, dim=-1)
            blocks = torch.cat([gate.chunk(etp, dim=-1)[etp_rank], up.chunk(etp, dim=-1)[etp_rank]], dim=-1)
            return blocks.contiguous().view(hidden, -1)
        hidden = full.shape[1]
        blocks = full.reshape(n_exp, -1, hidden)[experts]  # [E_l, F, H]
        return blocks.chunk(etp, dim=1)[etp_rank].contiguous().view(-1, hidden)
    tp, tp_rank = coords["tp_size"], coords["tp_rank"]
    if not meta["tensor_model_parallel"] or tp == 1:
        return full
    if is_swiglu_fc1(name):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]], dim=0)
    return full.chunk(tp, dim=meta["partition_dim"])[tp_rank]


# ------------------------------------------------------------------------------------------------
# rank bodies (module level: run_ranks imports them in the spawned processes)
# ------------------------------------------------------------------------------------------------


def rank_coords() -> dict:
    from megatron.core import parallel_state as ps

    return {
        "tp_size": ps.get_tensor_model_parallel_world_size(),
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "ep_size": ps.get_expert_model_parallel_world_size(),
        "ep_rank": ps.get_expert_model_parallel_rank(),
        "etp_size": ps.get_expert_tensor_parallel_world_size(),
        "etp_rank": ps.get_expert_tensor_parallel_rank(),
        "dp_size": ps.get_data_parallel_world_size(),
        "dp_rank": ps.get_data_parallel_rank(),
        "edp_rank": ps.get_expert_data_parallel_rank(),
    }


def global_param_names(model) -> Dict[str, str]:
    """Stage-local parameter / buffer name -> the single-rank model's name (decoder layers renumbered)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset, prefix = get_transformer_layer_offset(model.config), "decoder.layers."
    names = {}
    for name, _ in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith(prefix):
            layer, rest = name[len(prefix):].split(".", 1)
            names[name] = f"{prefix}{int(layer) + offset}.{rest}"
        else:
            names[name] = name
    return names


def param_meta(param: torch.nn.Parameter) -> dict:
    return {
        "tensor_model_parallel": bool(getattr(param, "tensor_model_parallel", False)),
        "partition_dim": getattr(param, "partition_dim", -1),
        # megatron's DDP reduces allreduce=False (expert-parallel) params over the expert-DP group
        "allreduce": bool(getattr(param, "allreduce", True)),
        "sequence_parallel": bool(getattr(param, "sequence_parallel", False)),
    }


def state_of(model) -> Dict[str, torch.Tensor]:
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    state.update({n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("expert_bias")})
    return state


def grads_of(model) -> Dict[str, torch.Tensor]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


def _forward_backward(model, tokens: torch.Tensor) -> torch.Tensor:
    """Per-token loss [b, s] of `tokens` [b, s + 1]; backward of its mean (this rank's tokens)."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    position_ids = torch.arange(inputs.shape[1]).unsqueeze(0).expand_as(inputs)
    loss = model(inputs, position_ids, attention_mask=None, labels=labels)
    loss.mean().backward()
    return loss.detach()


def rank_reference(rank: int, world_size: int, tokens: torch.Tensor) -> dict:
    from parallel.initialize import destroy_parallel, initialize_parallel
    from pretrain.model.builder import build_model

    cfg = config("ref")
    initialize_parallel(cfg.parallel, seed=SEED)
    try:
        model = build_model(cfg)
        gen = torch.Generator().manual_seed(SEED + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            for name, b in model.named_buffers():
                if name.endswith("expert_bias"):
                    b.copy_(0.05 * torch.randn(b.shape, generator=gen))
        state = state_of(model)
        loss = _forward_backward(model, tokens)
        # The same step without the MoE aux loss, to show its share of the router gradients.
        no_aux = build_model(replace(cfg, model=replace(cfg.model, moe_aux_loss_coeff=0.0)))
        no_aux.load_state_dict(model.state_dict())
        _forward_backward(no_aux, tokens)
        return {
            "state": state,
            "loss": loss,
            "grads": grads_of(model),
            "router_grads_without_aux": {
                n: p.grad.detach().clone() for n, p in no_aux.named_parameters() if n.endswith("router.weight")
            },
        }
    finally:
        destroy_parallel()


def parallel_step(cfg, tokens: torch.Tensor, ref_state: dict, ddp: bool) -> dict:
    """Build this rank's model, load its shard of `ref_state`, forward + backward its data.

    With `ddp`, the model is wrapped in megatron's DistributedDataParallel and the gradients are
    the `main_grad`s after `finalize_model_grads`, i.e. what the optimizer of a training step sees.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads

    from pretrain.model.builder import build_model

    coords = dict(rank_coords(), num_experts=cfg.model.num_moe_experts)
    model = build_model(cfg)
    meta = {n: param_meta(p) for n, p in model.named_parameters()}
    shapes = {}
    with torch.no_grad():
        tensors = dict(model.named_parameters())
        tensors.update({n: b for n, b in model.named_buffers() if n.endswith("expert_bias")})
        assert set(tensors) == set(ref_state), set(tensors) ^ set(ref_state)
        for name, t in tensors.items():
            shard = shard_like(name, ref_state[name], meta.get(name, param_meta(t)), coords)
            assert shard.shape == t.shape, f"{name}: rank holds {tuple(t.shape)}, shard_like gives {tuple(shard.shape)}"
            t.copy_(shard)
            shapes[name] = tuple(t.shape)
    data_rank, data_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    local_batch = tokens.shape[0] // data_size
    local_tokens = tokens[data_rank * local_batch : (data_rank + 1) * local_batch]
    if ddp:
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        )
        wrapped = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
        wrapped.zero_grad_buffer()
        loss = _forward_backward(wrapped, local_tokens)
        finalize_model_grads([wrapped])
        # frozen parameters (the DSA indexer while attention is dense) have no gradient buffer
        grads = {n: p.main_grad.detach().clone() if p.requires_grad else None for n, p in model.named_parameters()}
    else:
        loss = _forward_backward(model, local_tokens)
        grads = grads_of(model)
    return {"coords": coords, "meta": meta, "shapes": shapes, "loss": loss, "grads": grads}


def rank_parallel(rank: int, world_size: int, layouts: List[str], tokens: torch.Tensor, ref_state: dict) -> dict:
    """Each layout in turn on the same ranks: {layout: {"local": ..., "ddp": ...}}."""
    from parallel.initialize import destroy_parallel, initialize_parallel

    results = {}
    try:
        for layout in layouts:
            cfg = config(layout)
            # other seeds than the reference's: every value must come from ref_state
            initialize_parallel(cfg.parallel, seed=SEED + 100 + rank)
            results[layout] = {
                "local": parallel_step(cfg, tokens, ref_state, ddp=False),
                "ddp": parallel_step(cfg, tokens, ref_state, ddp=True),
            }
        return results
    finally:
        destroy_parallel()


def rank_environment(rank: int, world_size: int) -> dict:
    import os

    import torch._dynamo

    return {"probe": os.environ.get("RUN_RANKS_PROBE"), "cwd": os.getcwd(), "rank": os.environ["RANK"],
            "compile_disabled": torch._dynamo.config.disable}


def rank_fails_on_rank_1(rank: int, world_size: int) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.barrier()  # rank 0 waits in a collective for a peer that is gone
    return rank


# ------------------------------------------------------------------------------------------------
# combining and comparing
# ------------------------------------------------------------------------------------------------


def reduced_grad(results: List[dict], rank: int, name: str):
    """The gradient of `name` on `rank` after a correct data/sequence/expert-parallel reduction.

    The rules of megatron's DDP (average_in_collective=False: scale by 1/DP, then sum over a group)
    and finalize_model_grads, with routed experts recognized by name:
    * routed experts: summed over the expert-data-parallel group (ranks with this rank's EP and
      expert-TP ranks), scaled by 1/DP;
    * every other parameter: averaged over the data-parallel group (ranks with this rank's TP rank);
      if tagged `sequence_parallel`, then summed over the TP group (ranks with this rank's DP rank).
    """
    coords = results[rank]["coords"]

    def grads_of(members):
        grads = [results[m]["grads"][name] for m in members]
        if all(g is None for g in grads):
            return None
        assert all(g is not None for g in grads), f"{name}: gradient on some ranks only"
        return sum(grads) / coords["dp_size"]

    def same(keys, of):
        return [i for i, r in enumerate(results) if all(r["coords"][k] == results[of]["coords"][k] for k in keys)]

    if is_routed_expert(name):
        return grads_of(same(("ep_rank", "etp_rank"), rank))
    if not results[rank]["meta"][name]["sequence_parallel"]:
        return grads_of(same(("tp_rank",), rank))
    partial = [grads_of(same(("tp_rank",), i)) for i in same(("dp_rank",), rank)]
    return None if partial[0] is None else sum(partial)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.abs().max().item()
    diff = (actual - expected).abs().max().item()
    return diff / scale if scale > 0 else diff


def compare_grads(reference: dict, results: List[dict], reduce: bool, skip=lambda name: False) -> float:
    """Assert that every rank's gradient (combined by `reduced_grad` when `reduce`) equals its shard
    of the reference gradient; return the worst relative error. A parameter without a reference
    gradient must have none (or, after DDP, a zero one)."""
    worst, failures, compared = 0.0, [], 0
    for rank, res in enumerate(results):
        assert set(res["grads"]) == set(reference["grads"])
        for name, full in reference["grads"].items():
            if skip(name):
                continue
            got = reduced_grad(results, rank, name) if reduce else res["grads"][name]
            if full is None:
                if got is not None and got.any():
                    failures.append(f"rank {rank} {name}: has a gradient, the reference none")
                continue
            if got is None:
                failures.append(f"rank {rank} {name}: no gradient")
                continue
            err = rel_err(got, shard_like(name, full, res["meta"][name], res["coords"]))
            worst, compared = max(worst, err), compared + 1
            if not err <= TOL:
                failures.append(f"rank {rank} {name}: relative max-abs error {err:.2e}")
    assert not failures, "gradients differ from the single-rank run:\n" + "\n".join(failures)
    assert compared > 0
    return worst


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
    return run_ranks(rank_parallel, 2, ["tp2", "ep2"], batch, reference["state"], env=RANK_ENV)


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


def test_run_ranks_reports_the_failing_rank():
    """The rank-spawning helper itself: a rank's exception fails the caller with its traceback, first,
    and the rank blocked in a collective with it does not hang the test."""
    with pytest.raises(RankError) as info:
        run_ranks(rank_fails_on_rank_1, 2, timeout=60)
    message = str(info.value)
    assert message.index("--- rank 1 raised") < message.find("--- rank 0"), message
    assert "ValueError: rank 1 fails on purpose" in message


def test_run_ranks_gives_ranks_the_callers_environment_now(monkeypatch, tmp_path):
    """Ranks are forks of a server started at the first call: they still see the caller's environment
    and working directory at the time of the call, and TORCH_COMPILE_DISABLE as the call sets it."""
    run_ranks(rank_environment, 1)  # the fork server is running from here on
    monkeypatch.setenv("RUN_RANKS_PROBE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    ranks = run_ranks(rank_environment, 2, env={"TORCH_COMPILE_DISABLE": "1"})
    assert [r["rank"] for r in ranks] == ["0", "1"]
    for r in ranks:
        assert r["probe"] == "set after the server started" and r["cwd"] == str(tmp_path) and r["compile_disabled"]
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "0")
    (plain,) = run_ranks(rank_environment, 1)
    assert not plain["compile_disabled"]
