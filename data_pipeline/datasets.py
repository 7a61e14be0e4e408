"""Training datasets from the YAML `data` section: megatron-core GPTDataset blends.

    from data_pipeline.datasets import build_datasets
    train, valid, test = build_datasets(cfg, tokenizer, train_samples, valid_samples, test_samples)

`data.data_path` is Megatron-LM's blend, `["0.7", "prefix_a", "0.3", "prefix_b"]` or prefixes only
(one prefix: that dataset; several unweighted: weighted by their token counts). Each prefix's
documents are split by `data.split` into contiguous train/valid/test ranges (megatron's
`split_matrix`), shuffled with `train.seed`, packed into `data.seq_length` windows (see
`packing.py`) and, for a blend, interleaved by megatron's `BlendedDataset` so every prefix
contributes its weight's share of any prefix of the sample order. `data.min_document_length`
restricts blend entries to long documents (see `long_context.py`). `data.mock` uses megatron's
synthetic documents instead of files.

Everything is deterministic in (blend, split, seed, seq_length, sample counts): the sample at
index k is the same on every run and every rank, which is what makes `sampler.DataIterator`'s
resume exact.

Index cache: megatron writes each dataset's document/sample/shuffle indices (.npy) into
`data.data_cache_path` (default `<logging.run_dir>/data_cache`), keyed by a hash of everything
they depend on. Under torch.distributed global rank 0 builds them and the other ranks load them
after a barrier (megatron's own protocol), so the directory must be visible to every rank (the
run directory on a shared filesystem). Keeping it under the run directory means two jobs never
write the same files at once.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from typing import List, Optional, Sequence, Tuple

import numpy
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.megatron_dataset import _PAD_TOKEN_ID
from megatron.core.datasets.utils import Split

from data_pipeline.long_context import (
    min_lengths_for,
    select_long_documents,
    split_min_document_length,
    with_min_document_length,
)
from data_pipeline.packing import pack_sample
from pretrain.compat import rank_zero_without_process_group

log = logging.getLogger(__name__)


class DataError(ValueError):
    """The data section names files or a blend that cannot be used; the message names the prefix."""


# ---------------------------------------------------------------------------------------------
# the dataset class megatron's builder instantiates
# ---------------------------------------------------------------------------------------------


class DocumentGPTDataset(GPTDataset):
    """megatron's GPTDataset, restricted to long documents when its path says so, with document-aware samples.

    Samples are `packing.pack_sample` dicts: tokens, labels, loss_mask, position_ids, cu_seqlens
    and, with reset_attention_mask and create_attention_mask, a bool [1, s, s] attention_mask.
    """

    def __init__(self, indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config):
        _, min_length = split_min_document_length(dataset_path or "")
        if indexed_indices is not None and min_length > 0:
            indexed_indices = select_long_documents(indexed_indices, indexed_dataset.sequence_lengths, min_length)
        self.min_document_length = min_length
        began = time.monotonic()
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        # Progress of a long index build (a blend of many files on a cache miss): one line per file and split.
        log.info("dataset indices: %s %s ready (%d samples) in %.1f s", dataset_path or "mock",
                 index_split.name, len(self), time.monotonic() - began)
        if self._pad_token_id is None:  # a tokenizer without pad: megatron's "no pad" id, never a real token
            self._pad_token_id = _PAD_TOKEN_ID

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> IndexedDataset:
        prefix, _ = split_min_document_length(dataset_path)
        return GPTDataset.build_low_level_dataset(prefix, config)

    def __getitem__(self, idx: Optional[int]) -> dict:
        text, _ = self._query_document_sample_shuffle_indices(0 if idx is None else idx)
        sample = pack_sample(
            torch.from_numpy(text),
            eod=self.config.tokenizer.eod,
            pad=self._pad_token_id,
            reset_position_ids=self.config.reset_position_ids,
            reset_attention_mask=self.config.reset_attention_mask,
            eod_mask_loss=self.config.eod_mask_loss,
            create_attention_mask=self.config.create_attention_mask,
        )
        if idx is None:  # megatron's batch-padding sample: present but never trained on
            sample["loss_mask"].zero_()
        return sample


class MockDocumentGPTDataset(DocumentGPTDataset, MockGPTDataset):
    """megatron's synthetic documents (`MockGPTLowLevelDataset`) with our sample format."""

    numel_low_level_dataset = staticmethod(MockGPTDataset.numel_low_level_dataset)
    build_low_level_dataset = staticmethod(MockGPTDataset.build_low_level_dataset)


# ---------------------------------------------------------------------------------------------
# blend, sources, cache
# ---------------------------------------------------------------------------------------------


