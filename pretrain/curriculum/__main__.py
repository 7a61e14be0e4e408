"""Run or check a curriculum plan.

    python -m pretrain.curriculum --plan configs/curriculum/tiny.yaml [--launcher torchrun|srun|inline]
        [--validate-only] [--skip-data-check] [--gpus N [--cluster NAME]] [run_dir=DIR] [optimizer_state=carry]
        [section.key=value ...]

`--gpus N`: the layout planner's checks for every stage on N GPUs of `--cluster` (docs/layout.md): memory per GPU
within 90% of the GPU's and a pipeline bubble of at most 10%, by (PP - 1) / (VPP x m) and by megatron's schedule
simulated with the stage's own virtual stages (unequal stages wait more than the formula says); a stage that fails
is a bad plan. Each pipelined stage's simulated bubble is printed.

`KEY=VALUE` without a dot sets a plan key (run_dir, name, optimizer_state, pretrained, prune_checkpoints);
`section.key=value` applies to every stage's config. Exit codes: 0 done, 1 a stage failed (run the
same command again to resume), 2 a bad plan (one line, before anything runs), 75 a stage was stopped
by a signal after saving a checkpoint (run the same command again; launch/curriculum.sbatch requeues).
"""

from __future__ import annotations

import argparse
import sys
from typing import List

from pretrain.curriculum.plan import PlanError, check_plan_data, load_plan
from pretrain.curriculum.runner import LAUNCHERS, StageFailed, StagePreempted, run_plan
from pretrain.training.preemption import PREEMPTED_EXIT_CODE
from pretrain.layout.types import CLUSTERS
from pretrain.notices import configure_logging


def check_plan_layouts(plan, gpus: int, cluster: str) -> None:
    """The layout planner's memory and bubble checks for every stage on `gpus` GPUs; PlanError (one line) naming
    the first stage that fails."""
    from pretrain.layout.search import check_stage

    for index, stage in enumerate(plan.stages, 1):
        reason = check_stage(stage.cfg, gpus, cluster)
        if reason:
            raise PlanError(f"stage {index} ({stage.name}): {reason}")


def simulated_pipelines(plan, gpus: int, cluster: str) -> List[str]:
    """One line per pipelined stage: its bubble by the layout planner, megatron's schedule simulated with the stage's
    own virtual stages (docs/layout.md), next to the textbook (PP - 1) / (VPP m)."""
    from pretrain.layout.search import layout_of, stage_step
    from pretrain.layout.types import cluster_preset

    gpu_cluster = cluster_preset(cluster, gpus)
    lines = []
    for index, stage in enumerate(plan.stages, 1):
        layout, work = layout_of(stage.cfg, gpus)
        if layout.pp > 1:
            step = stage_step(stage.cfg, layout, work, gpu_cluster)
            lines.append(f"stage {index} ({stage.name}): PP {layout.pp} x VPP {layout.vpp}, {layout.num_microbatches} "
                         f"micro-batches: pipeline bubble {step.bubble_fraction:.1%} of the busiest rank's time "
                         f"(megatron's schedule simulated; the textbook (PP - 1) / (VPP m) says {layout.bubble:.1%})")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", required=True, help="plan YAML (configs/curriculum/*.yaml)")
    parser.add_argument("--launcher", choices=LAUNCHERS, default="torchrun",
                        help="torchrun: launch/train.sh per stage (default); srun: the same under srun "
                             "(inside a Slurm job); inline: in this process, one rank")
    parser.add_argument("--validate-only", action="store_true", help="build every stage's config, print the plan")
    parser.add_argument("--skip-data-check", action="store_true",
                        help="do not read the stages' data files and tokenizers (a plan whose data lives on the "
                             "cluster, validated elsewhere); each stage's run still checks them before it starts")
    parser.add_argument("--gpus", type=int, help="check every stage's layout on this many GPUs (layout planner)")
    parser.add_argument("--cluster", default="h100-nvl-ib400", choices=sorted(CLUSTERS),
                        help="GPU kind and network of --gpus (default h100-nvl-ib400)")
    parser.add_argument("overrides", nargs="*", help="plan keys KEY=VALUE or section.key=value for every stage")
    args = parser.parse_args(argv)
    if args.gpus is not None and args.gpus < 1:
        parser.error(f"--gpus must be >= 1, got {args.gpus}")
    configure_logging()
    try:
        plan = load_plan(args.plan, args.overrides)
        print(plan.summary(), flush=True)
        if args.skip_data_check:
            print("data not checked (--skip-data-check): every stage's data.data_path and data.tokenizer are "
                  "assumed to exist where the plan runs", flush=True)
        else:
            check_plan_data(plan)
        if args.gpus is not None:
            check_plan_layouts(plan, args.gpus, args.cluster)
            print(f"layouts: every stage fits {args.gpus} x {args.cluster} (memory within 90% of a GPU, pipeline "
                  "bubble <= 10%; the layout planner's estimates, docs/layout.md)", flush=True)
            for line in simulated_pipelines(plan, args.gpus, args.cluster):
                print(line, flush=True)
        if args.validate_only:
            return 0
        run_plan(plan, args.launcher, log=lambda line: print(line, flush=True))
    except PlanError as err:
        print(f"plan error: {err}", file=sys.stderr)
        return 2
    except StagePreempted as err:
        print(f"curriculum stopped: {err}", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    except StageFailed as err:
        print(f"curriculum stopped: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
