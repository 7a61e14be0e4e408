"""After backward, no module keeps a tensor that is still attached to the autograd graph.

Such a tensor keeps the whole graph alive until it is replaced: every tensor a node references outside its
saved tensors, and with full recompute each checkpoint's detached input and that input's gradient. The check
walks every module of the tiny GLM-5 (and the plain objects hanging off them, such as a MoE layer's token
dispatcher) for a tensor with a `grad_fn`, after one forward and backward with each token dispatcher, with
and without full recompute (and with DSA's sparse attention, recomputed or offloaded), on one rank and with EP=2,
and through megatron-core's own all-to-all dispatcher (which gloo cannot run at EP > 1) at EP=1.
"""

from __future__ import annotations

from typing import Dict, List

import torch

from tests.distributed import run_ranks
from tests.parallel_helpers import BASE_OVERRIDES, RANK_ENV, SEED, TINY, make_batch

FULL = ["model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1"]
SPARSE = ["model.dsa_sparse_attention=true", "model.dsa_indexer_loss_coeff=0.01",
          "model.dsa_indexer_use_sparse_loss=true"]


def graph_attached(model: torch.nn.Module) -> List[str]:
    """`module.attribute[.attribute ...]` of every tensor with a grad_fn held by a module or an object it holds."""
    found: List[str] = []

    def walk(obj, path: str, depth: int) -> None:
        if torch.is_tensor(obj):
            if obj.grad_fn is not None:
                found.append(f"{path} ({type(obj.grad_fn).__name__})")
        elif depth < 3 and isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                walk(value, f"{path}[{i}]", depth + 1)
        elif depth < 3 and isinstance(obj, dict):
            for key, value in obj.items():
                walk(value, f"{path}[{key!r}]", depth + 1)
        elif (depth < 3 and hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type))
              and not callable(obj)):  # a plain object: a token dispatcher, a config
            for key, value in vars(obj).items():
                walk(value, f"{path}.{key}", depth + 1)

    for name, module in model.named_modules():
        for key, value in vars(module).items():
            if key not in ("_parameters", "_buffers", "_modules"):
                walk(value, f"{name}.{key}", 0)
    return found


def _held_after_backward(rank: int, world_size: int, variants: Dict[str, List[str]]) -> Dict[str, List[str]]:
    from parallel.initialize import destroy_parallel, initialize_parallel
    from pretrain.config import load_config
    from pretrain.model.builder import build_model

    tokens = make_batch()
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    position_ids = torch.arange(inputs.shape[1]).unsqueeze(0).expand_as(inputs)
    held = {}
    for name, extra in variants.items():
        cfg = load_config(TINY, BASE_OVERRIDES + extra)
        initialize_parallel(cfg.parallel, seed=SEED)
        model = build_model(cfg)
        loss = model(inputs, position_ids, attention_mask=None, labels=labels)
        loss.mean().backward()
        del loss
        held[name] = graph_attached(model)
        destroy_parallel()
    return held


def _check(results: List[Dict[str, List[str]]]) -> None:
    problems = [f"rank {rank}, {name}: {', '.join(paths)}" for rank, held in enumerate(results)
                for name, paths in held.items() if paths]
    assert not problems, "modules keep graph-attached tensors after backward:\n" + "\n".join(problems)


def test_nothing_keeps_the_graph_after_backward():
    variants = {}
    for dispatcher in ("allgather", "alltoall", "alltoall_dedup"):  # alltoall at EP=1: pretrain.model.moe_dispatch
        variants[dispatcher] = [f"model.moe_token_dispatcher_type={dispatcher}"]
        variants[f"{dispatcher} + full recompute"] = variants[dispatcher] + FULL
    variants["alltoall + DSA sparse + full recompute"] = variants["alltoall + full recompute"] + SPARSE
    variants["alltoall + DSA sparse + offload"] = variants["alltoall"] + SPARSE + ["model.activation_offload=true"]
    results = run_ranks(_held_after_backward, 1, variants, env=RANK_ENV)
    assert set(results[0]) == set(variants)
    _check(results)


def test_nothing_keeps_the_graph_after_backward_with_expert_parallelism():
    # megatron's all-to-all dispatcher itself (EP > 1) needs NCCL: on gloo, torch 2.13 refuses its split sizes
    ep2 = ["parallel.expert_model_parallel_size=2"]
    variants = {"allgather EP=2 + full recompute": ep2 + ["model.moe_token_dispatcher_type=allgather"] + FULL,
                "alltoall_dedup EP=2 + full recompute": ep2 + ["model.moe_token_dispatcher_type=alltoall_dedup"]
                + FULL}
    for name, extra in variants.items():  # one launch each: a second set of EP groups in the same ranks hangs on gloo
        _check(run_ranks(_held_after_backward, 2, {name: extra}, env=RANK_ENV))


def _held_with_megatron_alltoall(rank: int, world_size: int, variants: Dict[str, List[str]]) -> Dict[str, List[str]]:
    # megatron-core's own all-to-all dispatcher at EP=1: the path our dispatcher hands every layout it does not
    # take itself (EP > 1 with moe_token_dispatcher_type=alltoall, capacity factors, ...)
    from pretrain.model.moe_dispatch import LocalTokenDispatcher

    LocalTokenDispatcher.takes_local_path = lambda self: False
    return _held_after_backward(rank, world_size, variants)


def test_nothing_keeps_the_graph_after_backward_with_megatrons_alltoall_dispatcher():
    variants = {"megatron alltoall + full recompute": ["model.moe_token_dispatcher_type=alltoall"] + FULL}
    _check(run_ranks(_held_with_megatron_alltoall, 1, variants, env=RANK_ENV))
