"""How much the DSA indexer's selections of neighbouring query tokens overlap: the input of a sparse attention
backward that handles several query tokens per program.

The sparse backward adds each (query token, selected key) pair's key gradient into dKV with an fp32 atomic, 576
floats per pair. A program that took T consecutive query tokens and walked the union U of their selections could
sum the T tokens' contributions to a key before one atomic: atomics per key drop from T to 1, by the factor
    reduction(T) = (selected pairs of the T tokens) / |U|,
while the block computes scores for |U| keys per token instead of its own k (masked compute |U| / k per token).
This script runs a model's forward on real text (or mock tokens), records every DSA layer's top-k indices, and
prints reduction(T) and |U| / k per layer for blocks of T = 1, 2, 4, ... tokens (blocks aligned to T, within one
sequence; padded slots, -1, are not selections).

    python lab/dsa/dsa_selection_overlap.py --checkpoint runs/ablations/dsa/dsa/seed1234/checkpoints \
        --data data/stdlib --sequences 4 --blocks 1,2,4,8,16 --out overlap.json
    python lab/dsa/dsa_selection_overlap.py --config configs/models/glm5-tiny.yaml --sequences 2   # random init

With `--config` the weights are a fresh initialization: its selections say nothing about a trained indexer (use it
to try the script). The model runs with `model.dsa_sparse_attention=true` so that every DSA layer selects.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, List

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.dsa_topk_recording import TopkRecorder, dsa_model, recorded_forwards  # noqa: E402


def block_union_sizes(indices: torch.Tensor, block: int) -> torch.Tensor:
    """|union of the selections| of each aligned block of `block` query tokens: indices [b, s, k] (int, -1 = no
    selection) -> [b, s // block] (a last partial block is dropped)."""
    b, s, k = indices.shape
    n = s // block
    x = indices[:, : n * block].reshape(b, n, block * k).sort(dim=-1).values
    new = torch.ones_like(x, dtype=torch.bool)
    new[..., 1:] = x[..., 1:] != x[..., :-1]
    return (new & (x >= 0)).sum(-1)


def overlap_stats(indices: torch.Tensor, blocks: List[int]) -> Dict[str, Dict[str, float]]:
    """Per block size T: `reduction` = selected pairs / union size (summed over all blocks) and `union_per_k`
    = mean union size / k, for the tokens of whole blocks."""
    k = indices.shape[-1]
    out = {}
    for t in blocks:
        n = indices.shape[1] // t
        if n == 0:
            continue
        pairs = (indices[:, : n * t] >= 0).sum()
        unions = block_union_sizes(indices, t)
        out[str(t)] = {"reduction": float(pairs) / max(float(unions.sum()), 1.0),
                       "union_per_k": float(unions.float().mean()) / k}
    return out


def first_keys_share(indices: torch.Tensor) -> float:
    """Share of the tokens with at least k visible keys (t >= k, causal) whose selection is exactly keys 0 .. k - 1:
    what an indexer whose scores tie across a row (e.g. every ReLU(q . k) at 0) selects under the tie rule (lower
    key index first). A layer near 1 has a degenerate, query-independent selection, whose overlap says nothing
    about a trained indexer's."""
    k = indices.shape[-1]
    rows = indices[:, k:]
    if rows.shape[1] == 0:
        return 0.0
    first = torch.arange(k, device=indices.device)
    return float((rows == first).all(-1).float().mean())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a DSA checkpoint (save dir or step dir)")
    src.add_argument("--config", help="a model config, randomly initialized (to try the script)")
    ap.add_argument("--data", default=None, help="dataset prefix of held-out documents (default: random tokens)")
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--blocks", default="1,2,4,8,16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    try:
        blocks = [int(b) for b in args.blocks.split(",")]
        if not blocks or min(blocks) < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--blocks takes positive integers, comma-separated: {args.blocks!r}")
    try:
        # sparse attention so that every DSA layer selects; the sparse indexer loss because the config rules refuse
        # sparse attention with the dense KL (a warm-up checkpoint's); no loss is formed here (forward only)
        cfg, model = dsa_model(args.checkpoint, args.config, ["model.dsa_sparse_attention=true",
                                                              "model.dsa_indexer_use_sparse_loss=true", *args.overrides])
    except ValueError as e:
        ap.error(str(e))
    per_layer: Dict[int, List[torch.Tensor]] = {}
    for calls in recorded_forwards(cfg, model, TopkRecorder(), args.data, args.sequences, args.seed):
        for layer, idx in enumerate(calls):
            per_layer.setdefault(layer, []).append(idx)
    if not per_layer:
        print("no DSA top-k was called: does the model have DSA layers with an indexer?", file=sys.stderr)
        return 2
    k = cfg.model.dsa_indexer_topk
    layers = {str(layer): overlap_stats(torch.cat(idx), blocks) for layer, idx in sorted(per_layer.items())}
    first_k = {str(layer): first_keys_share(torch.cat(idx)) for layer, idx in sorted(per_layer.items())}
    every = overlap_stats(torch.cat([torch.cat(v) for v in per_layer.values()]), blocks)
    print(f"top-{k} of {cfg.data.seq_length} keys, {args.sequences} sequences, "
          f"{len(layers)} DSA layers with their own indexer")
    print(f"{'T':>4}{'reduction':>11}{'|U| / k':>9}   (all layers; per layer in --out)")
    for t, row in every.items():
        print(f"{t:>4}{row['reduction']:>11.2f}{row['union_per_k']:>9.2f}")
    t_max = list(every)[-1]
    print(f"per layer: |U| / k at T = {t_max}, and the share of tokens selecting exactly keys 0 .. k - 1 "
          "(near 1: a degenerate, query-independent selection)")
    for layer, row in layers.items():
        print(f"  layer {layer:>3}: |U| / k {row[t_max]['union_per_k']:6.2f}   first-k share {first_k[layer]:.3f}")
    if args.out:
        record = {"date": time.strftime("%Y-%m-%d"), "source": args.checkpoint or args.config, "data": args.data,
                  "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                  "topk": k, "seq_length": cfg.data.seq_length, "sequences": args.sequences,
                  "all_layers": every, "layers": layers, "first_k_share": first_k}
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
