"""The memory-snapshot replay finds the peak and what is alive there, against a naive recount."""

from __future__ import annotations

import random

import pytest

from pretrain.training.memory_snapshot import BEFORE_WINDOW, allocation_site, format_report, peak_breakdown


def _frames(site: str):
    return [{"filename": "??", "line": 0, "name": "c10::alloc"},
            {"filename": f"/home/user/glm5/pretrain/model/{site}.py", "line": 7, "name": site}]


def _naive(trace, baseline):
    """Recount the live set after every event, keep the largest total (quadratic, obviously right)."""
    best, best_live, best_old = baseline, {}, baseline
    for n in range(1, len(trace) + 1):
        live, freed_old = {}, 0
        for e in trace[:n]:
            if e["action"] == "alloc":
                live[e["addr"]] = e
            elif e["action"] == "free_completed":
                if e["addr"] in live:
                    del live[e["addr"]]
                else:
                    freed_old += e["size"]
        total = baseline - freed_old + sum(e["size"] for e in live.values())
        if total > best:
            best, best_live, best_old = total, dict(live), baseline - freed_old
    sites = {BEFORE_WINDOW: best_old} if best_old else {}
    for e in best_live.values():
        key = allocation_site(e["frames"])
        sites[key] = sites.get(key, 0) + e["size"]
    return best, sites


@pytest.mark.parametrize("seed", range(5))
def test_peak_and_live_sites_match_a_naive_recount(seed):
    rng = random.Random(seed)
    trace, live, addr = [], [], 1000
    old = [(1, 300), (2, 500)]  # blocks from before the window (the baseline)
    for _ in range(200):
        if live and rng.random() < 0.45:
            a, size = live.pop(rng.randrange(len(live)))
            trace.append({"action": "free_requested", "addr": a, "size": size})
            trace.append({"action": "free_completed", "addr": a, "size": size})
        elif old and rng.random() < 0.05:
            a, size = old.pop()
            trace.append({"action": "free_completed", "addr": a, "size": size})
        else:
            addr += 1
            size = rng.randrange(1, 1000)
            live.append((addr, size))
            trace.append({"action": "alloc", "addr": addr, "size": size,
                          "frames": _frames(rng.choice(["attention", "moe", "indexer"]))})
    got = peak_breakdown(trace, baseline_bytes=800)
    assert got == _naive(trace, 800)
    assert sum(got[1].values()) == got[0]  # the sites account for the whole peak
    assert "GiB" in format_report(got[0], got[1], 800)


def test_site_is_the_innermost_project_frame():
    frames = [{"filename": "??", "line": 0, "name": "malloc"},
              {"filename": "/usr/lib/python3/site-packages/torch/nn/functional.py", "line": 3, "name": "linear"},
              {"filename": "/usr/lib/python3/site-packages/megatron/core/transformer/mlp.py", "line": 9, "name": "forward"},
              {"filename": "/src/pretrain/model/glm5_model.py", "line": 1, "name": "forward"}]
    assert allocation_site(frames) == "megatron/core/transformer/mlp.py:9 forward"
