"""Pipeline layouts: interleaved stages with GLM-5's MTP placement against one rank, the config's stage
resolution and refusals, and the balanced split.

Equivalence (one 2-rank spawn, several checks): the tiny GLM-5 cut to 3 layers (dense, MoE, MoE) with 3 MTP
depths sharing one layer, fp32 on gloo, trained on 4 micro-batches

* reference: one rank, PP=1, megatron's no-pipelining schedule, the trainer's `forward_step`;
* PP=2 x VPP=2 with the uneven layout "Et|t|tmmm|L": pp rank 0 holds (embedding, layer 0) and (layer 2, the
  MTP block), pp rank 1 holds (layer 1) and (the output layer and the losses). MTP sits on the stage before
  the loss (GLM-5's placement), on the same rank as the embedding, so that rank holds two embedding copies.

Checked: the per-micro-batch losses; every parameter's gradient (relative max-abs error <= 1e-5), the
embedding's as the sum of the two copies without DDP, and on each copy after megatron's DDP and
`finalize_model_grads` (the tie that `pretrain.compat.pipeline` adds); the MTP copy's initial values equal
the first stage's. With `parallel.microbatch_group_size_per_vp_stage=4` (all 4 micro-batches through a virtual
stage before the next) the same losses and gradients, and each rank's order of forward and backward steps, recorded
inside megatron's schedule, is the order `pretrain.layout.pipeline_schedule` simulates (group 2 and 4).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from tests.distributed import run_ranks
from tests.parallel_helpers import (BASE_OVERRIDES, RANK_ENV, SEED, SEQ, TINY, TOL, check_grad, global_param_names,
                                    perturb_norms_and_biases,
                                    rel_err)

REPO = Path(__file__).resolve().parents[1]
EMBEDDING = "embedding.word_embeddings.weight"
CUT = ["model.num_layers=3", "model.moe_layer_freq=[0,1,1]"]
LAYOUT = "Et|t|tmmm|L"
PIPELINE = ["parallel.pipeline_model_parallel_size=2", "parallel.virtual_pipeline_model_parallel_size=2",
            f"parallel.pipeline_model_parallel_layout={LAYOUT}"]
MICROBATCHES = 4
GROUPED = ["parallel.microbatch_group_size_per_vp_stage=4"]


def _config(extra: List[str]):
    from pretrain.config import load_config

    return load_config(TINY, BASE_OVERRIDES + CUT + extra)


def _batches(tokens: torch.Tensor) -> List[dict]:
    """One sample per micro-batch."""
    out = []
    for i in range(MICROBATCHES):
        inputs, labels = tokens[i:i + 1, :-1], tokens[i:i + 1, 1:]
        out.append({"tokens": inputs, "labels": labels, "loss_mask": torch.ones(labels.shape),
                    "position_ids": torch.arange(SEQ).unsqueeze(0), "attention_mask": None})
    return out


def _schedule(chunks, batches: List[dict]) -> List[torch.Tensor]:
    """Forward + backward of `batches` through megatron's schedule; the last stage's per-micro-batch losses."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from pretrain.training.step import forward_step

    iterators = [iter(batches) for _ in chunks]
    losses = get_forward_backward_func()(
        forward_step_func=lambda it, model: forward_step(it, model, cp_group=None),
        data_iterator=iterators if len(chunks) > 1 else iterators[0], model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=1, decoder_seq_length=SEQ,
        forward_only=False)
    return [item["lm loss"][0] / item["lm loss"][1] for item in losses or []]


def rank_reference(rank: int, world_size: int, tokens: torch.Tensor) -> dict:
    from parallel.initialize import destroy_parallel, initialize_parallel
    from pretrain.model.builder import build_model

    cfg = _config([])
    initialize_parallel(cfg.parallel, seed=SEED)
    try:
        model = build_model(cfg)
        perturb_norms_and_biases(model)
        state = {n: t.detach().clone() for n, t in list(model.named_parameters()) + list(model.named_buffers())
                 if not n.endswith("local_tokens_per_expert")}
        losses = _schedule([model], _batches(tokens))
        grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
        return {"state": state, "losses": losses, "grads": grads}
    finally:
        destroy_parallel()


