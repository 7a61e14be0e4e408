"""megatron-core `IndexedDataset` files: written atomically with a sidecar, checked at load time.

A dataset is `PREFIX.bin` (token ids back to back), `PREFIX.idx` (megatron's index: header,
sequence lengths, byte pointers, document boundaries) and our `PREFIX.meta.json` (tokenizer path
and sha256, vocab size, eod id, dtype, counts). A sharded dataset is `PREFIX_00000.*`,
`PREFIX_00001.*`, ... plus a `PREFIX.meta.json` listing the shards.

`DatasetWriter` writes through megatron's `IndexedDatasetBuilder` under `*.partial` names and
renames only when everything is written -- every .bin, then every .idx, then the meta files,
the top one last -- so an interrupted run leaves nothing under a final name except, at worst,
files without their meta, which `check_indexed_dataset` refuses. A re-run overwrites the
partials.

`check_indexed_dataset` is cheap (index arithmetic, file sizes, meta) unless `full_scan=True`,
which also reads every token id in chunks and compares it with the vocabulary.
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import struct
import warnings
from dataclasses import dataclass, field

import numpy as np

from pretrain.atomic_io import fsync_path

META_SUFFIX = ".meta.json"
PARTIAL = ".partial"
META_FORMAT = "glm5-indexed-dataset/1"
_INDEX_HEADER = b"MMIDIDX\x00\x00"  # megatron.core.datasets.indexed_dataset._INDEX_HEADER
_HEADER_BYTES = 9 + 8 + 1 + 8 + 8  # magic, version, dtype code, sequence count, document count
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
_CHUNK = 1 << 24


class IndexedDatasetError(ValueError):
    """A dataset that must not be trained on; the message names the file and the fix."""


def shard_prefix(prefix: str, index: int) -> str:
    return f"{prefix}_{index:05d}"


def final_paths(prefix: str) -> list[str]:
    """Existing files that a run writing `prefix` (sharded or not) would replace."""
    names = [prefix + s for s in (".bin", ".idx", META_SUFFIX)]
    shards = glob.glob(glob.escape(prefix) + "_[0-9][0-9][0-9][0-9][0-9]" + "[.]*")
    shards = [p for p in shards if p.endswith((".bin", ".idx", META_SUFFIX))]
    return sorted(p for p in names + shards if os.path.exists(p))


def write_json_atomic(path: str, obj: dict) -> None:
    partial = path + PARTIAL
    with open(partial, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def megatron_indexed_dataset():
    """`megatron.core.datasets.indexed_dataset`, imported without its TE/apex warnings."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
        from megatron.core.datasets import indexed_dataset

    return indexed_dataset


