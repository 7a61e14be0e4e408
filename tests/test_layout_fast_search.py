"""The layout search in seconds (docs/layout.md): GLM-5 744B on 2,048 GPUs with the calibrated time model, as the
command line runs it, and its fast paths held to the plain computations they replace, to the bit: the remembered
memory, host-memory and stage terms (`pretrain.layout.memo`) against the terms computed afresh from the models'
public pieces, the state bound that skips hopeless recompute settings against trying them all, and the closed-form
split's remembered and vectorized search (`pretrain.tools.split_search`) against the plain one."""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import replace

import pytest

from pretrain.config import load_config
from pretrain.layout.__main__ import NO_LAYOUT
from pretrain.layout.host_memory import PINNED_ROUNDING, PROCESS_BYTES, HostEstimate, host_refusal, written_bytes
from pretrain.layout.memo import clear_memos
from pretrain.layout.memory import (MemoryEstimate, activation_terms, compared_ranks, offloaded_bytes, rank_layers,
                                    rank_parameters, save_copies_terms, state_terms)
from pretrain.layout.rescore import TEXTBOOK_NOTE
from pretrain.layout.search import (RECOMPUTE_ORDER, Candidate, SearchOptions, bubble_refusal, config_validator,
                                    fitting, memory_refusal, pipeline_costs, refusal, saves_checkpoints, search,
                                    splits)
from pretrain.layout.types import ModelDims, Workload, cluster_preset

GLM5 = "configs/models/glm5-744b.yaml"
SAVES = ["checkpoint.save=runs/ckpt", "model.dsa_sparse_attention=false", "model.dsa_indexer_loss_coeff=0.0",
         "model.dsa_indexer_use_sparse_loss=false"]


def _setup(overrides, seq, batch, gpus, cluster="h100-nvl-ib400", config=GLM5):
    """dims, workload, cluster and options as `python -m pretrain.layout` builds them."""
    cfg = load_config(config, NO_LAYOUT + overrides)
    work, cl = Workload(seq, batch), cluster_preset(cluster, gpus)
    opts = SearchOptions(optimizer=cfg.optimizer.optimizer, trainable=cfg.train.trainable_params,
                         saves=saves_checkpoints(cfg), pinned_staging=cfg.checkpoint.pinned_staging,
                         pipeline_costs=pipeline_costs(cfg, work, gpu=cl.gpu_kind))
    return cfg, ModelDims.from_config(cfg), work, cl, opts


@pytest.fixture(scope="module")
def searched():
    """The 2,048-GPU search of docs/layout.md's first command, from empty memo tables, timed."""
    cfg, dims, work, cluster, opts = _setup([], 4096, 16384, 2048)
    clear_memos()
    start = time.perf_counter()
    result = search(dims, work, cluster, opts, validate=config_validator(cfg, work))
    return cfg, dims, work, cluster, opts, result, time.perf_counter() - start


# ---------------------------------------------------------------------------------------- the plain computations
def reference_estimate(dims, layout, work, a=2, trainable="all", saves=False) -> MemoryEstimate:
    """`memory.estimate` as first written: every compared rank's state and activations computed afresh."""
    best = None
    for rank in compared_ranks(dims, layout):  # which ranks are compared is not what the memo tables change
        shards = rank_parameters(dims, layout, rank, trainable)
        state = state_terms(shards, layout, a == 2)
        layers = tuple(rank_layers(dims, layout, rank))
        candidate = MemoryEstimate({**state, **activation_terms(dims, layout, work, rank, a)}, rank, layers)
        if saves:
            at_save = MemoryEstimate({**state, **save_copies_terms(shards, layout, a == 2)}, rank, layers)
            candidate = at_save if at_save.total > candidate.total else candidate
        best = candidate if best is None or candidate.total > best.total else best
    return best


