"""glm5-preprocess end to end against the raw `tokenizers` batch encoder, and its memory.

    python benchmarks/preprocess_throughput.py --workdir /tmp/ppbench --out results.json

1. Writes JSONL corpora of the given sizes (default 0.25 and 1 GB) by repeating the standard
   library corpus (`data_pipeline.stdlib_corpus`), one document per line, streamed to disk.
2. Runs `python -m data_pipeline.preprocess --append-eod` on them for each `--workers` count
   in a fresh process, and reads back its summary: tokens/s (wall clock, including start-up,
   reading, JSON decoding, inter-process transfer and writing .bin/.idx), peak RSS of the main
   process and of the largest worker, plus the CPU seconds the whole process tree used.
3. In this process, times the raw HF `tokenizers` batch encoders on the first `--raw-mb` of the
   same JSONL (texts decoded beforehand, nothing written), single-threaded as each preprocess
   worker is: `encode_batch_fast` (what the workers call) and `encode_batch`, in batches of
   `--batch-bytes` like the workers. It runs once before and once after the preprocess runs,
   since the machine may be shared; the mean is the reference.

Reports per run: tokens/s, tokens/s per worker, and that divided by the raw single-thread
`encode_batch_fast` speed (target: >= 80%). Not a test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the raw reference runs on one thread, like a worker

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def generate_corpus(path: str, target_bytes: int) -> dict:
    """JSONL of stdlib documents repeated until `target_bytes`, written as it is produced."""
    from data_pipeline.readers import iter_documents, stdlib_files

    if os.path.exists(path) and os.path.getsize(path) >= target_bytes:
        return {"path": path, "bytes": os.path.getsize(path), "reused": True}
    files, written, documents, passes = stdlib_files(), 0, 0, 0
    with open(path + ".partial", "w", encoding="utf-8") as f:
        while written < target_bytes:
            passes += 1
            for doc in iter_documents(files):
                line = json.dumps({"text": doc.text}, ensure_ascii=False) + "\n"
                f.write(line)
                written += len(line.encode("utf-8"))
                documents += 1
                if written >= target_bytes:
                    break
    os.replace(path + ".partial", path)
    return {"path": path, "bytes": written, "documents": documents, "stdlib_passes": passes}


def raw_encode(tokenizer_path: str, corpus: str, max_bytes: int, batch_bytes: int, method: str) -> dict:
    from data_pipeline.tokenizer import load_tokenizer

    hf = load_tokenizer(tokenizer_path).hf_tokenizer  # same settings as the workers
    encode = getattr(hf, method)
    batches, batch, size, total = [], [], 0, 0
    with open(corpus, "rb") as f:
        for line in f:
            text = json.loads(line)["text"]
            batch.append(text)
            size += len(line)
            total += len(line)
            if size >= batch_bytes:
                batches.append(batch)
                batch, size = [], 0
            if total >= max_bytes:
                break
    batches += [batch] if batch else []
    start, cpu_start, tokens = time.perf_counter(), time.process_time(), 0
    for texts in batches:
        tokens += sum(len(e.ids) for e in encode(texts, add_special_tokens=False))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return {"method": method, "input_bytes": total, "tokens": tokens, "wall_s": wall, "cpu_s": cpu,
            "tokens_per_s": tokens / wall, "tokens_per_cpu_s": tokens / cpu, "loadavg_1min_after": os.getloadavg()[0]}


def run_preprocess(corpus: str, tokenizer: str, workers: int, workdir: str, batch_bytes: int) -> dict:
    summary_path = os.path.join(workdir, "summary.json")
    cmd = [sys.executable, "-m", "data_pipeline.preprocess", "--input", corpus, "--tokenizer", tokenizer,
           "--output-prefix", os.path.join(workdir, "out"), "--append-eod", "--workers", str(workers),
           "--batch-bytes", str(batch_bytes), "--overwrite", "--summary-json", summary_path]
    before, load_before = resource.getrusage(resource.RUSAGE_CHILDREN), os.getloadavg()[0]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    after, load_after = resource.getrusage(resource.RUSAGE_CHILDREN), os.getloadavg()[0]
    with open(summary_path) as f:
        summary = json.load(f)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    keep = ("documents", "tokens", "input_bytes", "workers", "wall_s", "tokens_per_s", "main_peak_rss_mib",
            "worker_peak_rss_mib", "skipped")
    return {**{k: summary[k] for k in keep}, "cpu_s": cpu, "tokens_per_cpu_s": summary["tokens"] / cpu,
            "loadavg_1min_before": load_before, "loadavg_1min_after": load_after}


def machine() -> dict:
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    import tokenizers

    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(),
            "tokenizers": tokenizers.__version__, "date": datetime.date.today().isoformat()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="/tmp/preprocess_bench")
    p.add_argument("--tokenizer", help="tokenizer.json; default: train a 32K byte-level BPE on the stdlib")
    p.add_argument("--sizes-gb", type=float, nargs="+", default=[0.25, 1.0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--small-workers", type=int, nargs="+", default=[2], help="worker counts on the smaller corpora")
    p.add_argument("--raw-mb", type=float, default=32, help="MB of the corpus for the raw encoder reference")
    p.add_argument("--batch-bytes", type=int, default=1 << 20)
    p.add_argument("--out", help="write all numbers as JSON here")
    args = p.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    tokenizer = args.tokenizer
    if tokenizer is None:
        tokenizer = os.path.join(args.workdir, "stdlib-32k", "tokenizer.json")
        if not os.path.exists(tokenizer):
            subprocess.run([sys.executable, "-m", "data_pipeline.train_tokenizer", "--input", "@stdlib",
                            "--vocab-size", "32768", "--output", tokenizer], cwd=REPO, check=True)
    results = {"machine": machine(), "command": " ".join(sys.argv), "tokenizer": tokenizer, "corpora": [], "raw": [],
               "runs": []}
    corpora = {}
    for gb in sorted(args.sizes_gb):
        path = os.path.join(args.workdir, f"stdlib_{gb:g}gb.jsonl")
        results["corpora"].append(generate_corpus(path, int(gb * 1e9)))
        corpora[gb] = path
        print(f"corpus {path}: {os.path.getsize(path) / 1e9:.3f} GB", flush=True)
    largest = max(corpora)
    raw_args = (tokenizer, corpora[largest], int(args.raw_mb * 1e6), args.batch_bytes)
    results["raw"].append(raw_encode(*raw_args, "encode_batch_fast"))
    results["raw"].append(raw_encode(*raw_args, "encode_batch"))
    print(json.dumps(results["raw"], indent=1), flush=True)
    for gb, path in sorted(corpora.items(), reverse=True):
        for workers in args.workers if gb == largest else args.small_workers:
            run = run_preprocess(path, tokenizer, workers, args.workdir, args.batch_bytes)
            results["runs"].append({"corpus_gb": gb, **run})
            print(json.dumps(results["runs"][-1]), flush=True)
    results["raw"].append(raw_encode(*raw_args, "encode_batch_fast"))
    raw = [r["tokens_per_s"] for r in results["raw"] if r["method"] == "encode_batch_fast"]
    raw_cpu = [r["tokens_per_cpu_s"] for r in results["raw"] if r["method"] == "encode_batch_fast"]
    reference, reference_cpu = sum(raw) / len(raw), sum(raw_cpu) / len(raw_cpu)
    results["reference_tokens_per_s"] = reference
    print(f"\nraw encode_batch_fast, 1 thread: {' / '.join(f'{r:,.0f}' for r in raw)} tokens/s (before / after)")
    columns = ["corpus", "workers", "tokens", "wall (s)", "tokens/s", "per worker", "vs raw", "per CPU-s vs raw",
               "RSS main", "RSS worker", "load avg"]
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))
    for r in results["runs"]:
        per_worker = r["tokens_per_s"] / r["workers"]
        r["ratio_to_raw"] = per_worker / reference
        r["cpu_ratio_to_raw"] = r["tokens_per_cpu_s"] / reference_cpu
        print(f"| {r['input_bytes'] / 1e9:.2f} GB | {r['workers']} | {r['tokens']:,} | {r['wall_s']:.1f} | "
              f"{r['tokens_per_s']:,.0f} | {per_worker:,.0f} | {r['ratio_to_raw']:.0%} | {r['cpu_ratio_to_raw']:.0%} | "
              f"{r['main_peak_rss_mib']:.0f} MiB | {r['worker_peak_rss_mib']:.0f} MiB | {r['loadavg_1min_after']:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
