"""The default corpus: the source files of the running Python's standard library.

It is real text present on every machine, so the main job and the tests need no download.
`stdlib_files()` lists `*.py` under `sysconfig.get_paths()["stdlib"]` recursively, without
`site-packages`/`dist-packages` (installed packages, not the standard library) and
`__pycache__`. A few test-data files are deliberately not valid UTF-8 and some files
(`__init__.py`) are empty; the readers skip those and count them.

Measured on CPython 3.11.7 (pyenv, Linux):

    files        1,790 (31.5 MB)
    documents    1,758 (skipped: 4 invalid_utf8 test-data files, 28 empty_document)
    tokens       7,966,490 (7,968,248 with --append-eod) with the 32,768-token byte-level BPE
                 trained on this corpus by `python -m data_pipeline.train_tokenizer --input @stdlib
                 --vocab-size 32768` (10-16 s on 2 cores; sha256 94a27dcd...), 3.96 bytes/token

Other Python versions differ by a few percent. Reproduce with

    python -m data_pipeline.stdlib_corpus --stats [--tokenizer PATH/tokenizer.json]

The readers accept `@stdlib` wherever an input path goes (`--input @stdlib`); the listing itself
(`stdlib_files`) lives in `readers`, which this module builds on (never the other way round).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from data_pipeline.readers import SkipReport, iter_documents, stdlib_files, stdlib_root


def corpus_stats(tokenizer_path: str | None = None, batch_docs: int = 256) -> dict:
    """Counts of the corpus as the pipeline reads it; tokens only when a tokenizer is given."""
    files = stdlib_files()
    skips = SkipReport()
    stats = {"root": stdlib_root(), "files": len(files), "bytes": sum(os.path.getsize(f) for f in files)}
    tokenizer = None
    if tokenizer_path:
        from data_pipeline.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_path)
    documents, tokens, batch = 0, 0, []
    for doc in iter_documents(files, skips=skips):
        documents += 1
        batch.append(doc.text)
        if tokenizer and len(batch) == batch_docs:
            tokens += sum(map(len, tokenizer.tokenize_batch(batch)))
            batch = []
    if tokenizer:
        tokens += sum(map(len, tokenizer.tokenize_batch(batch))) if batch else 0
        stats.update(tokenizer=tokenizer.path, vocab_size=tokenizer.vocab_size, tokens=tokens)
    stats.update(documents=documents, skipped=skips.as_dict(), skip_report=skips.format())
    return stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stats", action="store_true", help="print files, bytes, documents (and tokens)")
    parser.add_argument("--list", action="store_true", help="print the corpus files, one per line")
    parser.add_argument("--tokenizer", help="tokenizer.json to count tokens with")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(stdlib_files()))
    if args.stats or not args.list:
        start = time.perf_counter()
        stats = corpus_stats(args.tokenizer)
        print(f"stdlib root    {stats['root']} (Python {sys.version.split()[0]})")
        print(f"files          {stats['files']:,} ({stats['bytes'] / 1e6:.1f} MB)")
        print(f"documents      {stats['documents']:,}")
        if "tokens" in stats:
            bpt = stats["bytes"] / max(stats["tokens"], 1)
            print(f"tokens         {stats['tokens']:,} (vocab {stats['vocab_size']:,}, {bpt:.2f} bytes/token)")
        print(stats["skip_report"])
        print(f"time           {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
