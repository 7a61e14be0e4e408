"""The per-rank expert-parallel dispatch (`pretrain.model.ep_dispatch`, `alltoall_dedup`) against one rank.

* Equality: glm5-tiny's MoE layer (16 experts, top-4, shared expert) at EP = 2 and EP = 4 over gloo,
  fp32, against the same layer on one rank with megatron's all-gather dispatcher (EP = 1): the
  output, the input gradient and every parameter gradient (router, routed experts, shared expert) at
  a relative max-abs error <= 1e-5. Each rank holds its own tokens; the reference holds all of them.
  Routing is fixed per token (the router's `routing` replaced by a given map, its probabilities still
  a function of the router's logits, so the router gets a gradient) and uneven on purpose: a token
  whose experts are all on its own rank, one whose experts are all on the last rank, one all on
  rank 0 from rank 1, and a second map in which no token picks an expert of the last rank (it
  receives nothing).
* Volume: the rows each rank actually hands to `all_to_all` (recorded in the ranks) equal a count
  made here by looping over tokens (distinct destination ranks per token), and megatron's per-pair
  count is the number of (token, off-rank expert) pairs; on a uniform random map the measured ratio
  matches `dedup_volume_ratio`'s closed form (and 2.17x at glm5-proxy's 48 experts, top-8, EP = 4).
* The layouts it cannot run are refused at config time: tests/test_layout_refusals.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.parallel_helpers import BASE_OVERRIDES, RANK_ENV, TINY, rel_err, shard_like

EXPERTS, TOPK, SEQ, BATCH = 16, 4, 6, 2
TOKENS = SEQ * BATCH  # per rank
TOL = 1e-5
SCENARIOS = ("mixed", "idle_rank")


def layer_config(ep: int, dispatcher: str):
    from pretrain.config import load_config

    return load_config(TINY, BASE_OVERRIDES + [
        f"model.num_moe_experts={EXPERTS}", f"model.moe_router_topk={TOPK}", f"data.seq_length={SEQ}",
        f"model.moe_token_dispatcher_type={dispatcher}", f"parallel.expert_model_parallel_size={ep}"])


def routing_map(scenario: str, ep: int) -> torch.Tensor:
    """[ep * TOKENS, EXPERTS] bool, k experts per token; rank r's tokens are rows r T .. r T + T - 1."""
    g = torch.Generator().manual_seed(7 + ep)
    local = EXPERTS // ep
    allowed = torch.arange(EXPERTS)
    if scenario == "idle_rank":  # nobody picks the last rank's experts
        allowed = allowed[: EXPERTS - local]
    rows = []
    for _ in range(ep * TOKENS):
        rows.append(allowed[torch.randperm(len(allowed), generator=g)[:TOPK]])
    rows[0] = torch.arange(TOPK)  # rank 0's token 0: all its experts on rank 0 (never leaves the rank)
    if scenario == "mixed":
        rows[1] = torch.arange(EXPERTS - TOPK, EXPERTS)  # rank 0's token 1: all on the last rank
        rows[TOKENS + 2] = torch.arange(TOPK)  # rank 1's token 2: all on rank 0
    out = torch.zeros(ep * TOKENS, EXPERTS, dtype=torch.bool)
    for t, experts in enumerate(rows):
        out[t, experts] = True
    assert bool((out.sum(1) == TOPK).all())
    return out


def fix_routing(layer, routing: torch.Tensor) -> None:
    """The router's top-k replaced by `routing`; probabilities sigmoid(logits) on the chosen experts."""

    def routing_fn(logits, *args, **kwargs):
        return torch.sigmoid(logits.float().view(-1, EXPERTS)) * routing, routing

    layer.router.routing = routing_fn


def moe_layer(cfg):
    from pretrain.model.builder import build_model

    return build_model(cfg).decoder.layers[1].mlp


def run_layer(layer, x, grad):
    x = x.clone().requires_grad_(True)
    for p in layer.parameters():
        p.grad = None
    out, _ = layer(x)
    out.backward(grad)
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    return {"out": out.detach(), "dx": x.grad.detach(), "grads": grads}


def inputs(ep: int):
    g = torch.Generator().manual_seed(11)
    hidden = layer_config(1, "allgather").model.hidden_size
    x = torch.randn(SEQ, ep * BATCH, hidden, generator=g)
    return x, torch.randn(x.shape, generator=g)


