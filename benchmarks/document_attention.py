"""Dense attention with packed documents against the same window without them, and the host cost of documents.

    python benchmarks/document_attention.py --seqs 32768,131072 --cp 1,2 --out document_attention.json
    python benchmarks/document_attention.py --host-only --seqs 16384,131072     # CPU: pack_sample + layout

GPU part: glm5-proxy's dense attention shape (16 heads, qk 256 / v 256, bf16, forward + backward) for one CP rank
(`pretrain.model.core_attention`): its S / cp queries against the S keys,
- `causal`: without documents (cp 1: one causal SDPA call, cuDNN; cp > 1: `attend_cp_causal`);
- `varlen` / `split`: with documents (`pretrain.model.document_attention`), FlashAttention varlen in one call,
  or one SDPA call per document piece.
Documents: lengths drawn log-uniformly in [--min-doc, --max-doc] (seeded) until the window is full, so a window
holds a mix of short and long documents; `--max-doc` at S gives one document in some windows. The ratio column is
time(documents) / time(causal): the target is <= 1.05 (documents cost less attention work than a causal window, so
a kernel on par with cuDNN comes in below 1).

Host part: `data_pipeline.packing.pack_sample` and the batch's document layout (`pretrain.training.step`), time
and tensor bytes per sample.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # run as a script from anywhere

EOD, PAD = 0, -1


def window(s: int, min_doc: int, max_doc: int, seed: int):
    """s + 1 token ids with EODs ending documents of log-uniform lengths."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    text = torch.randint(1, 1000, (s + 1,), generator=gen)
    pos = 0
    while True:
        u = torch.rand((), generator=gen).item()
        pos += int(math.exp(math.log(min_doc) + u * (math.log(max_doc) - math.log(min_doc))))
        if pos >= s:
            return text
        text[pos - 1] = EOD


def host_cost(s: int, args) -> dict:
    import torch

    from data_pipeline.packing import collate_batch, pack_sample
    from pretrain.training.step import with_documents

    text = window(s, args.min_doc, args.max_doc, args.seed)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        batch = with_documents(collate_batch([pack_sample(text, EOD, PAD, True, True, False)]))
        best = min(best, time.perf_counter() - start)
    nbytes = sum(v.numel() * v.element_size() for v in batch.values() if torch.is_tensor(v))
    return {"seq": s, "host_ms": round(best * 1e3, 2), "host_MiB": round(nbytes / 2**20, 3),
            "documents": int(batch["cu_seqlens"].numel() - 1)}


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


def gpu_cost(s: int, cp: int, args) -> dict:
    import torch
    from megatron.core.transformer.enums import AttnMaskType

    from data_pipeline.packing import collate_batch, pack_sample
    from parallel.context_parallel import split_sequence
    from pretrain.model.core_attention import SDPACoreAttention
    from pretrain.model.document_attention import document_attention
    from pretrain.model.documents import attention_plan, query_blocks
    from pretrain.training.step import with_documents

    h, d = args.heads, 256
    config = SimpleNamespace(context_parallel_size=1, attention_dropout=0.0, kv_channels=d, window_size=None,
                             num_attention_heads=h, experimental_attention_variant=None)
    attn = SDPACoreAttention(config, 1, AttnMaskType.causal, k_channels=d, v_channels=d, softmax_scale=d**-0.5)
    batch = with_documents(collate_batch([pack_sample(window(s, args.min_doc, args.max_doc, args.seed), EOD, PAD,
                                                      True, True, False)]))
    layout = batch["document_layout"].cuda()
    q_all, k, v = (torch.randn(s, 1, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    q = split_sequence(q_all.detach(), 0, cp, 0).requires_grad_()  # rank 0 (the same pairs as rank cp - 1)
    plan = attention_plan(layout, query_blocks(s // cp, cp, 0, s))
    grad = torch.randn(s // cp, 1, h * d, device="cuda", dtype=torch.bfloat16)

    def piece(q_, k_, v_, lower_right, mask=None):
        return attn.attend(q_, k_, v_, mask, AttnMaskType.causal, lower_right=lower_right)

    def causal():
        out = attn.attend(q, k, v, None, AttnMaskType.causal) if cp == 1 else attn.attend_cp_causal(q, k, v, cp, 0)
        out.backward(grad)

    def documents(method):
        def run():
            document_attention(q, k, v, plan, d**-0.5, piece, method=method).backward(grad)
        return run

    row = {"seq": s, "cp": cp, "documents": int(batch["cu_seqlens"].numel() - 1),
           "pieces": len(plan.pieces[0]), "causal_ms": round(timed(causal, args.reps), 3)}
    for method in args.methods.split(","):
        try:
            ms = timed(documents(method), args.reps)
        except Exception as exc:  # a method this torch cannot run: said in the table, not hidden
            row[f"{method}_error"] = f"{type(exc).__name__}: {exc}"[:200]
            continue
        row[f"{method}_ms"] = round(ms, 3)
        row[f"{method}_ratio"] = round(ms / row["causal_ms"], 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", default="32768,131072")
    parser.add_argument("--cp", default="1,2")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--min-doc", type=int, default=256)
    parser.add_argument("--max-doc", type=int, default=32768)
    parser.add_argument("--methods", default="varlen,split")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--host-only", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    seqs = [int(x) for x in args.seqs.split(",")]
    rows = [host_cost(s, args) for s in seqs]
    for r in rows:
        print(json.dumps(r), flush=True)
    if not args.host_only:
        import torch

        print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}), flush=True)
        for s in seqs:
            for cp in (int(x) for x in args.cp.split(",")):
                rows.append(gpu_cost(s, cp, args))
                print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
