"""The step of a pipeline schedule, simulated op by op: megatron-core's 1F1B and interleaved 1F1B orders
(Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC 2021).

The closed form (p - 1) / (v m) holds when every (virtual) stage takes the same time. With unequal stages the
interleaved schedule's waits depend on which stage is slow and where it sits in the order, so this runs the
schedule itself: each pipeline rank executes its ops in megatron-core 0.16.1's order
(`forward_backward_pipelining_with_interleaving`, `forward_backward_pipelining_without_interleaving`), and an op
starts when the rank is free and its input has arrived:

    forward  F(s, j): micro-batch j through virtual stage s   needs F(s - 1, j)   (s > 0)
    backward B(s, j)                                          needs B(s + 1, j)   (s < S - 1), F(S - 1, j) on the last

with S = p v virtual stages, stage s on rank s mod p. Each rank's order:

- the schedule table (megatron's `get_schedule_table`): micro-batches in groups of G (megatron's
  `microbatch_group_size_per_vp_stage`, default P), and for each group every model chunk in turn; virtual
  micro-batch k -> (micro-batch, chunk); backward visits the chunks in reverse;
- warm-up: (p - r - 1) x 2 + (v - 1) x G forwards on rank r, at most all of them; then one forward and one
  backward per slot (1F1B); then the remaining backwards. Without virtual stages: p - r - 1 warm-up forwards.

Transfers take `transfer` seconds (stage to stage, the same for activations and gradients); a rank that waits
for an input is idle. Returns the makespan and each rank's idle time, so a layout's cost can be ranked by the
schedule it will run, not by its busiest rank alone (`pretrain.tools.pipeline_split`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

Op = Tuple[str, int, int]  # ("F" or "B", virtual stage, micro-batch)


@dataclass(frozen=True)
class Simulated:
    step: float  # the schedule's makespan (first op start to last op end)
    busy: Tuple[float, ...]  # per pipeline rank: its ops' time
    idle: Tuple[float, ...]  # per pipeline rank: step - busy


def schedule_table(microbatches: int, vpp: int, group: int) -> List[Tuple[int, int]]:
    """megatron-core's `get_schedule_table`: virtual micro-batch k -> (micro-batch, model chunk), in groups of
    `group` micro-batches per chunk (the last group takes the rest)."""
    table = []
    for first in range(0, microbatches, group):
        last = microbatches if first + group >= microbatches else first + group
        table += [(j, chunk) for chunk in range(vpp) for j in range(first, last)]
    return table


def rank_order(rank: int, pp: int, vpp: int, microbatches: int, group: Optional[int] = None) -> List[Op]:
    """The ops of pipeline rank `rank` in megatron-core's order (module docstring); `group`: megatron's
    `microbatch_group_size_per_vp_stage` (default PP)."""
    if vpp == 1:
        warm = min(pp - rank - 1, microbatches)
        fwd = [("F", rank, j) for j in range(microbatches)]
        bwd = [("B", rank, j) for j in range(microbatches)]
        return _interleave(fwd, bwd, warm)
    group = group or pp
    if not pp <= group <= microbatches or 0 < microbatches % group < pp:
        raise ValueError(f"micro-batch group {group} per virtual stage: megatron needs PP ({pp}) <= group <= "
                         f"micro-batches ({microbatches}) and a last group of 0 or >= PP")
    table = schedule_table(microbatches, vpp, group)
    total = len(table)
    warm = min((pp - rank - 1) * 2 + (vpp - 1) * group, total)
    fwd = [("F", chunk * pp + rank, j) for j, chunk in table]
    bwd = [("B", (vpp - 1 - chunk) * pp + rank, j) for j, chunk in table]
    return _interleave(fwd, bwd, warm)


def _interleave(fwd: List[Op], bwd: List[Op], warm: int) -> List[Op]:
    steady = len(fwd) - warm
    out = fwd[:warm]
    for k in range(steady):
        out += [fwd[warm + k], bwd[k]]
    return out + bwd[steady:]


def simulate(forward: Sequence[float], backward: Sequence[float], pp: int, microbatches: int,
             transfer: float = 0.0, group: Optional[int] = None) -> Simulated:
    """Run the schedule of len(forward) = p x v virtual stages (stage s on rank s mod p) with these per-micro-batch
    forward and backward times."""
    stages = len(forward)
    if stages % pp or len(backward) != stages:
        raise ValueError(f"{stages} stages (forward) and {len(backward)} (backward) for PP {pp}")
    vpp = stages // pp
    orders = [rank_order(r, pp, vpp, microbatches, group) for r in range(pp)]
    done: Dict[Op, float] = {}
    free = [0.0] * pp
    busy = [0.0] * pp
    nxt = [0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            while nxt[r] < len(orders[r]):
                kind, s, j = orders[r][nxt[r]]
                if kind == "F":
                    need = ("F", s - 1, j) if s > 0 else None
                    cost = forward[s]
                else:
                    need = ("B", s + 1, j) if s < stages - 1 else ("F", s, j)
                    cost = backward[s]
                if need is not None and need not in done:
                    break
                ready = 0.0 if need is None else done[need] + (transfer if need[1] != s else 0.0)
                start = max(free[r], ready)
                free[r] = done[(kind, s, j)] = start + cost
                busy[r] += cost
                nxt[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("the schedule deadlocked (an op waits for one that never runs)")
    step = max(free)
    return Simulated(step, tuple(busy), tuple(step - b for b in busy))
