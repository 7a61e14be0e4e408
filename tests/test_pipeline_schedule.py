"""`pretrain.layout.pipeline_schedule`: the simulated step against the closed forms where they are exact (equal
stages), a hand-worked unequal case, and the split tool's choice. The order it simulates is checked against
megatron's own schedule in tests/test_pipeline_layout.py::test_simulated_schedule_order_is_megatrons."""

from __future__ import annotations

import pytest

from pretrain.layout.pipeline_schedule import rank_order, simulate
from pretrain.layout.pipeline_schedule import schedule_groups
from pretrain.tools.pipeline_split import simulated_split


@pytest.mark.parametrize("pp, vpp, m", [(2, 1, 8), (4, 1, 8), (2, 2, 8), (4, 2, 8), (2, 2, 4), (4, 3, 12)])
def test_equal_stages_give_the_textbook_bubble(pp, vpp, m):
    # equal stages: every rank busy m v (f + b), plus (p - 1) (f + b) of fill and drain (Narayanan et al. 2021)
    f, b = 1.0, 2.0
    r = simulate([f] * (pp * vpp), [b] * (pp * vpp), pp, m)
    assert r.step == pytest.approx((m * vpp + pp - 1) * (f + b))
    assert r.busy == pytest.approx([m * vpp * (f + b)] * pp)


def test_unequal_stages_by_hand():
    # PP 2 without virtual stages, 2 micro-batches; stage 0: F 1 B 2, stage 1: F 3 B 4.
    # rank 0: F0(0-1) F1(1-2) B0 waits for rank 1's B0; rank 1: F0(1-4) B0(4-8) F1(8-11) B1(11-15);
    # rank 0: B0(8-10) B1(15-17): step 17
    r = simulate([1.0, 3.0], [2.0, 4.0], 2, 2)
    assert r.step == pytest.approx(17.0)
    assert r.idle == pytest.approx((17.0 - 6.0, 17.0 - 14.0))
    assert rank_order(0, 2, 1, 2) == [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("B", 0, 1)]
    assert rank_order(1, 2, 1, 2) == [("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1)]


def test_groups_follow_megatrons_rules():
    assert schedule_groups(2, 8) == [2, 4, 6, 8]  # 8 % 6 = 2 >= PP: allowed
    assert schedule_groups(4, 12) == [4, 8, 12]
    with pytest.raises(ValueError, match="micro-batch group"):
        rank_order(0, 2, 2, 8, group=7)  # a last group of 1 < PP


def test_split_prefers_the_schedule_that_runs_shorter():
    # four entries, the last one heavy (a loss stage): the simulated choice is never worse than the closed form's
    costs, shares = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0], [1 / 3] * 6 + [0.97]
    sizes, group, step = simulated_split(costs, shares, 2, 2, 8)
    assert sum(sizes) == len(costs) and len(sizes) == 4 and group in schedule_groups(2, 8)
    from pretrain.tools.pipeline_split import interleaved_split, simulated_step

    closed = interleaved_split(costs, 2, 2, 8)
    assert step <= simulated_step(closed, costs, shares, 2, 8, 2) + 1e-12


def test_pipeline_bubble_benchmark_simulates_its_measured_stages():
    # benchmarks/pipeline_bubble.py's "simulated bubble": the hand-worked case above from per-rank medians
    # (seconds per step = per micro-batch x 2 micro-batches): the busiest rank (14 s) idles 3 s
    from benchmarks.pipeline_bubble import simulated_bubble

    ranks = [{"pp": 2, "vpp": 1, "microbatches": 2, "pp_rank": 0,
              "median": {"forward_chunk0_s": 2.0, "backward_chunk0_s": 4.0}},
             {"pp": 2, "vpp": 1, "microbatches": 2, "pp_rank": 1,
              "median": {"forward_chunk0_s": 6.0, "backward_chunk0_s": 8.0}}]
    assert simulated_bubble(ranks) == pytest.approx(3.0)


def test_the_744b_plans_pipelines_idle_at_most_a_tenth_of_their_busiest_rank():
    """benchmarks/results/pipeline_plan_schedule_744b.md (docs/layout.md): the plan re-laid by the planner with the
    simulated schedule (2026-11-29) runs every pipelined stage within 10% of its busiest rank in megatron's order,
    simulated with pipeline_split's entry costs (an estimate independent of the planner's stage model); the layouts
    before it reached 1.24-1.47x an ideal pipeline (tests/test_schedule_term.py keeps one of them refused)."""
    from benchmarks.pipeline_plan_schedule import stage_rows

    rows = {r["stage"]: r for r in stage_rows("configs/curriculum/glm5-744b.yaml", 1792, "h100", vpps=())}
    assert set(rows) == {"pretrain-ramp", "pretrain-4k", "mid-32k", "mid-128k"}
    for name, r in rows.items():
        assert r["simulated"] / r["busiest"] <= 1.10, (name, r["simulated"], r["busiest"])
    assert rows["pretrain-4k"]["simulated"] == pytest.approx(1.228, abs=0.002)


def _reference_simulate(forward, backward, pp, m, transfer=0.0, group=None):
    """`simulate` as first written: each op's end kept by ("F" / "B", stage, micro-batch), every rank in turn."""
    stages = len(forward)
    orders = [rank_order(r, pp, stages // pp, m, group) for r in range(pp)]
    done, free, busy, nxt = {}, [0.0] * pp, [0.0] * pp, [0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        for r in range(pp):
            while nxt[r] < len(orders[r]):
                kind, s, j = orders[r][nxt[r]]
                if kind == "F":
                    need, cost = (("F", s - 1, j) if s > 0 else None), forward[s]
                else:
                    need, cost = (("B", s + 1, j) if s < stages - 1 else ("F", s, j)), backward[s]
                if need is not None and need not in done:
                    break
                ready = 0.0 if need is None else done[need] + (transfer if need[1] != s else 0.0)
                free[r] = done[(kind, s, j)] = max(free[r], ready) + cost
                busy[r] += cost
                nxt[r] += 1
                remaining -= 1
    return max(free), tuple(busy)


@pytest.mark.parametrize("pp, vpp, m", [(2, 1, 8), (4, 1, 6), (2, 2, 8), (4, 2, 12), (4, 3, 16), (3, 2, 7), (8, 2, 24)])
def test_the_simulation_is_the_reference_one_to_the_bit(pp, vpp, m):
    """`simulate` numbers the ops instead of keying them by tuple: the same makespan and busy times, exactly, for
    unequal random stages, a transfer time and every micro-batch group."""
    import random

    rng = random.Random(pp * 100 + vpp * 10 + m)
    forward = [rng.uniform(0.5, 2.0) for _ in range(pp * vpp)]
    backward = [2 * f * rng.uniform(0.8, 1.2) for f in forward]
    for group in schedule_groups(pp, m) if vpp > 1 else [None]:
        for transfer in (0.0, 0.013):
            sim = simulate(forward, backward, pp, m, transfer=transfer, group=group)
            assert (sim.step, sim.busy) == _reference_simulate(forward, backward, pp, m, transfer, group)
