"""The layout planner's pipeline term by megatron's simulated schedule (pretrain/layout/schedule_term.py) and the
search's second pass that re-splits and re-times its best pipelined layouts with it (pretrain/layout/rescore.py).
References: the textbook (m v + p - 1)(f + b) for equal stages, the stage model's own times, hand-made rankings."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from pretrain.layout.rescore import TEXTBOOK_NOTE, rescore
from pretrain.layout.schedule_term import simulated_pipeline, virtual_stages
from pretrain.layout.types import Layout, ModelDims, StepTime


def _dims(layers: int = 12) -> ModelDims:
    from pretrain.config import load_config

    cfg = load_config("configs/models/glm5-tiny.yaml", [f"model.num_layers={layers}",
                                                          f"model.moe_layer_freq=[0]+[1]*{layers - 1}"])
    return ModelDims.from_config(cfg)


@pytest.mark.parametrize("pp, vpp, m", [(2, 1, 8), (4, 1, 8), (2, 2, 8), (4, 3, 12), (3, 2, 6)])
def test_equal_stages_give_the_textbook_pipeline(pp, vpp, m):
    """Every virtual stage 1 s forward, 2 s backward: the makespan is (m v + p - 1) x 3 s, the bubble (p - 1) / (v m)."""
    dims = _dims(12)
    lay = Layout(pp=pp, vpp=vpp, num_microbatches=m)
    sim = simulated_pipeline(dims, lay, lambda counts: {"fwd": 1.0, "bwd": 2.0, "recompute": 0.0, "total": 3.0},
                             [3.0 * vpp] * pp)
    assert sim.step == pytest.approx((m * vpp + pp - 1) * 3.0)
    assert sim.step / (m * 3.0 * vpp) - 1 == pytest.approx((pp - 1) / (vpp * m))


def test_each_rank_keeps_its_time_and_each_stage_its_forward_share(monkeypatch):
    """What reaches the simulation: per rank, the stages' forward + backward add up to the rank's own time per
    micro-batch; per stage, the forward share is the stage model's forward / (forward + backward + recompute)."""
    import pretrain.layout.schedule_term as term

    dims = _dims(12)
    lay = Layout(pp=2, vpp=2, num_microbatches=4, pipeline_layout="Et*2|t*4|t*3|t*3mL")
    seen = {}

    def capture(forward, backward, pp, m, group=None):
        seen.update(forward=forward, backward=backward, pp=pp, m=m, group=group)
        return "simulated"

    monkeypatch.setattr(term, "simulate", capture)

    def stage_time(counts):  # made-up costs that differ per stage: 1 s per layer, 0.5 for E, 2 for L
        layers, moe, mtp, first, last = counts
        fwd = layers + 0.5 * first + 2.0 * last + mtp
        return {"fwd": fwd, "bwd": 2 * fwd, "recompute": 0.5 * layers, "total": 3 * fwd + 0.5 * layers + 0.1}

    totals = [10.0, 20.0]
    assert simulated_pipeline(dims, lay, stage_time, totals) == "simulated"
    assert (seen["pp"], seen["m"], seen["group"]) == (2, 4, 2)
    stages = virtual_stages(dims, lay)
    assert [s[0] for s in stages] == [2, 4, 3, 3] and stages[0][3] and stages[3][4] and stages[3][2] == dims.mtp_depths
    for rank in range(2):
        assert sum(seen["forward"][rank::2]) + sum(seen["backward"][rank::2]) == pytest.approx(totals[rank])
    for s, counts in enumerate(stages):
        t = stage_time(counts)
        share = seen["forward"][s] / (seen["forward"][s] + seen["backward"][s])
        assert share == pytest.approx(t["fwd"] / (t["fwd"] + t["bwd"] + t["recompute"]))


def test_a_group_megatron_refuses_leaves_no_simulation():
    dims = _dims(12)
    lay = Layout(pp=4, vpp=2, num_microbatches=6, microbatch_group=4)  # the last group of 2 < PP
    assert simulated_pipeline(dims, lay, lambda c: {"fwd": 1, "bwd": 2, "recompute": 0, "total": 3}, [6.0] * 4) is None


@dataclass
class _Cand:
    layout: Layout
    step: StepTime


def _cand(speed: float, pp: int = 2) -> _Cand:
    step = StepTime(0, 0, 0, 0, 0, 0, 0, 0, 0, 1.0, speed, 0.1)
    return _Cand(Layout(pp=pp, num_microbatches=8), step)


