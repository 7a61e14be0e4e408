"""glm5-proxy on one GPU from 4K to 200K+ tokens per sequence: what each memory feature buys.

    python benchmarks/long_context.py --seqs 4096,16384,32768,65536,131072,200000 --out long_context.json

Each (sequence length, attention, memory features) point is a real training run through the user's
entry point (`python -m pretrain.train`, a fresh process, so an out-of-memory point cannot disturb the
next): glm5-proxy (2.29B with MTP), Muon, bf16, mock tokens, one sequence per micro-batch and per step,
`--steps` steps; the median of steps 2.. of tokens/s, TFLOP/s, MFU and the peak memory, read from the
run's metrics.jsonl. Attention: dense MLA (SDPA/cuDNN) or DSA sparse (indexer top-k 2048 + sparse KL,
Triton kernels). Features (`--features`, names below) are config overrides; a point that runs out of
memory is recorded as such and the longer sequences of that variant are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # run as a script from anywhere

from benchmarks.train_runs import ROOT, launch, point_overrides, steady_state  # noqa: E402

ATTENTION = {
    "dense": ["model.dsa_sparse_attention=false", "model.dsa_indexer_loss_coeff=0.0"],
    "dsa": ["model.dsa_sparse_attention=true", "model.dsa_indexer_loss_coeff=1e-3",
            "model.dsa_indexer_use_sparse_loss=true"],
}
FULL = ["model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1"]
FEATURES = {
    "none": [],
    "liger": ["model.output_loss_backend=liger"],
    "selective": ["model.recompute_granularity=selective", "model.recompute_modules=[core_attn,moe]",
                  "model.output_loss_backend=liger"],
    "full": FULL + ["model.output_loss_backend=liger"],
    "full+offload": FULL + ["model.output_loss_backend=liger", "model.activation_offload=true"],
    "full+offload-ds": FULL + ["model.output_loss_backend=liger", "model.activation_offload=true",
                               "model.activation_offload_backend=deepspeed"],
    "selective+offload": ["model.recompute_granularity=selective", "model.recompute_modules=[core_attn,moe]",
                          "model.output_loss_backend=liger", "model.activation_offload=true"],
    "offload": ["model.output_loss_backend=liger", "model.activation_offload=true"],
}


def run_point(seq: int, attention: str, features: str, steps: int, timeout: int) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        overrides = [*point_overrides(seq, 1, 1, steps, run_dir), *ATTENTION[attention], *FEATURES[features]]
        result = launch(ROOT / "configs/models/glm5-proxy.yaml", overrides, run_dir, timeout)
    if result.timed_out:
        return {"error": result.error()}
    if not result.ok or len(result.rows) < 2:
        return {"oom": result.oom, "error": result.error()}
    summary = steady_state(result.rows, skip={1})
    return {"tokens_per_sec": round(summary["tokens_per_sec"]), "tflops_per_gpu": round(summary["tflops_per_gpu"], 1),
            "mfu": round(summary["mfu"], 4), "mem_peak_gb": round(summary["mem_peak_gb"], 2),
            "loss": round(summary["loss"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="4096,16384,32768,65536,131072,200000")
    parser.add_argument("--attention", default="dense,dsa")
    parser.add_argument("--features", default=",".join(FEATURES))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per point")
    parser.add_argument("--out")
    args = parser.parse_args()
    import torch

    results = {"gpu": torch.cuda.get_device_name(), "points": []}
    for attention in args.attention.split(","):
        for features in args.features.split(","):
            for seq in (int(s) for s in args.seqs.split(",")):
                point = {"seq": seq, "attention": attention, "features": features,
                         **run_point(seq, attention, features, args.steps, args.timeout)}
                results["points"].append(point)
                print(json.dumps(point), flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps(results, indent=2))
                if "error" in point:
                    break  # longer sequences of this variant need at least as much
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