class DatasetWriter:
    """Documents in, `PREFIX.{bin,idx,meta.json}` (or shards) out, all or nothing.

    Use as a context manager: leaving the block by an exception removes the partial files.
    """

    def __init__(self, prefix: str, dtype, shard_size_docs: int | None = None):
        self.prefix, self.dtype, self.shard_size_docs = prefix, np.dtype(dtype).type, shard_size_docs
        self.shards: list[dict] = []  # per shard: prefix, documents, tokens
        self._builder = None

    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def _open_shard(self) -> None:
        name = shard_prefix(self.prefix, len(self.shards)) if self.shard_size_docs else self.prefix
        os.makedirs(os.path.dirname(os.path.abspath(name)), exist_ok=True)
        self._builder = megatron_indexed_dataset().IndexedDatasetBuilder(name + ".bin" + PARTIAL, dtype=self.dtype)
        self.shards.append({"prefix": name, "documents": 0, "tokens": 0})

    def _close_shard(self) -> None:
        self._builder.finalize(self.shards[-1]["prefix"] + ".idx" + PARTIAL)
        self._builder = None

    def add_document(self, tokens: np.ndarray) -> None:
        if self._builder is None:
            self._open_shard()
        elif self.shard_size_docs and self.shards[-1]["documents"] == self.shard_size_docs:
            self._close_shard()
            self._open_shard()
        self._builder.add_document(tokens, [len(tokens)])
        self.shards[-1]["documents"] += 1
        self.shards[-1]["tokens"] += len(tokens)

    def close(self, meta: dict) -> list[str]:
        """Finish and rename into place, replacing what `final_paths` lists; the dataset prefixes."""
        if self._builder is None and not self.shards:
            self._open_shard()  # no documents: still a valid (empty) dataset
        if self._builder is not None:
            self._close_shard()
        old = final_paths(self.prefix)
        for path in sorted(old, key=lambda p: not p.endswith(META_SUFFIX)):  # metas first
            os.remove(path)
        prefixes = [s["prefix"] for s in self.shards]
        for suffix in (".bin", ".idx"):
            for p in prefixes:
                fsync_path(p + suffix + PARTIAL)
                os.replace(p + suffix + PARTIAL, p + suffix)
        itemsize = np.dtype(self.dtype).itemsize
        created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        common = {"format": META_FORMAT, **meta, "dtype": np.dtype(self.dtype).name, "created": created}
        for i, shard in enumerate(self.shards):
            counts = {"documents": shard["documents"], "tokens": shard["tokens"]}
            counts["bin_bytes"] = shard["tokens"] * itemsize
            if self.shard_size_docs:
                counts.update(shard=i, num_shards=len(self.shards))
            write_json_atomic(shard["prefix"] + META_SUFFIX, {**common, **counts})
        if self.shard_size_docs:
            documents = sum(s["documents"] for s in self.shards)
            tokens = sum(s["tokens"] for s in self.shards)
            shards = [os.path.basename(p) for p in prefixes]
            top = {**common, "documents": documents, "tokens": tokens, "shards": shards}
            write_json_atomic(self.prefix + META_SUFFIX, top)
        return prefixes

    def abort(self) -> None:
        if self._builder is not None:
            self._builder.data_file.close()
            self._builder = None
        for shard in self.shards:
            for suffix in (".bin", ".idx", META_SUFFIX):
                if os.path.exists(shard["prefix"] + suffix + PARTIAL):
                    os.remove(shard["prefix"] + suffix + PARTIAL)


# --- checking at load time ----------------------------------------------------------------


@dataclass
class DatasetInfo:
    prefix: str
    prefixes: list[str]  # the megatron dataset prefixes: [prefix], or its shards
    documents: int
    tokens: int
    dtype: str
    meta: dict = field(default_factory=dict)

    @property
    def vocab_size(self) -> int | None:
        return self.meta.get("tokenizer", {}).get("vocab_size")


def read_meta(prefix: str) -> dict:
    path = prefix + META_SUFFIX
    try:
        with open(path) as f:
            meta = json.load(f)
    except json.JSONDecodeError as err:
        raise IndexedDatasetError(f"{path} is corrupted ({err}); re-run glm5-preprocess for {prefix}") from None
    if not isinstance(meta, dict) or meta.get("format") != META_FORMAT:
        raise IndexedDatasetError(f"{path} is not a {META_FORMAT} sidecar; re-run glm5-preprocess for {prefix}")
    return meta


def _missing(prefix: str, what: str) -> IndexedDatasetError:
    partials = [p for p in glob.glob(glob.escape(prefix) + "*" + PARTIAL)]
    hint = (
        f"an interrupted glm5-preprocess run left {', '.join(sorted(partials))}; re-run it"
        if partials
        else "check the data path or run glm5-preprocess with --output-prefix " + prefix
    )
    return IndexedDatasetError(f"dataset {prefix}: {what} is missing; {hint}")


