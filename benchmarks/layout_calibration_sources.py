"""Where the layout planner's calibration entries come from: the committed result files with the command, date
and GPU of each (`benchmarks/layout_calibration_results.py` derives the table from them), the readers of those
files, and the DSA entries (the kernel benchmark to 32K, the profiled training step at 128K)."""

from __future__ import annotations

import json
from typing import Dict, Tuple

R = "benchmarks/results"
PROXY = "configs/models/glm5-proxy.yaml"
PROXY_PARAMS = 2_290_000_000  # glm5-proxy with MTP (its config header; pretrain.layout.types.ModelDims counts 2.29e9)

# --- sources -------------------------------------------------------------------------------------------------
BREAKDOWN = {"file": f"{R}/train_throughput_h200/muon_seq4096_mbs4_breakdown.json",
             "command": "python benchmarks/train_throughput.py --seqs 4096 --optimizers muon --micro-batch-sizes 4 "
                        "--tokens-per-step 131072 --steps 6 --profile-step 4", "date": "2026-11-24", "gpu": "H200"}
MBS = {"file": f"{R}/train_throughput_h200/mbs_1_vs_4_h200.json",
       "command": "python benchmarks/train_throughput.py --seqs 4096 --optimizers muon,adam --micro-batch-sizes 1,4 "
                  "--tokens-per-step 131072 --steps 6", "date": "2026-11-24", "gpu": "H200"}
TT_H100 = {"file": f"{R}/train_throughput_h100/throughput_4k_h100.json",
           "command": "python benchmarks/train_throughput.py --seqs 4096 --optimizers muon,adam --micro-batch-sizes 4 "
                      "--tokens-per-step 131072 --steps 6 --out throughput_4k.json",
           "date": "2026-11-24", "gpu": "H100"}
TT_H200 = dict(TT_H100, file=f"{R}/train_throughput_h200/throughput_4k_h200.json", gpu="H200")
MUON = {"file": f"{R}/muon_h200/muon_step_final_default.json",
        "command": "python benchmarks/muon_step.py --config configs/models/glm5-proxy.yaml --variants "
                   "muon_split_unfused,muon_split,muon_glu_split --steps 5 --warmup 2",
        "date": "2026-11-25", "gpu": "H200"}
SCALING = {"file": f"{R}/multi_gpu_h200x4/scaling/gpu1.metrics.jsonl",
           "command": "bash benchmarks/multi_gpu.sh scaling OUT", "date": "2026-11-26", "gpu": "H200"}
EP = {"file": f"{R}/ep_dispatch_h200/ep_dispatch_layer.json",
      "command": "torchrun --nproc-per-node 2 benchmarks/ep_dispatch_layer.py --out ep_dispatch_layer.json",
      "date": "2026-11-28", "gpu": "2 x H200"}
CP = {"file": f"{R}/cp_attention_h200/cp_attention.json",
      "command": "python benchmarks/cp_attention.py --seqs 32768,131072 --cp 2,4 --out cp_attention.json",
      "date": "2026-11-27", "gpu": "H200"}
DOC = {"file": f"{R}/document_attention_h200/document_attention.json",
       "command": "python benchmarks/document_attention.py --seqs 32768,131072 --cp 1 --out document_attention.json",
       "date": "2026-11-28", "gpu": "H200"}
DSA = {"h200": {"file": f"{R}/dsa_kernels_h200/dsa_kernels_s16k_s32k.json",
                "command": "python benchmarks/dsa_kernels.py --seqs 16384,32768 --reference-max 0 --reps 3",
                "date": "2026-11-27", "gpu": "H200"},
       "h100": {"file": f"{R}/dsa_kernels_h100/dsa_kernels_s16k_s32k.json",
                "command": "python benchmarks/dsa_kernels.py --seqs 16384,32768 --reference-max 0 --reps 3 --out "
                           "dsa_kernels_s16k_s32k.json", "date": "2026-11-26", "gpu": "H100"}}
DSA128_H100 = dict(DSA["h100"], file=f"{R}/dsa_kernels_h100/dsa_kernels_s128k.json",
                   command="python benchmarks/dsa_kernels.py --seqs 131072 --reference-max 0 --reps 3 --out "
                           "dsa_kernels_s128k.json")
DSA128_STEP = {"file": f"{R}/scaling_h200x4_b/call2/b/gpu1_128k.breakdown.md",
               "command": "python benchmarks/scaling.py --out OUT --only gpu1_128k --iters 6 --breakdown gpu1_128k",
               "date": "2026-11-28", "gpu": "H200"}
HEADS = {"file": f"{R}/dsa_kernels_h200/heads_8_16_32.json",
         "command": 'python lab/dsa/dsa_heads_sweep.py --heads 16,8,32 --seqs 16384,32768 --configs "" '
                    '--ws off,on --reps 3',
         "date": "2026-11-27", "gpu": "H200"}
OUT_H200 = {"file": f"{R}/output_loss_h200/output_loss_h200.json",
            "command": "python benchmarks/output_loss.py --tokens 32768 --out output_loss_h200.json",
            "date": "2026-11-24", "gpu": "H200"}
OUT_H100 = {"file": f"{R}/long_context_h100/output_loss.json",
            "command": "python benchmarks/output_loss.py --tokens 32768 --out output_loss.json", "date": "2026-11-24",
            "gpu": "H100"}
