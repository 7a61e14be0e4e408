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
        layout, _ = layout_of(s.cfg, gpus)
        assert layout.pp == 1 or layout.bubble <= 0.10, s.name


def test_async_saves_do_not_fit_the_ramp_on_h100_but_fit_h200(stated):
    """What the plan's header and docs/layout.md say: asynchronous saves' expert copies take pretrain-ramp over the
    H100's 90% memory bound; an H200 cluster of the same size still fits every stage."""
    from pretrain.curriculum.plan import PlanError

    gpus, cluster = stated
    async_plan = load_plan(PLAN, ["checkpoint.async_save=true"])
    with pytest.raises(PlanError, match=r"pretrain-ramp.*memory: 73\.8 GiB needed"):
        check_plan_layouts(async_plan, gpus, cluster)
    check_plan_layouts(async_plan, gpus, "h200-nvl-ib400")


def test_batches_stay_glm5s(plan):
    """GLM-5: the batch ramps 16M -> 64M tokens over the first 500B (the ramp stage at its mean), 64M after;
    the DSA stages 14 x 202,752 tokens (glm5_facts.md sections 2 and 4)."""
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
