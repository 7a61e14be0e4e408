"""check_indexed_dataset: every way a dataset on disk can be unusable is caught with its file named."""

import json
import os
import shutil
import struct

import numpy as np
import pytest

from data_pipeline.indexed import DatasetWriter, IndexedDatasetError, check_indexed_dataset, megatron_indexed_dataset
from data_pipeline.tokenizer import load_tokenizer
from data_pipeline.train_tokenizer import save_atomic, train_tokenizer

TEXTS = ["alpha beta gamma\n", "δέλτα εψιλον ζήτα", "def f():\n    pass\n", "x" * 300, "last one"]
VOCAB = 300


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A dataset written by DatasetWriter with the meta glm5-preprocess records; (prefix, tokenizer)."""
    root = tmp_path_factory.mktemp("indexed")
    tok = load_tokenizer(save_atomic(train_tokenizer(TEXTS * 5, vocab_size=VOCAB), str(root / "tokenizer.json")))
    prefix = str(root / "ds")
    with DatasetWriter(prefix, np.uint16) as writer:
        for text in TEXTS:
            writer.add_document(np.asarray(tok.tokenize(text) + [tok.eod], dtype=np.uint16))
        writer.close({"tokenizer": {"path": tok.path, "sha256": tok.sha256, "vocab_size": tok.vocab_size, "eod": tok.eod}})
    return prefix, tok


@pytest.fixture
def ds(built, tmp_path):
    """A fresh copy of the good dataset to damage."""
    prefix, _ = built
    for suffix in (".bin", ".idx", ".meta.json"):
        shutil.copy(prefix + suffix, str(tmp_path / "ds") + suffix)
    return str(tmp_path / "ds")


def test_good_dataset_passes_and_megatron_reads_it(ds, built):
    _, tok = built
    info = check_indexed_dataset(ds, vocab_size=VOCAB, full_scan=True, tokenizer=tok)
    assert (info.documents, info.dtype, info.vocab_size, info.prefixes) == (len(TEXTS), "uint16", VOCAB, [ds])
    dataset = megatron_indexed_dataset().IndexedDataset(ds)
    assert info.tokens == int(dataset.sequence_lengths.sum())
    assert [tok.detokenize(dataset[i][:-1]) for i in range(len(dataset))] == TEXTS


def test_truncated_bin(ds):
    with open(ds + ".bin", "r+b") as f:
        f.truncate(f.seek(0, 2) - 2)
    with pytest.raises(IndexedDatasetError, match=r"ds\.bin is truncated: .*ds\.idx expects .* re-run glm5-preprocess"):
        check_indexed_dataset(ds)


def test_bin_longer_than_index(ds):
    with open(ds + ".bin", "ab") as f:
        f.write(b"\x00\x00")
    with pytest.raises(IndexedDatasetError, match=r"ds\.bin is longer than its index"):
        check_indexed_dataset(ds)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: b"XXXXXXXXX" + b[9:], "not a megatron index header"),
        (lambda b: b[:-5], "truncated or corrupted: its header announces"),
        (lambda b: b[:18] + struct.pack("<Q", 999) + b[26:], "truncated or corrupted: its header announces"),
        (lambda b: b[:17] + bytes([42]) + b[18:], "dtype code 42"),
    ],
    ids=["magic", "truncated", "sequence-count", "dtype-code"],
)
def test_corrupted_idx_header(ds, damage, message):
    with open(ds + ".idx", "rb") as f:
        data = f.read()
    with open(ds + ".idx", "wb") as f:
        f.write(damage(data))
    with pytest.raises(IndexedDatasetError, match=rf"ds\.idx is .*{message}"):
        check_indexed_dataset(ds)


def test_corrupted_idx_pointers_and_boundaries(ds):
    sequences = len(TEXTS)
    pointers_at = 34 + 4 * sequences
    with open(ds + ".idx", "r+b") as f:
        f.seek(pointers_at + 8 * 2)  # third pointer
        f.write(struct.pack("<q", 3))
    with pytest.raises(IndexedDatasetError, match=r"ds\.idx is corrupted: sequence pointers do not follow the lengths"):
        check_indexed_dataset(ds)


def test_corrupted_document_boundaries(ds):
    doc_index_at = 34 + 12 * len(TEXTS)
    with open(ds + ".idx", "r+b") as f:
        f.seek(doc_index_at + 8 * len(TEXTS))  # the last boundary must equal the sequence count
        f.write(struct.pack("<q", 2))
    with pytest.raises(IndexedDatasetError, match=r"ds\.idx is corrupted: document boundaries"):
        check_indexed_dataset(ds)


def test_missing_files(ds):
    os.remove(ds + ".bin")
    with pytest.raises(IndexedDatasetError, match=r"ds\.bin is missing"):
        check_indexed_dataset(ds)
    os.remove(ds + ".meta.json")
    with pytest.raises(IndexedDatasetError, match=r"ds\.meta\.json is missing, so it was not completed by glm5-preprocess"):
        check_indexed_dataset(ds)
    with pytest.raises(IndexedDatasetError, match=r"nothing\.meta\.json is missing; check the data path"):
        check_indexed_dataset(ds[:-2] + "nothing")


def test_dataset_without_meta_is_accepted_on_request(ds):
    os.remove(ds + ".meta.json")
    assert check_indexed_dataset(ds, require_meta=False, full_scan=True).documents == len(TEXTS)


def test_tokenizer_does_not_fit_the_model(ds):
    with pytest.raises(IndexedDatasetError, match=rf"tokenized with .*tokenizer\.json \({VOCAB} tokens\) but model\.vocab_size is 256; set model\.vocab_size >= {VOCAB}"):
        check_indexed_dataset(ds, vocab_size=256)
    check_indexed_dataset(ds, vocab_size=VOCAB + 1)


def test_tokenizer_file_differs_from_the_datasets(ds, built, tmp_path):
    other = load_tokenizer(save_atomic(train_tokenizer(["other text"] * 3, vocab_size=VOCAB), str(tmp_path / "other.json")))
    with pytest.raises(IndexedDatasetError, match=r"was tokenized with .*tokenizer\.json .* but training uses .*other\.json"):
        check_indexed_dataset(ds, tokenizer=other)
    check_indexed_dataset(ds, tokenizer=built[1])


def test_out_of_vocab_ids_found_by_full_scan(ds):
    with open(ds + ".bin", "r+b") as f:
        f.seek(2 * 7)
        f.write(np.uint16(VOCAB + 5).tobytes())
    check_indexed_dataset(ds)  # the cheap check reads no token
    with pytest.raises(IndexedDatasetError, match=rf"token id {VOCAB + 5} at token 7 \(document \d\) is outside the tokenizer's vocab size {VOCAB}"):
        check_indexed_dataset(ds, full_scan=True)


def test_meta_disagrees_with_files(ds):
    with open(ds + ".meta.json") as f:
        meta = json.load(f)
    meta["documents"] += 1
    with open(ds + ".meta.json", "w") as f:
        json.dump(meta, f)
    with pytest.raises(IndexedDatasetError, match=r"records \(documents, tokens, dtype\)"):
        check_indexed_dataset(ds)
    with open(ds + ".meta.json", "w") as f:
        f.write("{truncated")
    with pytest.raises(IndexedDatasetError, match=r"ds\.meta\.json is corrupted"):
        check_indexed_dataset(ds)