def reference_host(dims, layout, work, gpus_per_node, trainable="all", saves=False, pinned=True) -> HostEstimate:
    """`host_memory.host_estimate` as first written: every rank's bytes computed afresh."""
    best = None
    for rank in range(layout.pp) if layout.pipeline_layout else sorted({0, layout.pp - 1}):
        terms = {"process": PROCESS_BYTES}
        if saves:
            staged = written_bytes(rank_parameters(dims, layout, rank, trainable), layout)
            terms["checkpoint_staging"] = staged * (PINNED_ROUNDING if pinned else 1.0)
        if layout.activation_offload:
            terms["activation_offload"] = offloaded_bytes(dims, layout, work, rank) * PINNED_ROUNDING
        candidate = HostEstimate(terms, rank, min(gpus_per_node, layout.gpus))
        best = candidate if best is None or candidate.per_gpu > best.per_gpu else best
    return best


def reference_fitting(dims, layout, work, cluster, opts):
    """`search.fitting` as first written: every recompute setting from the fastest, the first that fits kept."""
    reason, needed = None, 0.0
    for recompute, offload in RECOMPUTE_ORDER:
        lay = replace(layout, recompute=recompute, activation_offload=offload)
        mem = reference_estimate(dims, lay, work, trainable=opts.trainable, saves=opts.saves)
        reason, needed = memory_refusal(mem, cluster.memory_bytes, opts.headroom), mem.needed
        if reason is None:
            host = reference_host(dims, lay, work, cluster.gpus_per_node, opts.trainable, opts.saves,
                                  opts.pinned_staging)
            reason = host_refusal(host, cluster.host_memory_bytes, opts.headroom)
            if reason is None:
                return Candidate(lay, mem, host=host), None, needed
    return None, reason, needed


def same_candidate(a, b) -> bool:
    return (a.layout == b.layout and a.memory.terms == b.memory.terms and a.memory.rank == b.memory.rank
            and a.memory.layers == b.memory.layers and a.host.terms == b.host.terms and a.host.rank == b.host.rank)


# ---------------------------------------------------------------------------------------------------- the search
def test_the_2048_gpu_search_with_the_time_model_runs_in_seconds(searched):
    """The real search (calibrated time model, the second pass's simulated schedule, the config validator) of
    GLM-5 744B on 2,048 H100: about 4 s on one core of the development machine (docs/layout.md), bounded loosely
    here for slow shared CI machines."""
    cfg, _, work, _, _, result, elapsed = searched
    assert elapsed < 15.0, elapsed
    assert result.considered > 50_000 and len(result.ranked) > 10_000 and result.refused["memory"] > 0
    speeds = [c.step.tokens_per_s_per_gpu for c in result.ranked]
    assert speeds == sorted(speeds, reverse=True)
    assert config_validator(cfg, work)(result.ranked[0].layout) is None


def test_the_best_layouts_are_the_ones_the_plain_models_give(searched):
    """Each of the ten best: the recompute setting, memory and host memory that the plain fitting gives its split
    (memo tables emptied first), and the step `timing.step_time` gives its layout afresh (no memo, a fresh
    calibration; the simulated schedule for the re-timed, the textbook for the rest), exactly."""
    from pretrain.layout import timing

    _, dims, work, cluster, opts, result, _ = searched
    calib = timing.load_calibration(cluster.gpu_kind)
    variant = {"selective_modules": ("core_attn", "moe")}
    clear_memos()
    for cand in result.ranked[:10]:
        split = replace(cand.layout, recompute="none", activation_offload=False)
        ref, reason, _ = reference_fitting(dims, split, work, cluster, opts)
        assert reason is None and same_candidate(cand, ref), cand.layout.short()
        schedule = "textbook" if TEXTBOOK_NOTE in cand.step.notes else "simulated"
        fresh = timing.step_time(dims, cand.layout, work, cluster, calib, variant=variant, schedule=schedule)
        assert replace(cand.step, notes=tuple(n for n in cand.step.notes if n != TEXTBOOK_NOTE)) == fresh


def test_fitting_is_the_plain_fitting_on_a_sample_of_the_search(searched):
    """Every 40th split the search sizes: the same candidate, or the same refusal and bytes, as trying every
    recompute setting with the plain models (the state bound refuses some of them with one setting sized)."""
    _, dims, work, cluster, opts, _, _ = searched
    layouts = [lay for lay in splits(dims, work, cluster, opts)
               if not (refusal(dims, lay, work) or bubble_refusal(lay, opts.bubble_bound))][::40]
    refused = 0
    for lay in layouts:
        cand, reason, needed = fitting(dims, lay, work, cluster, opts)
        ref, ref_reason, ref_needed = reference_fitting(dims, lay, work, cluster, opts)
        assert (reason, needed) == (ref_reason, ref_needed), lay.short()
        assert (cand is None and ref is None) or same_candidate(cand, ref), lay.short()
        refused += cand is None
    assert len(layouts) > 400 and 0 < refused < len(layouts)