def _check_index(prefix: str) -> tuple[type, np.ndarray, np.ndarray]:
    """Header, sizes and internal consistency of PREFIX.idx; (dtype, lengths, document indices)."""
    idx_path = prefix + ".idx"
    fix = f"re-run glm5-preprocess for {prefix}"
    size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        header = f.read(_HEADER_BYTES)
    if len(header) < _HEADER_BYTES or header[:9] != _INDEX_HEADER:
        raise IndexedDatasetError(f"{idx_path} is corrupted: not a megatron index header; {fix}")
    version, code, sequences, documents = struct.unpack("<QBQQ", header[9:])
    if version != 1 or code not in _DTYPES:
        raise IndexedDatasetError(f"{idx_path} is corrupted: version {version}, dtype code {code}; {fix}")
    expected = _HEADER_BYTES + 12 * sequences + 8 * documents
    if size not in (expected, expected + sequences):  # + one mode byte per sequence when multimodal
        raise IndexedDatasetError(
            f"{idx_path} is truncated or corrupted: its header announces {sequences} sequences and "
            f"{documents} document boundaries ({expected} bytes) but the file has {size} bytes; {fix}"
        )
    mm = np.memmap(idx_path, mode="r")
    lengths = np.frombuffer(mm, np.int32, sequences, _HEADER_BYTES)
    pointers = np.frombuffer(mm, np.int64, sequences, _HEADER_BYTES + 4 * sequences)
    doc_index = np.frombuffer(mm, np.int64, documents, _HEADER_BYTES + 12 * sequences)
    itemsize = np.dtype(_DTYPES[code]).itemsize
    offset = 0
    for start in range(0, sequences, _CHUNK):
        chunk = lengths[start : start + _CHUNK].astype(np.int64)
        expected_ptr = offset + (np.cumsum(chunk) - chunk) * itemsize
        if (chunk < 0).any() or not np.array_equal(expected_ptr, pointers[start : start + _CHUNK]):
            raise IndexedDatasetError(f"{idx_path} is corrupted: sequence pointers do not follow the lengths; {fix}")
        offset += int(chunk.sum()) * itemsize
    if documents < 1 or doc_index[0] != 0 or doc_index[-1] != sequences or (np.diff(doc_index) < 0).any():
        raise IndexedDatasetError(
            f"{idx_path} is corrupted: document boundaries are not 0..{sequences} ascending; {fix}"
        )
    return _DTYPES[code], lengths, doc_index


def _scan_tokens(prefix: str, dtype, tokens: int, limit: int, limit_name: str, doc_of_token) -> None:
    data = np.memmap(prefix + ".bin", dtype=dtype, mode="r", shape=(tokens,)) if tokens else np.empty(0, dtype)
    for start in range(0, tokens, _CHUNK):
        chunk = data[start : start + _CHUNK]
        bad = (chunk >= limit) | (chunk < 0) if np.issubdtype(dtype, np.signedinteger) else chunk >= limit
        if bad.any():
            at = start + int(np.argmax(bad))
            raise IndexedDatasetError(
                f"{prefix}.bin: token id {int(data[at])} at token {at} (document {doc_of_token(at)}) is outside "
                f"{limit_name} {limit}; the dataset was made with another tokenizer: re-run glm5-preprocess"
            )


def _check_vocab(prefix: str, meta: dict, vocab_size: int | None, tokenizer) -> None:
    tok_meta = meta.get("tokenizer", {})
    made_with = tok_meta.get("vocab_size")
    if vocab_size is not None and made_with is not None and made_with > vocab_size:
        raise IndexedDatasetError(
            f"dataset {prefix} was tokenized with {tok_meta.get('path')} ({made_with} tokens) but model.vocab_size "
            f"is {vocab_size}; set model.vocab_size >= {made_with} or re-tokenize with a smaller tokenizer"
        )
    if tokenizer is not None and tokenizer.sha256 != tok_meta.get("sha256"):
        raise IndexedDatasetError(
            f"dataset {prefix} was tokenized with {tok_meta.get('path')} (sha256 {str(tok_meta.get('sha256'))[:12]}) "
            f"but training uses {tokenizer.path} (sha256 {tokenizer.sha256[:12]}); re-run glm5-preprocess "
            f"with --tokenizer {tokenizer.path} or train with the dataset's tokenizer"
        )