def rank_tokens(t: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank r's [SEQ, BATCH, H] slice of the reference's [SEQ, ep BATCH, H] (samples r B .. r B + B - 1)."""
    return t[:, rank * BATCH:(rank + 1) * BATCH]


def reference_map(routing: torch.Tensor, ep: int) -> torch.Tensor:
    """The reference flattens [SEQ, ep BATCH] tokens s-major; rank r's map rows are its own [SEQ, BATCH] flattened."""
    per_rank = routing.view(ep, SEQ, BATCH, EXPERTS)
    return per_rank.permute(1, 0, 2, 3).reshape(-1, EXPERTS)


# ------------------------------------------------------------------------------------------------
# rank bodies
# ------------------------------------------------------------------------------------------------


def rank_reference(rank: int, world_size: int, eps) -> dict:
    from parallel.initialize import destroy_parallel, initialize_parallel

    cfg = layer_config(1, "allgather")
    initialize_parallel(cfg.parallel, seed=3)
    try:
        layer = moe_layer(cfg)
        assert type(layer.token_dispatcher).__name__ == "MoEAllGatherTokenDispatcher"
        state = {k: v.clone() for k, v in layer.state_dict().items() if isinstance(v, torch.Tensor)}
        results = {}
        for ep in eps:
            x, grad = inputs(ep)
            for scenario in SCENARIOS:
                fix_routing(layer, reference_map(routing_map(scenario, ep), ep))
                results[(ep, scenario)] = run_layer(layer, x, grad)
        return {"state": state, "results": results}
    finally:
        destroy_parallel()


def rank_ep(rank: int, world_size: int, ref_state: dict) -> dict:
    from megatron.core import parallel_state as ps

    from parallel.initialize import destroy_parallel, initialize_parallel
    from pretrain.model import ep_dispatch

    ep = world_size
    cfg = layer_config(ep, "alltoall_dedup")
    initialize_parallel(cfg.parallel, seed=50 + rank)
    sent = []
    real_all_to_all = ep_dispatch.all_to_all

    def recording_all_to_all(group, tensor, output_splits, input_splits):
        sent.append((tuple(tensor.shape), list(input_splits)))
        return real_all_to_all(group, tensor, output_splits, input_splits)

    ep_dispatch.all_to_all = recording_all_to_all
    try:
        layer = moe_layer(cfg)
        assert type(layer.token_dispatcher) is ep_dispatch.DedupTokenDispatcher
        coords = {"num_experts": EXPERTS, "ep_size": ps.get_expert_model_parallel_world_size(),
                  "ep_rank": ps.get_expert_model_parallel_rank(), "etp_size": 1, "etp_rank": 0,
                  "tp_size": 1, "tp_rank": 0}
        assert coords["ep_size"] == ep and coords["ep_rank"] == rank
        with torch.no_grad():
            for name, t in layer.state_dict(keep_vars=True).items():
                if not isinstance(t, torch.Tensor):
                    continue
                full = ref_state[name]
                t.copy_(shard_like(f"decoder.layers.1.mlp.{name}", full, {"tensor_model_parallel": False}, coords))
        x, grad = inputs(ep)
        results = {}
        for scenario in SCENARIOS:
            fix_routing(layer, routing_map(scenario, ep)[rank * TOKENS:(rank + 1) * TOKENS])
            sent.clear()
            results[scenario] = run_layer(layer, rank_tokens(x, rank), rank_tokens(grad, rank))
            results[scenario]["sent"] = list(sent)
        return results
    finally:
        ep_dispatch.all_to_all = real_all_to_all
        destroy_parallel()


# ------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference() -> dict:
    (ref,) = run_ranks(rank_reference, 1, (2, 4), env=RANK_ENV)
    return ref


@pytest.fixture(scope="module", params=[2, 4], ids=["ep2", "ep4"])
def ep_run(request, reference):
    ep = request.param
    return ep, run_ranks(rank_ep, ep, reference["state"], env=RANK_ENV, threads_per_rank=1)


def test_dedup_dispatch_matches_single_rank(ep_run, reference):
    ep, ranks = ep_run
    local = EXPERTS // ep
    for scenario in SCENARIOS:
        ref = reference["results"][(ep, scenario)]
        failures = []

        def check(label, got, want):
            err = rel_err(got, want)
            if not err <= TOL:
                failures.append(f"{label}: relative max-abs error {err:.2e}")

        for rank, res in enumerate(ranks):
            r = res[scenario]
            check(f"rank {rank} output", r["out"], rank_tokens(ref["out"], rank))
            check(f"rank {rank} input grad", r["dx"], rank_tokens(ref["dx"], rank))
        names = set(ref["grads"])
        assert {"router.weight", "experts.weight1", "experts.weight2", "shared_experts.linear_fc1.weight"} <= names
        for name in names:
            got = [res[scenario]["grads"].get(name) for res in ranks]
            assert all(g is not None for g in got), f"{scenario} {name}: no gradient on some rank"
            if name.startswith("experts."):
                # rank r holds experts r L .. r L + L - 1 and sees every token routed to them
                for rank, g in enumerate(got):
                    coords = {"num_experts": EXPERTS, "ep_size": ep, "ep_rank": rank, "etp_size": 1, "etp_rank": 0}
                    want = shard_like(f"decoder.layers.1.mlp.{name}", ref["grads"][name], {}, coords)
                    check(f"rank {rank} {name}", g, want)
            else:  # replicated: each rank's gradient covers its own tokens
                check(f"sum over ranks of {name}", sum(got), ref["grads"][name])
        assert not failures, f"EP={ep} {scenario}:\n" + "\n".join(failures)


def distinct_off_rank(routing: torch.Tensor, ep: int, rank: int) -> tuple:
    """(rows per token and destination, rows per (token, expert) pair) that leave `rank`, by a Python loop."""
    local = routing.shape[1] // ep
    dedup = per_pair = 0
    for row in routing.tolist():
        ranks = [e // local for e, on in enumerate(row) if on and e // local != rank]
        dedup += len(set(ranks))
        per_pair += len(ranks)
    return dedup, per_pair


def test_rows_sent_match_an_independent_count(ep_run):
    ep, ranks = ep_run
    hidden = layer_config(1, "allgather").model.hidden_size
    for scenario in SCENARIOS:
        routing = routing_map(scenario, ep)
        for rank, res in enumerate(ranks):
            calls = [(shape, splits) for shape, splits in res[scenario]["sent"] if shape[-1] == hidden]
            assert len(calls) == 2, calls  # dispatch and combine of the hidden states, forward
            dispatch_splits = calls[0][1]
            off_rank = sum(dispatch_splits) - dispatch_splits[rank]
            dedup, per_pair = distinct_off_rank(routing[rank * TOKENS:(rank + 1) * TOKENS], ep, rank)
            assert off_rank == dedup, (scenario, rank, dispatch_splits)
            assert per_pair >= dedup
        if scenario == "idle_rank":  # nobody sends to the last rank
            assert all(res[scenario]["sent"][0][1][ep - 1] == 0 for res in ranks)


@pytest.mark.parametrize("experts, topk, ep", [(48, 8, 4), (256, 8, 8), (16, 4, 2)])
def test_volume_ratio_formula_against_a_count(experts, topk, ep):
    from pretrain.model.ep_dispatch import dedup_volume_ratio

    g = torch.Generator().manual_seed(0)
    tokens = 4000
    choice = torch.rand(tokens, experts, generator=g).argsort(dim=1)[:, :topk]
    routing = torch.zeros(tokens, experts, dtype=torch.bool)
    routing[torch.arange(tokens)[:, None], choice] = True
    local = experts // ep
    per_rank = routing.view(tokens, ep, local)
    dedup = int(per_rank.any(-1)[:, 1:].sum())  # rank 0's view: ranks 1.. are off-rank
    per_pair = int(per_rank[:, 1:].sum())
    measured = per_pair / dedup
    assert abs(measured / dedup_volume_ratio(experts, topk, ep) - 1) < 0.03, measured
    if (experts, topk, ep) == (48, 8, 4):
        assert round(dedup_volume_ratio(experts, topk, ep), 2) == 2.17
    if (experts, topk, ep) == (256, 8, 8):
        assert round(dedup_volume_ratio(experts, topk, ep), 2) == 1.51


def test_sum_rows_skips_padding_slots():
    from pretrain.model.moe_dispatch import sum_rows

    torch.manual_seed(0)
    rows = torch.randn(9, 5, dtype=torch.float64)
    slots = torch.tensor([[3, 1, -1], [-1, -1, -1], [8, 0, 2]])
    want = torch.stack([rows[3] + rows[1], torch.zeros(5, dtype=torch.float64), rows[8] + rows[0] + rows[2]])
    torch.testing.assert_close(sum_rows(rows, slots), want)
    assert sum_rows(rows[:0], torch.full((2, 2), -1)).shape == (2, 5)


def test_gather_sum_kernel_skips_padding_in_the_interpreter():
    from pretrain.model.moe_dispatch import gather_sum_triton

    torch.manual_seed(0)
    rows = torch.randn(11, 70)
    slots = torch.randint(-1, 11, (6, 3))
    ref = torch.stack([sum((rows.double()[j] for j in s if j >= 0), torch.zeros(70, dtype=torch.float64))
                       for s in slots.tolist()])
    torch.testing.assert_close(gather_sum_triton(rows, slots, block_h=32).double(), ref, rtol=1e-6, atol=1e-6)


def test_config_keys_reach_megatron():
    """`alltoall_dedup` builds megatron's alltoall dispatcher plus our flag; forced balance is megatron's own field."""
    from pretrain.model.builder import transformer_config
    from tests.config_helpers import tiny

    cfg = tiny("model.moe_token_dispatcher_type=alltoall_dedup", "model.moe_router_force_load_balancing=true")
    tcfg = transformer_config(cfg.model, cfg.parallel)
    assert (tcfg.moe_token_dispatcher_type, tcfg.moe_alltoall_dedup) == ("alltoall", True)
    assert tcfg.moe_router_force_load_balancing is True
    plain = transformer_config(tiny("model.moe_token_dispatcher_type=alltoall").model, cfg.parallel)
    assert (plain.moe_token_dispatcher_type, plain.moe_alltoall_dedup, plain.moe_router_force_load_balancing) == (
        "alltoall", False, False)
