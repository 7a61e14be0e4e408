"""Derive the layout planner's calibration table (pretrain/layout/calibration/<gpu>.json) from the committed
benchmark results, entry by entry, each with the result file, the command that produced it, its date and the
arithmetic that turned it into the entry.

    python benchmarks/layout_calibration_results.py --gpu h200 --out pretrain/layout/calibration/h200.json
    python benchmarks/layout_calibration_results.py --gpu h100 --out pretrain/layout/calibration/h100.json

Kinds of entry (the "kind" field):
  measured    read from a result file (a kernel or op timed alone, or a part of a profiled step);
  derived     arithmetic on measured numbers (the formula is in "derivation");
  assumption  not measured on this GPU kind; a named, stated guess the planner falls back to.
`benchmarks/layout_calibration.py` re-measures what it can on a CUDA machine and writes the same format.

Rates are achieved MODEL FLOP/s in pretrain.training.flops' counting (forward + backward = 3x forward GEMMs,
causal attention as S / 2 keys per query), so time = FLOPs from that counter / rate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # run as a script from the repository root

from benchmarks.layout_calibration_sources import (  # noqa: E402  (after the path line above)
    BREAKDOWN, CP, DOC, DSA, DSA16, DSA128_H100, DSA128_STEP, EP, HEADS, LC16, MBS, MUON, NONE, OUT_H100, OUT_H200,
    PROXY_PARAMS, TT_H100, TT_H200, dsa_entries, entry, indexer_forward_share, load,
)


def _breakdown_entries() -> Dict[str, Dict]:
    """Per op class rates and per-token overheads from the profiled 4K step (H200, glm5-proxy, 8 x (4 x 4096))."""
    p = load(BREAKDOWN["file"])["parts"]
    ms = {k: (v.get("fwd", 0.0) + v.get("bwd", 0.0)) * 1e-3 for k, v in p.items()}
    fwd_share = {k: v.get("fwd", 0.0) / max(v.get("fwd", 0.0) + v.get("bwd", 0.0), 1e-12) for k, v in p.items()}
    tokens, layers, moe_slots, embeds = 131072, 15, 14, 4  # 12 layers + 3 MTP depths; 11 + 3 MoE; main + 3 MTP
    # flops.py components of this step (python -m pretrain.training.flops --config configs/models/glm5-proxy.yaml)
    f = {"attention_proj": 211.82778703872e12, "attention_core": 197.91209299968e12, "dense_mlp": 27.212912787456e12,
         "routed_experts": 277.076930199552e12, "shared_expert": 34.634616274944e12,
         "output_head": 211.106232532992e12, "mtp_eh_proj": 19.791209299968e12}
    kv_up_gemm_s = p["core_attn"]["gemm"] * 1e-3  # MLA's key/value up-projection runs inside the core-attention row
    e = {}
    src = BREAKDOWN
    def rate(name, flops, sec, what):
        return entry(flops / sec, "FLOP/s", "derived", src,
                      f"{what}: flops.py {name} {flops / 1e12:.2f} TFLOP / {sec * 1e3:.1f} ms")
    e["rate.attention_proj"] = rate("attention_proj", f["attention_proj"], ms["mla_proj"] + kv_up_gemm_s,
                                    "MLA projections row + the kv up-projection GEMMs of the core-attention row")
    e["rate.dense_mlp"] = rate("dense_mlp", f["dense_mlp"], ms["dense_mlp"], "dense MLP row")
    e["rate.shared_expert"] = rate("shared_expert", f["shared_expert"], ms["shared_expert"], "shared expert row")
    e["rate.routed_experts"] = rate("routed_experts", f["routed_experts"], ms["experts"],
                                    "expert GEMMs row (grouped GEMM, 2,731 rows per expert)")
    e["rate.mtp_eh_proj"] = rate("mtp_eh_proj", f["mtp_eh_proj"], ms["mtp"], "MTP eh_proj + glue row")
    e["routed_experts.rows_per_expert"] = entry(16384 * 8 / 48, "rows", "derived", src,
                                                 "4 x 4096 tokens x top-8 / 48 experts: where rate.routed_experts ran")
    e["overhead.glue_s_per_token_layer_hidden"] = entry(
        ms["glue"] / (tokens * layers * 2048), "s", "derived", src,
        f"norms/RoPE/residual row {ms['glue'] * 1e3:.1f} ms / (131,072 tokens x 15 layers x hidden 2048)")
    e["overhead.router_s_per_token_layer_expert"] = entry(
        ms["router"] / (tokens * moe_slots * 48), "s", "derived", src,
        f"router row {ms['router'] * 1e3:.1f} ms / (131,072 tokens x 14 MoE layers x 48 experts)")
    e["overhead.dispatch_s_per_row_hidden"] = entry(
        ms["dispatch"] / (tokens * moe_slots * 8 * 2048), "s", "derived", src,
        f"permute/unpermute row {ms['dispatch'] * 1e3:.1f} ms / (131,072 x 14 MoE layers x top-8 x hidden 2048)")
    e["overhead.embedding_s_per_token_hidden"] = entry(
        ms["embedding"] / (tokens * embeds * 2048), "s", "derived", src,
        f"embedding row {ms['embedding'] * 1e3:.1f} ms / (131,072 x 4 look-ups x hidden 2048)")
    e["overhead.grad_accum_s_per_param_microbatch"] = entry(
        ms["grad_reduce"] / (8 * PROXY_PARAMS), "s", "derived", src,
        f"gradient zero/accumulate row {ms['grad_reduce'] * 1e3:.1f} ms / (8 micro-batches x 2.29e9 parameters)")
    # the output row (main + 3 MTP heads) at this shape: one point of the output-loss table
    e["rate.output_head_in_step"] = rate("output_head", f["output_head"], ms["output"], "output layer + Liger loss row")
    # the core attention row minus the kv up-projection: dense attention at 4K, 16 heads, with its concatenations
    e["attention.s4096_in_step"] = entry(f["attention_core"] / (ms["core_attn"] - kv_up_gemm_s), "FLOP/s", "derived",
                                          src,
                                          "core-attention row minus its kv up-projection GEMMs (cuDNN SDPA + "
                                          "concatenations), 16 heads, S 4096")
    e["recompute.forward_share"] = entry(
        {"attention_proj": fwd_share["mla_proj"], "attention_core": fwd_share["core_attn"],
         "routed_experts": fwd_share["experts"], "shared_expert": fwd_share["shared_expert"],
         "dense_mlp": fwd_share["dense_mlp"], "router": fwd_share["router"], "dispatch": fwd_share["dispatch"],
         "glue": fwd_share["glue"], "dsa_indexer": indexer_forward_share()}, "fraction", "derived", src,
        "forward ms / (forward + backward ms) per row: what recomputing that part's forward costs (dsa_indexer: "
        "index scores + top-k over those + the sparse KL, from " + DSA128_STEP["file"] + ")")
    busy = load(BREAKDOWN["file"])
    opt_ms = ms["muon"] + ms["adamw"] + ms["optimizer"]
    e["profile.gpu_busy_per_microbatch_s"] = entry((busy["busy_ms"] * 1e-3 - opt_ms) / 8, "s", "derived", src,
                                                    "(device-busy ms - optimizer rows) / 8 micro-batches of 4 x 4096")
    return e


def _host_entries(fixed: float = 0.0) -> Dict[str, Dict]:
    """Host time per micro-batch: micro-batch 1 is bound by launching kernels, 4 by the GPU (same step, same day).
    `fixed`: step.fixed_s, the per-step time outside micro-batches and optimizer."""
    pts = {(p["optimizer"], p["micro_batch_size"]): p for p in load(MBS["file"])["points"]}
    b = _breakdown_entries()["profile.gpu_busy_per_microbatch_s"]["value"]
    m4, m1 = pts[("Muon", 4)], pts[("Muon", 1)]
    t4 = ((m4["step_ms"] - m4["optimizer_ms"]) * 1e-3 - fixed) / 8
    t1 = ((m1["step_ms"] - m1["optimizer_ms"]) * 1e-3 - fixed) / 32
    sync = max(t4 - b, 0.0)
    return {
        "host.sync_s_per_layer_microbatch": entry(
            sync / 15, "s", "derived", MBS,
            f"micro-batch 4: (step - optimizer) / 8 = {t4 * 1e3:.1f} ms against {b * 1e3:.1f} ms of GPU work "
            f"(profile) -> {sync * 1e3:.1f} ms of gaps per micro-batch / 15 layers"),
        "host.launch_s_per_layer_microbatch": entry(
            (t1 - sync) / 15, "s", "derived", MBS,
            f"micro-batch 1: (step - optimizer) / 32 = {t1 * 1e3:.1f} ms per micro-batch, above its GPU work "
            f"(~{b / 4 * 1e3:.1f} ms), so the host's kernel launches bound it: ({t1 * 1e3:.1f} - gaps) / 15 layers"),
    }


def _attention_entries(gpu: str) -> Dict[str, Dict]:
    """Dense causal attention (cuDNN SDPA), achieved model FLOP/s at each (S, heads)."""
    flops = lambda s, heads, tokens: 3 * 2 * heads * 512 * (s / 2) * tokens  # qk 256 + v 256 at MLA-256
    pts: List[Dict] = []
    dsa = load(DSA[gpu]["file"])["rows"]
    for r in dsa:
        s = r["S"]
        pts.append({"seq": s, "heads": 64, "flops_per_s": flops(s, 64, s) / (r["dense"]["fwdbwd_ms"] * 1e-3),
                    "source": DSA[gpu]})
    if gpu == "h100":
        r = load(DSA128_H100["file"])["rows"][0]
        sec = r["dense"]["fwdbwd_ms"] * 1e-3
        pts.append({"seq": 131072, "heads": 64, "flops_per_s": flops(131072, 64, 131072) / sec, "source": DSA128_H100})
    if gpu == "h200":
        pts.append({"seq": 4096, "heads": 16, "flops_per_s": _breakdown_entries()["attention.s4096_in_step"]["value"],
                    "source": BREAKDOWN})
        for r in load(CP["file"])["rows"]:
            if r["cp"] == 2:
                s = r["seq"]
                pts.append({"seq": s, "heads": 16, "flops_per_s": flops(s, 16, s) / (2 * r["ideal_ms"] * 1e-3),
                            "source": CP})
    entries = {"attention.dense": entry(pts, "FLOP/s", "derived", NONE,
                                         "3 x 2 x heads x 512 x S/2 x S (flops.py causal count) / fwd+bwd time of one "
                                         "causal cuDNN call (cp_attention: 2 x its 'ideal' = the whole sequence)")}
    if gpu == "h200":
        rows = [r for r in load(CP["file"])["rows"]]
        entries["cp.chunks_over_ideal"] = entry(
            [{"seq": r["seq"], "cp": r["cp"], "value": r["chunks_over_ideal"]} for r in rows], "ratio", "measured", CP,
            "one CP rank's per-chunk causal attention / (1/cp of one causal call)")
        entries["cp.mask_over_ideal"] = entry(
            [{"seq": r["seq"], "cp": r["cp"], "value": r["mask_ms"] / r["ideal_ms"]} for r in rows], "ratio",
            "derived", CP, "the explicit-mask CP attention (before 2026-11-27) / (1/cp of one causal call)")
        entries["documents.attention_ratio"] = entry(
            [{"seq": r["seq"], "value": r["varlen_ratio"]} for r in load(DOC["file"]) if "varlen_ratio" in r],
            "ratio", "measured", DOC, "FlashAttention varlen over packed documents / one causal call over the window "
            "(documents log-uniform, seeded)")
    return entries


def _output_entries(gpu: str) -> Dict[str, Dict]:
    src = OUT_H200 if gpu == "h200" else OUT_H100
    rows = load(src["file"])["rows"]
    pts = []
    for r in rows:
        names = {"liger": "liger", "unfused": "unfused", "chunked-8192": "chunked", "chunked-4096": "chunked"}
        name = names.get(r["backend"])
        if name is None or r.get("ms") is None:
            continue
        flops = 6 * r["hidden"] * r["vocab"] * load(src["file"]).get("tokens", 32768)
        pts.append({"backend": name, "chunk": r["backend"], "hidden": r["hidden"], "vocab": r["vocab"],
                    "flops_per_s": flops / (r["ms"] * 1e-3)})
    note = "6 x hidden x vocab x 32,768 tokens / fwd+bwd ms per backend and head shape"
    if gpu == "h100":  # its chunked rows are the torch path the Triton kernels replaced; derive from Liger instead
        h200 = {(p["backend"], p["hidden"]): p["flops_per_s"] for p in _output_entries("h200")["output_loss"]["value"]
                if p["chunk"] != "chunked-4096"}
        pts = [p for p in pts if p["backend"] != "chunked"]
        pts += [dict(p, backend="chunked", chunk="chunked-8192 (assumption)",
                     flops_per_s=p["flops_per_s"] * h200[("chunked", p["hidden"])] / h200[("liger", p["hidden"])])
                for p in pts if p["backend"] == "liger"]
        note += ("; chunked on the H100 = its Liger rate x the H200's chunked-8192 / Liger ratio (assumption: the "
                 "H100 file predates the Triton chunked kernels)")
    return {"output_loss": entry(pts, "FLOP/s", "derived", src, note)}


def _optimizer_entries() -> Dict[str, Dict]:
    res = {r["variant"]: r for r in load(MUON["file"])["results"]}
    m = res["muon_split"]
    ns = m["newton_schulz"]
    rest = (m["optimizer_step_ms"] - ns["ms"]) * 1e-3
    a = {(p["optimizer"], p["micro_batch_size"]): p for p in load(MBS["file"])["points"]}[("AdamW", 4)]
    return {
        "muon.newton_schulz_flops_per_s": entry(ns["tflops"] * 1e12, "FLOP/s", "measured", MUON,
                                                 f"{ns['tflop']:.1f} TFLOP of Newton-Schulz (5 steps, bf16) in "
                                                 f"{ns['ms']:.1f} ms"),
        "muon.newton_schulz_flops_per_step": entry(ns["tflop"] * 1e12, "FLOP", "measured", MUON,
                                                    "glm5-proxy's Muon matrices (fc1 whole, heads split), one step"),
        "muon.other_s_per_param": entry(rest / PROXY_PARAMS, "s", "derived", MUON,
                                         f"(optimizer step {m['optimizer_step_ms']:.1f} ms - Newton-Schulz "
                                         f"{ns['ms']:.1f} ms) / 2.29e9 parameters: momentum, update, grad norm, clip"),
        "adamw.s_per_param": entry(a["optimizer_ms"] * 1e-3 / PROXY_PARAMS, "s", "derived", MBS,
                                    f"AdamW optimizer_ms {a['optimizer_ms']:.1f} / 2.29e9 parameters"),
    }


def _comm_entries() -> Dict[str, Dict]:
    res = {(r["dispatcher"], r["forced_balance"]): r for r in load(EP["file"])["results"]}
    a2a, ded = res[("alltoall", False)], res[("alltoall_dedup", False)]
    ep = 2
    off_a2a = a2a["rows_dispatched_rank0"] * (ep - 1) / ep
    off_ded = ded["rows_dispatched_rank0"] * (ep - 1) / ep
    dt = (a2a["ms_fwd_bwd_slowest_rank"] - ded["ms_fwd_bwd_slowest_rank"]) * 1e-3
    bytes_ = (off_a2a - off_ded) * 2048 * 2 * 4  # bf16 rows, dispatch + combine, forward and backward
    return {
        "a2a.intra_node_bytes_per_s": entry(
            bytes_ / dt, "B/s", "derived", EP,
            f"EP=2 MoE layer: alltoall {a2a['ms_fwd_bwd_slowest_rank']:.2f} ms vs alltoall_dedup "
            f"{ded['ms_fwd_bwd_slowest_rank']:.2f} ms for {off_a2a - off_ded:,.0f} fewer off-rank rows x 4 transfers "
            f"x 4 KiB (includes the permutes of those rows)"),
        "collective.busbw_fraction_intra": entry(0.75, "fraction of Cluster.intra_node_bw", "assumption", NONE,
                                                  "NCCL all-gather / reduce-scatter / all-reduce bus bandwidth inside "
                                                  "a node; not measured by a committed run (layout_calibration.py "
                                                  "--collectives measures it)"),
        "collective.busbw_fraction_inter": entry(0.8, "fraction of Cluster.inter_node_bw", "assumption", NONE,
                                                  "NCCL bus bandwidth across nodes (one NIC per GPU); not measured"),
        "a2a.inter_node_fraction": entry(0.6, "fraction of Cluster.inter_node_bw", "assumption", NONE,
                                          "all-to-all across nodes; not measured"),
        "collective.latency_s": entry(30e-6, "s", "assumption", NONE,
                                       "launch + synchronisation per NCCL call on the critical path; not measured"),
        "tp.exposed_fraction_backward": entry(0.5, "fraction", "assumption", NONE,
                                               "megatron 0.16.1 without TE overlaps only the backward all-gather / "
                                               "reduce-scatter with the weight-gradient GEMM; half assumed hidden"),
        "dp.overlap_fraction_of_backward": entry(0.8, "fraction", "assumption", NONE,
                                                  "share of the last micro-batch's backward that the bucketed "
                                                  "gradient reduce can hide behind (overlap_grad_reduce)"),
        "p2p.exposed_fraction": entry(1.0, "fraction", "assumption", NONE, "pipeline send/recv on the critical path"),
        "p2p.overhead_s_per_transfer": entry(0.0, "s", "assumption", NONE, "replaced by its fit (FITS)"),
    }


def _memory_features() -> Dict[str, Dict]:
    pts = {(p["attention"], p["features"]): p for p in load(LC16["file"])["points"]}
    return {
        "offload.time_fraction": entry(
            {a: pts[(a, "selective")]["tokens_per_sec"] / pts[(a, "selective+offload")]["tokens_per_sec"] - 1
             for a in ("dense", "dsa")},
            "fraction of layer time", "derived", LC16,
            "tokens/s of selective recompute / selective + offload - 1, at 16K (one sequence per step)"),
    }


FITS = [  # (entry, the case whose measurement it is fitted to, what it stands for)
    ("step.fixed_s", "h200 dense 16K none",
     "time per step outside the micro-batches and the optimizer step (zeroing, loss reduction, logging); seen "
     "where a step holds one sequence"),
    ("tp.overhead_s_per_layer_microbatch", "h200 muon tp2 sp mbs4",
     "what TP=2 + SP costs per layer and micro-batch beyond its collectives' volume (serial: at micro-batch 1 and 4 "
     "alike the TP=2 micro-batch is ~95 ms longer than the model's compute + collectives)"),
    ("ep.host_s_per_moe_layer_microbatch", "h200 muon ep4 dp4 mbs1 (11-26)",
     "host time megatron's all-to-all dispatcher adds per MoE layer and micro-batch (hidden at micro-batch 4, where "
     "the GPU is the bound)"),
    ("dp.zero2_microbatch_reduce_shown", "h200 muon dp2 zero2 m32 (11-29)",
     "the share of ZeRO-2's per-micro-batch gradient reduce (its ring time at the modeled bus bandwidth) that "
     "lengthens each micro-batch although the backward could hide it: NCCL's kernels take SMs and memory bandwidth "
     "from the backward (not yet split by a profile); DDP's one reduce per step is not charged this"),
    ("p2p.overhead_s_per_transfer", "h200 muon pp2 vpp2 mbs4 simulated schedule, group 4 (11-29d)",
     "what a pipeline rank waits per stage transfer (2 x VPP per micro-batch) beyond megatron's schedule simulated "
     "with the planner's stage times and the transfers' modeled time: transfers not hidden, host stalls, the "
     "tied-embedding gradient reduce (benchmarks/pipeline_bubble.py on this layout: 0.116 s of rank 0's idle, "
     "0.052 s of it the schedule's); measured at PP = 2 over NVLink only"),
    ("cp.merged_over_ideal", "h200 muon cp2 32K full, CP merged (11-28)",
     "one CP rank's dense attention with model.cp_attention=merged (a non-causal block and a causal square per query "
     "chunk, lse-merged) / (1/cp of one causal call); whatever else CP costs per rank at 32K lands here too; measured "
     "at CP = 2 and 32K only (other lengths and CP sizes take this value)"),
]
FIT_SHAPES = {  # entries that are tables: (lower, upper bound of the bisection, unit, the value as stored)
    "cp.merged_over_ideal": (0.5, 3.0, "ratio", lambda v: [{"seq": 32768, "cp": 2, "value": v}]),
    "dp.zero2_microbatch_reduce_shown": (0.0, 4.0, "fraction of the reduce's ring time", lambda v: v),
}
# Ratios of a cost to the model's own estimate of it, and waits outside the GPU's rates (the pipeline's per-transfer
# overhead): on another GPU kind they take the value fitted on the case's kind (its committed table: regenerate
# that one first) instead of a refit against the other kind's rates
RATIO_FITS = {"dp.zero2_microbatch_reduce_shown", "p2p.overhead_s_per_transfer"}


def _fit(table: Dict, gpu: str) -> None:
    """Bisect each fitted entry until the time model meets its case's measured tokens/s per GPU."""
    from pretrain.layout.calibration import Calibration, load_calibration
    from pretrain.layout.calibration.checks import load_checks, predict

    cases = {c["id"]: c for c in load_checks()}
    for name, case_id, what in FITS:
        case = cases[case_id]
        cache = {("calib", case["gpu_kind"]): Calibration(table)}
        lo, hi, unit, shape = FIT_SHAPES.get(name, (0.0, 0.1, "s", lambda v: v))
        if name in RATIO_FITS and gpu != case["gpu_kind"]:
            lo = hi = load_calibration(case["gpu_kind"])[name]
        for _ in range(0 if lo == hi else 60):
            mid = (lo + hi) / 2
            table["entries"][name] = entry(shape(mid), unit, "derived", NONE)
            cache[("calib", case["gpu_kind"])] = Calibration(table)
            err = predict(case, cache)["error"]
            lo, hi = (mid, hi) if err > 0 else (lo, mid)
        src = dict(case["source"], case=case_id)
        kind, note = "derived", ""
        if gpu != case["gpu_kind"]:
            kind, note = "assumption", f" (fitted on the {case['gpu_kind'].upper()}, assumed on the {gpu.upper()})"
        table["entries"][name] = entry(shape((lo + hi) / 2), unit, kind, src,
                                        f"fitted: the time model meets the measured tokens/s of '{case_id}'{note}; "
                                        f"{what}")


