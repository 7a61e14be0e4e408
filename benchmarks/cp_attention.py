"""One context-parallel rank's dense attention against an even split of one causal call (forward + backward).

    python benchmarks/cp_attention.py --seqs 32768,131072 --cp 2,4 --out cp_attention.json

What one CP rank of glm5-proxy's dense attention computes (`pretrain.model.core_attention`): its S / cp
queries (two chunks of the load-balanced split) against all S gathered keys, 16 heads, qk 256 / v 256, bf16,
forward + backward. Timed side by side on one GPU, every rank's queries in turn (the slowest rank is reported):
- `merged`: `attend_cp_causal`, each chunk as a non-causal block plus a causal square merged by log-sum-exp
  (`pretrain.model.blockwise_attention`; the kernel it takes is recorded);
- `lower_right`: the path before it, one bottom-right causal SDPA call per chunk (flash / memory-efficient);
- `mask` (with `--mask`): one SDPA call with the explicit [S / cp, S] global-causal mask;
- `ideal`: 1 / cp of one causal SDPA call over the whole sequence (cuDNN on Hopper), what a perfect split costs.
Target (issue: CP attention at the speed of one causal call): merged / ideal <= 1.10.

With `--documents N` each (S, cp) also times attention within packed documents (`attend_documents`, the path of
`data.reset_attention_mask: true`) on N windows of the synthetic-long blend of benchmarks/cp_balance.py (log-normal
document lengths, median 8,192 tokens), the slowest rank per window summed over the windows, for the chunk
assignments of `parallel.cp_chunk_assignment`: `zigzag` (two chunks per rank) and `work` (`--chunks-per-rank`, 8 by
default, assigned by work as training does: `parallel.cp_load_balance.assign`); `doc_ideal` is 1 / cp of the same
attention over the whole window on one rank. What `work` buys: doc_zigzag_ms / doc_work_ms; what its smaller pieces
cost: doc_work_ms / doc_ideal_ms against the pair-count imbalance of cp_balance.py.

    python benchmarks/cp_attention.py --seqs 32768,131072 --cp 2,4 --documents 8 --out cp_attention_documents.json
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


def measure(attn, s: int, cp: int, heads: int, reps: int, with_mask: bool) -> dict:
    """Forward + backward times (ms) of the ways of the module docstring; per-rank ways at their slowest rank."""
    import torch
    from megatron.core.transformer.enums import AttnMaskType

    from parallel.context_parallel import causal_visibility, chunk_ids, local_positions, split_sequence
    from pretrain.model.blockwise_attention import choose_kernel

    q, k, v = (torch.randn(s, 1, heads, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    kernel, why = choose_kernel(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), 0.0)
    row = {"seq": s, "cp": cp, "heads": heads, "kernel": kernel.name if kernel else f"none ({why})"}

    def lower_right(mine, rank):
        c = mine.shape[0] // 2
        return torch.cat([attn.attend(mine[i * c:(i + 1) * c], k[:(chunk + 1) * c], v[:(chunk + 1) * c], None,
                                      lower_right=True) for i, chunk in enumerate(chunk_ids(cp, rank))])

    ways = {"merged": lambda mine, rank: attn.attend_cp_causal(mine, k, v, cp, rank), "lower_right": lower_right}
    if with_mask:
        ways["mask"] = lambda mine, rank: attn.attend(
            mine, k, v, ~causal_visibility(local_positions(s // cp, cp, rank, q.device), s))
    for name, fwd in ways.items():
        per_rank = []
        for rank in range(cp):
            mine = split_sequence(q.detach(), 0, cp, rank).requires_grad_()
            per_rank.append(timed(lambda: fwd(mine, rank).sum().backward(), reps))
            q.grad = k.grad = v.grad = None
        row[f"{name}_ms"], row[f"{name}_ms_per_rank"] = max(per_rank), per_rank
    row["ideal_ms"] = timed(lambda: attn.attend(q, k, v, None, AttnMaskType.causal).sum().backward(), reps) / cp
    q.grad = k.grad = v.grad = None
    for name in ways:
        row[f"{name}_over_ideal"] = row[f"{name}_ms"] / row["ideal_ms"]
    return row


def measure_documents(attn, s: int, cp: int, heads: int, reps: int, windows: int, chunks_per_rank: int,
                      device: str = "cuda") -> dict:
    """Document attention (forward + backward, ms) per chunk assignment, the slowest rank of each window summed over
    `windows` packed windows (module docstring)."""
    import torch

    from benchmarks.cp_balance import synthetic_windows
    from parallel.context_parallel import split_sequence
    from parallel.cp_load_balance import assign, chunk_work, imbalance, rank_work, zigzag
    from pretrain.model.documents import attention_plan, query_blocks

    q, k, v = (torch.randn(s, 1, heads, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    row = {"seq": s, "cp": cp, "heads": heads, "windows": windows, "chunks_per_rank": chunks_per_rank}
    totals = {"doc_zigzag_ms": 0.0, "doc_work_ms": 0.0, "doc_ideal_ms": 0.0}
    pairs = {"zigzag": [], "work": []}
    for starts in synthetic_windows(s, windows, 8192.0, 1.5, seed=s):
        layout = torch.stack([starts, torch.zeros_like(starts)]).to(device, torch.int32)[None]  # [1, 2, S]
        whole = attention_plan(layout, query_blocks(s))
        totals["doc_ideal_ms"] += timed(lambda: attn.attend_documents(q, k, v, whole).sum().backward(), reps) / cp
        q.grad = k.grad = v.grad = None
        work_assignment = assign(starts[None], cp, chunks_per_rank) or zigzag(cp)
        for name, assignment in (("zigzag", None), ("work", work_assignment)):
            per_rank = []
            for rank in range(cp):
                mine = split_sequence(q.detach(), 0, cp, rank, assignment).requires_grad_()
                plan = attention_plan(layout, query_blocks(s // cp, cp, rank, assignment=assignment))
                per_rank.append(timed(lambda: attn.attend_documents(mine, k, v, plan).sum().backward(), reps))
                k.grad = v.grad = None
            totals[f"doc_{name}_ms"] += max(per_rank)
            chunks = assignment or zigzag(cp)
            pairs[name].append(imbalance(rank_work(chunk_work(starts, len(chunks) * len(chunks[0])).tolist(), chunks)))
    row.update(totals)
    row["doc_zigzag_over_work"] = totals["doc_zigzag_ms"] / totals["doc_work_ms"]
    for name in ("zigzag", "work"):
        row[f"doc_{name}_over_ideal"] = totals[f"doc_{name}_ms"] / totals["doc_ideal_ms"]
        row[f"pairs_{name}_imbalance_mean"] = sum(pairs[name]) / len(pairs[name])
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", default="32768")
    parser.add_argument("--cp", default="2")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--mask", action="store_true", help="also time the explicit-mask path (slow)")
    parser.add_argument("--documents", type=int, default=0,
                        help="also time attention within packed documents on this many windows per (S, cp)")
    parser.add_argument("--chunks-per-rank", type=int, default=8, help="chunks per rank of the work assignment")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    import torch
    from megatron.core.transformer.enums import AttnMaskType

    from pretrain.model.core_attention import SDPACoreAttention

    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    config = SimpleNamespace(cp_attention="merged", context_parallel_size=1, attention_dropout=0.0, kv_channels=256,
                             num_attention_heads=args.heads, experimental_attention_variant=None)
    attn = SDPACoreAttention(config, 1, AttnMaskType.causal, k_channels=256, v_channels=256,
                             softmax_scale=1 / math.sqrt(256))
    rows = []
    for s in (int(x) for x in args.seqs.split(",")):
        for cp in (int(x) for x in args.cp.split(",")):
            row = measure(attn, s, cp, args.heads, args.reps, args.mask)
            print(json.dumps(row), flush=True)
            rows.append(row)
            torch.cuda.empty_cache()
            if args.documents:
                row = measure_documents(attn, s, cp, args.heads, args.reps, args.documents, args.chunks_per_rank)
                print(json.dumps(row), flush=True)
                rows.append(row)
                torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
