"""Packing: every token kept, positions and attention reset at documents, loss mask, long-document selection."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

from data_pipeline.long_context import split_min_document_length, with_min_document_length
from data_pipeline.packing import (
    block_causal_mask,
    collate_batch,
    pack_sample,
    packed_seq_params,
    reset_positions,
    segment_offsets,
)
from tests.test_datasets import EOD, PAD, build, make_cfg, random_documents, write_dataset


def unshuffled(dataset) -> list:
    """Samples in stream order: megatron's shuffle index maps position -> stream sample."""
    order = np.argsort(np.asarray(dataset.shuffle_index))
    return [dataset[int(k)] for k in order]


def naive_documents(tokens: list) -> list:
    """doc id of every position: a document ends with (and includes) its EOD."""
    ids, doc = [], 0
    for t in tokens:
        ids.append(doc)
        doc += t == EOD
    return ids


# ---------------------------------------------------------------------------------------------
# the packed stream
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seq_length", [7, 16, 64])
def test_packing_preserves_every_token(tmp_path, seq_length):
    docs = random_documents(120, 10, 4000, seed=3, min_len=1, max_len=90)
    prefix = write_dataset(str(tmp_path / "docs"), docs)
    train, _, _ = build(make_cfg(tmp_path, [prefix], seq_length=seq_length, split="1,0,0"), 1)  # one epoch
    samples = unshuffled(train)
    order = np.asarray(train.document_index)
    assert sorted(order.tolist()) == list(range(len(docs)))  # one epoch: each document once
    stream = np.concatenate([docs[d] + [EOD] for d in order])
    n, s = len(samples), seq_length
    inputs = torch.cat([x["tokens"] for x in samples]).numpy()
    assert np.array_equal(inputs, stream[: n * s])
    for x in samples:  # labels are the inputs shifted by one, across window borders too
        assert torch.equal(x["labels"][:-1], x["tokens"][1:])
    assert np.array_equal(np.array([int(x["labels"][-1]) for x in samples]), stream[s : n * s + 1 : s])
    assert len(stream) - (n * s + 1) < s  # only the last partial window is left out