def build(gpu: str) -> Dict:
    entries: Dict[str, Dict] = {}
    entries.update(_breakdown_entries())
    entries.update(_host_entries())
    entries.update(_attention_entries(gpu))
    entries.update(dsa_entries(gpu))
    entries.update(_output_entries(gpu))
    entries.update(_optimizer_entries())
    entries.update(_comm_entries())
    entries.update(_memory_features())
    with open(DSA16["file"]) as f:
        row = [line for line in f if line.startswith("| core attention")][0].split("|")
    core_ms, gemm_ms = float(row[4]), float(row[6])
    entries["dsa.core_s_per_token_layer_2026_11_24"] = entry(
        (core_ms - gemm_ms) * 1e-3 / (15 * 16384), "s", "derived" if gpu == "h200" else "assumption", DSA16,
        f"DSA core attention row ({core_ms} ms minus its {gemm_ms} ms of absorption GEMMs) / (15 layers x 16,384 "
        f"tokens): the DSA kernels before 2026-11-25, for predicting runs made on them (16 heads, 16K)"
        + ("" if gpu == "h200" else "; the H200 profile assumed on the H100"))
    entries["gemm.small_m_knee_rows"] = entry(1024, "rows", "assumption", NONE,
                                               "GEMM rates hold down to this many rows per expert (or tokens per "
                                               "micro-batch and rank) and fall in proportion below it; not measured")
    device = "NVIDIA H200" if gpu == "h200" else "NVIDIA H100 80GB HBM3"
    if gpu == "h100":
        def pick(src):
            return [p for p in load(src["file"])["points"] if p["optimizer"] == "Muon" and "tokens_per_sec" in p][0]
        h1, h2 = pick(TT_H100), pick(TT_H200)
        scale = h1["tokens_per_sec"] / h2["tokens_per_sec"]
        entries["h100.scale_of_h200"] = entry(
            scale, "ratio", "derived", TT_H100,
            f"glm5-proxy Muon 4K micro-batch 4 tokens/s on the H100 ({h1['tokens_per_sec']:,.0f}) / on the H200 "
            f"({h2['tokens_per_sec']:,.0f}) the same day: applied to every rate, overhead and optimizer entry "
            f"that has no H100 measurement")
        for k, v in entries.items():
            if k.startswith("rate.") or k == "muon.newton_schulz_flops_per_s":
                v["value"] *= scale
                v["kind"], v["derivation"] = "derived", v["derivation"] + f"; x {scale:.4f} (h100.scale_of_h200)"
            elif k.startswith(("host.", "a2a.intra")):
                v["kind"] = "assumption"
                v["derivation"] = "the H200 measurement, assumed to hold on the H100: " + v["derivation"]
            elif k.startswith(("overhead.", "muon.other", "adamw.", "profile.")):
                v["value"] /= scale
                v["kind"], v["derivation"] = "derived", v["derivation"] + f"; / {scale:.4f} (h100.scale_of_h200)"
        pts = entries["attention.dense"]["value"]
        in_step = _breakdown_entries()["attention.s4096_in_step"]["value"]
        pts.append({"seq": 4096, "heads": 16, "flops_per_s": in_step * scale,
                    "source": dict(BREAKDOWN, note="H200 in-step rate x h100.scale_of_h200")})
        for name in ("cp.chunks_over_ideal", "cp.mask_over_ideal", "documents.attention_ratio"):
            e = _attention_entries("h200")[name]
            e["kind"] = "assumption"
            e["derivation"] = "the H200 measurement, assumed to hold on the H100: " + e["derivation"]
            entries[name] = e
        heads = [p for p in dsa_entries("h200")["dsa.sparse_attention"]["value"] if p["source"] is HEADS]
        for p in heads:
            p["flops_per_s"] *= scale
            p["source"] = dict(HEADS, note="H200 heads sweep x h100.scale_of_h200 (assumption)")
        entries["dsa.sparse_attention"]["value"].extend(heads)
        offl = entries["offload.time_fraction"]
        offl["kind"] = "assumption"
        offl["derivation"] = "the H200 measurement, assumed on the H100: " + offl["derivation"]
    from pretrain.training.flops import peak_flops
    table = {"gpu_kind": gpu, "device_name": device, "peak_bf16_flops": peak_flops(device),
            "about": "Calibration of pretrain.layout.timing; every entry names its source, kind and derivation. "
                     "Regenerate: python benchmarks/layout_calibration_results.py --gpu " + gpu,
            "entries": entries}
    entries["step.fixed_s"] = entry(0.0, "s", "derived", NONE)
    for _ in range(3):  # the host entries subtract the fixed step time the fit finds; a few rounds settle both
        _fit(table, gpu)
        host = _host_entries(entries["step.fixed_s"]["value"])
        for k, v in host.items():
            if gpu == "h100":
                v["kind"] = "assumption"
                v["derivation"] = "the H200 measurement, assumed to hold on the H100: " + v["derivation"]
            entries[k] = v
    return table


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", choices=["h100", "h200"], required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    table = build(args.gpu)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}: {len(table['entries'])} entries")


if __name__ == "__main__":
    main()
