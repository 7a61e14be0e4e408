"""Causal work per context-parallel rank on packed real documents: zigzag against work-balanced chunks (counts, CPU).

    python benchmarks/cp_balance.py --workdir /tmp/cpbal --seqs 32768,65536,131072 --cp 2,4,8 \
        --out benchmarks/results/cp_balance_cpu/cp_balance.json

Windows come from the training data pipeline (`data_pipeline.datasets.build_datasets`: megatron's GPTDataset
shuffles the documents, packs them end to end into `seq_length` windows, `packing.pack_sample` gives the segment
offsets, `pretrain.model.documents.document_layout` the document start of every token, as the training step does)
with `reset_attention_mask=true`. Data: `--prefix` / `--tokenizer`, else the quickstart corpus built in
`--workdir` (`glm5-train-tokenizer` and `glm5-preprocess` on @stdlib, the running Python's standard library).
Blends: `stdlib` (all documents), `stdlib-long` (half the windows from documents of at least `--long-min` tokens,
`data.min_document_length`, as docs/long_context.md up-samples long documents), and `synthetic-long`: document
lengths drawn from a log-normal distribution (median `--synthetic-median` tokens, sigma `--synthetic-sigma`,
seeded), for lengths the corpus does not have.

Per window and CP size: the attended (query, key) pairs of each chunk (`parallel.cp_load_balance.chunk_work`:
dense attention and the DSA indexer; `--topk` caps each query for DSA's sparse attention), summed per rank for
`zigzag` (megatron's split, 2 cp chunks) and for `work` (chunks assigned by work, 2 cp and 8 cp chunks).
Reported: the imbalance cost sum_w max_r W_r / sum_w mean_r W_r - 1 over the windows (each layer waits for the
slowest rank), and the per-window max / mean at the median, p90 and worst window.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # run as a script from anywhere

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def build_stdlib(workdir: str) -> tuple:
    """(prefix, tokenizer) of the quickstart corpus in `workdir`, built with the pipeline's commands if missing."""
    tokenizer, prefix = os.path.join(workdir, "tokenizer.json"), os.path.join(workdir, "stdlib")
    os.makedirs(workdir, exist_ok=True)
    if not os.path.exists(tokenizer):
        subprocess.run([sys.executable, "-m", "data_pipeline.train_tokenizer", "--input", "@stdlib", "--vocab-size",
                        "32768", "--output", tokenizer], check=True, cwd=ROOT)
    if not os.path.exists(prefix + ".idx"):
        subprocess.run([sys.executable, "-m", "data_pipeline.preprocess", "--input", "@stdlib", "--tokenizer",
                        tokenizer, "--output-prefix", prefix, "--append-eod", "--workers", "2"], check=True, cwd=ROOT)
    return prefix, tokenizer


def pipeline_windows(data_path, min_lengths, tokenizer: str, seq: int, windows: int, workdir: str):
    """Document starts [S] of the first `windows` training windows of a blend, through the data pipeline."""
    from pretrain.config import load_config
    from data_pipeline.datasets import build_datasets
    from pretrain.model.documents import document_layout

    overrides = [f"data.data_path={json.dumps(data_path)}", f"data.min_document_length={json.dumps(min_lengths)}",
                 f"data.tokenizer={tokenizer}", f"data.seq_length={seq}", "data.reset_attention_mask=true",
                 "data.reset_position_ids=true", "data.split=100,0,0", "model.vocab_size=32768",
                 f"model.max_position_embeddings={seq}", "data.mock=false",
                 f"logging.run_dir={workdir}"]
    cfg = load_config(os.path.join(ROOT, "configs", "models", "glm5-tiny.yaml"), overrides)
    train, _, _ = build_datasets(cfg, None, windows, 0, 0)
    for i in range(windows):
        sample = train[i]
        layout = document_layout(sample["cu_seqlens"], None, 1, seq)
        yield layout[0, 0] if layout is not None else None


