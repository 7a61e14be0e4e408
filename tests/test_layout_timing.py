"""The layout planner's time model (pretrain/layout/timing.py) against every committed measured layout, and its
parts against independent references: the trainer's own FLOP count for MFU, the profiled step it is calibrated
on, 1F1B's bubble formula, the rows the EP=2 benchmark counted, and the calibration tables' sources."""

import dataclasses
import json
import math
import os

import pytest

from pretrain.layout.calibration import load_calibration
from pretrain.layout.calibration.checks import load_checks, predict_all
from pretrain.layout.timing import offrank_rows, step_time
from pretrain.layout.types import CLUSTERS, Layout, ModelDims, Workload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREDICTIONS = os.path.join(ROOT, "benchmarks", "results", "layout_predictions.json")


@pytest.fixture(scope="module")
def rows():
    return predict_all()


@pytest.fixture(scope="module")
def committed():
    with open(PREDICTIONS) as f:
        return {r["id"]: r for r in json.load(f)["rows"]}


@pytest.fixture(scope="module")
def proxy():
    from pretrain.config import load_config

    cfg = load_config(os.path.join(ROOT, "configs/models/glm5-proxy.yaml"), [])
    return cfg, ModelDims.from_config(cfg)


def test_every_measured_layout_within_its_committed_bound(rows, committed):
    assert {r["id"] for r in rows} == set(committed), "checks.json and layout_predictions.json list different cases"
    for r in rows:
        c = committed[r["id"]]
        assert abs(r["error"]) <= c["bound"] + 1e-9, (r["id"], r["error"], c["bound"])
        assert c["bound"] <= 0.15 or not c["within_target"], r["id"]
        if c.get("memory_bound") is not None and r.get("memory_error") is not None:
            assert abs(r["memory_error"]) <= c["memory_bound"] + 1e-9, (r["id"], r["memory_error"], c["memory_bound"])


def test_predictions_are_the_committed_ones(rows, committed):
    """Any change of the model's answer shows here: regenerate the table (and say why) when it is meant."""
    for r in rows:
        want = committed[r["id"]]["predicted_tokens_per_s_per_gpu"]
        assert r["predicted_tokens_per_s_per_gpu"] == pytest.approx(want, rel=1e-6), r["id"]
        if r.get("predicted_peak_gib") is not None:  # the memory model's answer too
            assert r["predicted_peak_gib"] == pytest.approx(committed[r["id"]]["predicted_peak_gib"], rel=1e-6), r["id"]


def test_checks_meet_the_target_where_the_table_says_so(committed):
    checks = [r for r in committed.values() if r["role"] == "check"]
    within = [r for r in checks if r["within_target"]]
    assert len(within) >= 45, f"{len(within)} of {len(checks)} checks within 15%"
    misses = ("11-21", "h100 dense", "h100 dsa", "mbs1")  # checks.MISSES
    current = [r for r in checks if not any(k in r["id"] for k in misses)]
    assert all(r["within_target"] for r in current), [r["id"] for r in current if not r["within_target"]]


def test_mfu_is_the_trainers(proxy):
    """MFU from the trainer's configured_flops_per_step on the real config, not the planner's adapter."""
    from pretrain.training.flops import configured_flops_per_step, peak_flops

    cfg, dims = proxy
    lay = Layout(ep=2, dp=2, micro_batch_size=4, num_microbatches=8, zero="ddp", output_loss_backend="liger")
    work = Workload(4096, 64)
    st = step_time(dims, lay, work, CLUSTERS["h200-nvl-ib400"].with_gpus(2), load_calibration("h200"))
    flops = configured_flops_per_step(cfg.model, 4096, work.tokens_per_step)
    assert st.mfu == pytest.approx(flops / st.total / 2 / peak_flops("NVIDIA H200"), rel=1e-9)
    assert st.tokens_per_s_per_gpu == pytest.approx(work.tokens_per_step / st.total / 2, rel=1e-9)
    assert sum(st.components().values()) == pytest.approx(st.total, rel=1e-9)