def _pipeline_step(cfg, tokens: torch.Tensor, ref_state: dict, ddp: bool) -> dict:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads

    from pretrain.model.builder import build_model_chunks

    chunks = build_model_chunks(cfg)
    copies = [c.embedding.word_embeddings.weight.detach().clone() for c in chunks if hasattr(c, "embedding")]
    names = [global_param_names(c) for c in chunks]
    with torch.no_grad():
        for chunk, chunk_names in zip(chunks, names):
            for name, t in list(chunk.named_parameters()) + list(chunk.named_buffers()):
                if chunk_names[name] in ref_state:
                    t.copy_(ref_state[chunk_names[name]])
    wrapped = chunks
    if ddp:
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=False)
        wrapped = [DistributedDataParallel(config=c.config, ddp_config=ddp_config, module=c) for c in chunks]
        for w in wrapped:
            w.zero_grad_buffer()
        chunks[0].config.finalize_model_grads_func = finalize_model_grads
    with _recorded_order(wrapped) as order:
        losses = _schedule(wrapped, _batches(tokens))
    grads = []
    for chunk, chunk_names in zip(chunks, names):
        grads.append({chunk_names[n]: (getattr(p, "main_grad", None) if ddp else p.grad) for n, p in chunk.named_parameters()})
        grads[-1] = {n: None if g is None else g.detach().clone() for n, g in grads[-1].items()}
    return {"losses": losses, "grads": grads, "initial_embedding_copies": copies,
            "roles": [(c.pre_process, c.post_process, getattr(c, "mtp_process", False)) for c in chunks],
            "p2p": (chunks[0].config.overlap_p2p_comm, chunks[0].config.batch_p2p_comm,
                    chunks[0].config.deallocate_pipeline_outputs),
            "group": chunks[0].config.microbatch_group_size_per_vp_stage, "order": order}


@contextlib.contextmanager
def _recorded_order(chunks):
    """("F" or "B", model chunk, micro-batch) of every forward_step / backward_step megatron's schedule runs, in
    order: a backward's chunk from the output tensor it receives, micro-batches counted per chunk."""
    from megatron.core.pipeline_parallel import schedules

    order, owner, seen = [], {}, {}
    forward, backward = schedules.forward_step, schedules.backward_step

    def log(kind, chunk):
        seen[(kind, chunk)] = seen.get((kind, chunk), -1) + 1
        order.append((kind, chunk, seen[(kind, chunk)]))

    def forward_step(*args, **kwargs):
        out = forward(*args, **kwargs)
        chunk = kwargs.get("vp_stage") or 0
        owner[id(out[0])] = chunk
        log("F", chunk)
        return out

    def backward_step(input_tensor, output_tensor, *args, **kwargs):
        log("B", owner[id(output_tensor)])
        return backward(input_tensor, output_tensor, *args, **kwargs)

    schedules.forward_step, schedules.backward_step = forward_step, backward_step
    try:
        yield order
    finally:
        schedules.forward_step, schedules.backward_step = forward, backward


def rank_pipeline(rank: int, world_size: int, tokens: torch.Tensor, ref_state: dict) -> dict:
    from parallel.initialize import destroy_parallel, initialize_parallel

    cfg = _config(PIPELINE)
    try:
        initialize_parallel(cfg.parallel, seed=SEED + 100 + rank)  # other seeds: values come from ref_state
        return {"local": _pipeline_step(cfg, tokens, ref_state, ddp=False),
                "ddp": _pipeline_step(cfg, tokens, ref_state, ddp=True),
                # the config's defaults (megatron-LM's) overlap sends and receives with compute and free each
                # stage's output once sent; megatron-core's own defaults batch each transfer and keep the output
                "batched": _pipeline_step(_config(PIPELINE + ["parallel.overlap_p2p_comm=false",
                                                              "parallel.deallocate_pipeline_outputs=false"]),
                                          tokens, ref_state, ddp=False),
                "grouped": _pipeline_step(_config(PIPELINE + GROUPED), tokens, ref_state, ddp=False)}
    finally:
        destroy_parallel()


@pytest.fixture(scope="module")
def runs() -> dict:
    tokens = torch.randint(0, 512, (MICROBATCHES, SEQ + 1), generator=torch.Generator().manual_seed(SEED))
    (reference,) = run_ranks(rank_reference, 1, tokens, env=RANK_ENV)
    ranks = run_ranks(rank_pipeline, 2, tokens, reference["state"], env=RANK_ENV)
    return {"reference": reference, "ranks": ranks}


def _compare(reference: dict, chunk_grads: List[Dict[str, torch.Tensor]], sum_embedding: bool) -> float:
    worst, failures, seen = 0.0, [], set()
    for i, grads in enumerate(chunk_grads):
        for name, got in grads.items():
            seen.add(name)
            if name == EMBEDDING and sum_embedding:
                got = sum(g[name] for g in chunk_grads if name in g)
            err = check_grad(f"chunk {i} {name}", got, reference["grads"][name], failures)
            worst = max(worst, err or 0.0)
    assert seen == set(reference["grads"]), set(reference["grads"]) ^ seen
    assert not failures, "gradients differ from the one-rank run:\n" + "\n".join(failures)
    return worst


