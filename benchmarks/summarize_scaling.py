"""Table of a scaling run folder of the former train_scaling.sh / multi_gpu.sh scaling (benchmarks/scaling.py now
writes its own table): median throughput over steps 3.., per GPU, MFU, memory.

    python benchmarks/summarize_scaling.py OUT_DIR gpu1 dp4 ...          (first run = the 1-GPU baseline)
    python benchmarks/summarize_scaling.py OUT_DIR gpu1 dp4:4 gpu1_32k cp2dp2_32k:4:gpu1_32k

A run is NAME[:GPUS[:BASELINE]]: GPUS defaults to 1 for names starting with gpu1 and to 4 otherwise, BASELINE
(the run its per-GPU throughput is divided by for the scaling efficiency) to the first run.
"""

import json
import os
import statistics
import sys


def load(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if r["step"] >= 3]  # steps 1-2 include warm-up (allocator, kernels)


def main():
    out, names = sys.argv[1], sys.argv[2:]
    table, per_gpu_of = [], {}
    for spec in names:
        name, *rest = spec.split(":")
        n = int(rest[0]) if rest else (1 if name.startswith("gpu1") else 4)
        baseline = rest[1] if len(rest) > 1 else names[0].split(":")[0]
        rows = load(os.path.join(out, name))
        tps = statistics.median(r["tokens_per_sec"] for r in rows)
        per_gpu = tps / n
        per_gpu_of[name] = per_gpu
        base = per_gpu_of[baseline]
        table.append({
            "run": name, "gpus": n, "tokens_per_sec": tps, "tokens_per_sec_per_gpu": per_gpu,
            "tflops_per_gpu": statistics.median(r["tflops_per_gpu"] for r in rows),
            "mfu": statistics.median(r["mfu"] for r in rows if r["mfu"] is not None),
            "mem_peak_gb": max(r["mem_peak_gb"] for r in rows),
            "scaling_efficiency": per_gpu / base, "final_loss": rows[-1]["loss"],
        })
    with open(os.path.join(out, "scaling.json"), "w") as f:
        json.dump(table, f, indent=2)
    print(f"{'run':<12}{'GPUs':>5}{'tok/s':>10}{'tok/s/GPU':>11}{'TFLOP/s/GPU':>13}{'MFU':>7}{'peak GiB':>10}{'scaling':>9}")
    for r in table:
        print(f"{r['run']:<12}{r['gpus']:>5}{r['tokens_per_sec']:>10,.0f}{r['tokens_per_sec_per_gpu']:>11,.0f}"
              f"{r['tflops_per_gpu']:>13.1f}{100 * r['mfu']:>6.1f}%{r['mem_peak_gb']:>10.1f}{r['scaling_efficiency']:>8.2f}x")


if __name__ == "__main__":
    main()