def test_one_gpu_compute_is_the_profiled_step(proxy):
    """The calibration point: the model's GPU time per micro-batch against the profile's device-busy time (the
    profile's own sum, read from the committed result, not from the calibration table)."""
    _, dims = proxy
    with open(os.path.join(ROOT, "benchmarks/results/train_throughput_h200/muon_seq4096_mbs4_breakdown.json")) as f:
        prof = json.load(f)
    opt_ms = sum(sum(prof["parts"][k].get(x, 0.0) for x in ("fwd", "bwd")) for k in ("muon", "adamw", "optimizer"))
    busy_per_mb = (prof["busy_ms"] - opt_ms) * 1e-3 / 8
    lay = Layout(micro_batch_size=4, num_microbatches=8, zero="ddp", output_loss_backend="liger")
    st = step_time(dims, lay, Workload(4096, 32), CLUSTERS["h200-nvl-ib400"].with_gpus(1), load_calibration("h200"))
    model_gpu = (st.compute_fwd + st.compute_bwd) / 8
    assert model_gpu == pytest.approx(busy_per_mb, rel=0.03)


def test_pipeline_bubble_is_1f1b(proxy):
    """Balanced stages (all-MoE layers, no MTP, a tiny vocabulary): bubble / pipelined time = (pp - 1) / (vpp m)."""
    _, dims = proxy
    flat = dataclasses.replace(dims, mtp_depths=0, mtp_layers=0, num_layers=12, moe_pattern=(1,) * 12,
                               dsa_layers=(False,) * 12, vocab=8)
    cal = load_calibration("h200")
    cl = CLUSTERS["h200-nvl-ib400"].with_gpus(4)
    for vpp, m in ((1, 8), (3, 8), (1, 32)):
        lay = Layout(pp=4, vpp=vpp, micro_batch_size=4, num_microbatches=m, zero="ddp")
        st = step_time(flat, lay, Workload(4096, 4 * m), cl, cal, schedule="textbook")
        pipelined = st.total - st.pp_bubble - st.optimizer - st.dp_comm_exposed - cal["step.fixed_s"]
        # plus the stage-boundary sends: one activation of 4 x 4096 x 2048 bf16 each way per model chunk
        # and the fitted wait per transfer beyond it (calibration p2p.overhead_s_per_transfer)
        p2p = 2 * vpp * m * (4 * 4096 * 2048 * 2 / (cl.intra_node_bw * cal["collective.busbw_fraction_intra"])
                             + cal["collective.latency_s"] + cal["p2p.overhead_s_per_transfer"])
        assert (st.pp_bubble - p2p) / pipelined == pytest.approx(3 / (vpp * m), rel=0.05), (vpp, m)
        # megatron's schedule simulated (the default): the first and last stages carry the embedding and the head,
        # so the critical rank is a little above the mean and the others' fill and drain a little below it
        # (measured 0.90-0.94 of the textbook here)
        sim = step_time(flat, lay, Workload(4096, 4 * m), cl, cal)
        assert (sim.pp_bubble - p2p) / pipelined == pytest.approx(3 / (vpp * m), rel=0.12), (vpp, m)
        assert sim.bubble_fraction == pytest.approx(3 / (vpp * m), rel=0.12), (vpp, m)


def test_dedup_rows_match_the_ep2_benchmark(proxy):
    """Rows sent per rank at EP=2, 16,384 tokens: the formula against what ep_dispatch_layer.py counted."""
    _, dims = proxy
    with open(os.path.join(ROOT, "benchmarks/results/ep_dispatch_h200/ep_dispatch_layer.json")) as f:
        res = {(r["dispatcher"], r["forced_balance"]): r["rows_dispatched_rank0"] for r in json.load(f)["results"]}
    # the benchmark counts rows to every rank (its own too): twice the off-rank rows at EP=2
    assert 2 * offrank_rows(16384, dims, 2, "alltoall") == res[("alltoall", False)]
    assert 2 * offrank_rows(16384, dims, 2, "alltoall_dedup") == pytest.approx(res[("alltoall_dedup", True)], rel=0.01)


def test_calibration_entries_name_their_sources():
    for gpu in ("h100", "h200"):
        cal = load_calibration(gpu)
        for name, e in cal.entries.items():
            assert e["kind"] in ("measured", "derived", "assumption"), (gpu, name)
            if e["kind"] == "assumption":
                continue
            files = [e["source"]["file"]] if e["source"].get("file") else [
                p["source"]["file"] for p in e["value"] if isinstance(p, dict) and "source" in p]
            assert files, (gpu, name)
            for f in files:
                path = f.split(" (")[0]
                assert path.startswith("issue") or os.path.exists(os.path.join(ROOT, path)), (gpu, name, path)
    with pytest.raises(ValueError, match="'a100'"):
        load_calibration("a100")


