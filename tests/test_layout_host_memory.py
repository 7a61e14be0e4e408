"""The layout planner's host memory (pretrain/layout/host_memory.py) against measured runs, and its refusals.

The measurements are the committed ones: a synchronous save's host RSS before and after the first save (glm5-proxy
on one and on two H200, `benchmarks/soak.py`), and the GPU test's two saves of a 48-expert glm5-tiny, with the bytes
they wrote to disk (`tests/test_checkpoint_async.py::test_sync_save_keeps_pinned_staging_unless_told_not_to`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from benchmarks.layout_predictions import STAGING_TEST_MODEL, host_rows, staging_test_result
from pretrain.config import load_config
from pretrain.layout.from_config import layout_of
from pretrain.layout.host_memory import host_estimate, written_bytes
from pretrain.layout.memory import rank_parameters
from pretrain.layout.search import SearchOptions, fitting
from pretrain.layout.types import CLUSTERS, GiB, ModelDims

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PROXY = "configs/models/glm5-proxy.yaml"


def _staging(config: str, overrides, world_size: int, pinned: bool = True) -> float:
    cfg = load_config(config, overrides)
    layout, work = layout_of(cfg, world_size)
    return host_estimate(ModelDims.from_config(cfg), layout, work, 8, saves=True,
                         pinned_staging=pinned).terms["checkpoint_staging"]


def test_checkpoint_staging_is_the_host_memory_a_sync_save_kept():
    """Every committed measurement of the host memory a synchronous save kept (benchmarks/layout_predictions.py's
    HOST_CASES, also its table), within 10%; and the committed table is this model's answer."""
    rows = host_rows()
    assert len(rows) == 3
    for r in rows:
        assert abs(r["error"]) <= 0.10, r
    committed = {r["id"]: r for r in json.loads((RESULTS / "layout_predictions.json").read_text())["host_rows"]}
    assert {r["id"]: pytest.approx(r["predicted_gib"], rel=1e-6) for r in rows} == {
        k: v["predicted_gib"] for k, v in committed.items()}


def test_written_bytes_are_what_a_save_writes():
    """W against the bytes of the `.distcp` files two saves wrote (the rest of a file is its small metadata)."""
    cfg = load_config("configs/models/glm5-tiny.yaml", STAGING_TEST_MODEL)
    layout, _ = layout_of(cfg, 1)
    written = written_bytes(rank_parameters(ModelDims.from_config(cfg), layout, 0), layout)
    assert written == pytest.approx(staging_test_result()["pinned"]["written"] / 2, rel=0.01)


def test_staging_of_the_gpu_tests_model_when_pageable():
    got = staging_test_result()
    pinned = got["pinned"]["after"] - got["pinned"]["before"]
    # pageable: the model's term is the save's own transient (1.0 x W), not kept: the run's RSS came back
    assert got["pageable"]["after"] - got["pageable"]["before"] < 0.05 * pinned
    assert _staging("configs/models/glm5-tiny.yaml", STAGING_TEST_MODEL, 1, pinned=False) == pytest.approx(
        got["pinned"]["written"] / 2, rel=0.01)


def test_the_search_refuses_what_a_node_cannot_host():
    """The same layout fits a node with the preset's 2 TiB of host memory and is refused, with a 'host memory' line
    naming the per-node need, on a node with less than its trainers' own memory."""
    cfg = load_config(PROXY, ["train.global_batch_size=8", "train.micro_batch_size=1"])
    layout, work = layout_of(cfg, 8)
    dims = ModelDims.from_config(cfg)
    cluster = CLUSTERS["h100-nvl-ib400"].with_gpus(8)
    opts = SearchOptions(saves=True)
    cand, reason, _ = fitting(dims, layout, work, cluster, opts)
    assert cand is not None and reason is None, reason
    assert cand.host.terms["checkpoint_staging"] > 0 and cand.host.gpus_per_node == 8
    small = dataclasses.replace(cluster, host_memory_bytes=16 * GiB)  # 8 trainers alone hold 17.6 GiB
    cand, reason, _ = fitting(dims, layout, work, small, opts)
    assert cand is None and reason.startswith("host memory: ") and "GiB per node (8 GPUs x" in reason, reason


def test_a_curriculum_stage_is_refused_for_host_memory(monkeypatch):
    """`check_stage` (curriculum `--validate-only`) says 'host memory' in its one line for a node that cannot hold
    the stage's trainers; it accepts the same stage on the preset."""
    from pretrain.layout import types
    from pretrain.layout.search import check_stage

    cfg = load_config(PROXY, ["train.global_batch_size=8", "train.micro_batch_size=1", "checkpoint.save=ckpt"])
    assert check_stage(cfg, 8, "h100-nvl-ib400") is None
    small = dataclasses.replace(types.CLUSTERS["h100-nvl-ib400"], host_memory_bytes=16 * GiB)
    monkeypatch.setitem(types.CLUSTERS, "h100-nvl-ib400", small)
    line = check_stage(cfg, 8, "h100-nvl-ib400")
    assert line is not None and ": host memory: " in line and "\n" not in line, line