def test_a_search_from_empty_tables_and_one_from_full_ones_agree():
    """glm5-proxy at 32K on 32 H100 with checkpoint saves (uneven stages, CP, host staging), searched twice: once
    after emptying every memo table, once with what the first left; the same layouts, terms and refusals."""
    _, dims, work, cluster, opts = _setup(["checkpoint.save=runs/ckpt"], 32768, 64, 32,
                                          config="configs/models/glm5-proxy.yaml")

    def run():
        r = search(dims, work, cluster, opts)
        return ([(c.layout, c.memory.terms, c.memory.rank, c.host.terms, c.step) for c in r.ranked],
                dict(r.refused), dict(r.examples), r.considered)

    clear_memos()
    first = run()
    assert len(first[0]) > 1000 and any(lay.pipeline_layout for lay, *_ in first[0]) and first == run()


# ------------------------------------------------------------------------------------------ the closed-form split
def reference_balanced_split(costs, stages, can_start=None):
    """`balanced_split` as first written (the plain dynamic program)."""
    n, inf = len(costs), float("inf")
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} entries into {stages} non-empty stages")
    can_start = can_start or [True] * n
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                if best[k - 1][j] == inf or (j > 0 and not can_start[j]):
                    continue
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    if best[stages][n] == inf:
        raise ValueError("no split satisfies the stage-start constraints")
    sizes, i = [], n
    for k in range(stages, 0, -1):
        sizes.append(i - cut[k][i])
        i = cut[k][i]
    return sizes[::-1]


def test_the_minimax_split_is_the_plain_dynamic_programs():
    """Random costs with ties, with and without stage-start constraints: the same sizes, or the same refusal."""
    from pretrain.tools.split_search import balanced_split

    rng = random.Random(7)
    compared = 0
    for trial in range(40):
        n = rng.randint(5, 40)
        costs = [rng.choice([1.0, 2.0, 3.0, rng.uniform(0.5, 4.0)]) for _ in range(n)]
        can = [True] + [rng.random() < 0.5 for _ in range(n - 1)] if trial % 2 else None
        for stages in (1, 2, 3, n // 2, n - 1, n, n + 1):
            try:
                ref = reference_balanced_split(costs, stages, can)
            except ValueError:
                with pytest.raises(ValueError):
                    balanced_split(costs, stages, can)
                continue
            assert balanced_split(costs, stages, can) == ref, (costs, stages, can)
            compared += 1
    assert compared > 150


def test_the_closed_form_split_is_the_plain_search_on_the_744b_stages():
    """The planner's 744B entry costs at 4K: every split scored at once (PP 2 x VPP 2) and the local search with
    its stage sums remembered (PP 8 x VPP 3, PP 16 x VPP 2) pick the split the plain search over `step_time` picks."""
    from pretrain.layout.pipeline_schedule import local_search, sizes_of
    from pretrain.tools.split_search import interleaved_split, step_time

    _, _, _, _, opts = _setup(SAVES, 4096, 16128, 1792)
    _, costs, can = (list(x) for x in opts.pipeline_costs)
    starts = [i for i in range(1, len(costs)) if can[i]]
    for m in (16, 144):
        plain = min(itertools.combinations(starts, 3), key=lambda cuts: step_time(sizes_of(cuts, len(costs)), costs,
                                                                                 2, m))
        assert interleaved_split(costs, 2, 2, m, can) == sizes_of(plain, len(costs))
    for pp, vpp, m in ((8, 3, 24), (16, 2, 144)):
        start = reference_balanced_split(costs, pp * vpp, can)
        plain = local_search(start, lambda trial: step_time(trial, costs, pp, m), can)[0]
        assert interleaved_split(costs, pp, vpp, m, can) == plain, (pp, vpp, m)