def test_every_case_names_a_source_and_a_role():
    for c in load_checks():
        assert c["role"] in ("check", "calibration") and c["source"]["date"] and c["source"]["command"], c["id"]
        assert math.isfinite(c["measured"]["tokens_per_s_per_gpu"]), c["id"]


def test_groups_spanning_nodes_use_the_network(proxy):
    """EP=4 with 2 GPUs per node crosses nodes (megatron's rank order puts the EP group on consecutive ranks): its
    all-to-all time scales by the intra-node all-to-all bandwidth over the inter-node one; DP=2 x TP=4 on 4-GPU
    nodes keeps TP inside a node and puts the DP reduce on the network."""
    _, dims = proxy
    cal = load_calibration("h200")
    lay = Layout(ep=4, dp=4, micro_batch_size=4, num_microbatches=8, zero="ddp")
    work = Workload(4096, 128)
    base = CLUSTERS["h200-nvl-ib400"].with_gpus(4)
    inside = step_time(dims, lay, work, base, cal)
    across = step_time(dims, lay, work, dataclasses.replace(base, gpus_per_node=2), cal)
    ratio = cal["a2a.intra_node_bytes_per_s"] / (base.inter_node_bw * cal["a2a.inter_node_fraction"])
    assert across.ep_a2a / inside.ep_a2a == pytest.approx(ratio, rel=0.01)
    lay = Layout(tp=4, dp=2, sequence_parallel=True, micro_batch_size=4, num_microbatches=8, zero="zero2")
    one_node = step_time(dims, lay, Workload(4096, 64), base.with_gpus(8), cal)
    two_nodes = step_time(dims, lay, Workload(4096, 64), dataclasses.replace(base.with_gpus(8), gpus_per_node=4), cal)
    assert two_nodes.tp_comm == pytest.approx(one_node.tp_comm, rel=1e-9)
    assert two_nodes.dp_comm_exposed > one_node.dp_comm_exposed


def test_expert_tensor_parallelism_gathers_the_received_rows(proxy):
    """ETP > 1: megatron's alltoall dispatcher all-gathers the rows a rank received over the expert-TP group and
    reduce-scatters the experts' output (forward and backward): 4 ring collectives per MoE layer of etp x the
    topk x tokens-per-rank rows, inside a node. Counted by hand at EP=1, where no all-to-all runs."""
    _, dims = proxy
    cal = load_calibration("h200")
    cl = CLUSTERS["h200-nvl-ib400"].with_gpus(4)
    work = Workload(4096, 16)
    m, mbs, tp, etp = 4, 2, 4, 4
    base = Layout(tp=tp, sequence_parallel=True, micro_batch_size=mbs, num_microbatches=m, zero="ddp")
    none = step_time(dims, base, work, cl, cal)
    gathered = step_time(dims, dataclasses.replace(base, etp=etp), work, cl, cal)
    assert none.ep_a2a == 0
    moe_slots = sum(dims.moe_pattern) + (dims.mtp_depths if dims.mtp_layer_is_moe else 0)
    rows = etp * mbs * 4096 / tp * dims.topk
    bw = cl.intra_node_bw * cal["collective.busbw_fraction_intra"]
    one = rows * dims.hidden * 2 * (etp - 1) / etp / bw + cal["collective.latency_s"]
    assert gathered.ep_a2a == pytest.approx(m * moe_slots * 4 * one, rel=1e-9)


@pytest.mark.parametrize("config", ["configs/models/glm5-tiny.yaml", "configs/models/glm5-proxy.yaml"])
def test_newton_schulz_flops_are_the_optimizers(config):
    """The planner's Newton-Schulz count against the blocks one Muon step orthogonalizes: the meta-device model's
    matrices cut by the optimizer's own Muon Split (benchmarks/layout_calibration.py: muon_batches)."""
    import sys

    sys.path.insert(0, ROOT)
    from benchmarks.layout_calibration import muon_batches
    from pretrain.config import load_config
    from pretrain.layout.timing import newton_schulz_flops

    cfg = load_config(os.path.join(ROOT, config), ["optimizer.optimizer=muon"])
    counted = sum(5 * (4 * m * m * n + 2 * m ** 3) * blocks for blocks, m, n in muon_batches(cfg))
    assert newton_schulz_flops(ModelDims.from_config(cfg)) == pytest.approx(counted, rel=1e-9)
