"""The layout planner's command line (docs/layout.md):

    python -m pretrain.layout --config configs/models/glm5-744b.yaml --seq 4096 --global-batch 2048 \
        --cluster h100-nvl-ib400 --gpus 2048 [--top 5] [--table out.tsv] [--emit-overrides] [--tokens 28.5e12] \
        [--zero2-grad-reduce search|microbatch|step]

Prints the best layouts (memory per GPU with its breakdown, step time by component, tokens/s per GPU, MFU, days for
--tokens) and how many layouts each rule refused, with one example reason per rule.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from pretrain.layout.types import CLUSTERS, GiB, Workload


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pretrain.layout", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="model config (YAML)")
    p.add_argument("--seq", type=int, required=True, help="tokens per sequence")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--cluster", default="h100-nvl-ib400", choices=sorted(CLUSTERS), help="cluster preset")
    p.add_argument("--gpus", type=int, required=True, help="GPUs the layout must use")
    p.add_argument("--top", type=int, default=5, help="layouts printed")
    p.add_argument("--table", help="write every feasible layout to this TSV file")
    p.add_argument("--emit-overrides", action="store_true", help="print the best layout's config overrides")
    p.add_argument("--tokens", type=float, help="tokens to train: print the days the best layouts take")
    p.add_argument("--headroom", type=float, default=0.10, help="GPU memory kept free (fraction)")
    p.add_argument("--bubble-bound", type=float, default=0.10, help="largest pipeline bubble accepted (fraction)")
    p.add_argument("--optimizer", choices=["muon", "adam"], help="default: the config's")
    p.add_argument("--zero2-grad-reduce", choices=["search", "microbatch", "step"], default=None,
                   help="Muon ZeRO-2's optimizer.zero2_grad_reduce: searched (the default), or pinned to one mode; an "
                        "optimizer.zero2_grad_reduce=... override pins it too")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. model.dsa_sparse_attention=true")
    args = p.parse_args(argv)
    if args.gpus < 1 or args.seq < 1 or args.global_batch < 1:
        p.error("--gpus, --seq and --global-batch must be positive")
    if not 0 <= args.headroom < 1 or not 0 <= args.bubble_bound < 1:
        p.error("--headroom and --bubble-bound are fractions in [0, 1)")
    return args


NO_LAYOUT = ["parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
             "parallel.virtual_pipeline_model_parallel_size=null", "parallel.pipeline_model_parallel_layout=null",
             "parallel.num_layers_in_first_pipeline_stage=null", "parallel.num_layers_in_last_pipeline_stage=null",
             "parallel.context_parallel_size=1", "parallel.expert_model_parallel_size=1",
             "parallel.expert_tensor_parallel_size=1", "parallel.sequence_parallel=false"]


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    from pretrain.config import load_config
    from pretrain.layout.search import (SearchOptions, config_validator, default_step_fn, pipeline_costs,
                                        saves_checkpoints, search)
    from pretrain.layout.types import ModelDims, cluster_preset

    # the planner searches the layout itself: the config's own parallel section (an example for another cluster,
    # often one that a cut model's depth does not divide) is reset before the user's overrides
    cfg = load_config(args.config, NO_LAYOUT + list(args.overrides))
    # the reduce mode is a layout dimension: searched unless pinned here or by an override (the config file's own
    # value, like its parallel section, is an example the search replaces)
    if args.zero2_grad_reduce not in (None, "search"):
        reduce_modes = (args.zero2_grad_reduce,)
    elif args.zero2_grad_reduce is None and any(o.startswith("optimizer.zero2_grad_reduce=") for o in args.overrides):
        reduce_modes = (cfg.optimizer.zero2_grad_reduce,)
    else:
        reduce_modes = ("microbatch", "step")
    dims = ModelDims.from_config(cfg)
    cluster = cluster_preset(args.cluster, args.gpus)
    work = Workload(args.seq, args.global_batch)
    opts = SearchOptions(headroom=args.headroom, bubble_bound=args.bubble_bound,
                         optimizer=args.optimizer or cfg.optimizer.optimizer, trainable=cfg.train.trainable_params,
                         saves=saves_checkpoints(cfg), pinned_staging=cfg.checkpoint.pinned_staging,
                         zero2_grad_reduce=reduce_modes,
                         pipeline_costs=pipeline_costs(cfg, work, gpu=cluster.gpu_kind))
    try:
        default_step_fn(cluster)  # the CLI never ranks without the time model: its calibration loads first
    except (RuntimeError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # the default time model: textbook bubble first, the best pipelined layouts re-timed by the simulated schedule
    result = search(dims, work, cluster, opts, validate=config_validator(cfg, work))
    print(f"{args.config}: {dims.total_params / 1e9:.1f}B parameters; seq {args.seq}, global batch {args.global_batch} "
          f"({work.tokens_per_step / 1e6:.1f}M tokens/step) on {args.gpus} x {cluster.gpu_kind} ({args.cluster}); "
          f"{result.considered} layouts considered, {len(result.ranked)} feasible; ZeRO-2 gradient reduce "
          + ("searched (microbatch, step)" if len(reduce_modes) > 1 else f"pinned to {reduce_modes[0]}"))
    for i, cand in enumerate(result.ranked[:args.top], 1):
        print(describe(i, cand, args.tokens))
    if not result.ranked:
        print("no layout fits: see the refusals below")
    print("refused:")
    for kind, n in result.refused.most_common():
        print(f"  {n:7d}  {result.examples[kind]}")
    if args.emit_overrides and result.ranked:
        print("overrides of the best layout:")
        print(" ".join(result.ranked[0].layout.overrides()))
    if args.table:
        write_table(args.table, result.ranked, args.tokens)
        print(f"wrote {len(result.ranked)} layouts to {args.table}")
    return 0 if result.ranked else 1


def days(cand, tokens: Optional[float]) -> Optional[float]:
    return tokens / cand.tokens_per_s / 86400 if tokens and cand.tokens_per_s else None


def describe(i: int, cand, tokens: Optional[float]) -> str:
    st, mem, lay = cand.step, cand.memory, cand.layout
    d = days(cand, tokens)
    lines = [f"#{i} {lay.short()}",
             f"   {st.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, MFU {st.mfu:.1%}, step {st.total:.2f} s, "
             f"bubble {cand.step.bubble_fraction:.1%}" + (f", {d:.1f} days for {tokens:.3g} tokens" if d else ""),
             f"   memory {mem.needed / GiB:.1f} GiB (peak {mem.total / GiB:.1f} + reserve {mem.reserve / GiB:.1f}, "
             f"pipeline rank {mem.rank}): {mem.format()}",
             f"   host memory {cand.host.per_node / GiB:,.0f} GiB per node ({cand.host.gpus_per_node} GPUs x "
             f"{cand.host.per_gpu / GiB:.1f}: {cand.host.format()})",
             "   time (s): " + "  ".join(f"{k} {v:.3f}" for k, v in st.components().items() if v >= 5e-4)]
    return "\n".join(lines)


COLUMNS = ["tp", "pp", "vpp", "ep", "etp", "cp", "dp", "micro_batch_size", "num_microbatches", "recompute",
           "activation_offload", "optimizer", "zero", "zero2_grad_reduce"]


def write_table(path: str, ranked, tokens: Optional[float]) -> None:
    with open(path, "w") as f:
        f.write("\t".join(COLUMNS + ["bubble", "memory_gib", "needed_gib", "host_gib_per_node", "step_s",
                                     "tokens_per_s_per_gpu", "mfu", "days"]) + "\n")
        for c in ranked:
            d = days(c, tokens)
            row = [str(getattr(c.layout, k)) for k in COLUMNS] + [
                f"{c.step.bubble_fraction:.4f}", f"{c.memory.total / GiB:.2f}",
                f"{c.memory.needed / GiB:.2f}", f"{c.host.per_node / GiB:.1f}", f"{c.step.total:.4f}",
                f"{c.step.tokens_per_s_per_gpu:.1f}", f"{c.step.mfu:.4f}", f"{d:.2f}" if d else ""]
            f.write("\t".join(row) + "\n")


if __name__ == "__main__":
    sys.exit(main())
