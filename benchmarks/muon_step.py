"""Optimizer cost of Muon vs AdamW inside the training loop, on one GPU (bf16, glm5-proxy by default).

    python benchmarks/muon_step.py --config configs/models/glm5-proxy.yaml --out muon_step.json

For each optimizer (AdamW; Muon with Muon Split; Muon without it) a Trainer runs `--steps` training
steps on mock tokens after `--warmup` steps; reported per step (medians): the whole step, the
optimizer's `step()` alone (CUDA events around it), and the optimizer's share of the step. Then
Newton-Schulz alone on the model's Muon matrices as the optimizer batches them (blocks of equal
shape in one batched call), with its TFLOP/s: per iteration on X [m, n] (m <= n) 4 m^2 n + 2 m^3.
Timings use wall clock around synchronized CUDA work (CPU runs, for a smoke test, also work).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

VARIANTS = {
    "adamw": ["optimizer.optimizer=adam"],
    "muon_split": ["optimizer.optimizer=muon", "optimizer.muon_split=true"],
    "muon_whole": ["optimizer.optimizer=muon", "optimizer.muon_split=false"],
}


def run(config: str, name: str, extra, steps: int, warmup: int) -> dict:
    from pretrain.config import load_config
    from pretrain.training.loop import Trainer

    over = ["data.mock=true", f"train.train_iters={steps + warmup}", "train.eval_interval=null", "optimizer.lr_warmup_iters=0",
            "logging.log_interval=1000", f"logging.run_dir=/tmp/muon_step_{name}", "checkpoint.save=null",
            *VARIANTS[name], *extra]
    trainer = Trainer(load_config(config, over))
    opt_ms, step_ms = [], []
    original = trainer.optimizer.step

    def timed_step():
        _sync()
        t0 = time.perf_counter()
        out = original()
        _sync()
        opt_ms.append((time.perf_counter() - t0) * 1e3)
        return out

    trainer.optimizer.step = timed_step
    for i in range(steps + warmup):
        _sync()
        t0 = time.perf_counter()
        trainer.train_step()
        _sync()
        step_ms.append((time.perf_counter() - t0) * 1e3)
        trainer.iteration += 1
    opt, step = statistics.median(opt_ms[warmup:]), statistics.median(step_ms[warmup:])
    result = {"variant": name, "step_ms": step, "optimizer_step_ms": opt, "optimizer_share": opt / step,
              "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None}
    if name != "adamw":
        result["newton_schulz"] = newton_schulz_bench(trainer)
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return result


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def newton_schulz_bench(trainer) -> dict:
    """Newton-Schulz on this rank's Muon matrices, grouped as `orthogonalized_update` groups them."""
    from pretrain.optim.muon import newton_schulz
    from pretrain.training.muon_setup import muon_roles

    batches = []
    for p, role, split in muon_roles(trainer.optimizer):
        if role != "muon":
            continue
        u = torch.randn_like(p)
        batches.extend(split.blocks(u) if split is not None else [u])
    steps = trainer.cfg.optimizer.muon_num_ns_steps
    flops = 0.0
    for x in batches:
        m, n = sorted(x.shape[-2:])
        count = x.numel() // (m * n)
        flops += count * steps * (4 * m * m * n + 2 * m**3)
    for x in batches:  # warm-up
        newton_schulz(x, steps)
    _sync()
    t0 = time.perf_counter()
    for x in batches:
        newton_schulz(x, steps)
    _sync()
    ms = (time.perf_counter() - t0) * 1e3
    return {"calls": len(batches), "ms": ms, "tflops": flops / ms / 1e9}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/models/glm5-proxy.yaml")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--variants", default="adamw,muon_split,muon_whole")
    ap.add_argument("--out", default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    variants = args.variants.split(",")
    if len(variants) == 1:
        results = [run(args.config, variants[0], args.overrides, args.steps, args.warmup)]
    else:  # one process per variant: nothing of one run's model or optimizer survives into the next
        import subprocess
        import tempfile

        results = []
        for v in variants:
            with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                subprocess.run([sys.executable, __file__, "--config", args.config, "--steps", str(args.steps),
                                "--warmup", str(args.warmup), "--variants", v, "--out", tmp.name, *args.overrides],
                               check=True)
                with open(tmp.name) as f:
                    results.extend(json.load(f)["results"])
    record = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "date": time.strftime("%Y-%m-%d"), "config": args.config,
              "overrides": args.overrides, "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    print(f"{'variant':<12}{'step ms':>10}{'opt ms':>10}{'share':>8}{'NS TFLOP/s':>12}{'peak GiB':>10}")
    for r in results:
        ns = r.get("newton_schulz", {}).get("tflops", math.nan)
        print(f"{r['variant']:<12}{r['step_ms']:>10.1f}{r['optimizer_step_ms']:>10.1f}{r['optimizer_share']:>8.1%}"
              f"{ns:>12.1f}{r['peak_mem_gib'] or math.nan:>10.2f}")


if __name__ == "__main__":
    main()
