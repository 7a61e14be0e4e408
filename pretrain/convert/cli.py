"""`glm5-convert`: Hugging Face GLM-5 checkpoints <-> our checkpoints.

    glm5-convert import-hf HF_DIR OUT_DIR      # HF safetensors -> our sharded checkpoint
    glm5-convert export-hf CKPT_DIR OUT_HF_DIR # our checkpoint -> HF safetensors + config.json
    glm5-convert hf-to-checkpoint HF_DIR OUT_DIR [--no-mtp]
                                               # HF -> weights-only training checkpoint
                                               # (checkpoint.pretrained; any parallel layout)
"""

from __future__ import annotations

import argparse
import sys

from pretrain.convert import ConversionError, export_hf, import_hf


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="glm5-convert", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import-hf", help="HF directory -> our checkpoint directory")
    imp.add_argument("hf_dir")
    imp.add_argument("out_dir")
    exp = sub.add_parser("export-hf", help="our checkpoint directory -> HF directory")
    exp.add_argument("ckpt_dir")
    exp.add_argument("out_dir")
    to_ckpt = sub.add_parser("hf-to-checkpoint", help="HF directory -> weights for checkpoint.pretrained")
    to_ckpt.add_argument("hf_dir")
    to_ckpt.add_argument("out_dir")
    to_ckpt.add_argument("--no-mtp", action="store_true", help="leave out the MTP layer")
    for p in (imp, exp):
        p.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors shard (GiB)")
    args = parser.parse_args(argv)
    from pretrain.notices import configure_logging

    configure_logging()
    from pretrain import compat

    compat.install()
    shard = int(getattr(args, "max_shard_gb", 5.0) * 2**30)
    try:
        if args.command == "hf-to-checkpoint":
            from pretrain.convert.training_checkpoint import hf_to_checkpoint

            out = hf_to_checkpoint(args.hf_dir, args.out_dir, **({"mtp_num_layers": None} if args.no_mtp else {}))
        elif args.command == "import-hf":
            out = import_hf(args.hf_dir, args.out_dir, max_shard_bytes=shard)
        else:
            out = export_hf(args.ckpt_dir, args.out_dir, max_shard_bytes=shard)
    except (ConversionError, FileNotFoundError, FileExistsError, ValueError) as err:
        print(f"glm5-convert: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