def test_a_longer_run_cycles_whole_epochs(tmp_path):
    docs = random_documents(40, 10, 4000, seed=4)
    prefix = write_dataset(str(tmp_path / "docs"), docs)
    epoch_tokens = sum(len(d) + 1 for d in docs)
    train, _, _ = build(make_cfg(tmp_path, [prefix], seq_length=16, split="1,0,0"), 3 * epoch_tokens // 16)
    counts = np.bincount(np.asarray(train.document_index), minlength=len(docs))
    assert counts.min() == counts.max() >= 3  # every document equally often: nothing dropped, nothing favoured


# ---------------------------------------------------------------------------------------------
# document boundaries inside a window
# ---------------------------------------------------------------------------------------------

WINDOWS = [
    [5, 6, EOD, 7, 8, 9, EOD, 10, 11],  # two boundaries inside
    [EOD, 5, 6, 7, EOD, EOD, 8, 9, 10],  # EOD first, two in a row
    [5, 6, 7, 8, 9, 10, 11, 12, EOD],  # EOD at the end: one document
    [5, 6, 7, 8, 9, 10, 11, 12, 13],  # no EOD
    [EOD] * 9,
]


@pytest.mark.parametrize("text", WINDOWS)
def test_boundaries_positions_and_mask_against_naive(text):
    sample = pack_sample(torch.tensor(text), EOD, PAD, reset_position_ids=True, reset_attention_mask=True,
                         eod_mask_loss=False)
    tokens = text[:-1]
    doc = naive_documents(tokens)
    s = len(tokens)
    # position ids restart at 0 at every document start
    expected_pos = [i - doc.index(doc[i]) for i in range(s)]
    assert sample["position_ids"].tolist() == expected_pos
    # cu_seqlens: the first position of every document, then s
    starts = [doc.index(k) for k in sorted(set(doc))]
    assert sample["cu_seqlens"].tolist() == starts + [s]
    # attention: i may see j iff j <= i and both are in the same document (True = masked); the sample carries
    # no mask (cu_seqlens say it), the tests' dense writing of it is checked here
    assert "attention_mask" not in sample
    naive = torch.tensor([[not (j <= i and doc[i] == doc[j]) for j in range(s)] for i in range(s)])
    mask = block_causal_mask(sample["tokens"], EOD)
    assert mask.shape == (1, s, s) and mask.dtype == torch.bool
    assert torch.equal(mask[0], naive)


def test_matches_megatron_masks_and_positions():
    rng = np.random.default_rng(0)
    for _ in range(20):
        tokens = torch.from_numpy(rng.choice([EOD, 5, 6, 7, 8, 9], size=33, p=[0.15] + [0.17] * 5))
        ours = pack_sample(tokens, EOD, PAD, True, True, True)
        mask, loss_mask, pos = _get_ltor_masks_and_position_ids(tokens[:-1], EOD, True, True, True, True)
        assert torch.equal(block_causal_mask(tokens[:-1], EOD), mask)
        assert torch.equal(ours["position_ids"], pos)
        assert torch.equal(ours["loss_mask"], loss_mask)


def test_without_reset_one_window_is_one_segment():
    text = torch.tensor(WINDOWS[0])
    sample = pack_sample(text, EOD, PAD, reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    assert sample["position_ids"].tolist() == list(range(8))
    assert sample["cu_seqlens"].tolist() == [0, 8]
    assert "attention_mask" not in sample  # the model's causal mask covers it
    # positions may reset while attention spans documents, and the dense mask can be left out
    sample = pack_sample(text, EOD, PAD, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=False,
                         create_attention_mask=False)
    assert "attention_mask" not in sample and sample["cu_seqlens"].tolist() == [0, 3, 7, 8]


def test_the_dense_mask_is_refused():
    with pytest.raises(ValueError, match="data.create_attention_mask"):
        pack_sample(torch.tensor(WINDOWS[0]), EOD, PAD, True, True, False, create_attention_mask=True)


def test_documents_cost_linear_host_memory_at_long_lengths():
    """A 128K window with documents: the sample (and the model's document layout built from its batch) hold O(S)
    bytes: under 8 MiB, where megatron's dense mask alone is 16 GiB; the same per token as at 16K."""
    import time

    from pretrain.training.step import with_documents

    per_token = {}
    for s in (16384, 131072):
        gen = torch.Generator().manual_seed(s)
        text = torch.randint(1, 1000, (s + 1,), generator=gen)
        text[torch.randint(0, s, (s // 2000,), generator=gen)] = EOD
        start = time.perf_counter()
        sample = pack_sample(text, EOD, PAD, True, True, False)
        batch = with_documents(collate_batch([sample]))
        seconds = time.perf_counter() - start
        nbytes = sum(v.numel() * v.element_size() for v in batch.values() if torch.is_tensor(v))
        assert batch["document_layout"].shape == (1, 2, s)
        print(f"\npack_sample + document layout at {s}: {seconds * 1e3:.1f} ms, {nbytes / 2**20:.2f} MiB")
        assert nbytes < 8 * 2**20 and seconds < 5.0
        per_token[s] = nbytes / s
    assert per_token[131072] <= 1.01 * per_token[16384]


def test_loss_mask():
    text = torch.tensor([5, EOD, 6, 7, EOD, PAD, PAD])  # a short final window, padded
    sample = pack_sample(text, EOD, PAD, False, False, eod_mask_loss=True)
    # no loss where the input is EOD (predicting across documents) or the label is padding
    assert sample["loss_mask"].tolist() == [1, 0, 1, 1, 0, 0]
    assert sample["labels"].tolist() == [EOD, 6, 7, EOD, 0, 0]  # padding mapped to an id the embedding has
    assert sample["tokens"].tolist() == [5, EOD, 6, 7, EOD, 0]
    assert pack_sample(text, EOD, PAD, False, False, eod_mask_loss=False)["loss_mask"].tolist() == [1, 1, 1, 1, 0, 0]


def test_collate_flattens_segments_thd():
    a = pack_sample(torch.tensor(WINDOWS[0]), EOD, PAD, True, True, False)
    b = pack_sample(torch.tensor(WINDOWS[2]), EOD, PAD, True, True, False)
    batch = collate_batch([a, b])
    assert batch["tokens"].shape == (2, 8) and "attention_mask" not in batch
    assert batch["cu_seqlens"].tolist() == [0, 3, 7, 8, 16]
    assert int(batch["max_seqlen"]) == 8
    params = packed_seq_params(batch)
    assert params.qkv_format == "thd" and params.max_seqlen_q == 8
    assert torch.equal(params.cu_seqlens_q, batch["cu_seqlens"])


def test_helpers_agree():
    tokens = torch.tensor(WINDOWS[1][:-1])
    cu = segment_offsets(tokens, EOD)
    assert cu.tolist() == [0, 1, 5, 6, 8]
    assert reset_positions(tokens, EOD).tolist() == [0, 0, 1, 2, 3, 0, 0, 1]
    mask = block_causal_mask(tokens, EOD)[0]
    for beg, end in zip(cu[:-1].tolist(), cu[1:].tolist()):  # each segment sees exactly its own causal prefix
        for i in range(beg, end):
            assert (~mask[i]).nonzero().flatten().tolist() == list(range(beg, i + 1))


def test_dataset_samples_carry_document_segments(tmp_path):
    docs = random_documents(60, 10, 4000, seed=9, min_len=2, max_len=12)
    prefix = write_dataset(str(tmp_path / "docs"), docs)
    cfg = make_cfg(tmp_path, [prefix], seq_length=32, split="1,0,0", reset_position_ids=True,
                   reset_attention_mask=True, eod_mask_loss=True)
    train, _, _ = build(cfg, 20)
    for i in range(len(train)):
        x = train[i]
        tokens = x["tokens"].tolist()
        doc = naive_documents(tokens)
        assert x["position_ids"].tolist() == [k - doc.index(doc[k]) for k in range(32)]
        assert "attention_mask" not in x  # documents as cu_seqlens: each document's first position, then 32
        assert x["cu_seqlens"].tolist() == [doc.index(d) for d in sorted(set(doc))] + [32]
        assert x["loss_mask"].tolist() == [0.0 if t == EOD else 1.0 for t in tokens]


# ---------------------------------------------------------------------------------------------
# long documents
# ---------------------------------------------------------------------------------------------


def length_coded_documents(n: int, seed: int) -> list:
    """Document of length L (EOD included) is the token 10 + L repeated, so any token tells its length."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, 200, n)
    return [[10 + int(L)] * (int(L) - 1) for L in lengths]


def lengths_in(tokens: torch.Tensor) -> set:
    return set((tokens[tokens != EOD] - 10).tolist())


def test_long_document_filter(tmp_path):
    docs = length_coded_documents(300, seed=1)
    prefix = write_dataset(str(tmp_path / "mixed"), docs)
    cfg = make_cfg(tmp_path, [prefix], seq_length=64, split="1,0,0", min_document_length=[120])
    train, _, _ = build(cfg, 200)
    assert len(train) >= 200 and train.min_document_length == 120
    seen = set()
    for i in range(len(train)):
        seen |= lengths_in(train[i]["tokens"])
    long_docs = {len(d) + 1 for d in docs if len(d) + 1 >= 120}
    assert seen and min(seen) >= 120 and seen == long_docs  # only long documents, all of them
    assert set(np.asarray(train.document_index).tolist()) == {i for i, d in enumerate(docs) if len(d) + 1 >= 120}


def test_filter_keeps_the_split(tmp_path):
    docs = length_coded_documents(200, seed=2)
    prefix = write_dataset(str(tmp_path / "mixed"), docs)
    cfg = make_cfg(tmp_path, [prefix], seq_length=32, split="1,1,0", min_document_length=[100])
    train, valid, _ = build(cfg, 20, 5)
    long_ids = {i for i, d in enumerate(docs) if len(d) + 1 >= 100}
    assert set(np.asarray(train.document_index).tolist()) == {i for i in long_ids if i < 100}
    assert set(np.asarray(valid.document_index).tolist()) == {i for i in long_ids if i >= 100}


def test_up_sampling_long_documents_by_weight(tmp_path):
    docs = length_coded_documents(400, seed=3)
    prefix = write_dataset(str(tmp_path / "mixed"), docs)
    n, s, threshold = 2000, 32, 150

    def long_share(data_path, min_lengths):
        cfg = make_cfg(tmp_path, data_path, seq_length=s, split="1,0,0", min_document_length=min_lengths)
        train, _, _ = build(cfg, n)
        long_tokens = sum(int(((x["tokens"] - 10) >= threshold).sum()) for x in (train[i] for i in range(n)))
        return train, long_tokens / (n * s)

    _, base = long_share([prefix], [])
    train, boosted = long_share(["0.5", prefix, "0.5", prefix], [0, threshold])
    assert [split_min_document_length(d.dataset_path)[1] for d in train.datasets] == [0, threshold]
    ids = np.array([int(train[i]["dataset_id"]) for i in range(n)])
    assert abs(int((ids == 1).sum()) - n // 2) <= 1  # the filtered entry gets its weight
    for i in np.flatnonzero(ids == 1)[:200]:
        assert min(lengths_in(train[int(i)]["tokens"])) >= threshold
    # half the windows now come only from long documents: their token share rises to ~ (1 + base) / 2
    assert base < 0.5 and abs(boosted - (1 + base) / 2) < 0.05


def test_filter_in_the_dataset_path_round_trips():
    assert with_min_document_length("/d/web", 0) == "/d/web"
    path = with_min_document_length("/d/web", 32768)
    assert path == "/d/web[min_document_length=32768]"
    assert split_min_document_length(path) == ("/d/web", 32768)
    assert split_min_document_length("/d/web") == ("/d/web", 0)


def test_no_long_documents_in_a_split_is_an_error(tmp_path):
    from data_pipeline.datasets import DataError

    prefix = write_dataset(str(tmp_path / "short"), [[5] * 10] * 50)
    cfg = make_cfg(tmp_path, [prefix], seq_length=8, split="1,0,0", min_document_length=[100])
    with pytest.raises(DataError, match=r"short' has no document of >= 100 tokens in its train split"):
        build(cfg, 10)
