"""What is alive at the peak of a CUDA memory snapshot, grouped by the code that allocated it.

    python -m pretrain.tools.memory_report RUN_DIR/profile/memory_rank0_steps2-2.pickle [--top 25]

Reads the snapshot a run with `logging.profile_memory: true` wrote over its profile window (also
viewable at pytorch.org/memory_viz); the replay is pretrain.training.memory_snapshot's.
"""

from __future__ import annotations

import argparse
import pickle

from pretrain.training.memory_snapshot import format_report, peak_breakdown


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("snapshot")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args(argv)
    with open(args.snapshot, "rb") as f:
        snapshot = pickle.load(f)
    baseline = int(snapshot.get("baseline_bytes", 0))
    peak, sites = peak_breakdown(snapshot["device_traces"][args.device], baseline)
    print(format_report(peak, sites, baseline, args.top))


if __name__ == "__main__":
    main()
