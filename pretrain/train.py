"""Training entry point.

    torchrun --nproc-per-node 8 -m pretrain.train --config configs/models/glm5-proxy.yaml \
        train.train_iters=1000 checkpoint.save=ckpt/proxy

One process per GPU (or per CPU rank with gloo). Configuration errors are reported before any
process group or GPU memory is touched.
"""

from __future__ import annotations

import argparse
import sys

from pretrain.config import ConfigError, load_config


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config (may extend another with base:)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.train_iters=100")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        from pretrain import compat
        from pretrain.training.loop import Trainer

        compat.install()

        trainer = Trainer(cfg)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    trainer.train()
    from parallel.initialize import destroy_parallel

    destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
