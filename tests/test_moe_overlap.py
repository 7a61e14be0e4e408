"""The all-to-all overlaps of pretrain/model/moe_overlap.py against the plain per-rank EP dispatch.

One spawn of two gloo ranks (EP = 2 x DP = 2, fp32, glm5-tiny with MTP): the plain `alltoall_dedup` model's
loss and every parameter gradient (router, routed and shared experts, attention, embedding, MTP) against
the same weights and tokens with
  * `model.moe_shared_expert_overlap` (the shared expert under the async dispatch),
  * `model.moe_overlap_chunks=2` (each micro-batch split in two after routing),
  * both at once,
at a relative max-abs error <= 1e-5. The router's balancing loss is weighted up (1e-2) so that a split
made before routing (a per-half sequence aux loss) would move the router gradient past the tolerance.
The same spawn checks that no all-to-all of a finished step stays alive (a reference cycle through an autograd
node leaked every micro-batch's buffers on GPUs) and that forced balance logs its warning line. Config refusals run
in this process.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from tests.distributed import run_ranks
from tests.parallel_helpers import BASE_OVERRIDES, RANK_ENV, TINY, make_batch, rel_err

TOL = 1e-5
EP = ["parallel.expert_model_parallel_size=2", "model.moe_token_dispatcher_type=alltoall_dedup",
      "model.moe_aux_loss_coeff=1e-2"]
VARIANTS = {"shared": (True, 1), "chunks": (False, 2), "both": (True, 2)}  # (shared under dispatch, chunks)
BOTH = ["model.moe_shared_expert_overlap=true", "model.moe_overlap_chunks=2"]


def load(*overrides):
    from pretrain.config import load_config

    return load_config(TINY, BASE_OVERRIDES + list(overrides))


def step(model, tokens):
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    position_ids = torch.arange(inputs.shape[1]).unsqueeze(0).expand_as(inputs)
    loss = model(inputs, position_ids, attention_mask=None, labels=labels).mean()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.detach(), "grads": grads}


def rank_variants(rank: int, world_size: int) -> dict:
    from parallel.initialize import destroy_parallel, initialize_parallel
    from pretrain.model import moe_layer, moe_overlap
    from pretrain.model.builder import build_model

    tokens = make_batch()[rank:rank + 1]  # DP = 2: one sample per rank
    cfg = load(*EP)
    initialize_parallel(cfg.parallel, seed=5)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger(moe_layer.__name__).addHandler(handler)
    try:
        plain = build_model(cfg)
        state = plain.state_dict()
        results = {"plain": step(plain, tokens)}
        model = build_model(load(*EP, *BOTH))  # the keys build the overlapped layers ...
        model.load_state_dict(state)
        layers = [m for m in model.modules() if isinstance(m, moe_layer.GLM5MoELayer)]
        assert layers and all(m.shared_under_dispatch and m.overlap_chunks == 2 for m in layers)
        for name, (shared, chunks) in VARIANTS.items():  # ... and each overlap runs alone on the same model
            for m in layers:
                m.shared_under_dispatch, m.overlap_chunks = shared, chunks
            for p in model.parameters():
                p.grad = None
            results[name] = step(model, tokens)
        # nothing of a finished step may outlive it: a flight kept alive by its own autograd node leaked every
        # micro-batch's receive buffers on GPUs (out of memory by the third step)
        gc.collect()
        results["flights_alive"] = sum(isinstance(o, moe_overlap.AllToAllInFlight) for o in gc.get_objects())
        build_model(load(*EP, "model.moe_router_force_load_balancing=true"))
        results["warnings"] = [r.getMessage() for r in records if r.levelno == logging.WARNING]
        return results
    finally:
        logging.getLogger(moe_layer.__name__).removeHandler(handler)
        destroy_parallel()


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(rank_variants, 2, env=RANK_ENV, threads_per_rank=1)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_overlap_equals_plain_dispatch(ranks, variant):
    failures = []
    for rank, res in enumerate(ranks):
        ref, got = res["plain"], res[variant]
        if not rel_err(got["loss"], ref["loss"]) <= TOL:
            failures.append(f"rank {rank} loss {got['loss'].item()} vs {ref['loss'].item()}")
        assert got["grads"].keys() == ref["grads"].keys()
        assert any("router" in n for n in ref["grads"]) and any("shared_experts" in n for n in ref["grads"])
        for name in ref["grads"]:
            err = rel_err(got["grads"][name], ref["grads"][name])
            if not err <= TOL:
                failures.append(f"rank {rank} {name}: relative max-abs error {err:.2e}")
    assert not failures, f"{variant}:\n" + "\n".join(failures)


def test_finished_steps_leave_no_all_to_all_alive(ranks):
    assert [res["flights_alive"] for res in ranks] == [0, 0]


def test_forced_balance_logs_a_warning(ranks):
    from pretrain.model.moe_layer import FORCED_BALANCE_WARNING

    assert all(FORCED_BALANCE_WARNING in res["warnings"] for res in ranks)


@pytest.mark.parametrize("overrides, keys", [
    (["model.moe_shared_expert_overlap=true"], ["model.moe_shared_expert_overlap", "alltoall_dedup"]),
    (["model.moe_overlap_chunks=2", "model.moe_token_dispatcher_type=alltoall"], ["model.moe_overlap_chunks"]),
    (["model.moe_overlap_chunks=0"], ["model.moe_overlap_chunks"]),
    (EP + ["model.moe_overlap_chunks=2", "model.recompute_granularity=full", "model.recompute_method=uniform",
           "model.recompute_num_layers=1"], ["model.moe_overlap_chunks", "model.recompute_granularity"]),
    (EP + ["model.moe_shared_expert_overlap=true", "model.moe_shared_expert_intermediate_size=null"],
     ["model.moe_shared_expert_intermediate_size"]),
    (EP + ["parallel.overlap_moe_expert_parallel_comm=true"], ["parallel.overlap_moe_expert_parallel_comm", "MTP"]),
])
def test_overlap_keys_refused_in_one_line(overrides, keys):
    from pretrain.config import ConfigError

    with pytest.raises(ConfigError) as err:
        load(*overrides)
    message = str(err.value)
    assert "\n" not in message and all(k in message for k in keys), message
