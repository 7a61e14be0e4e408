"""The layout search's second pass: its best pipelined layouts re-split, re-grouped and re-timed by megatron's
schedule simulated op by op (`pretrain.layout.schedule_term`).

The first pass times every layout with the textbook bubble, (PP - 1) / (VPP m), and cuts uneven stages by the
closed-form balance: cheap enough for tens of thousands of layouts, and optimistic where the virtual stages are
unequal (the 744B plan's VPP 3 and 4 stages: 1.24-1.47x an ideal pipeline simulated, about 1.1x by the textbook).
In textbook order, each pipelined layout then gets

- with virtual stages: the split and megatron's micro-batch group (`parallel.microbatch_group_size_per_vp_stage`)
  whose simulated schedule is shortest (`pretrain.tools.pipeline_split.scheduled_stages`: megatron's even split,
  the closed-form split and the smallest-largest-stage split, the first four groups);
- its memory again (the group sets how many micro-batches rank 0 holds) and its step with the schedule simulated;
- a refusal when the simulated bubble exceeds the bound.

The pass stops once `need` re-timed layouts are at least as fast as the next layout's textbook time (the textbook
is close to an upper bound: with equal stages the two agree, and unequal stages wait more in the simulation), or
after `limit` re-timings. Layouts below stay with their textbook time, and are marked so in their notes.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Callable, List, Optional, Sequence, Tuple

from pretrain.layout.types import Layout

__all__ = ["scheduled", "rescore", "TEXTBOOK_NOTE"]

TEXTBOOK_NOTE = "pipeline timed with the textbook bubble (not re-timed by the simulated schedule)"
Costs = Tuple[Tuple[str, ...], Tuple[float, ...], Tuple[bool, ...]]


@lru_cache(maxsize=1024)
def _scheduled(costs: Costs, pp: int, vpp: int, m: int) -> Optional[Tuple[Optional[str], int]]:
    from pretrain.config.pipeline_layout import format_layout
    from pretrain.tools.pipeline_split import scheduled_stages

    entries, cost, can_start = costs
    if pp * vpp > len(entries):
        return None
    try:
        stages, group, _ = scheduled_stages(list(entries), list(cost), pp, vpp, m, list(can_start))
    except ValueError:  # no split meets the DSA stage-start constraints
        return None
    return (format_layout(stages) if stages is not None else None), group


def scheduled(layout: Layout, costs: Optional[Costs]) -> Layout:
    """The layout with the split and micro-batch group its simulated schedule prefers (module docstring); unchanged
    without virtual stages or entry costs."""
    if layout.pp == 1 or layout.vpp == 1 or costs is None:
        return layout
    chosen = _scheduled(costs, layout.pp, layout.vpp, layout.num_microbatches)
    if chosen is None:
        return layout
    stages, group = chosen  # stages None: megatron's even split (chosen only where the layers divide)
    return replace(layout, pipeline_layout=stages, microbatch_group=None if group == layout.pp else group)


def rescore(ranked: Sequence, retime: Callable[[Layout], Tuple[Optional[object], Optional[str]]],
            speed: Callable[[object], float], need: int, limit: int = 400) -> Tuple[List, List[str]]:
    """(the candidates re-ranked, the refusals): `ranked` sorted by textbook speed; `retime(layout)` returns the
    re-split, re-fitted and re-timed candidate or its refusal; `speed(candidate)` its tokens/s per GPU."""
    done, refusals, rest, tried = [], [], [], 0
    for i, cand in enumerate(ranked):
        if cand.layout.pp == 1:  # no pipeline: the two timings agree
            done.append(cand)
        elif tried >= limit:
            rest = list(ranked[i:])
            break
        else:
            tried += 1
            new, reason = retime(cand.layout)
            if new is None:
                refusals.append(reason)
            else:
                done.append(new)
        fastest = sorted((speed(c) for c in done), reverse=True)
        if i + 1 < len(ranked) and len(fastest) >= need and fastest[need - 1] >= speed(ranked[i + 1]):
            rest = list(ranked[i + 1:])
            break
    for cand in rest:
        if cand.layout.pp > 1:
            cand.step = replace(cand.step, notes=cand.step.notes + (TEXTBOOK_NOTE,))
    out = done + rest
    out.sort(key=lambda c: -speed(c))
    return out, refusals