def test_pp2_vpp2_mtp_before_last_stage_matches_one_rank(runs):
    ref, (rank0, rank1) = runs["reference"], runs["ranks"]
    # placement: rank 0 = (embedding, layer 0), (layer 2, MTP); rank 1 = (layer 1), (output layer + losses)
    assert rank0["local"]["roles"] == [(True, False, False), (False, False, True)]
    assert rank1["local"]["roles"] == [(False, False, False), (False, True, False)]
    assert any(n.startswith("mtp.layers.0") for n in rank0["local"]["grads"][1])
    assert "output_layer.weight" in rank1["local"]["grads"][1] and not rank1["local"]["grads"][1].keys() & {
        EMBEDDING, "decoder.layers.0.input_layernorm.weight"}
    # the MTP chunk's embedding starts as the first chunk's, not zero (megatron zero-fills it)
    first, mtp = rank0["local"]["initial_embedding_copies"]
    assert torch.equal(first, mtp) and mtp.abs().max() > 0
    assert rank0["local"]["p2p"] == (True, False, True) and rank0["batched"]["p2p"] == (False, True, False)
    for mode in ("local", "ddp", "batched", "grouped"):
        losses = rank1[mode]["losses"]
        assert len(losses) == MICROBATCHES and all(rel_err(a, b) <= TOL for a, b in zip(losses, ref["losses"])), (
            mode, losses, ref["losses"])
    chunks = rank0["local"]["grads"] + rank1["local"]["grads"]
    worst = _compare(ref, chunks, sum_embedding=True)
    # each copy's own share is far from the whole: the sum is needed
    assert min(rel_err(g[EMBEDDING], ref["grads"][EMBEDDING]) for g in rank0["local"]["grads"]) > 100 * TOL
    # after DDP + finalize_model_grads each copy holds the whole gradient
    worst = max(worst, _compare(ref, rank0["ddp"]["grads"] + rank1["ddp"]["grads"], sum_embedding=False))
    worst = max(worst, _compare(ref, rank0["batched"]["grads"] + rank1["batched"]["grads"], sum_embedding=True))
    worst = max(worst, _compare(ref, rank0["grouped"]["grads"] + rank1["grouped"]["grads"], sum_embedding=True))
    print(f"\nPP=2 x VPP=2 {LAYOUT}: worst relative max-abs error {worst:.2e}")


def test_simulated_schedule_order_is_megatrons(runs):
    from pretrain.layout.pipeline_schedule import rank_order

    for rank, result in enumerate(runs["ranks"]):
        for mode, group in (("local", 2), ("grouped", 4)):
            assert result[mode]["group"] == group
            recorded = [(kind, chunk * 2 + rank, j) for kind, chunk, j in result[mode]["order"]]
            assert recorded == rank_order(rank, 2, 2, MICROBATCHES, group), (rank, mode)
    # the two orders differ: group 4 runs all four micro-batches through a chunk before the next
    assert runs["ranks"][0]["local"]["order"] != runs["ranks"][0]["grouped"]["order"]


# ------------------------------------------------------------------------------------------------
# the config's stages and refusals, the balanced split (no process group)
# ------------------------------------------------------------------------------------------------


