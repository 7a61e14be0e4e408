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

- the schedule table (megatron's own `get_schedule_table`): micro-batches in groups of G (megatron's
  `microbatch_group_size_per_vp_stage`, default P), and for each group every model chunk in turn; virtual
  micro-batch k -> (micro-batch, chunk); backward visits the chunks in reverse;
- warm-up (megatron's own `get_pp_rank_microbatches`): (p - r - 1) x 2 + (v - 1) x G forwards on rank r, at most
  all of them; then one forward and one backward per slot (1F1B); then the remaining backwards. Without virtual
  stages: p - r - 1 warm-up forwards.

Transfers take `transfer` seconds (stage to stage, the same for activations and gradients); a rank that waits
for an input is idle. Returns the makespan and each rank's idle time, so a layout's cost can be ranked by the
schedule it will run, not by its busiest rank alone (`pretrain.tools.pipeline_split`).

Each rank's order is built once per schedule shape (PP, VPP, micro-batches, group) and reused for every set of
stage costs a search tries.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace
from typing import Callable, List, Optional, Sequence, Tuple

from pretrain.config.pipeline_layout import microbatch_group_ok

Op = Tuple[str, int, int]  # ("F" or "B", virtual stage, micro-batch)


@dataclass(frozen=True)
class Simulated:
    step: float  # the schedule's makespan (first op start to last op end)
    busy: Tuple[float, ...]  # per pipeline rank: its ops' time

    @property
    def idle(self) -> Tuple[float, ...]:
        """Per pipeline rank: the step minus its ops' time."""
        return tuple(self.step - b for b in self.busy)


def warmup_forwards(rank: int, pp: int, vpp: int, microbatches: int, group: int) -> int:
    """Forwards before rank `rank`'s first backward: megatron-core's own `get_pp_rank_microbatches`, given a stand-in
    for the pipeline communicator it reads the sizes from (no process group needed)."""
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    comm = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: pp, rank=lambda: rank),
                           virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    return get_pp_rank_microbatches(microbatches, vpp, group, p2p_communicator=comm)[2]


