"""Train a byte-level BPE `tokenizer.json` with Hugging Face `tokenizers`.

    python -m data_pipeline.train_tokenizer --input @stdlib --vocab-size 32768 \
        --output tokenizers/stdlib-32k/tokenizer.json

No tokenizer can be downloaded on the training machines, so this makes one from any corpus the
readers understand (JSONL, parquet, text files, source trees; see `readers`). Byte-level: the
256 byte symbols are always in the vocabulary and the ByteLevel pre-tokenizer/decoder pair is
lossless, so `decode(encode(x)) == x` for every UTF-8 text, with no unknown token. Special tokens
get the first ids in the order given (default `<|endoftext|>` = 0, the end-of-document token,
and `<|pad|>` = 1). The file is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

DEFAULT_SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>")


def build_bpe_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def train_tokenizer(
    texts,
    vocab_size: int,
    special_tokens=DEFAULT_SPECIAL_TOKENS,
    min_frequency: int = 2,
    show_progress: bool = False,
):
    """A trained `tokenizers.Tokenizer` (byte-level BPE) from an iterable of strings."""
    from tokenizers import pre_tokenizers, trainers

    special_tokens = list(dict.fromkeys(special_tokens))
    floor = 256 + len(special_tokens)
    if vocab_size < floor:
        raise ValueError(
            f"--vocab-size {vocab_size} is below {floor} (256 byte symbols + {len(special_tokens)} special tokens)"
        )
    tokenizer = build_bpe_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def save_atomic(tokenizer, output: str) -> str:
    output = os.path.abspath(output)
    if os.path.isdir(output) or output.endswith(os.sep):
        output = os.path.join(output, "tokenizer.json")
    os.makedirs(os.path.dirname(output), exist_ok=True)
    partial = f"{output}.partial"
    tokenizer.save(partial)
    os.replace(partial, output)
    return output


def parse_args(argv):
    p = argparse.ArgumentParser(prog="glm5-train-tokenizer", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", action="extend", nargs="+", required=True, help="files, directories, globs or @stdlib")
    p.add_argument("--output", required=True, help="path of the tokenizer.json to write (or a directory)")
    p.add_argument("--vocab-size", type=int, required=True, help="size including the special tokens")
    p.add_argument("--special-tokens", nargs="+", default=list(DEFAULT_SPECIAL_TOKENS),
                   help="they get ids 0, 1, ...; the end-of-document token is found by name (<|endoftext|>, </s>, ...)")
    p.add_argument("--min-frequency", type=int, default=2, help="merges seen fewer times are not learned")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="JSONL field / parquet column holding the text")
    p.add_argument("--extensions", help="comma list filtering directories and globs, e.g. .py,.c")
    p.add_argument("--lines-as-documents", action="store_true", help="plain text: one document per line")
    p.add_argument("--max-bytes", type=float, default=None, help="stop reading after this many bytes of text")
    p.add_argument("--strict", action="store_true", help="fail on the first bad document")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    return p, p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from data_pipeline.readers import BadInputError, InputError, RecordReader, SkipReport, decode_record
    from data_pipeline.readers import expand_inputs, format_origin, parse_extensions

    parser, args = parse_args(argv)
    if len(args.json_keys) != 1:
        parser.error("give one --json-keys field (one tokenizer per run)")
    output = args.output
    if os.path.exists(output) and not os.path.isdir(output) and not args.overwrite:
        parser.error(f"output exists: {output} (pass --overwrite to replace it)")
    try:
        files = expand_inputs(args.input, parse_extensions(args.extensions))
    except InputError as err:
        parser.error(str(err))
    reader = RecordReader(files, args.json_keys[0], args.lines_as_documents)
    skips, counts = SkipReport(), {"documents": 0, "bytes": 0}
    bar = tqdm(total=reader.total_bytes, unit="B", unit_scale=True, desc="reading", disable=None)

    def texts():
        for record in reader:
            text, reason, detail = decode_record(record, args.json_keys[0])
            bar.update(reader.bytes_read - bar.n)
            if reason:
                if args.strict:
                    raise BadInputError(format_origin(record.source, record.line), reason, detail)
                skips.add(reason, format_origin(record.source, record.line), detail)
                continue
            counts["documents"] += 1
            counts["bytes"] += len(text)
            yield text
            if args.max_bytes and counts["bytes"] >= args.max_bytes:
                return

    start = time.perf_counter()
    try:
        tokenizer = train_tokenizer(
            texts(), args.vocab_size, args.special_tokens, args.min_frequency, show_progress=True
        )
    except (BadInputError, InputError, ValueError) as err:
        bar.close()
        print(f"error: {err}", file=sys.stderr)
        return 2
    bar.close()
    path = save_atomic(tokenizer, output)
    print(
        f"wrote {path}: vocab {tokenizer.get_vocab_size(with_added_tokens=True):,}, "
        f"special {' '.join(args.special_tokens)}; trained on {counts['documents']:,} documents "
        f"({counts['bytes'] / 1e6:.1f} M characters) in {time.perf_counter() - start:.1f} s"
    )
    print(skips.format())
    return 0


if __name__ == "__main__":
    sys.exit(main())