LC16 = {"file": f"{R}/long_context_h200/lc_16k_h200.json",
        "command": "python benchmarks/long_context.py --seqs 16384 --attention dense,dsa --features "
                   "liger,selective,selective+offload --steps 4 --out lc_16k_h200.json",
        "date": "2026-11-24", "gpu": "H200"}
NONE = {"file": None, "command": None, "date": None, "gpu": None}
DSA16 = {"file": f"{R}/long_context_h200/dsa_16k_breakdown.md",
         "command": "python -m pretrain.tools.step_breakdown on a profile of steps 3-4 of python -m pretrain.train "
                    "--config "
                    "configs/models/glm5-proxy.yaml data.mock=true data.seq_length=16384 train.micro_batch_size=1 "
                    "train.global_batch_size=1 (DSA sparse + sparse KL)", "date": "2026-11-24", "gpu": "H200"}


def load(path: str):
    with open(path) as f:
        return json.load(f)


def entry(value, unit: str, kind: str, source: Dict, derivation: str = "") -> Dict:
    return {"value": value, "unit": unit, "kind": kind, "source": source, "derivation": derivation}

def dsa_entries(gpu: str) -> Dict[str, Dict]:
    """DSA sparse attention rate at (S, heads) and the indexer's top-k + KL seconds per token at S."""
    def sparse_flops(s, heads, topk=2048):
        keys = topk - topk * topk / (2 * s) if s > topk else s / 2
        return 3 * heads * (2 * 576 + 2 * 512) * keys * s
    att, idx = [], []
    rows = list(load(DSA[gpu]["file"])["rows"])
    srcs = [DSA[gpu]] * len(rows)
    if gpu == "h100":
        rows.append(load(DSA128_H100["file"])["rows"][0])
        srcs.append(DSA128_H100)
    for r, src in zip(rows, srcs):
        s, d = r["S"], r["dsa"]
        sec = (d["attn_fwd_ms"] + d["attn_bwd_ms"]) * 1e-3
        att.append({"seq": s, "heads": 64, "flops_per_s": sparse_flops(s, 64) / sec, "source": src})
        idx.append({"seq": s, "indexer_heads": 32, "s_per_token": (d["topk_ms"] + d["kl_ms"]) * 1e-3 / s,
                    "source": src})
    if gpu == "h200":
        att_pt, idx_pt = dsa_in_step_128k()
        att.append(att_pt)
        idx.append(idx_pt)
        for r in load(HEADS["file"])["rows"]:
            if r.get("ws") == "on":
                s, h = r["S"], r["heads"]
                sec = (r["fwd_ms"] + r["bwd_ms"]) * 1e-3
                att.append({"seq": s, "heads": h, "flops_per_s": sparse_flops(s, h) / sec, "source": HEADS})
    return {
        "dsa.sparse_attention": entry(att, "FLOP/s", "derived", NONE,
                                       "flops.py attention_sparse (3 x heads x (2 x 576 + 2 x 512) x keys) x S / "
                                       "(sparse attention forward + backward ms)"),
        "dsa.indexer_topk_kl": entry(idx, "s per token", "derived", NONE,
                                      "(top-k ms + sparse KL ms) / S at the GLM-5 indexer (32 heads x 128); "
                                      "the index-score GEMMs are inside the top-k time"),
    }


def kernel_ms(path: str) -> Dict[str, float]:
    """ms per step by kernel name, from a step breakdown's "Largest kernels" table (summed over its rows)."""
    ms: Dict[str, float] = {}
    with open(path) as f:
        for line in f:
            cells = [c.strip() for c in line.split("|")]
            if len(cells) > 6 and cells[5].startswith("`"):
                name = cells[5].strip("`")
                ms[name] = ms.get(name, 0.0) + float(cells[1])
    return ms


def dsa_in_step_128k() -> Tuple[Dict, Dict]:
    """glm5-proxy's DSA sparse step at 131,072 tokens (one GPU, full recompute, 15 layer slots), profiled: the sparse
    attention's forward + backward and the indexer's index scores + top-k + KL, once per layer (the recompute runs
    the forward kernels a second time; their two passes are averaged). The kernel benchmark measured only to 32K, and
    at 128K the sparse backward runs in key partitions (model.dsa_key_partition_mib): 6.9x its forward, 4.3x at 32K."""
    k = kernel_ms(DSA128_STEP["file"])
    s, layers, heads = 131072, 15, 16
    fwd = k["fwd_kernel"] / 2
    attn_s = (fwd + k["_bwd_kernel"]) * 1e-3 / layers
    index_s = (k["_scores_kernel"] / 2 + k["_radix_select_kernel"] / 2 + k["_sparse_kl_kernel"]) * 1e-3 / layers
    keys = 2048 - 2048 * 2048 / (2 * s)
    src = dict(DSA128_STEP, note="in-step kernels of a profiled training step (SparseMLACore forward + backward; "
                                 "index scores + radix top-k + sparse KL), per layer")
    return ({"seq": s, "heads": heads, "flops_per_s": 3 * heads * (2 * 576 + 2 * 512) * keys * s / attn_s,
             "source": src},
            {"seq": s, "indexer_heads": 32, "s_per_token": index_s / s * 32 / 16, "source": src})


def indexer_forward_share() -> float:
    """The indexer's forward share: index scores and top-k run only forward (a recompute repeats them whole), the
    sparse KL's kernel runs in the backward; from the 128K profile."""
    k = kernel_ms(DSA128_STEP["file"])
    fwd = (k["_scores_kernel"] + k["_radix_select_kernel"]) / 2
    return fwd / (fwd + k["_sparse_kl_kernel"])