def rank_order(rank: int, pp: int, vpp: int, microbatches: int, group: Optional[int] = None) -> List[Op]:
    """The ops of pipeline rank `rank` in megatron-core's order (module docstring); `group`: megatron's
    `microbatch_group_size_per_vp_stage` (default PP)."""
    group = group or pp
    if vpp == 1:
        table = [(j, 0) for j in range(microbatches)]
    elif microbatch_group_ok(pp, group, microbatches):
        from megatron.core.pipeline_parallel.schedules import get_schedule_table

        table = get_schedule_table(microbatches, vpp, group)
    else:
        raise ValueError(f"micro-batch group {group} per virtual stage: megatron needs PP ({pp}) <= group <= "
                         f"micro-batches ({microbatches}) and a last group of 0 or >= PP")
    warm = warmup_forwards(rank, pp, vpp, microbatches, group)
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
    orders = _numbered_orders(pp, stages // pp, microbatches, group or pp)
    done: List[Optional[float]] = [None] * (2 * stages * microbatches)  # each op's end, by its number
    free = [0.0] * pp
    busy = [0.0] * pp
    nxt = [0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            ops, i, end, work = orders[r], nxt[r], free[r], busy[r]
            while i < len(ops):
                op, s, is_forward, need, need_stage = ops[i]
                cost = forward[s] if is_forward else backward[s]
                if need < 0:
                    ready = 0.0
                else:
                    arrived = done[need]
                    if arrived is None:
                        break
                    ready = arrived + (transfer if need_stage != s else 0.0)
                start = max(end, ready)
                end = done[op] = start + cost
                work += cost
                i += 1
                remaining -= 1
                progressed = True
            nxt[r], free[r], busy[r] = i, end, work
        if not progressed:
            raise RuntimeError("the schedule deadlocked (an op waits for one that never runs)")
    return Simulated(max(free), tuple(busy))


@lru_cache(maxsize=64)  # a search simulates a few dozen schedule shapes (PP, VPP, m, group) for many stage costs
def _numbered_orders(pp: int, vpp: int, microbatches: int, group: int
                     ) -> Tuple[Tuple[Tuple[int, int, bool, int, int], ...], ...]:
    """Every rank's `rank_order` as (op number, stage, forward, number of the op it needs or -1, that op's stage):
    `simulate` keeps each op's end in a list by number (the same arithmetic as with the ops as keys, less work)."""
    stages = pp * vpp

    def number(kind: str, s: int, j: int) -> int:
        return ((kind == "B") * stages + s) * microbatches + j

    out = []
    for order in (rank_order(r, pp, vpp, microbatches, group) for r in range(pp)):
        ops = []
        for kind, s, j in order:
            if kind == "F":
                need = ("F", s - 1, j) if s > 0 else None
            else:
                need = ("B", s + 1, j) if s < stages - 1 else ("F", s, j)
            ops.append((number(kind, s, j), s, kind == "F", -1 if need is None else number(*need),
                        -1 if need is None else need[1]))
        out.append(tuple(ops))
    return tuple(out)


# ----------------------------------------------------------------------------------- choosing a split by it
SIMULATED_SPLITS = 5_000  # up to this many ways to cut, every split is simulated (else a local search)
BACKWARD_PER_FORWARD = 2.0  # a layer's backward: two GEMMs per forward GEMM


def forward_shares(entries: Sequence[str], fused_loss: bool) -> List[float]:
    """Each pipeline entry's forward share of its training time: 1 / 3 (backward = 2 x forward), but L with a fused
    output loss (output_loss_backend chunked or liger), whose forward computes the logits' gradient too (measured on
    glm5-proxy, 2 x H200: the heads' forward 319 ms per step, their backward 11 ms)."""
    return [0.97 if e.endswith("L") and fused_loss else 1 / (1 + BACKWARD_PER_FORWARD) for e in entries]


def schedule_groups(pp: int, microbatches: int) -> List[int]:
    """megatron's valid `microbatch_group_size_per_vp_stage` values that are multiples of PP, and all the
    micro-batches in one group."""
    out = [g for g in range(pp, microbatches + 1, pp) if microbatch_group_ok(pp, g, microbatches)]
    return out + ([microbatches] if microbatches not in out else [])


def sizes_of(cuts: Sequence[int], n: int) -> List[int]:
    """Stage sizes of n entries from the entry indices where stages 1.. start."""
    bounds = [0, *cuts, n]
    return [bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)]


def local_search(sizes: Sequence[int], objective: Callable[[List[int]], float],
                 can_start: Optional[Sequence[bool]] = None) -> Tuple[List[int], float]:
    """Move one stage boundary by one entry while `objective` improves; (sizes, value)."""
    sizes = list(sizes)
    can_start = can_start or [True] * sum(sizes)
    best, improved = objective(sizes), True
    while improved:
        improved = False
        for b in range(len(sizes) - 1):  # the boundary between stage b and b + 1
            for delta in (-1, 1):
                trial = list(sizes)
                trial[b] += delta
                trial[b + 1] -= delta
                if min(trial[b], trial[b + 1]) < 1 or not can_start[sum(trial[:b + 1])]:
                    continue
                value = objective(trial)
                if value < best - 1e-9 * best:
                    sizes, best, improved = trial, value, True
    return sizes, best


def simulated_step(sizes: Sequence[int], costs: Sequence[float], shares: Sequence[float], pp: int,
                   microbatches: int, group: int) -> float:
    """The simulated step for stages of `sizes` consecutive entries with these costs and forward shares."""
    fwd, bwd, start = [], [], 0
    for size in sizes:
        fwd.append(sum(c * f for c, f in zip(costs[start:start + size], shares[start:start + size])))
        bwd.append(sum(c * (1 - f) for c, f in zip(costs[start:start + size], shares[start:start + size])))
        start += size
    return simulate(fwd, bwd, pp, microbatches, group=group).step


def best_split(costs: Sequence[float], shares: Sequence[float], pp: int, vpp: int, microbatches: int,
               start: Sequence[int], can_start: Optional[Sequence[bool]] = None,
               exhaustive: int = SIMULATED_SPLITS) -> Tuple[List[int], int, float]:
    """(stage sizes, micro-batch group per virtual stage, simulated step) minimizing the simulated schedule over the
    splits of `costs` into PP x VPP stages and megatron's `microbatch_group_size_per_vp_stage`: every split when
    there are at most `exhaustive`, else a local search from `start`."""
    n, stages = len(costs), pp * vpp
    can_start = list(can_start or [True] * n)
    best: Optional[Tuple[float, List[int], int]] = None
    for group in schedule_groups(pp, microbatches):
        def step(sizes: Sequence[int], group: int = group) -> float:
            return simulated_step(sizes, costs, shares, pp, microbatches, group)

        if math.comb(n - 1, stages - 1) <= exhaustive:
            starts = [i for i in range(1, n) if can_start[i]]
            scored = min(((step(sizes_of(cuts, n)), sizes_of(cuts, n))
                          for cuts in itertools.combinations(starts, stages - 1)), default=None)
            if scored is None:
                continue
            value, sizes = scored
        else:
            sizes, value = local_search(start, step, can_start)
        if best is None or value < best[0] - 1e-9 * best[0]:
            best = (value, list(sizes), group)
    if best is None:
        raise ValueError("no split satisfies the stage-start constraints (model.dsa_indexer_types)")
    return best[1], best[2], best[0]


def even_sizes(n: int, stages: int) -> Optional[List[int]]:
    """megatron's even split of n entries (the embedding, the decoder layers, then the MTP block and the output
    heads, 1 or 2 entries) over `stages` virtual stages: the embedding with the first stage's layers, the rest with
    the last's; None where the layers do not divide evenly."""
    for tail in (2, 1):
        layers = n - 1 - tail
        if layers > 0 and layers % stages == 0:
            k = layers // stages
            return [1 + k] + [k] * (stages - 2) + [k + tail] if stages > 1 else [n]
    return None


def quick_split(costs: Sequence[float], shares: Sequence[float], pp: int, vpp: int, microbatches: int,
                candidates: Sequence[Sequence[int]], groups: int = 4) -> Tuple[List[int], int, float]:
    """(stage sizes, micro-batch group, simulated step): the best of a few candidate splits (each a list of stage
    sizes) under megatron's first `groups` valid micro-batch groups, simulated; what the layout planner's search
    affords per layout (a full `best_split` local search takes seconds at PP 16 x VPP 3)."""
    options = schedule_groups(pp, microbatches)[:groups] if vpp > 1 else [pp]
    best: Optional[Tuple[float, List[int], int]] = None
    for sizes in candidates:
        if len(sizes) != pp * vpp or min(sizes) < 1:
            continue
        for group in options:
            value = simulated_step(sizes, costs, shares, pp, microbatches, group)
            if best is None or value < best[0] - 1e-9 * best[0]:
                best = (value, list(sizes), group)
    if best is None:
        raise ValueError("no candidate split of the right number of stages")
    return best[1], best[2], best[0]