def parse_blend(data_path: Sequence[str]) -> Tuple[List[str], Optional[List[float]]]:
    """Megatron-LM's flat blend list -> (prefixes, weights or None), with errors that show the list."""
    entries = [str(x).strip() for x in data_path]
    if not entries:
        raise DataError("data.data_path is empty; give a prefix, or weight/prefix pairs, or set data.mock=true")

    def number(text: str) -> Optional[float]:
        try:
            return float(text)
        except ValueError:
            return None

    if len(entries) == 1 or number(entries[0]) is None:
        numeric = [e for e in entries if number(e) is not None]
        if numeric:
            raise DataError(
                f"data.data_path {entries} mixes prefixes with numbers ({numeric}); write weight/prefix pairs "
                "[\"0.7\", \"prefix_a\", \"0.3\", \"prefix_b\"] or prefixes only"
            )
        return entries, None
    weights, prefixes = entries[0::2], entries[1::2]
    if len(entries) % 2 or any(number(w) is None for w in weights) or any(number(p) is not None for p in prefixes):
        raise DataError(
            f"data.data_path {entries} is not a list of weight/prefix pairs; write "
            "[\"0.7\", \"prefix_a\", \"0.3\", \"prefix_b\"] or prefixes only"
        )
    values = [float(w) for w in weights]
    bad = [p for p, w in zip(prefixes, values) if not w > 0]
    if bad:
        raise DataError(
            f"data.data_path gives {bad} a weight <= 0; every blend weight must be > 0 (drop the entry instead)"
        )
    return prefixes, values


def resolve_sources(prefixes: Sequence[str], vocab_size: Optional[int], tokenizer=None) -> List[List[str]]:
    """Check every blend entry's files (`indexed.check_indexed_dataset`); the megatron prefixes of each.

    A sharded dataset (`PREFIX.meta.json` listing `PREFIX_00000`, ...) yields its shard prefixes.
    `tokenizer`, when it is a file-backed `Tokenizer`, must be the one the data was made with.
    """
    from data_pipeline.indexed import check_indexed_dataset

    checked = tokenizer if hasattr(tokenizer, "sha256") else None
    resolved = {}
    for prefix in dict.fromkeys(prefixes):
        try:
            resolved[prefix] = check_indexed_dataset(prefix, vocab_size, tokenizer=checked).prefixes
        except (OSError, ValueError) as exc:
            raise DataError(f"data.data_path entry {prefix!r}: {exc}") from None
    return [resolved[p] for p in prefixes]


def default_cache_path(data, run_dir: str) -> str:
    """`data.data_cache_path`, else `<logging.run_dir>/data_cache`."""
    return data.data_cache_path or os.path.join(run_dir, "data_cache")


class _MockTokenizer:
    """The ids megatron's mock dataset needs when no tokenizer file is configured."""

    def __init__(self, vocab_size: int):
        self.vocab_size, self.eod, self.pad = vocab_size, vocab_size - 1, None
        self.unique_identifiers = OrderedDict(cls="mock", vocab_size=vocab_size)


# ---------------------------------------------------------------------------------------------
# the entry point
# ---------------------------------------------------------------------------------------------


def build_datasets(cfg, tokenizer, train_samples: int, valid_samples: int, test_samples: int):
    """(train, valid, test) megatron datasets for `cfg.data`, each with at least the samples asked for.

    A split asked for 0 samples, or with no share in `data.split`, is None. `tokenizer` is a
    `data_pipeline.tokenizer.Tokenizer` (or anything with vocab_size, eod, pad, unique_identifiers);
    None loads `data.tokenizer`, or for `data.mock` uses placeholder ids. Call on every rank (every
    rank gets the full datasets; `sampler.DataIterator` picks its data-parallel slice): under
    torch.distributed rank 0 builds the index cache first, the others then load it.
    """
    d = cfg.data
    sizes = [train_samples, valid_samples, test_samples]
    if any(n is None or n < 0 for n in sizes):
        raise DataError(f"sample counts must be integers >= 0, got train/valid/test = {sizes}")
    tokenizer = _resolve_tokenizer(d, cfg.model.vocab_size, tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise DataError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is {cfg.model.vocab_size}; "
            f"set model.vocab_size >= {tokenizer.vocab_size}"
        )
    if d.mock:
        if d.data_path:
            raise DataError(
                f"data.mock=true but data.data_path is set ({list(d.data_path)}); set data.mock=false to train on "
                "the files, or data.data_path=[] for synthetic tokens"
            )
        blend, cls = None, MockDocumentGPTDataset
    else:
        blend, cls = blend_paths(d, cfg.model.vocab_size, tokenizer, sizes), DocumentGPTDataset

    config = GPTDatasetConfig(
        random_seed=cfg.train.seed,
        sequence_length=d.seq_length,
        blend=blend,
        split=d.split,
        path_to_cache=default_cache_path(d, cfg.logging.run_dir),
        tokenizer=tokenizer,
        reset_position_ids=d.reset_position_ids,
        reset_attention_mask=d.reset_attention_mask,
        eod_mask_loss=d.eod_mask_loss,
        create_attention_mask=d.create_attention_mask,
        num_dataset_builder_threads=d.num_dataset_builder_threads,
    )
    # A split nobody asked samples of is not built (megatron would build it, and loops forever on an
    # empty one); the split string, and so every other split's document range, is unchanged.
    config.split_matrix = [None if n == 0 else rng for n, rng in zip(sizes, config.split_matrix)]
    builder = BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config)
    # On a cache miss megatron builds the sample indices on rank 0 while the other ranks wait in a
    # barrier, which parallel.distributed_timeout_minutes bounds: say so, and how long it took.
    files = len(blend[0]) if blend else 1
    log.info("dataset indices: building or reading %d file(s) x %d split(s) in %s (rank 0 builds on a cache miss "
             "with data.num_dataset_builder_threads=%d; the other ranks wait up to parallel.distributed_timeout_minutes)",
             files, sum(n > 0 for n in sizes), config.path_to_cache, d.num_dataset_builder_threads)
    began = time.monotonic()
    with rank_zero_without_process_group():
        train, valid, test = builder.build()
    log.info("dataset indices ready in %.1f s", time.monotonic() - began)
    return train, valid, test


