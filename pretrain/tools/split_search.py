"""The closed-form pipeline split that `pretrain.tools.pipeline_split` builds layouts from (docs/parallelism.md,
pipeline section): the split of a model's entries into consecutive stages whose largest stage is smallest
(`balanced_split`) and, with virtual stages, the split of least estimated step (`interleaved_split`, by `step_time`).

The layout planner's search asks for a few hundred of these splits per search (docs/layout.md), so what they
repeat is done once: a minimax split is remembered by (costs, stages, starts), the local search sums each stage's
entries once, and where every split is tried with two virtual stages per rank, numpy scores them all at once. Each
takes the same sums in the same order as `step_time`, so each gives the same split to the bit.
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from pretrain.layout.pipeline_schedule import local_search, sizes_of

__all__ = ["EXHAUSTIVE_SPLITS", "balanced_split", "interleaved_split", "step_time"]

EXHAUSTIVE_SPLITS = 200_000  # up to this many ways to cut, every split is estimated (a local search from above)


def balanced_split(costs: Sequence[float], stages: int, can_start: Optional[Sequence[bool]] = None) -> List[int]:
    """Sizes of `stages` consecutive non-empty groups of `costs` whose largest sum is smallest.

    `can_start[i]`: whether a group may begin at item i (item 0 always does). Exact: best[k][i] is the
    smallest possible largest sum of the first i items in k groups."""
    return list(_balanced_split(tuple(costs), stages, tuple(can_start) if can_start else None))


@lru_cache(maxsize=1024)
def _balanced_split(costs: Tuple[float, ...], stages: int, can_start: Optional[Tuple[bool, ...]]) -> Tuple[int, ...]:
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} entries into {stages} non-empty stages")
    can_start = can_start or (True,) * n
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        prev, row, cuts = best[k - 1], best[k], cut[k]
        # the k-th group may start at j: the first j items made k - 1 groups and a group may begin there
        starts = [j for j in range(k - 1, n) if prev[j] != inf and (j == 0 or can_start[j])]
        for i in range(k, n + 1):  # the k-th group is items j .. i-1: the first j with the least largest group
            value_i, cut_i, total = inf, 0, prefix[i]
            for j in starts:
                if j >= i:
                    break
                before, group = prev[j], total - prefix[j]
                value = group if group > before else before  # max(before, group)
                if value < value_i:
                    value_i, cut_i = value, j
            row[i], cuts[i] = value_i, cut_i
    if best[stages][n] == inf:
        raise ValueError("no split satisfies the stage-start constraints (model.dsa_indexer_types)")
    sizes, i = [], n
    for k in range(stages, 0, -1):
        sizes.append(i - cut[k][i])
        i = cut[k][i]
    return tuple(sizes[::-1])


def step_time(sizes: Sequence[int], costs: Sequence[float], pp: int, microbatches: int) -> float:
    """Estimated step time of a split, per token of a micro-batch: m x the busiest rank's work (steady state)
    plus (p - 1) x the slowest stage (the warm-up and drain)."""
    stage, start = [], 0
    for size in sizes:
        stage.append(sum(costs[start:start + size]))
        start += size
    ranks = [sum(stage[r::pp]) for r in range(pp)]
    return microbatches * max(ranks) + (pp - 1) * max(stage)


def _step_estimator(costs: Sequence[float], pp: int, microbatches: int) -> Callable[[Sequence[int]], float]:
    """`step_time` of splits of `costs`, each stage's sum (the same `sum` of the same slice) taken once."""
    sums: Dict[Tuple[int, int], float] = {}

    def step(sizes: Sequence[int]) -> float:
        stage, start = [], 0
        for size in sizes:
            s = sums.get((start, size))
            if s is None:
                s = sums[(start, size)] = sum(costs[start:start + size])
            stage.append(s)
            start += size
        ranks = [sum(stage[r::pp]) for r in range(pp)]
        return microbatches * max(ranks) + (pp - 1) * max(stage)

    return step


def _scored_at_once(costs: Sequence[float], pp: int, microbatches: int, starts: Sequence[int], stages: int
                    ) -> Optional[Tuple[int, ...]]:
    """The first of `itertools.combinations(starts, stages - 1)` (the cut points) with the least `step_time`, for
    two virtual stages per rank and float costs: every split's stage sums read from a table of `sum`s of the slices
    and each rank's two stages added, as `step_time` adds them (a sum of two floats is their one rounded addition
    in every Python), so the same values and the same first minimum (`np.argmin`, as `min`)."""
    import numpy as np

    cuts, busiest, slowest = _every_split(tuple(costs), pp, tuple(starts), stages)
    if not cuts:
        return None
    return cuts[int(np.argmin(microbatches * busiest + (pp - 1) * slowest))]


@lru_cache(maxsize=4)  # a search asks for one model's (its costs at one sequence length); ~10 MB each
def _every_split(costs: Tuple[float, ...], pp: int, starts: Tuple[int, ...], stages: int):
    """(the cut points of every split, each split's busiest rank and slowest stage): what `_scored_at_once` needs
    that does not depend on the micro-batches, for the search's several micro-batch counts."""
    import numpy as np

    cuts = list(itertools.combinations(starts, stages - 1))
    n = len(costs)
    table = np.array([[float(sum(costs[a:b])) for b in range(n + 1)] for a in range(n + 1)])
    bounds = np.empty((len(cuts), stages + 1), dtype=np.intp)
    bounds[:, 0], bounds[:, -1] = 0, n
    bounds[:, 1:-1] = np.array(cuts, dtype=np.intp).reshape(len(cuts), stages - 1)
    stage = table[bounds[:, :-1], bounds[:, 1:]]
    return cuts, (stage[:, :pp] + stage[:, pp:]).max(axis=1), stage.max(axis=1)


def interleaved_split(costs: Sequence[float], pp: int, vpp: int, microbatches: int,
                      can_start: Optional[Sequence[bool]] = None, exhaustive: int = EXHAUSTIVE_SPLITS) -> List[int]:
    """Stage sizes for PP x VPP stages minimizing `step_time`: exact (`balanced_split`) for VPP = 1; with
    virtual stages a rank's work is the sum of non-adjacent stages: every split when there are at most
    `exhaustive` (EXHAUSTIVE_SPLITS), else a local search from the minimax split that moves one stage boundary by
    one entry while the estimate improves."""
    if vpp == 1:
        return balanced_split(costs, pp, can_start)
    step = _step_estimator(costs, pp, microbatches)
    if math.comb(len(costs) - 1, pp * vpp - 1) <= exhaustive:  # small models: every split, the best estimate
        starts = [i for i in range(1, len(costs)) if can_start is None or can_start[i]]
        if vpp == 2 and all(type(c) is float for c in costs):
            best_cuts = _scored_at_once(costs, pp, microbatches, starts, pp * vpp)
        else:
            best_cuts = min(itertools.combinations(starts, pp * vpp - 1),
                            key=lambda cuts: step(sizes_of(cuts, len(costs))), default=None)
        if best_cuts is not None:
            return sizes_of(best_cuts, len(costs))
    sizes = balanced_split(costs, pp * vpp, can_start)
    return local_search(sizes, step, can_start)[0]
