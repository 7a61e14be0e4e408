"""Run an ablation sweep, then write its table (Markdown, JSON) and loss curves (PNG).

    python -m pretrain.ablate SWEEP.yaml [--dry-run] [--only NAME ...] [--seeds N ...] [--slurm] [--report]
                                         [--parallel N] [--at-step N] [--evaluate-at N]

--dry-run      print the commands that would run (finished runs are listed as skipped), run nothing
--only NAME    only these variants (a variant that starts from another's checkpoint needs it finished)
--seeds N      only these seeds (say, one seed first, the second later)
--slurm        submit one sbatch job per unfinished run (launch/slurm.sbatch) instead of running here
--report       only collect the table and plot from what has run
--output-dir   put the runs somewhere else than the sweep's output_dir
--parallel N   run up to N runs at once on this machine (runs of a small model sharing a GPU)
--at-step N    report every run as of step N (a sweep compared before it finished; runs short of N left out)
--evaluate-at N  run the evaluations of every run's step-N checkpoint (no training), then report as of step N

Results: <output_dir>/results.md, results.json, loss_curves.png (the plot needs matplotlib:
pip install -e '.[plot]'). A bad sweep file stops with one line before anything runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pretrain.ablate.runner import evaluate_at, run_local, run_slurm
from pretrain.ablate.sweep import SweepError, load_sweep, rel, select
from pretrain.notices import configure_logging


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.ablate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", type=Path)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--only", nargs="+", default=[], metavar="NAME")
    parser.add_argument("--seeds", nargs="+", type=int, default=[], metavar="N")
    parser.add_argument("--slurm", action="store_true")
    parser.add_argument("--report", action="store_true")
    parser.add_argument("--output-dir", type=Path, default=None)
    parser.add_argument("--parallel", type=int, default=1, metavar="N")
    parser.add_argument("--at-step", type=int, default=None, metavar="N")
    parser.add_argument("--evaluate-at", type=int, default=None, metavar="N")
    parser.add_argument("--smooth", type=int, default=1, metavar="N", help="moving average of the plotted curves")
    args = parser.parse_args(argv)
    configure_logging()
    if args.parallel < 1:
        parser.error(f"--parallel must be >= 1, got {args.parallel}")
    if args.parallel > 1 and args.slurm:
        parser.error("--parallel runs several runs on this machine; with --slurm every run is its own job")
    if args.at_step is not None and args.at_step < 1:
        parser.error(f"--at-step must be >= 1, got {args.at_step}")
    if args.evaluate_at is not None:
        if args.evaluate_at < 1 or args.report or args.slurm or args.at_step not in (None, args.evaluate_at):
            parser.error("--evaluate-at N (N >= 1) evaluates and reports as of step N; it takes no --report, --slurm "
                         "or other --at-step")
        args.at_step = args.evaluate_at
    try:
        sweep = load_sweep(args.sweep, args.output_dir)
        runs = select(sweep, args.only, args.seeds)
        if args.evaluate_at is not None:
            rc = evaluate_at(sweep, runs, args.evaluate_at, args.dry_run)
            if rc or args.dry_run:
                return rc
        elif not args.report:
            if args.slurm:
                rc = run_slurm(sweep, runs, args.dry_run)
            else:
                rc = run_local(sweep, runs, args.dry_run, parallel=args.parallel)
            if rc or args.dry_run or args.slurm:
                return rc
    except SweepError as err:
        print(f"sweep error: {err}", file=sys.stderr)
        return 2
    from pretrain.ablate.report import write_report

    paths = write_report(sweep, args.smooth, args.at_step)
    print(paths["markdown"].read_text(encoding="utf-8"))
    print("wrote " + ", ".join(rel(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
