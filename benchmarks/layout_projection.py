"""How long a curriculum plan takes on its cluster, by the layout planner (issue 45; docs/layout.md).

    python benchmarks/layout_projection.py [--plan configs/curriculum/glm5-744b.yaml] [--gpus N --cluster NAME]
        [--compare h100-nvl-ib800,h200-nvl-ib800] [--out benchmarks/results/layout_projection.md]

For every stage of the plan, the stage's own layout (its config's parallel, micro-batch, recompute and optimizer
keys, as `pretrain.layout.search.layout_of` reads them) on the plan's GPUs: memory per GPU (`stage_memory`), the
step time (`stage_step`, the GPU kind's calibration), tokens/s per GPU, MFU, and for the stage's steps x that step
the GPU-hours and days; then the totals, next to DeepSeek-V3's and Kimi K2's published figures, and every
calibration entry labelled "assumption" that the step times rest on. Without --gpus / --cluster the plan's header
line `--gpus N --cluster NAME` (the GPUs the plan states it was laid out for) gives them.

Prints Markdown (and writes it to --out). CPU only; seconds.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DEFAULT_PLAN = "configs/curriculum/glm5-744b.yaml"
STATED = re.compile(r"--gpus\s+(\d+)\s+--cluster\s+(\S+)")

# Published figures (docs/layout.md cites them; unknown where the sources this project keeps do not give them)
DEEPSEEK_V3 = {"run": "DeepSeek-V3 (671B, 37B active)", "gpus": 2048, "gpu": "H800", "tokens": 14.8e12,
               "gpu_hours": 2.788e6, "layout": "PP16 (DualPipe), EP64 over 8 nodes, ZeRO-1 DP, no TP; "
               "all-to-all ~96% hidden behind compute", "source": "arXiv 2412.19437"}
KIMI_K2 = {"run": "Kimi K2 (1T MoE)", "gpus": None, "gpu": "H800", "tokens": None, "gpu_hours": None,
           "layout": "interleaved 1F1B PP (virtual stages, extra warm-up micro-batches hide the all-to-all), EP16, "
           "ZeRO-1; 256-GPU model-parallel group", "source": "arXiv 2507.20534 section 2.4"}


def stated_cluster(plan_path: str) -> Tuple[int, str]:
    """(GPUs, cluster preset) the plan states in its header: the first `--gpus N --cluster NAME` of its comments."""
    with open(plan_path) as f:
        for line in f:
            if not line.startswith("#"):
                break
            hit = STATED.search(line)
            if hit:
                return int(hit.group(1)), hit.group(2)
    raise ValueError(f"{plan_path} states no '--gpus N --cluster NAME' in its header comments; pass --gpus and --cluster")


def project(plan_path: str, gpus: int, cluster_name: str, plan=None) -> Dict:
    """Per stage and in total: layout, memory, step, tokens/s per GPU, MFU, GPU-hours, days (`plan`: the loaded
    plan of `plan_path`, when the caller has it)."""
    from pretrain.curriculum.plan import load_plan
    from pretrain.layout.search import (bubble_refusal, layout_of, memory_refusal, refusal,
                                        simulated_bubble_refusal, stage_memory, stage_step)
    from pretrain.layout.types import ModelDims, cluster_preset

    plan = plan or load_plan(plan_path)
    cluster = cluster_preset(cluster_name, gpus)
    stages: List[Dict] = []
    for s in plan.stages:
        layout, work = layout_of(s.cfg, gpus)
        dims = ModelDims.from_config(s.cfg)
        refused = refusal(dims, layout, work) or bubble_refusal(layout, 0.10)
        if refused:
            raise ValueError(f"stage {s.name}: {layout.short()} on {gpus} GPUs: {refused}")
        mem = stage_memory(s.cfg, layout, work)
        step = stage_step(s.cfg, layout, work, cluster)
        refused = simulated_bubble_refusal(layout, step, 0.10)  # megatron's schedule, the stage's virtual stages
        if refused:
            raise ValueError(f"stage {s.name}: {layout.short()} on {gpus} GPUs: {refused}")
        seconds = s.train_iters * step.total
        stages.append({"name": s.name, "seq": s.seq_length, "tokens": s.trained_tokens, "steps": s.train_iters,
                       "batch": s.global_batch_size, "layout": layout, "memory": mem,
                       "fits": memory_refusal(mem, cluster.memory_bytes, 0.10) is None, "step": step,
                       "gpu_hours": seconds * gpus / 3600, "days": seconds / 86400})
    total_tokens = sum(x["tokens"] for x in stages)
    total_hours = sum(x["gpu_hours"] for x in stages)
    return {"plan": plan_path, "gpus": gpus, "cluster": cluster, "stages": stages, "tokens": total_tokens,
            "gpu_hours": total_hours, "days": sum(x["days"] for x in stages),
            "tokens_per_s_per_gpu": total_tokens / (total_hours * 3600)}


# entries read only for predicting runs of older code or other paths (timing.step_time's variants, packed documents)
NOT_READ = {"cp.mask_over_ideal": "the explicit-mask CP attention before 2026-11-27",
            "dsa.core_s_per_token_layer_2026_11_24": "the DSA kernels of 2026-11-24",
            "documents.attention_ratio": "packed documents' attention, not credited here"}


def _assumptions(gpu_kind: str, notes: List[str]) -> List[str]:
    from pretrain.layout.calibration import load_calibration
    from pretrain.layout.memory import RUNTIME_RESERVE_BYTES

    calib = load_calibration(gpu_kind)
    out = []
    for name in calib.assumptions():
        if name in NOT_READ:
            continue
        value = calib[name]
        shown = f"{value:.4g}" if isinstance(value, float) else ("table" if isinstance(value, list) else str(value))
        why = calib.entries[name]["derivation"].split("; ")[0]
        out.append(f"- `{name}` = {shown}: {why}")
    out.append(f"- memory: a runtime reserve of {RUNTIME_RESERVE_BYTES / 2**30:.0f} GiB outside PyTorch's allocator "
               "per GPU (CUDA context, NCCL buffers, fragmentation), not measured")
    out += [f"- this plan: {n}" for n in notes]
    out.append("- not read for this plan: " + "; ".join(f"`{k}` ({v})" for k, v in NOT_READ.items()))
    return out


def render(p: Dict, command: str, date: str, others: Optional[List[Dict]] = None) -> str:
    cl = p["cluster"]
    lines = [f"# Projection: {p['plan']} on {p['gpus']:,} x {cl.gpu_kind.upper()} ({cl.name})", "",
             f"Command: `{command}` (CPU, {date}). The layout planner's time and memory models (docs/layout.md) "
             "applied to each stage's own layout; nothing here is measured at this scale.", "",
             "| stage | seq | tokens | steps x seqs | layout | memory GiB (of 90% of the GPU) | bubble | step s | "
             "all-to-all share | tokens/s/GPU | MFU | GPU-hours | days |",
             "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    bound = 0.9 * cl.memory_bytes / 2**30
    notes: List[str] = []
    for x in p["stages"]:
        lay, st, mem = x["layout"], x["step"], x["memory"]
        notes += [n for n in st.notes if n not in notes]
        lines.append(
            f"| {x['name']} | {x['seq']:,} | {x['tokens'] / 1e9:,.1f}B | {x['steps']:,} x {x['batch']:,} | "
            f"{_short(lay)} | {mem.needed / 2**30:.1f} ({bound:.1f}){'' if x['fits'] else ' OVER'} | "
            f"{st.bubble_fraction:.1%} | {st.total:.2f} | {st.ep_a2a / st.total:.0%} | {st.tokens_per_s_per_gpu:,.0f} | {st.mfu:.1%} | "
            f"{x['gpu_hours'] / 1e6:.3f}M | {x['days']:.1f} |")
    lines.append(f"| **total** | | **{p['tokens'] / 1e12:.2f}T** | | | | | | | **{p['tokens_per_s_per_gpu']:,.0f}** | | "
                 f"**{p['gpu_hours'] / 1e6:.2f}M** | **{p['days']:.0f}** |")
    lines += ["", "## Next to published runs", "",
              "| run | GPUs | tokens | GPU-hours | GPU-hours per 1T tokens | tokens/s/GPU | days | layout | source |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |",
              f"| GLM-5 plan (this projection) | {p['gpus']:,} {cl.gpu_kind.upper()} | {p['tokens'] / 1e12:.2f}T | "
              f"{p['gpu_hours'] / 1e6:.2f}M | {p['gpu_hours'] / (p['tokens'] / 1e12) / 1e3:,.0f}K | "
              f"{p['tokens_per_s_per_gpu']:,.0f} | {p['days']:.0f} | per stage above | the planner |"]
    for ref in (DEEPSEEK_V3, KIMI_K2):
        lines.append("| " + " | ".join(_published(ref)) + " |")
    lines += ["", "Unknown: not given by the published sources (the GLM-5, DeepSeek-V3 and Kimi K2 reports)."]
    if others:
        lines += ["", f"## The same layouts on other clusters of {p['gpus']:,} GPUs", "",
                  "How much the network and the GPU kind move the projection (each stage's layout unchanged; the "
                  "planner may prefer other layouts there).", "",
                  "| cluster | GPU-hours | days | tokens/s/GPU | stages over the memory bound |",
                  "| --- | ---: | ---: | ---: | --- |"]
        for o in [p] + others:
            over = [x["name"] for x in o["stages"] if not x["fits"]]
            lines.append(f"| {o['cluster'].name}{' (this plan)' if o is p else ''} | {o['gpu_hours'] / 1e6:.2f}M | "
                         f"{o['days']:.0f} | {o['tokens_per_s_per_gpu']:,.0f} | {', '.join(over) or 'none'} |")
    lines += ["",
              "## What the numbers rest on", "",
              "Measured (committed runs on 1-4 H100/H200, docs/layout.md's calibration tables): per-class GEMM and "
              "attention rates, DSA kernel rates, Muon and AdamW step costs, host launch times, the EP=2 all-to-all "
              "bandwidth inside a node. Extrapolated to this scale, and labelled **assumption** in "
              f"`pretrain/layout/calibration/{cl.gpu_kind}.json`, to be re-checked when 4- and 8-GPU (and multi-node) "
              "calibration runs exist:", ""]
    lines += _assumptions(cl.gpu_kind, notes)
    lines += ["", "Not modelled: overlap of the all-to-all with compute (DualPipe / combined 1F1B), routing "
              "imbalance, packed documents' cheaper attention (attention is timed as one causal window), failures "
              "and restarts.", ""]
    return "\n".join(lines)


def _short(lay) -> str:
    rc = {"none": "", "selective": " sel", "full": " full"}[lay.recompute]
    return (f"TP{lay.tp} PP{lay.pp}" + (f" VPP{lay.vpp}" if lay.vpp > 1 else "") + f" EP{lay.ep}"
            + (f" ETP{lay.etp}" if lay.etp > 1 else "") + (f" CP{lay.cp}" if lay.cp > 1 else "")
            + f" DP{lay.dp} mbs{lay.micro_batch_size} m{lay.num_microbatches}{rc}"
            + (" offload" if lay.activation_offload else "") + f" {lay.optimizer}/{lay.zero}")


def _published(ref: Dict) -> List[str]:
    unknown = "unknown"
    tokens, hours, gpus = ref["tokens"], ref["gpu_hours"], ref["gpus"]
    per_t = f"{hours / (tokens / 1e12) / 1e3:,.0f}K" if tokens and hours else unknown
    rate = f"{tokens / (hours * 3600):,.0f}" if tokens and hours else unknown
    days = f"{hours / gpus / 24:.0f}" if hours and gpus else unknown
    return [ref["run"], f"{gpus:,} {ref['gpu']}" if gpus else f"{unknown} ({ref['gpu']})",
            f"{tokens / 1e12:.1f}T" if tokens else unknown, f"{hours / 1e6:.3f}M" if hours else unknown, per_t, rate,
            days, ref["layout"], ref["source"]]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", default=DEFAULT_PLAN, help="curriculum plan (YAML)")
    p.add_argument("--gpus", type=int, help="default: the plan's stated GPU count")
    p.add_argument("--cluster", help="cluster preset; default: the plan's stated one")
    p.add_argument("--compare", default="", help="comma-separated cluster presets: the same layouts there, in totals")
    p.add_argument("--out", help="also write the Markdown here")
    args = p.parse_args(argv)
    gpus, cluster = args.gpus, args.cluster
    if gpus is None or cluster is None:
        try:
            stated = stated_cluster(args.plan if os.path.exists(args.plan) else os.path.join(ROOT, args.plan))
        except (OSError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        gpus, cluster = gpus or stated[0], cluster or stated[1]
    command = "python benchmarks/layout_projection.py" + "".join(
        f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    result = project(args.plan, gpus, cluster)
    others = [project(args.plan, gpus, name) for name in args.compare.split(",") if name and name != cluster]
    text = render(result, command, datetime.date.today().isoformat(), others)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
