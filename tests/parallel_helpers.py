"""Shared by the parallel-equivalence tests: the tiny fp32 GLM-5 config, its single-rank reference run,
sharding a full tensor the way a rank holds it, and the gradient reduction and comparison.

tests/test_parallel_equivalence.py states the procedure and the reduction rules; the context-, pipeline-
and DSA-parallel tests, the memory features' tests and the checkpoint tests reuse these pieces.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Optional

import torch

from tests.distributed import EAGER_ENV

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "models" / "glm5-tiny.yaml"
SEQ, BATCH, VOCAB = 16, 2, 512
SEED = 1234
TOL = 1e-5  # relative max-abs error: max|parallel - reference| / max|reference|
RANK_ENV = EAGER_ENV  # megatron's jit_fuser functions eager in every rank (tests/distributed.py)

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
    # the per-rank EP dispatch (pretrain/model/ep_dispatch.py) in the whole model
    "ep2_dedup": ["parallel.expert_model_parallel_size=2", "model.moe_token_dispatcher_type=alltoall_dedup"],
    "tp2ep2_dedup": ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
                     "parallel.expert_model_parallel_size=2", "model.moe_token_dispatcher_type=alltoall_dedup"],
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


def perturb_norms_and_biases(model) -> None:
    """Norm weights and expert biases away from their init (seeded), so a mixed-up one shows."""
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))


def global_param_names(model) -> Dict[str, str]:
    """Stage-local (or virtual-stage chunk-local) parameter / buffer name -> the single-rank model's name (decoder
    layers renumbered)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(model.config, vp_stage=getattr(model, "vp_stage", None))
    prefix = "decoder.layers."
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
        perturb_norms_and_biases(model)
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


def check_grad(label: str, got: Optional[torch.Tensor], want: Optional[torch.Tensor], failures: List[str]) -> Optional[float]:
    """One gradient against its reference: a mismatch is appended to `failures` (a gradient where the
    reference has none, none where it has one, or a relative max-abs error above TOL). Returns the error,
    or None where there was nothing to compare."""
    if want is None:
        if got is not None and got.any():
            failures.append(f"{label}: has a gradient, the reference none")
        return None
    if got is None:
        failures.append(f"{label}: no gradient")
        return None
    err = rel_err(got, want)
    if not err <= TOL:
        failures.append(f"{label}: relative max-abs error {err:.2e}")
    return err


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
            want = None if full is None else shard_like(name, full, res["meta"][name], res["coords"])
            err = check_grad(f"rank {rank} {name}", got, want, failures)
            if err is not None:
                worst, compared = max(worst, err), compared + 1
    assert not failures, "gradients differ from the single-rank run:\n" + "\n".join(failures)
    assert compared > 0
    return worst
