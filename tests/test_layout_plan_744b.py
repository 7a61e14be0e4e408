"""The shipped 744B curriculum (configs/curriculum/glm5-744b.yaml) on the cluster its header states: every stage
passes the layout planner's checks there (what `python -m pretrain.curriculum --validate-only --gpus N --cluster
NAME` runs), uses every GPU, keeps GLM-5's batch sizes within 2%, and the projection's totals add up
(benchmarks/layout_projection.py, docs/layout.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.layout_projection import DEEPSEEK_V3, project, render, stated_cluster
from pretrain.curriculum.__main__ import check_plan_layouts
from pretrain.curriculum.plan import load_plan
from pretrain.layout.search import layout_of

ROOT = Path(__file__).resolve().parents[1]
PLAN = str(ROOT / "configs/curriculum/glm5-744b.yaml")


@pytest.fixture(scope="module")
def plan():
    return load_plan(PLAN)


@pytest.fixture(scope="module")
def stated():
    return stated_cluster(PLAN)


def test_every_stage_passes_the_planner_on_the_stated_cluster(plan, stated):
    gpus, cluster = stated
    assert (gpus, cluster) == (1792, "h100-nvl-ib400")
    check_plan_layouts(plan, gpus, cluster)  # raises PlanError naming the first stage that fails
    for s in plan.stages:
        p = s.cfg.parallel
        model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
        assert gpus % model_parallel == 0, s.name  # the layout uses every GPU
        dp = gpus // model_parallel
        assert s.global_batch_size % (dp * s.cfg.train.micro_batch_size) == 0, s.name
        layout, work = layout_of(s.cfg, gpus)
        assert layout.pp == 1 or layout.bubble <= 0.10, s.name
        if layout.pp > 1:  # and megatron's schedule, simulated with the stage's own virtual stages
            from pretrain.layout.search import stage_step
            from pretrain.layout.types import cluster_preset

            assert stage_step(s.cfg, layout, work, cluster_preset(cluster, gpus)).bubble_fraction <= 0.10, s.name


def test_checkpoint_saves_of_either_kind_fit_and_peak_at_dsa_sparses_save(plan, stated):
    """What the plan's header and docs/layout.md say: asynchronous saves fit the stated H100 cluster (they hold no
    copies while they write) with the same estimates as synchronous ones; a save's routed-expert copies stay under
    the step peak in mid-200k and dsa-warmup, and peak above it in the four pipelined stages (pretrain-ramp at EP 128:
    8.6 GiB per GPU, 66.1 GiB, 4.4 over its step; the three at EP 8: 16.9-17.4 GiB, 70.6-70.9 GiB, 10.2-14.8 over)
    and in dsa-sparse (9.9 GiB: 63.4, 2.0 over)."""
    from pretrain.layout.memory import estimate
    from pretrain.layout.search import stage_memory
    from pretrain.layout.types import GiB, ModelDims

    gpus, cluster = stated
    async_plan = load_plan(PLAN, ["checkpoint.async_save=true"])
    check_plan_layouts(async_plan, gpus, cluster)
    for s, a in zip(plan.stages, async_plan.stages):
        assert s.cfg.checkpoint.save and not s.cfg.checkpoint.async_save, s.name  # the runner gives each a directory
        layout, work = layout_of(s.cfg, gpus)
        with_saves = stage_memory(s.cfg, layout, work)
        assert stage_memory(a.cfg, *layout_of(a.cfg, gpus)).terms == with_saves.terms, s.name
        step = estimate(ModelDims.from_config(s.cfg), layout, work, trainable=s.cfg.train.trainable_params)
        copies = with_saves.terms.get("checkpoint_save_copies")
        if s.name == "dsa-sparse":
            assert copies / GiB == pytest.approx(9.9, abs=0.05)
            assert with_saves.needed / GiB == pytest.approx(63.4, abs=0.05)
            assert (with_saves.total - step.total) / GiB == pytest.approx(2.0, abs=0.05)
        elif s.name == "pretrain-ramp":  # PP 2 x EP 128: a GPU holds fewer experts
            assert copies / GiB == pytest.approx(8.6, abs=0.05)
            assert with_saves.needed / GiB == pytest.approx(66.1, abs=0.05)
            assert (with_saves.total - step.total) / GiB == pytest.approx(4.4, abs=0.05)
        elif s.cfg.parallel.pipeline_model_parallel_size > 1:
            assert 16.9 - 0.05 <= copies / GiB <= 17.4 + 0.05, s.name
            assert 70.6 - 0.05 <= with_saves.needed / GiB <= 70.9 + 0.05, s.name
            assert 10.2 - 0.05 <= (with_saves.total - step.total) / GiB <= 14.8 + 0.05, s.name
        else:
            assert copies is None and with_saves.terms == step.terms, s.name


def test_batches_stay_glm5s(plan):
    """GLM-5: the batch ramps 16M -> 64M tokens over the first 500B (the ramp stage at its mean), 64M after;
    the DSA stages 14 x 202,752 tokens (GLM-5 report)."""
    tokens = {s.name: s.global_batch_size * s.seq_length for s in plan.stages}
    assert tokens["pretrain-ramp"] == pytest.approx(2**25, rel=0.02)
    for name in ("pretrain-4k", "mid-32k", "mid-128k", "mid-200k"):
        assert tokens[name] == pytest.approx(2**26, rel=0.02), name
    assert tokens["dsa-warmup"] == tokens["dsa-sparse"] == 14 * 202752


def test_projection_adds_up(plan, stated):
    gpus, cluster = stated
    p = project(PLAN, gpus, cluster, plan=plan)
    assert p["tokens"] == sum(s.trained_tokens for s in plan.stages)
    for x in p["stages"]:
        assert x["fits"], x["name"]
        # GPU-seconds x tokens/s per GPU = the stage's tokens
        assert x["gpu_hours"] * 3600 * x["step"].tokens_per_s_per_gpu == pytest.approx(x["tokens"], rel=1e-9)
        assert x["days"] * 86400 * gpus == pytest.approx(x["gpu_hours"] * 3600, rel=1e-9)
    assert p["gpu_hours"] == pytest.approx(sum(x["gpu_hours"] for x in p["stages"]))
    text = render(p, "cmd", "today")
    # DeepSeek-V3: 14.8T tokens in 2.788M GPU-hours = 1,475 tokens/s per GPU, 57 days on 2,048 GPUs
    assert DEEPSEEK_V3["tokens"] / (DEEPSEEK_V3["gpu_hours"] * 3600) == pytest.approx(1474.6, abs=0.5)
    assert "| 2,048 H800 | 14.8T | 2.788M | 188K | 1,475 | 57 |" in text
    assert "Kimi K2 (1T MoE) | unknown (H800) | unknown | unknown" in text
    assert "`a2a.inter_node_fraction` = 0.6" in text and "tp.overhead_s_per_layer_microbatch fitted at TP=2" in text


def test_host_memory_of_every_stage_fits_its_nodes(plan, stated):
    """What docs/layout.md says: with saves, a node's host memory need (trainers, kept checkpoint staging, offloaded
    activations) peaks at pretrain-4k's 1,453 GiB, under 90% of the preset's 2 TiB; check_plan_layouts refuses it over."""
    from pretrain.layout.search import stage_host_memory
    from pretrain.layout.types import CLUSTERS, GiB

    gpus, cluster = stated
    need = {s.name: stage_host_memory(s.cfg, *layout_of(s.cfg, gpus), 8).per_node for s in plan.stages}
    assert max(need, key=need.get) == "pretrain-4k" and need["pretrain-4k"] / GiB == pytest.approx(1453, abs=1)
    assert max(need.values()) < 0.9 * CLUSTERS[cluster].host_memory_bytes
