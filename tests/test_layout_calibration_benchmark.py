"""benchmarks/layout_calibration.py on CPU: its whole single-process path at tiny sizes writes the table format the
layout time model reads, and its Newton-Schulz rate is glm5-tiny's Muon matrix mix (counted here by hand from the
config's dims) weighted by FLOPs, not one block size's rate."""

import json
import math
import os

import pytest

from pretrain.layout.calibration import Calibration
from pretrain.layout.timing import step_time
from pretrain.layout.types import CLUSTERS, Layout, ModelDims, Workload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# glm5-tiny's Muon blocks (m <= n): count, counted by hand from configs/models/glm5-tiny.yaml (hidden 64, 4 heads,
# q_lora 32, kv_lora 16, qk 24 + rope 8, v 32, dense ffn 128, 8 experts of 32 and a shared expert of 32, DSA indexer
# 4 heads x 16; layer 0 dense, layer 1 MoE, one MTP layer (MoE) with its eh_proj [64, 128]). Three attentions, each:
# q_down [32, 64]; q_up per head [24 + 8, 32] x 4; kv_down [16 + 8, 64]; kv_up per head W_UK [24, 16] and
# W_UV [32, 16] x 4; linear_proj whole [64, 4 x 32]; indexer wq_b [4 x 16, 32], wk [16, 64], weights_proj [4, 64].
# Dense MLP: fc1 [2 x 128, 64] whole (muon_split_glu off), fc2 [64, 128]. Two MoE blocks, each: 8 experts' fc1
# [64, 2 x 32] and fc2 [32, 64], shared fc1 [64, 64], fc2 [64, 32]. Embedding, output layer, routers: AdamW.
TINY_MUON_BLOCKS = {
    (32, 64): 3 + 3 + 2 * 8 + 2,   # q_down, indexer wq_b, expert fc2, shared fc2
    (32, 32): 3 * 4,               # q_up heads
    (24, 64): 3,                   # kv_down
    (16, 24): 3 * 4,               # W_UK heads
    (16, 32): 3 * 4,               # W_UV heads
    (64, 128): 3 + 1 + 1,          # linear_proj, dense fc2, eh_proj
    (16, 64): 3,                   # indexer wk
    (4, 64): 3,                    # indexer weights_proj
    (64, 256): 1,                  # dense fc1
    (64, 64): 2 * 8 + 2,           # expert fc1, shared fc1
}
NS_STEPS = 5  # glm5-tiny's optimizer.muon_num_ns_steps


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    from benchmarks.layout_calibration import main

    out = tmp_path_factory.mktemp("calib") / "calib.json"
    main(["--device", "cpu", "--smoke", "--gpu-kind", "h200", "--out", str(out)])
    with open(out) as f:
        return str(out), json.load(f)


def test_calibration_benchmark_smoke_on_cpu(smoke):
    """The table it writes is the format the time model reads (and a step time comes out of it)."""
    out, table = smoke
    measured = {k for k, v in table["entries"].items() if v["kind"] == "measured" and v["source"]["file"] == out}
    want = {"attention.dense", "output_loss", "muon.newton_schulz_flops_per_s", "muon.newton_schulz_points",
            "kernel.rate.routed_experts"}
    assert want <= measured
    assert all(p["flops_per_s"] > 0 for p in table["entries"]["attention.dense"]["value"])
    from pretrain.config import load_config

    dims = ModelDims.from_config(load_config(os.path.join(ROOT, "configs/models/glm5-proxy.yaml"), []))
    st = step_time(dims, Layout(micro_batch_size=4, num_microbatches=8, zero="ddp"), Workload(4096, 32),
                   CLUSTERS["h200-nvl-ib400"].with_gpus(1), Calibration(table))
    assert st.total > 0 and math.isfinite(st.tokens_per_s_per_gpu)


def test_newton_schulz_rate_is_the_models_mix_weighted_by_flops(smoke):
    """Every Muon block shape of glm5-tiny with its hand-counted blocks; the rate the model reads is all FLOPs over
    all time of those points (5 x (4 m^2 n + 2 m^3) per block, counted here), the per-step FLOPs their sum."""
    _, table = smoke
    e = table["entries"]
    pts = e["muon.newton_schulz_points"]["value"]
    assert {(p["m"], p["n"]): p["blocks"] for p in pts} == TINY_MUON_BLOCKS
    hand = {(m, n): k * NS_STEPS * (4 * m * m * n + 2 * m ** 3) for (m, n), k in TINY_MUON_BLOCKS.items()}
    for p in pts:
        assert p["flops"] == pytest.approx(hand[(p["m"], p["n"])], rel=1e-12)
        assert sum(p["batches"]) == p["blocks"] and p["seconds"] > 0
    seconds = sum(p["seconds"] for p in pts)
    assert e["muon.newton_schulz_flops_per_s"]["value"] == pytest.approx(sum(hand.values()) / seconds, rel=1e-9)
    assert e["muon.newton_schulz_flops_per_step"]["value"] == pytest.approx(sum(hand.values()), rel=1e-12)


def test_group_sizes_and_launch_errors(monkeypatch, tmp_path):
    """Collectives run at 2, 4, ... up to the torchrun world (and the world itself); a launch that mixes the
    single-process part with torchrun, or --collectives-only without it, stops with one line before any work."""
    from benchmarks.layout_calibration import group_sizes, main

    assert [group_sizes(w) for w in (2, 3, 4, 6, 8)] == [[2], [2, 3], [2, 4], [2, 4, 6], [2, 4, 8]]
    out = str(tmp_path / "x.json")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit, match="--collectives-only"):
        main(["--device", "cpu", "--smoke", "--out", out])
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit, match="torchrun"):
        main(["--device", "cpu", "--smoke", "--collectives-only", "--out", out])
    assert not os.path.exists(out)
