"""A curriculum plan's pipelined stages, their schedules simulated: what the layout planner's bubble term leaves out.

    python benchmarks/pipeline_plan_schedule.py --plan configs/curriculum/glm5-744b.yaml --gpus 1792 --gpu h100 \\
        --out benchmarks/results/pipeline_plan_schedule_744b.md

The layout planner times a pipeline as m x the slowest rank's micro-batch + (PP - 1) / VPP x the mean rank's: the
textbook bubble, which assumes equal virtual stages. For every stage of the plan with PP > 1 this script takes the
stage's layout, weighs each entry by the planner's calibrated cost on `--gpu` (`pretrain.tools.pipeline_split`,
forward shares from `pretrain.layout.pipeline_schedule.forward_shares`), and runs megatron's schedule op by op
(`pretrain.layout.pipeline_schedule.simulate`, transfers free). Reported, all against an ideal pipeline (the
work spread evenly, no bubble):

    plan layout         the busiest rank, and the simulated schedule, of the plan's own layout
    textbook            1 + (PP - 1) / (VPP m) on top of the busiest rank: what the planner's bubble term assumes
    VPP v, searched     the shortest simulated schedule over splits at v virtual stages per rank (a local search from
                        pipeline_split's closed-form split), micro-batch groups of PP

A simulation, not a measurement: on 2 x H200 (glm5-proxy, PP = 2 x VPP = 2) it placed the waits where the profile
found them and was optimistic by about 5% (docs/parallelism.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # run as a script from the repository root


def stage_rows(plan_path: str, gpus: int, gpu: str, vpps=(1, 2, 3, 4)) -> List[dict]:
    from pretrain.curriculum.plan import load_plan
    from pretrain.layout.pipeline_schedule import forward_shares, local_search, simulated_step
    from pretrain.tools.pipeline_split import interleaved_split, simulated_schedule, split_inputs

    rows = []
    for stage in load_plan(plan_path).stages:
        cfg, p = stage.cfg, stage.cfg.parallel
        pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1
        if pp == 1:
            continue
        est = simulated_schedule(cfg, gpus, gpu)
        entries, costs, can_start = split_inputs(cfg, gpu=gpu)
        shares = forward_shares(entries, cfg.model.output_loss_backend in ("chunked", "liger"))
        m = est.microbatches
        row = {"stage": stage.name, "pp": pp, "vpp": vpp, "m": m, "busiest": est.busiest, "simulated": est.simulated,
               "textbook": est.textbook, "searched": {}}
        for v in vpps:
            if len(costs) < pp * v or (v > 1 and m % pp):
                continue
            start = interleaved_split(costs, pp, v, m, can_start)
            _, value = local_search(start, lambda s: simulated_step(s, costs, shares, pp, m, pp), can_start)
            row["searched"][v] = value / est.ideal_s
        rows.append(row)
        print(f"{stage.name}: done", file=sys.stderr, flush=True)
    return rows


def table(rows: List[dict], vpps=(1, 2, 3, 4)) -> str:
    lines = ["| stage | plan layout | m | busiest rank | simulated schedule | textbook (planner) | "
             + " | ".join(f"VPP {v}, searched" for v in vpps) + " |",
             "| --- | --- | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in vpps) + " |"]
    for r in rows:
        searched = " | ".join(f"{r['searched'][v]:.3f}" if v in r["searched"] else "-" for v in vpps)
        lines.append(f"| {r['stage']} | PP{r['pp']} VPP{r['vpp']} | {r['m']} | {r['busiest']:.3f} | "
                     f"**{r['simulated']:.3f}** | {r['textbook']:.3f} | {searched} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", default="configs/curriculum/glm5-744b.yaml")
    parser.add_argument("--gpus", type=int, default=1792)
    parser.add_argument("--gpu", choices=("h100", "h200"), default="h100")
    parser.add_argument("--out", help="also write the Markdown table here")
    args = parser.parse_args(argv)
    text = (f"`python benchmarks/pipeline_plan_schedule.py --plan {args.plan} --gpus {args.gpus} --gpu {args.gpu}`"
            "; each column is the step's schedule against an ideal pipeline (the work spread evenly, no bubble).\n\n"
            + table(stage_rows(args.plan, args.gpus, args.gpu)))
    print(text, end="")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
