"""Corpus to megatron-core `IndexedDataset` (`glm5-preprocess`).

    glm5-preprocess --input data/*.jsonl --tokenizer tok/tokenizer.json \
        --output-prefix data/corpus --append-eod --workers 8
    glm5-preprocess --input @stdlib --tokenizer tok/tokenizer.json --output-prefix data/stdlib --append-eod

Flags follow Megatron-LM's `tools/preprocess_data.py` where they overlap (`--input`,
`--output-prefix`, `--json-keys`, `--workers`, `--append-eod`, `--log-interval`). Differences:
`--input` takes any number of files, directories, globs or `@stdlib` (see `readers`) and one
text field; the output is `PREFIX.bin/.idx` (not `PREFIX_text_document.*`) plus
`PREFIX.meta.json`, or shards `PREFIX_00000.*` with `--shard-size-docs`.

Pipeline: the main process streams raw records (undecoded lines / files) in batches of about
`--batch-bytes` to `--workers` processes, at most two batches per worker in flight, so memory
does not grow with the corpus; a worker decodes (UTF-8, JSON) and tokenizes its batch with one
`encode_batch` call and returns the token ids as one array; the main process writes the batches
in input order through megatron's `IndexedDatasetBuilder`. The output is therefore identical for
any number of workers. Files are written under partial names and renamed when complete
(see `indexed.DatasetWriter`).

Exit status: 0 done, 1 bad input under `--strict`, 2 command-line error (one line on stderr).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import itertools
import json
import multiprocessing
import os
import resource
import sys
import time

import numpy as np

from data_pipeline.readers import BadInputError, InputError, RecordReader, SkipReport, decode_record
from data_pipeline.readers import expand_inputs, format_origin, parse_extensions
from data_pipeline.tokenizer import TokenizerError

_worker: dict = {}


class CLIError(Exception):
    """A command-line mistake: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise CLIError(message)


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(prog="glm5-preprocess", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", action="extend", nargs="+", required=True,
                   help="files, directories, globs or @stdlib; repeatable")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx, PREFIX.meta.json")
    p.add_argument("--tokenizer", required=True, help="Hugging Face tokenizer.json (or its directory)")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="JSONL field / parquet column of the text")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizer processes")
    p.add_argument("--append-eod", action="store_true", help="end every document with the eod token")
    p.add_argument("--extensions", help="comma list filtering directories and globs, e.g. .py,.c")
    p.add_argument("--lines-as-documents", action="store_true", help="plain text: one document per line")
    p.add_argument("--strict", action="store_true", help="stop at the first bad document (file:line)")
    p.add_argument("--shard-size-docs", type=int, help="start a new PREFIX_NNNNN shard every N documents")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset at PREFIX")
    p.add_argument("--log-interval", type=int, default=100_000, help="documents between log lines (no TTY)")
    p.add_argument("--batch-bytes", type=int, default=1 << 20, help="input bytes per worker task")
    p.add_argument("--summary-json", help="also write the run summary to this JSON file")
    p.add_argument("--eod-token", help="name of the end-of-document token (default: eos_token of a "
                   "tokenizer_config.json beside tokenizer.json, else a usual name such as <|endoftext|>)")
    args = p.parse_args(argv)
    if len(args.json_keys) != 1:
        p.error("give one --json-keys field; run once per field for several outputs")
    if args.workers < 1 or args.batch_bytes < 1 or (args.shard_size_docs is not None and args.shard_size_docs < 1):
        p.error("--workers, --batch-bytes and --shard-size-docs must be positive")
    return args


# --- worker processes ---------------------------------------------------------------------


def _init_worker(tokenizer_path: str, eod_token: str | None, json_key: str, append_eod: bool, dtype: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker; the pool is the parallelism
    from data_pipeline.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path, eod_token=eod_token)
    _worker.update(tokenizer=tokenizer, json_key=json_key, append_eod=append_eod, dtype=np.dtype(dtype))


def encode_records(records) -> tuple[np.ndarray, np.ndarray, list, int]:
    """(token ids of the good documents back to back, their lengths, skips, worker peak RSS KiB)."""
    texts, skips = [], []
    for record in records:
        text, reason, detail = decode_record(record, _worker["json_key"])
        if reason is None:
            texts.append(text)
        else:
            skips.append((reason, record.source, record.line, detail))
    ids = _worker["tokenizer"].tokenize_batch(texts) if texts else []
    if _worker["append_eod"]:
        eod = _worker["tokenizer"].eod
        for doc in ids:
            doc.append(eod)
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype=_worker["dtype"], count=int(lengths.sum()))
    return tokens, lengths, skips, peak_rss_kib()