def synthetic_windows(seq: int, windows: int, median: float, sigma: float, seed: int):
    """Document starts of windows packed from log-normal document lengths (a shuffled stream cut into windows)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    carry = int(torch.empty(1).log_normal_(float(torch.log(torch.tensor(median))), sigma, generator=gen).item())
    for _ in range(windows):
        starts, pos = torch.empty(seq, dtype=torch.int64), 0
        start = 0  # the window begins inside a document (its tail) or at a new one
        while pos < seq:
            length = max(1, min(carry, seq - pos))
            starts[pos:pos + length] = start
            pos += length
            carry -= length
            if carry == 0:
                carry = max(1, int(torch.empty(1).log_normal_(float(torch.log(torch.tensor(median))), sigma,
                                                              generator=gen).item()))
            start = pos
        yield starts


def measure(all_starts, seq: int, cps, topk: int) -> list:
    from parallel.cp_load_balance import balance, chunk_work, imbalance, rank_work, zigzag

    rows = []
    for cp in cps:
        for kind, cap in (("dense", 0), ("sparse", topk)):
            sums = {}
            per_window = {}
            for starts in all_starts:
                ways = {"zigzag": (2 * cp, lambda w: zigzag(cp))}
                ways.update({f"work_{m}cp": (m * cp, lambda w: balance(w.tolist(), cp)) for m in (2, 8)})
                for name, (n, assign) in ways.items():
                    work = chunk_work(starts, n, cap)
                    loads = rank_work(work.tolist(), assign(work))
                    mx, mean = max(loads), sum(loads) / cp
                    total = sums.setdefault(name, [0.0, 0.0])
                    total[0], total[1] = total[0] + mx, total[1] + mean
                    per_window.setdefault(name, []).append(imbalance(loads))
            row = {"seq": seq, "cp": cp, "work": kind, "windows": len(all_starts)}
            for name, (mx, mean) in sums.items():
                values = sorted(per_window[name])
                row[name] = {"cost": mx / mean - 1, "p50": values[len(values) // 2],
                             "p90": values[int(0.9 * (len(values) - 1))], "worst": values[-1]}
            rows.append(row)
    return rows


def document_stats(all_starts, seq: int) -> dict:
    """Documents per window and the share of tokens in documents (pieces within the window) >= 4K / >= seq / 2."""
    import torch

    pieces, long4k, half = 0, 0, 0
    for starts in all_starts:
        bounds = torch.cat([(starts[1:] != starts[:-1]).nonzero().flatten() + 1, torch.tensor([seq])])
        lengths = torch.diff(torch.cat([torch.tensor([0]), bounds]))
        pieces += lengths.numel()
        long4k += int(lengths[lengths >= 4096].sum())
        half += int(lengths[lengths >= seq // 2].sum())
    n = len(all_starts) * seq
    return {"documents_per_window": pieces / len(all_starts), "tokens_in_docs_ge_4k": long4k / n,
            "tokens_in_docs_ge_half_window": half / n}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", help="an indexed dataset prefix (else the stdlib corpus in --workdir)")
    parser.add_argument("--tokenizer")
    parser.add_argument("--workdir", default="/tmp/cp_balance")
    parser.add_argument("--seqs", default="32768,65536,131072")
    parser.add_argument("--cp", default="2,4,8")
    parser.add_argument("--windows", type=int, default=48, help="windows per blend and length")
    parser.add_argument("--long-min", type=int, default=16384, help="min_document_length of the long entry")
    parser.add_argument("--synthetic-median", type=float, default=8192.0)
    parser.add_argument("--synthetic-sigma", type=float, default=1.5)
    parser.add_argument("--topk", type=int, default=2048, help="DSA's top-k (sparse attention's cap per query)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.prefix:
        prefix, tokenizer = args.prefix, args.tokenizer
    else:
        prefix, tokenizer = build_stdlib(args.workdir)
    cps = [int(x) for x in args.cp.split(",")]
    results = []
    for seq in (int(x) for x in args.seqs.split(",")):
        blends = {
            "stdlib": lambda: pipeline_windows([prefix], [], tokenizer, seq, args.windows, args.workdir),
            "stdlib-long": lambda: pipeline_windows(["0.5", prefix, "0.5", prefix], [0, args.long_min], tokenizer,
                                                    seq, args.windows, args.workdir),
            "synthetic-long": lambda: synthetic_windows(seq, args.windows, args.synthetic_median,
                                                        args.synthetic_sigma, seed=seq),
        }
        for blend, windows in blends.items():
            import torch

            starts = [s if s is not None else torch.zeros(seq, dtype=torch.int64) for s in windows()]
            stats = document_stats(starts, seq)
            for row in measure(starts, seq, cps, args.topk):
                row.update(blend=blend, **stats)
                print(json.dumps(row), flush=True)
                results.append(row)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"rows": results, "args": vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