def check_indexed_dataset(
    prefix: str, vocab_size: int | None = None, full_scan: bool = False, tokenizer=None, require_meta: bool = True
) -> DatasetInfo:
    """Raise `IndexedDatasetError` unless `prefix` is a complete dataset that fits the model.

    vocab_size: the model's; the tokenizer recorded in the meta must fit it. tokenizer: the
    training `Tokenizer`; must be the file the dataset was made with (sha256). full_scan: also
    read every token id (chunked memmap) against min(vocab_size, the meta's vocab size).
    require_meta=False accepts datasets from other tools (no tokenizer checks then).
    """
    meta: dict = {}
    if os.path.exists(prefix + META_SUFFIX):
        meta = read_meta(prefix)
    elif require_meta:
        if os.path.exists(prefix + ".bin") or os.path.exists(prefix + ".idx"):
            raise IndexedDatasetError(
                f"dataset {prefix}: {prefix}{META_SUFFIX} is missing, so it was not completed by glm5-preprocess "
                "(interrupted run or another tool); re-run glm5-preprocess, or load it with require_meta=False"
            )
        raise _missing(prefix, prefix + META_SUFFIX)
    _check_vocab(prefix, meta, vocab_size, tokenizer)
    if "shards" in meta:
        directory = os.path.dirname(prefix)
        infos = [
            check_indexed_dataset(os.path.join(directory, s), vocab_size, full_scan, tokenizer, require_meta)
            for s in meta["shards"]
        ]
        documents, tokens = sum(i.documents for i in infos), sum(i.tokens for i in infos)
        if (documents, tokens) != (meta.get("documents"), meta.get("tokens")):
            raise IndexedDatasetError(f"{prefix}{META_SUFFIX} counts do not match its shards; re-run glm5-preprocess")
        return DatasetInfo(prefix, [p for i in infos for p in i.prefixes], documents, tokens, infos[0].dtype, meta)
    for suffix in (".idx", ".bin"):
        if not os.path.exists(prefix + suffix):
            raise _missing(prefix, prefix + suffix)
    dtype, lengths, doc_index = _check_index(prefix)
    tokens = int(lengths.sum(dtype=np.int64))
    itemsize = np.dtype(dtype).itemsize
    bin_bytes = os.path.getsize(prefix + ".bin")
    if bin_bytes != tokens * itemsize:
        state = "truncated" if bin_bytes < tokens * itemsize else "longer than its index"
        raise IndexedDatasetError(
            f"{prefix}.bin is {state}: {prefix}.idx expects {tokens} {np.dtype(dtype).name} tokens "
            f"({tokens * itemsize} bytes) but the file has {bin_bytes} bytes; re-run glm5-preprocess for {prefix}"
        )
    documents = len(doc_index) - 1
    if meta:
        recorded = (meta.get("documents"), meta.get("tokens"), meta.get("dtype"))
        if recorded != (documents, tokens, np.dtype(dtype).name):
            raise IndexedDatasetError(
                f"{prefix}{META_SUFFIX} records (documents, tokens, dtype) = {recorded} but the files hold "
                f"{(documents, tokens, np.dtype(dtype).name)}; the files were replaced or damaged: "
                "re-run glm5-preprocess"
            )
    if full_scan:
        limits = [v for v in (vocab_size, meta.get("tokenizer", {}).get("vocab_size")) if v is not None]
        if limits:
            seq_starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])

            def doc_of_token(at: int) -> int:
                seq = int(np.searchsorted(seq_starts, at, side="right")) - 1
                return int(np.searchsorted(doc_index, seq, side="right")) - 1

            by_model = vocab_size is not None and vocab_size == min(limits)
            name = "model.vocab_size" if by_model else "the tokenizer's vocab size"
            _scan_tokens(prefix, dtype, tokens, min(limits), name, doc_of_token)
    return DatasetInfo(prefix, [prefix], documents, tokens, np.dtype(dtype).name, meta)