def test_balanced_split_hand_computed():
    """E=1, four layers of 4, the MTP block 6, the loss 3, into 3 stages. By hand: the cuts give
    [E t t | t t | M L] = 9 | 8 | 9, and every other cut has a stage of 12 or more (e.g. [E t | t t t | M L]
    = 5 | 12 | 9, [E t t | t t M | L] = 9 | 14 | 3), so the largest stage is 9 only there."""
    from pretrain.tools.pipeline_split import balanced_split, interleaved_split, step_time

    costs = [1, 4, 4, 4, 4, 6, 3]
    assert balanced_split(costs, 3) == [3, 2, 2]
    # a stage may not start at item 3 (a 'shared' DSA indexer): [E t | t t t | M L] = 5 | 12 | 9 beats
    # [E t t t | t | M L] = 13 | 4 | 9 and [E t t t | t M | L] = 13 | 10 | 3
    assert balanced_split(costs, 3, can_start=[True, True, True, False, True, True, True]) == [2, 3, 2]
    # PP=2 x VPP=2, 4 micro-batches: rank 0 runs stages 0 and 2, rank 1 stages 1 and 3. By hand, the ranks
    # split the 26 evenly only with a last stage [M L] = 9 and stage 1 = one layer: [E t | t | t t | M L]
    # (5 + 8, 4 + 9) or [E t t | t | t | M L] (9 + 4, 4 + 9); both cost 4 x 13 + 9 = 61, the least of all 20
    # splits. The minimax split [E t t | t t | M | L] (9 + 6, 8 + 3) costs 4 x 15 + 9 = 69.
    assert step_time([2, 1, 2, 2], costs, pp=2, microbatches=4) == 61
    assert step_time([3, 2, 1, 1], costs, pp=2, microbatches=4) == 69
    assert interleaved_split(costs, pp=2, vpp=2, microbatches=4) in ([2, 1, 2, 2], [3, 1, 1, 2])
    import itertools
    splits = [s for s in itertools.product(range(1, 5), repeat=4) if sum(s) == len(costs)]
    assert min(step_time(s, costs, 2, 4) for s in splits) == 61


@pytest.mark.parametrize("extra, expected", [
    ([], [["E", "t", "t", "t", "m", "m", "m", "L"]]),
    (["parallel.pipeline_model_parallel_size=3"], [["E", "t"], ["t"], ["t", "m", "m", "m", "L"]]),
    (["parallel.pipeline_model_parallel_size=2", "parallel.num_layers_in_first_pipeline_stage=1"],
     [["E", "t"], ["t", "t", "m", "m", "m", "L"]]),
    (["parallel.pipeline_model_parallel_size=2", "parallel.account_for_loss_in_pipeline_split=true"],
     [["E", "t", "t"], ["t", "m", "m", "m", "L"]]),
    (PIPELINE, [["E", "t"], ["t"], ["t", "m", "m", "m"], ["L"]]),
])
def test_stage_entries(extra, expected):
    from pretrain.config.pipeline_layout import stage_entries

    cfg = _config(extra)
    assert stage_entries(cfg.model, cfg.parallel) == expected


@pytest.mark.parametrize("extra, keys", [
    (["parallel.pipeline_model_parallel_size=2"], ["model.num_layers", "parallel.pipeline_model_parallel_size"]),
    (["parallel.pipeline_model_parallel_size=2", "parallel.pipeline_model_parallel_layout=Et|t|tmmm|L"],
     ["parallel.pipeline_model_parallel_layout", "virtual_pipeline_model_parallel_size"]),
    (PIPELINE[:2] + ["parallel.pipeline_model_parallel_layout=Et|t|mmm|L"], ["parallel.pipeline_model_parallel_layout",
                                                                            "model.num_layers"]),
    (PIPELINE[:2] + ["parallel.pipeline_model_parallel_layout=Et|tmm|tm|L"], ["parallel.pipeline_model_parallel_layout",
                                                                            "MTP"]),
    (PIPELINE[:2] + ["parallel.pipeline_model_parallel_layout=Et|tmmm|t|L"], ["parallel.pipeline_model_parallel_layout",
                                                                            "MTP"]),
    (PIPELINE + ["model.share_embeddings_and_output_weights=true"], ["model.share_embeddings_and_output_weights"]),
    (PIPELINE + ["parallel.num_layers_in_first_pipeline_stage=1"], ["parallel.num_layers_in_first_pipeline_stage"]),
    (PIPELINE[:2] + ["parallel.num_layers_in_first_pipeline_stage=1"], ["parallel.virtual_pipeline_model_parallel_size"]),
])
def test_bad_layouts_refused_in_one_line(extra, keys):
    from pretrain.config.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        _config(extra)
    message = str(err.value)
    assert "\n" not in message and all(k in message for k in keys), message