def blend_paths(data, vocab_size: int, tokenizer, sizes: Sequence[int]):
    """megatron's (dataset paths, weights) for `data.data_path`, after every check of the files: each
    blend entry exists, fits the vocabulary and `tokenizer`, and has documents (of at least its
    `data.min_document_length`) in every split `sizes` asks samples of. Raises DataError naming the
    key and the file. Reads only the index files: the run's preflight calls it before any process group."""
    prefixes, weights = parse_blend(data.data_path)
    try:
        min_lengths = min_lengths_for(prefixes, data.min_document_length)
    except ValueError as exc:
        raise DataError(str(exc)) from None
    shards = resolve_sources(prefixes, vocab_size, tokenizer)
    return _expand_entries(prefixes, weights, min_lengths, shards, data.split, sizes)


def _resolve_tokenizer(data, vocab_size: int, tokenizer):
    if tokenizer is not None:
        return tokenizer
    if data.tokenizer:
        from data_pipeline.tokenizer import load_tokenizer

        return load_tokenizer(data.tokenizer)
    if data.mock:
        return _MockTokenizer(vocab_size)
    raise DataError("data.tokenizer is not set; give the path of the tokenizer.json the data was preprocessed with")


def _expand_entries(prefixes, weights, min_lengths, shards, split, sizes):
    """Blend entries -> megatron (dataset paths, weights): one path per shard, filters encoded in it.

    An entry's weight is shared among its shards by their token counts (after the length filter);
    an unweighted blend of several paths is weighted by token counts, so it yields the samples asked for.
    """
    paths, tokens, entry_of = [], [], []
    for i, (prefix, min_length) in enumerate(zip(prefixes, min_lengths)):
        for shard in shards[i]:
            per_split = _documents_per_split(shard, min_length, split)
            _check_splits_have_documents(prefix, shard, min_length, per_split, sizes)
            paths.append(with_min_document_length(shard, min_length))
            tokens.append(float(sum(t for _, t in per_split)))
            entry_of.append(i)
    if weights is None:
        return paths, (tokens if len(paths) > 1 else None)
    entry_tokens = [sum(t for t, e in zip(tokens, entry_of) if e == i) for i in range(len(prefixes))]
    return paths, [weights[e] * t / max(entry_tokens[e], 1.0) for t, e in zip(tokens, entry_of)]


def _documents_per_split(prefix: str, min_length: int, split: str) -> List[Tuple[int, int]]:
    """(documents, tokens) of each split of one megatron prefix, after the length filter; megatron's split rule."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    indexed = IndexedDataset(prefix, mmap=True)  # held: `lengths` reads its memory map
    lengths = indexed.sequence_lengths
    per_split = []
    for bookends in matrix:
        if bookends is None:
            per_split.append((0, 0))
            continue
        beg, end = (int(round(b * float(len(lengths)))) for b in bookends)
        kept = lengths[beg:end]
        kept = kept[kept >= min_length] if min_length > 0 else kept
        per_split.append((int(kept.size), int(kept.sum(dtype=numpy.int64))))
    return per_split


def held_out_document_range(prefix: str, split: str) -> Tuple[int, int]:
    """[begin, end) of the documents of `prefix` that megatron's `split` keeps out of training (its
    valid and test ranges: the documents after the train range, by megatron's split rule)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    train = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))[0]
    count = len(IndexedDataset(prefix, mmap=True).sequence_lengths)
    begin = 0 if train is None else int(round(train[1] * float(count)))
    return begin, count


def _check_splits_have_documents(entry: str, prefix: str, min_length: int, per_split, sizes) -> None:
    # megatron loops forever on a split without documents, so say which one is empty instead
    for split, (documents, _), wanted in zip(Split, per_split, sizes):
        if wanted > 0 and documents == 0:
            what = f"no document of >= {min_length} tokens" if min_length else "no documents"
            shard = "" if prefix == entry else f" (shard {prefix!r})"
            raise DataError(
                f"data.data_path entry {entry!r}{shard} has {what} in its {split.name} split (data.split "
                f"is the document share of each split), but {wanted} {split.name} samples are needed; "
                "change data.split, data.min_document_length or the blend"
            )
