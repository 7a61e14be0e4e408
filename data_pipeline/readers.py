"""Streaming documents out of JSONL, parquet, plain-text files and source trees.

Inputs are files, directories (walked recursively, hidden entries and `__pycache__` pruned,
filtered by `extensions`), globs (`src/**/*.py`, filtered the same way) or `@stdlib` (the
running Python's standard library, listed by `stdlib_files()` here; `stdlib_corpus` describes and
measures it). The kind of a file follows its name:

    *.jsonl *.ndjson *.json (+ .gz)   one JSON object per line, text in field `json_key`
    *.parquet                         column `json_key` (needs pyarrow)
    anything else                     UTF-8 text: one document per file, or per line

Reading is split in two so the preprocessor can parallelise the expensive half:
`iter_records` (main process) yields raw `Record`s -- undecoded bytes with their origin -- and
`decode_record` (worker processes) turns one into text or a skip reason. `iter_documents` chains
both in one process (tokenizer training, corpus statistics).

Bad input is never silently lost: each skipped document is counted under one of `SKIP_REASONS`
in a `SkipReport` that keeps the first few origins (file:line) per reason; `strict=True` raises
`BadInputError` at the first one instead.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import sysconfig
from collections import Counter
from typing import Iterator, NamedTuple

SKIP_REASONS = ("malformed_json", "invalid_utf8", "empty_document", "missing_field", "non_string_field")
JSON_SUFFIXES = (".jsonl", ".ndjson", ".json")
STDLIB_INPUT = "@stdlib"
# installed packages are not the standard library; bytecode caches are not text
STDLIB_EXCLUDED_DIRS = ("site-packages", "dist-packages", "__pycache__")

# Record kinds: how `decode_record` must read the payload.
JSON_LINE, TEXT_BYTES, TEXT_VALUE = 0, 1, 2


class InputError(ValueError):
    """An input that cannot be read at all (missing path, parquet without the column, ...)."""


class BadInputError(ValueError):
    """One bad document under `strict=True`."""

    def __init__(self, origin: str, reason: str, detail: str):
        super().__init__(f"{origin}: {reason}: {detail}")
        self.origin, self.reason, self.detail = origin, reason, detail


class Record(NamedTuple):
    """An undecoded document. line: 1-based line (JSONL, text lines), row (parquet), 0 = whole file."""

    kind: int
    source: str
    line: int
    payload: object  # bytes, or str/None/other for parquet values


class Document(NamedTuple):
    text: str
    source: str
    line: int


def format_origin(source: str, line: int) -> str:
    return f"{source}:{line}" if line else source


class SkipReport:
    """Skipped documents counted per reason, with the first `max_examples` origins of each."""

    def __init__(self, max_examples: int = 5):
        self.max_examples = max_examples
        self.counts: Counter = Counter()
        self.examples: dict[str, list[str]] = {}

    def add(self, reason: str, origin: str, detail: str) -> None:
        self.counts[reason] += 1
        examples = self.examples.setdefault(reason, [])
        if len(examples) < self.max_examples:
            examples.append(f"{origin}: {detail}")

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def as_dict(self) -> dict[str, int]:
        return {reason: self.counts[reason] for reason in SKIP_REASONS if self.counts[reason]}

    def format(self) -> str:
        if not self.total:
            return "skipped documents: none"
        lines = [f"skipped documents: {self.total}"]
        for reason, count in self.as_dict().items():
            lines.append(f"  {reason}: {count}")
            shown = self.examples.get(reason, [])
            lines.extend(f"    {example}" for example in shown)
            if count > len(shown):
                lines.append(f"    ... and {count - len(shown)} more")
        return "\n".join(lines)


# --- expanding inputs into files -----------------------------------------------------------


def parse_extensions(spec: str | None) -> tuple[str, ...] | None:
    """".py,c" -> (".py", ".c"); None or "" -> None (no filter)."""
    if not spec:
        return None
    return tuple(e if e.startswith(".") else f".{e}" for e in (s.strip() for s in spec.split(",")) if e)


def _walk(directory: str) -> Iterator[str]:
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        for name in sorted(files):
            if not name.startswith("."):
                yield os.path.join(root, name)


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_files() -> list[str]:
    """Every `*.py` of the standard library (the `@stdlib` input), sorted, installed packages excluded."""
    files = []
    for root, dirs, names in os.walk(stdlib_root()):
        dirs[:] = sorted(d for d in dirs if d not in STDLIB_EXCLUDED_DIRS)
        files.extend(os.path.join(root, n) for n in sorted(names) if n.endswith(".py"))
    return files


def expand_inputs(inputs: list[str], extensions: tuple[str, ...] | None = None) -> list[str]:
    """Files named by `inputs`, in a deterministic order, each once.

    `extensions` filters files found by walking directories or expanding globs; a file named
    explicitly is always read.
    """
    keep = (lambda p: p.endswith(extensions)) if extensions else (lambda p: True)
    files: list[str] = []
    for spec in inputs:
        if spec == STDLIB_INPUT:
            files.extend(stdlib_files())
        elif os.path.isfile(spec):
            files.append(spec)
        elif os.path.isdir(spec):
            files.extend(p for p in _walk(spec) if keep(p))
        elif glob.has_magic(spec):
            matches = sorted(glob.glob(spec, recursive=True))
            if not matches:
                raise InputError(f"input glob matches nothing: {spec}")
            for match in matches:
                if os.path.isdir(match):
                    files.extend(p for p in _walk(match) if keep(p))
                elif keep(match):
                    files.append(match)
        else:
            raise InputError(f"input not found: {spec}")
    unique, seen = [], set()
    for f in files:
        real = os.path.realpath(f)
        if real not in seen:
            seen.add(real)
            unique.append(f)
    if not unique:
        raise InputError(f"no input files (inputs: {' '.join(inputs)}; extensions: {extensions})")
    return unique


def file_kind(path: str) -> str:
    name = path[:-3] if path.endswith(".gz") else path
    if name.endswith(JSON_SUFFIXES):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    return "text"


# --- reading files into records (main process) ------------------------------------------


class RecordReader:
    """Iterates the `Record`s of `files`; `bytes_read` tracks progress against `total_bytes`."""

    def __init__(self, files: list[str], json_key: str = "text", lines_as_documents: bool = False):
        self.files, self.json_key, self.lines_as_documents = files, json_key, lines_as_documents
        self.total_bytes = sum(os.path.getsize(f) for f in files)
        self.bytes_read = 0

    def __iter__(self) -> Iterator[Record]:
        for path in self.files:
            start = self.bytes_read
            kind = file_kind(path)
            if kind == "parquet":
                yield from self._parquet(path)
            elif kind == "jsonl" or self.lines_as_documents:
                yield from self._lines(path, JSON_LINE if kind == "jsonl" else TEXT_BYTES)
            else:
                with open(path, "rb") as f:
                    payload = f.read()
                self.bytes_read += len(payload)
                yield Record(TEXT_BYTES, path, 0, payload)
            self.bytes_read = start + os.path.getsize(path)

    def _lines(self, path: str, kind: int) -> Iterator[Record]:
        compressed = path.endswith(".gz")
        with open(path, "rb") as raw:
            stream = gzip.open(raw) if compressed else raw
            base = self.bytes_read
            for number, line in enumerate(stream, 1):
                if kind == TEXT_BYTES and line.endswith(b"\n"):
                    line = line[:-1]
                if compressed:
                    if number % 1024 == 0:
                        self.bytes_read = base + raw.tell()
                else:
                    self.bytes_read += len(line) + 1
                yield Record(kind, path, number, line)

    def _parquet(self, path: str) -> Iterator[Record]:
        try:
            import pyarrow.parquet as pq
            import pyarrow.types as pat
        except ImportError:
            raise InputError(f"reading {path} needs pyarrow: pip install pyarrow") from None
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        if self.json_key not in names:
            raise InputError(
                f"parquet file {path} has no column {self.json_key!r} (columns: {', '.join(names)}); pass --json-keys"
            )
        column_type = pf.schema_arrow.field(self.json_key).type
        textual = (pat.is_string, pat.is_large_string, pat.is_binary, pat.is_large_binary)
        if not any(is_kind(column_type) for is_kind in textual):
            raise InputError(f"parquet file {path}: column {self.json_key!r} has type {column_type}, expected string")
        rows = max(pf.metadata.num_rows, 1)
        size, base, row = os.path.getsize(path), self.bytes_read, 0
        for batch in pf.iter_batches(columns=[self.json_key], batch_size=1024):
            for value in batch.column(0).to_pylist():
                row += 1
                yield Record(TEXT_VALUE, path, row, value)
            self.bytes_read = base + size * row // rows


# --- decoding records (worker processes) ------------------------------------------------


def _utf8_error_detail(payload: bytes, err: UnicodeDecodeError, whole_file: bool) -> str:
    where = f"byte {err.start}"
    if whole_file:
        line = payload.count(b"\n", 0, err.start) + 1
        where = f"line {line}, {where}"
    return f"{err.reason} (0x{payload[err.start]:02x}) at {where}"


def _empty_detail(text: str) -> str:
    return "empty text" if not text else f"only whitespace ({len(text)} characters)"


def decode_record(record: Record, json_key: str = "text") -> tuple[str | None, str | None, str]:
    """(text, None, "") for a good record, (None, reason, detail) for a bad one."""
    kind, _, line, payload = record
    if kind == TEXT_VALUE:
        if payload is None:
            return None, "missing_field", f"column {json_key!r} is null"
        if isinstance(payload, bytes):
            kind = TEXT_BYTES
        else:
            text = payload
    if kind != TEXT_VALUE:
        try:
            text = payload.decode("utf-8")
        except UnicodeDecodeError as err:
            return None, "invalid_utf8", _utf8_error_detail(payload, err, whole_file=line == 0)
    if kind == JSON_LINE:
        if not text.strip():
            return None, "empty_document", "blank line"
        try:
            obj = json.loads(text)
        except ValueError as err:
            return None, "malformed_json", str(err)
        if not isinstance(obj, dict):
            return None, "malformed_json", f"top-level JSON value is {type(obj).__name__}, expected an object"
        if json_key not in obj:
            return None, "missing_field", f"no field {json_key!r} (fields: {', '.join(map(str, list(obj)[:8]))})"
        text = obj[json_key]
        if text is None:
            return None, "missing_field", f"field {json_key!r} is null"
        if not isinstance(text, str):
            return None, "non_string_field", f"field {json_key!r} is {type(text).__name__}, expected a string"
        try:
            text.encode("utf-8")  # a JSON escape can smuggle in a lone surrogate
        except UnicodeEncodeError as err:
            return None, "invalid_utf8", f"field {json_key!r} has a lone surrogate at character {err.start}"
    if not text.strip():
        return None, "empty_document", _empty_detail(text)
    return text, None, ""


def iter_documents(
    files: list[str],
    json_key: str = "text",
    lines_as_documents: bool = False,
    skips: SkipReport | None = None,
    strict: bool = False,
) -> Iterator[Document]:
    """Good documents of `files` in order; bad ones go to `skips` (or raise when `strict`)."""
    skips = skips if skips is not None else SkipReport()
    for record in RecordReader(files, json_key, lines_as_documents):
        text, reason, detail = decode_record(record, json_key)
        if reason is None:
            yield Document(text, record.source, record.line)
            continue
        origin = format_origin(record.source, record.line)
        if strict:
            raise BadInputError(origin, reason, detail)
        skips.add(reason, origin, detail)