def test_p2p_overlap_applies_under_virtual_stages_and_is_said_otherwise(caplog):
    """megatron-LM's semantics: overlap_p2p_comm (default true) overlaps the interleaved schedule's transfers;
    megatron-core's non-interleaved 1F1B raises on it, so without virtual stages the builder batches the transfers
    and says so once."""
    import logging

    from pretrain.model.builder import pipeline_p2p_fields
    from pretrain.notices import forget_said

    assert pipeline_p2p_fields(_config(PIPELINE).parallel) == {"overlap_p2p_comm": True, "batch_p2p_comm": False}
    forget_said()
    with caplog.at_level(logging.INFO, logger="pretrain"):
        cfg = _config(["parallel.pipeline_model_parallel_size=3", "parallel.overlap_p2p_comm=true"])
        assert pipeline_p2p_fields(cfg.parallel) == {"overlap_p2p_comm": False, "batch_p2p_comm": True}
        pipeline_p2p_fields(cfg.parallel)
    said = [r.getMessage() for r in caplog.records if "overlap_p2p_comm" in r.getMessage()]
    assert len(said) == 1 and "virtual_pipeline_model_parallel_size" in said[0], said
    # nothing to say where nothing is batched against the user's setting: overlap off, or no pipeline at all
    forget_said()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pretrain"):
        off = _config(["parallel.pipeline_model_parallel_size=3", "parallel.overlap_p2p_comm=false"]).parallel
        assert pipeline_p2p_fields(off) == {"overlap_p2p_comm": False, "batch_p2p_comm": True}
        assert pipeline_p2p_fields(_config([]).parallel) == {"overlap_p2p_comm": False, "batch_p2p_comm": True}
    assert not [r for r in caplog.records if "overlap_p2p_comm" in r.getMessage()]


def test_split_tool_prints_a_layout_that_loads(capsys):
    from pretrain.tools.pipeline_split import main

    main(["--config", str(TINY), "--pp", "2", "--vpp", "2"] + BASE_OVERRIDES + CUT)
    out = capsys.readouterr().out
    layout = out.split("pipeline_model_parallel_layout='")[1].split("'")[0]
    _config(PIPELINE[:2] + [f"parallel.pipeline_model_parallel_layout={layout}"])


def test_interleaved_split_finds_the_best_estimate():
    """glm5-proxy's entries as the H200 calibration weighs them (ms per micro-batch: E, the dense layer, 11 MoE
    layers, the 3 MTP depths, every head with L), PP=2 x VPP=2, 8 micro-batches. A naive enumeration of every
    split is the reference; the local search alone (exhaustive=0) stops at Et*4|t*6|t*2m*3|L, which the
    estimate puts about 3% above the best."""
    import itertools

    from pretrain.tools.pipeline_split import interleaved_split, step_time

    costs = [0.3, 17.0] + [17.6] * 11 + [59.4, 43.6]
    n = len(costs)
    best = min(step_time([b - a for a, b in zip((0,) + cuts, cuts + (n,))], costs, 2, 8)
               for cuts in itertools.combinations(range(1, n), 3))
    assert step_time(interleaved_split(costs, 2, 2, 8), costs, 2, 8) == pytest.approx(best)
    assert step_time(interleaved_split(costs, 2, 2, 8, exhaustive=0), costs, 2, 8) > 1.02 * best


def _breakdown_ms(path):
    """Forward + backward ms per step of the model's parts in a committed step breakdown (scaling.py --breakdown)."""
    parts = ("embedding", "MLA projections", "core attention", "router", "token permute", "expert GEMMs",
             "shared expert", "dense MLP", "norms, RoPE", "MTP eh_proj", "output layer")
    total = 0.0
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) > 3 and cells[0].startswith(parts):
            total += float(cells[3])
    return total


@pytest.mark.parametrize("gpu,bound", [(None, 0.20), ("h200", 0.10)])
def test_stage_costs_match_a_measured_pipeline_rank(gpu, bound):
    """Measured on 2 x H200 (benchmarks/results/scaling_h200x4): glm5-proxy at PP=2 x VPP=2 with the layout
    Et*3|t*9|m*3|L, rank 0 (stages Et*3 and m*3) spent 841 ms per step in the model's parts, against 2,445 ms for
    the whole model on one GPU: a share of 0.34. Megatron computes every MTP depth's head on the stage holding L,
    so charging the heads to m (3 of the 4 heads) put this share at 0.51 by FLOPs. The cost model's share of
    these entries, by FLOPs and by the planner's H200 calibration, against the measured one."""
    import dataclasses

    from pretrain.config import load_config
    from pretrain.tools.pipeline_split import entry_costs

    results = REPO / "benchmarks" / "results" / "scaling_h200x4"
    measured = _breakdown_ms(results / "two_gpus" / "b" / "pp2.breakdown.md") / _breakdown_ms(
        results / "four_gpus" / "gpu1.breakdown.md")
    cfg = load_config(str(REPO / "configs" / "models" / "glm5-proxy.yaml"))
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=4))
    entries, costs = entry_costs(cfg, gpu=gpu)
    assert entries[0] == "E" and entries[-2] == "mmm" and entries[-1] == "L"
    share = (sum(costs[:4]) + costs[-2]) / sum(costs)
    assert share == pytest.approx(measured, rel=bound), (share, measured)