def test_rescore_retimes_in_textbook_order_until_the_next_cannot_win():
    """Textbook speeds 10, 9, 8, 7 re-time to 5, 8.5, ...: after the second, 8.5 >= the next textbook 8, so the
    pass stops; 8 and 7 keep their textbook times with a note; the re-timed 5 sinks below them."""
    ranked = [_cand(10), _cand(9), _cand(8), _cand(7)]
    new_speed = {10: 5.0, 9: 8.5, 8: 7.5, 7: 6.0}
    calls = []

    def retime(layout):
        old = ranked[len(calls)].step.tokens_per_s_per_gpu
        calls.append(old)
        return _cand(new_speed[old]), None

    out, refusals = rescore(ranked, retime, lambda c: c.step.tokens_per_s_per_gpu, need=1)
    assert calls == [10, 9] and refusals == []
    assert [c.step.tokens_per_s_per_gpu for c in out] == [8.5, 8, 7, 5.0]
    assert TEXTBOOK_NOTE in out[1].step.notes and TEXTBOOK_NOTE not in out[0].step.notes


def test_rescore_keeps_unpipelined_layouts_and_passes_refusals_on():
    ranked = [_cand(10), _cand(9, pp=1), _cand(8)]
    out, refusals = rescore(ranked, lambda layout: (None, "bubble (simulated schedule): 13%"),
                            lambda c: c.step.tokens_per_s_per_gpu, need=1)
    assert [c.step.tokens_per_s_per_gpu for c in out] == [9, 8] and refusals == ["bubble (simulated schedule): 13%"]
    assert TEXTBOOK_NOTE in out[1].step.notes


def test_check_stage_refuses_the_plans_old_pretraining_layout():
    """The 744B plan's pretrain-ramp layout before 2026-11-29 (TP2 PP14 VPP3, closed-form uneven stages): the
    textbook bubble is 13 / (3 x 126) = 3%, the schedule simulated with its stages idles a third of the busiest
    rank's time; `--validate-only --gpus` now refuses it in one line."""
    from pretrain.config import load_config
    from pretrain.layout.search import check_stage

    old = ("Et*3|t|t*2|t*2|t*2|t*2|t*2|t*2|t*2|t*2|t*2|t*2|t|t*2|t*2|t*2|t*2|t*2|t*2|t*2|t*2|t*2|t*2|t*2|t*2|t*3|t|"
           "t*2|t*2|t*2|t*2|t*2|t*2|t*2|t*2|t*2|t*2|t*2|t*2|t|m*3|L")
    cfg = load_config("configs/models/glm5-744b.yaml", [
        "parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=14",
        "parallel.virtual_pipeline_model_parallel_size=3", f"parallel.pipeline_model_parallel_layout='{old}'",
        "parallel.num_layers_in_first_pipeline_stage=null", "parallel.num_layers_in_last_pipeline_stage=null",
        "parallel.context_parallel_size=1", "parallel.expert_model_parallel_size=8", "parallel.sequence_parallel=true",
        "data.seq_length=4096", "train.global_batch_size=8064", "train.micro_batch_size=1",
        "model.recompute_granularity=selective", "model.recompute_modules=[core_attn,moe]",
        "model.activation_offload=true", "model.output_loss_backend=chunked", "model.output_chunk_size=4096",
        "optimizer.zero2_grad_reduce=step"])
    reason = check_stage(cfg, 1792)
    assert reason is not None and "\n" not in reason
    assert "bubble (simulated schedule):" in reason and "PP 14 x VPP 3, m 126, over 10%" in reason, reason
    from pretrain.layout.search import layout_of
    assert layout_of(cfg, 1792)[0].bubble < 0.04  # what the textbook check alone let through


def test_the_searchs_best_layouts_are_timed_by_the_simulated_schedule():
    """GLM-5 at 4K on 448 H100: each of the ten best layouts carries the step that `timing.step_time` with the
    simulated schedule gives its layout afresh (not the first pass's textbook step), a simulated bubble within the
    bound, and the ranking is by that step."""
    from pretrain.config import load_config
    from pretrain.layout import timing
    from pretrain.layout.__main__ import NO_LAYOUT
    from pretrain.layout.search import SearchOptions, pipeline_costs, search
    from pretrain.layout.types import Workload, cluster_preset

    cfg = load_config("configs/models/glm5-744b.yaml", NO_LAYOUT + ["model.dsa_sparse_attention=false"])
    dims, work, cluster = ModelDims.from_config(cfg), Workload(4096, 2016), cluster_preset("h100-nvl-ib400", 448)
    result = search(dims, work, cluster, SearchOptions(pipeline_costs=pipeline_costs(cfg, work, gpu="h100")))
    best = result.ranked[:10]
    assert sum(c.layout.pp > 1 and c.layout.vpp > 1 for c in best) >= 3
    calib = timing.load_calibration("h100")
    for c in best:
        fresh = timing.step_time(dims, c.layout, work, cluster, calib, variant={"selective_modules": ("core_attn", "moe")})
        assert c.step.total == pytest.approx(fresh.total, rel=1e-12), c.layout.short()
        assert c.step.bubble_fraction <= 0.10 and TEXTBOOK_NOTE not in c.step.notes
    speeds = [c.step.tokens_per_s_per_gpu for c in best]
    assert speeds == sorted(speeds, reverse=True)
