"""The pipeline's term in the layout planner's step time: megatron's schedule run with the layout's own stages.

The textbook bubble, (p - 1) / (v m) of the step, holds when every virtual stage takes the same time. The splits a
pipeline of GLM-5 gets are not equal (the embedding, the MTP block of three depths on one layer, the output heads;
layers that do not divide evenly), and megatron's interleaved schedule then waits more than that: simulated in
megatron's order, the 744B plan's VPP 3 and 4 stages ran 1.24-1.47x an ideal pipeline where the textbook said
1.07-1.13 (docs/layout.md, the 744B plan). So the planner times a pipeline by running the
schedule (`pretrain.layout.pipeline_schedule.simulate`, Narayanan et al., SC 2021, megatron-core's order):

- each virtual stage s of `pipeline_plan.pipeline_plan` is timed by the planner's stage model as if it were a rank's only
  stage (its decoder layers, MoE layers, MTP depths, embedding, output heads), forward and backward apart
  (recompute counts with the backward);
- a rank's stages are then scaled together to the rank's own time per micro-batch (what a rank pays once per
  micro-batch, not once per stage, stays counted once);
- the schedule runs with megatron's micro-batch groups (`Layout.microbatch_group`, default PP), transfers free
  (the step time's calibrated p2p term adds them):

    pipeline  = the simulated makespan of m micro-batches
    bubble    = pipeline / (m x the busiest rank's time per micro-batch) - 1

With equal stages that is the textbook: (m + (p - 1) / v) t and (p - 1) / (v m).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from pretrain.config.pipeline_layout import microbatch_group_ok
from pretrain.layout.pipeline_schedule import Simulated, simulate
from pretrain.layout.pipeline_plan import pipeline_plan
from pretrain.layout.types import Layout, ModelDims

StageCounts = Tuple[int, int, int, bool, bool]  # (decoder layers, MoE layers, MTP depths, embedding, output heads)

__all__ = ["StageCounts", "virtual_stages", "schedule_group", "simulated_pipeline"]


def virtual_stages(dims: ModelDims, layout: Layout) -> List[StageCounts]:
    """What each virtual stage of the layout holds, in stage order (stage s on pipeline rank s mod PP)."""
    plan = pipeline_plan(dims, layout)
    out = []
    for s, entries in enumerate(plan.stages):
        layers = plan.stage_layers[s]
        out.append((len(layers), sum(dims.moe_pattern[i] for i in layers),
                    dims.mtp_depths if "m" in entries else 0, "E" in entries, "L" in entries))
    return out


def schedule_group(layout: Layout) -> Optional[int]:
    """megatron's micro-batch group per virtual stage for the layout (default PP), or None where megatron refuses
    it (the layout's refusal then names the rule)."""
    group = layout.microbatch_group or layout.pp
    if layout.vpp > 1 and not microbatch_group_ok(layout.pp, group, layout.num_microbatches):
        return None
    return group


def simulated_pipeline(dims: ModelDims, layout: Layout, stage_time: Callable[[StageCounts], Mapping[str, float]],
                       rank_totals: Sequence[float]) -> Optional[Simulated]:
    """The layout's schedule simulated (module docstring); `stage_time(counts)` is the planner's stage model
    ({"fwd", "bwd", "recompute", "total"} seconds per micro-batch), `rank_totals` each rank's time per micro-batch.
    None where megatron would refuse the micro-batch group."""
    group = schedule_group(layout)
    if group is None:
        return None
    pp = layout.pp
    raw: List[Dict[str, float]] = [dict(stage_time(counts)) for counts in virtual_stages(dims, layout)]
    per_rank = [sum(r["total"] for r in raw[rank::pp]) for rank in range(pp)]
    forward, backward = [], []
    for s, r in enumerate(raw):
        scale = rank_totals[s % pp] / per_rank[s % pp] if per_rank[s % pp] > 0 else 0.0
        work = r["fwd"] + r["bwd"] + r["recompute"]
        share = r["fwd"] / work if work > 0 else 1 / 3
        forward.append(r["total"] * scale * share)
        backward.append(r["total"] * scale * (1 - share))
    return simulate(forward, backward, pp, layout.num_microbatches, group=group)
