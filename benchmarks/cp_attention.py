"""One context-parallel rank's dense attention: per-chunk causal calls against the global-causal mask.

    python benchmarks/cp_attention.py --seqs 32768,131072 --cp 2,4 --out cp_attention.json

What one CP rank of glm5-proxy's dense attention computes (`pretrain.model.core_attention`): its S / cp
queries (two chunks of the load-balanced split) against all S gathered keys, 16 heads, qk 256 / v 256, bf16,
forward + backward. Three ways, timed side by side on one GPU:
- `chunks`: `attend_cp_causal`, one lower-right causal SDPA call per chunk (no mask tensor);
- `mask`: one SDPA call with the explicit [S / cp, S] global-causal mask (the path before `chunks`);
- `ideal`: 1 / cp of one causal SDPA call over the whole sequence (what a perfect split would cost).
Rank 0 and rank cp - 1 hold the same number of (query, key) pairs; rank 0 is timed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # run as a script from anywhere


def timed(fn, reps: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def measure(attn, s: int, cp: int, heads: int, reps: int) -> dict:
    """Forward + backward times (ms) of rank 0's attention three ways (the module docstring)."""
    import torch
    from megatron.core.transformer.enums import AttnMaskType

    from parallel.context_parallel import causal_visibility, local_positions, split_sequence

    q, k, v = (torch.randn(s, 1, heads, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    mine = split_sequence(q.detach(), 0, cp, 0).requires_grad_()
    mask = ~causal_visibility(local_positions(s // cp, cp, 0, q.device), s)
    ways = {
        "chunks": lambda: attn.attend_cp_causal(mine, k, v, cp, 0),
        "mask": lambda: attn.attend(mine, k, v, mask),
        "ideal": lambda: attn.attend(q, k, v, None, AttnMaskType.causal),
    }
    row = {"seq": s, "cp": cp, "heads": heads}
    for name, fwd in ways.items():
        ms = timed(lambda: fwd().sum().backward(), reps)
        row[f"{name}_ms"] = ms / cp if name == "ideal" else ms
        q.grad = k.grad = v.grad = mine.grad = None
    row["mask_over_chunks"] = row["mask_ms"] / row["chunks_ms"]
    row["chunks_over_ideal"] = row["chunks_ms"] / row["ideal_ms"]
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", default="32768")
    parser.add_argument("--cp", default="2")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import torch
    from megatron.core.transformer.enums import AttnMaskType

    from pretrain.model.core_attention import SDPACoreAttention

    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    config = SimpleNamespace(context_parallel_size=1, attention_dropout=0.0, kv_channels=256,
                             num_attention_heads=args.heads, experimental_attention_variant=None)
    attn = SDPACoreAttention(config, 1, AttnMaskType.causal, k_channels=256, v_channels=256,
                             softmax_scale=1 / math.sqrt(256))
    rows = []
    for s in (int(x) for x in args.seqs.split(",")):
        for cp in (int(x) for x in args.cp.split(",")):
            row = measure(attn, s, cp, args.heads, args.reps)
            print(json.dumps(row), flush=True)
            rows.append(row)
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
