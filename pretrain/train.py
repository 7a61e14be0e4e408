"""Training entry point.

    torchrun --nproc-per-node 8 -m pretrain.train --config configs/models/glm5-proxy.yaml \
        train.train_iters=1000 checkpoint.save=ckpt/proxy

One process per GPU (or per CPU rank with gloo). Configuration errors are reported before any
process group or GPU memory is touched. Exit codes: 0 trained, 2 a configuration error (one line),
75 stopped by a signal of `train.exit_signals` after saving a checkpoint (run the same command again
to resume; `pretrain.training.preemption`), anything else a failure.
"""

from __future__ import annotations

import argparse
import sys

from pretrain.config import ConfigError, load_config
from pretrain.notices import configure_logging


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config (may extend another with base:)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.train_iters=100")
    args = parser.parse_args(argv)
    configure_logging()
    try:
        cfg = load_config(args.config, args.overrides)
        from pretrain import compat
        from pretrain.training.loop import Trainer

        compat.install()

        trainer = Trainer(cfg)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    from parallel.initialize import destroy_parallel
    from pretrain.training.preemption import PREEMPTED_EXIT_CODE, Preempted

    try:
        trainer.train()
    except Preempted:  # saved and logged by the trainer; the launcher may requeue on this code
        destroy_parallel()
        return PREEMPTED_EXIT_CODE
    destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