def peak_rss_kib() -> int:
    """This process's peak RSS. VmHWM, since ru_maxrss of a spawned child includes its parent's."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _batches(reader: RecordReader, batch_bytes: int):
    batch, size = [], 0
    for record in reader:
        batch.append(record)
        size += len(record.payload) if isinstance(record.payload, (bytes, str)) else 1
        if size >= batch_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


# --- the run ------------------------------------------------------------------------------


def _token_dtype(vocab_size: int):
    from data_pipeline.indexed import megatron_indexed_dataset

    return megatron_indexed_dataset().DType.optimal_dtype(vocab_size)


class _Progress:
    def __init__(self, total_bytes: int, log_interval: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="preprocess", disable=None, smoothing=0.1)
        self.log_interval, self.next_log, self.start = log_interval, log_interval, time.perf_counter()

    def update(self, bytes_read: int, documents: int, tokens: int) -> None:
        self.bar.update(bytes_read - self.bar.n)
        if self.bar.disable and documents >= self.next_log:
            elapsed = time.perf_counter() - self.start
            print(f"[preprocess] {documents:,} documents, {tokens:,} tokens, {tokens / elapsed:,.0f} tokens/s, "
                  f"{bytes_read / 1e6:,.0f}/{self.bar.total / 1e6:,.0f} MB", flush=True)
            self.next_log = documents + self.log_interval
        elif not self.bar.disable:
            self.bar.set_postfix(docs=f"{documents:,}", tokens=f"{tokens:,}", refresh=False)

    def close(self) -> None:
        self.bar.close()


@contextlib.contextmanager
def _worker_pool(workers: int, ctx, initargs: tuple):
    """A process pool whose exit never kills a worker mid-write.

    `multiprocessing.Pool.__exit__` terminates its workers; one killed while it holds the result queue's lock leaves
    the pool's task thread waiting on that lock forever (a hang seen in CI after a writer error). The executor
    instead cancels the batches not yet started and waits for the at most 2 x workers in flight, and a worker that
    dies raises `BrokenProcessPool` instead of hanging.
    """
    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                                  initargs=initargs)
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def preprocess(args: argparse.Namespace) -> dict:
    """Run the preprocessing described by `args` (see `parse_args`); the summary dict."""
    from data_pipeline.indexed import DatasetWriter, final_paths
    from data_pipeline.tokenizer import load_tokenizer

    start = time.perf_counter()
    tokenizer = load_tokenizer(args.tokenizer, eod_token=args.eod_token)
    files = expand_inputs(args.input, parse_extensions(args.extensions))
    existing = final_paths(args.output_prefix)
    if existing and not args.overwrite:
        raise CLIError(f"output exists: {existing[0]} (pass --overwrite to replace the dataset {args.output_prefix})")
    dtype = _token_dtype(tokenizer.vocab_size)
    json_key = args.json_keys[0]
    reader = RecordReader(files, json_key, args.lines_as_documents)
    skips, documents, tokens, worker_rss = SkipReport(), 0, 0, 0
    progress = _Progress(reader.total_bytes, args.log_interval)
    ctx = multiprocessing.get_context("spawn")  # workers import no torch and inherit no threads
    initargs = (tokenizer.path, tokenizer.eod_token, json_key, args.append_eod, np.dtype(dtype).name)
    try:
        with DatasetWriter(args.output_prefix, dtype, args.shard_size_docs) as writer, \
                _worker_pool(args.workers, ctx, initargs) as pool:
            pending: collections.deque = collections.deque()
            batches = _batches(reader, args.batch_bytes)

            def write_next() -> None:
                nonlocal documents, tokens, worker_rss
                ids, lengths, batch_skips, rss = pending.popleft().result()
                for reason, source, line, detail in batch_skips:
                    origin = format_origin(source, line)
                    if args.strict:
                        raise BadInputError(origin, reason, detail)
                    skips.add(reason, origin, detail)
                offset = 0
                for length in lengths.tolist():
                    writer.add_document(ids[offset : offset + length])
                    offset += length
                documents += len(lengths)
                tokens += offset
                worker_rss = max(worker_rss, rss)
                progress.update(reader.bytes_read, documents, tokens)

            for batch in batches:
                pending.append(pool.submit(encode_records, batch))
                if len(pending) >= 2 * args.workers:
                    write_next()
            while pending:
                write_next()
            tokenize_s = time.perf_counter() - start
            meta = {
                "tokenizer": {"path": tokenizer.path, "sha256": tokenizer.sha256,
                              "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod, "pad": tokenizer.pad},
                "append_eod": args.append_eod,
                "json_key": json_key,
                "inputs": args.input,
                "skipped": skips.as_dict(),
            }
            prefixes = writer.close(meta)
    finally:
        progress.close()
    wall = time.perf_counter() - start
    return {
        "output_prefix": args.output_prefix, "prefixes": prefixes, "files": len(files),
        "documents": documents, "tokens": tokens, "skipped": skips.as_dict(), "skip_report": skips.format(),
        "input_bytes": reader.total_bytes, "dtype": np.dtype(dtype).name, "workers": args.workers,
        "wall_s": wall, "tokenize_s": tokenize_s, "tokens_per_s": tokens / wall,
        "main_peak_rss_mib": peak_rss_kib() / 1024,
        "worker_peak_rss_mib": worker_rss / 1024,
    }


def format_summary(s: dict) -> str:
    written = f"{s['output_prefix']}.{{bin,idx,meta.json}}"
    if len(s["prefixes"]) > 1 or s["prefixes"] != [s["output_prefix"]]:
        written = f"{len(s['prefixes'])} shards {s['prefixes'][0]}..{s['prefixes'][-1][-5:]}.{{bin,idx,meta.json}}"
        written += f" and {s['output_prefix']}.meta.json"
    return "\n".join([
        f"wrote {written}: {s['documents']:,} documents, "
        f"{s['tokens']:,} tokens ({s['dtype']}) from {s['files']:,} files ({s['input_bytes'] / 1e6:,.1f} MB)",
        s["skip_report"],
        f"throughput: {s['tokens_per_s']:,.0f} tokens/s ({s['input_bytes'] / 1e6 / s['wall_s']:.2f} MB/s) "
        f"with {s['workers']} workers, wall {s['wall_s']:.1f} s",
        f"peak RSS: main {s['main_peak_rss_mib']:,.0f} MiB, worker {s['worker_peak_rss_mib']:,.0f} MiB",
    ])


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        summary = preprocess(args)
    except BadInputError as err:
        print(f"glm5-preprocess: bad input (--strict): {err}", file=sys.stderr)
        return 1
    except (CLIError, InputError, TokenizerError) as err:
        print(f"glm5-preprocess: error: {err}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
