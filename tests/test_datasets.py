"""Training datasets: blend weights, disjoint splits, exact resume across data-parallel sizes, fingerprints, errors.

Datasets are written with megatron's IndexedDatasetBuilder from known token sequences whose ids
say where they came from (source, document), so every check reads the tokens themselves.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from typing import Dict, List, Sequence

import numpy as np
import pytest
import torch

from data_pipeline.datasets import DataError, DocumentGPTDataset, build_datasets, parse_blend
from data_pipeline.indexed import DatasetWriter
from data_pipeline.sampler import DataIterator, DataPositionError, PretrainingSampler
from pretrain.config import ConfigError, GLM5Config, load_config

VOCAB, EOD, PAD = 4096, 1, 2
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class StandInTokenizer:
    """What megatron's GPTDataset reads from a tokenizer (data_pipeline.tokenizer.Tokenizer has the same)."""

    def __init__(self, vocab_size: int = VOCAB, eod: int = EOD, pad: int = PAD):
        self.vocab_size, self.eod, self.pad = vocab_size, eod, pad
        self.unique_identifiers = OrderedDict(cls="stand-in", vocab_size=vocab_size, eod=eod, pad=pad)


def write_dataset(prefix: str, documents: Sequence[Sequence[int]], vocab_size: int = VOCAB, shard_size_docs=None):
    """PREFIX.bin/.idx through megatron's IndexedDatasetBuilder, plus the sidecar the loader checks.

    Each document gets an EOD appended, as the preprocessor does.
    """
    with DatasetWriter(prefix, np.uint16, shard_size_docs=shard_size_docs) as writer:
        for doc in documents:
            writer.add_document(np.asarray(list(doc) + [EOD], dtype=np.uint16))
        writer.close({"tokenizer": {"path": "stand-in", "vocab_size": vocab_size, "eod": EOD}})
    return prefix


def random_documents(n: int, low: int, high: int, seed: int, min_len: int = 3, max_len: int = 40) -> List[List[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(low, high, int(rng.integers(min_len, max_len))).tolist() for _ in range(n)]


def make_cfg(tmp_path, data_path: List[str], seq_length: int = 16, seed: int = 1234, **data) -> GLM5Config:
    cfg = GLM5Config()
    cfg.model.vocab_size = VOCAB
    cfg.train.seed = seed
    cfg.logging.run_dir = str(tmp_path / "run")
    cfg.data.data_path, cfg.data.seq_length, cfg.data.mock = list(data_path), seq_length, False
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return cfg


def build(cfg, train: int, valid: int = 0, test: int = 0, tokenizer=None):
    return build_datasets(cfg, tokenizer or StandInTokenizer(), train, valid, test)


def take(iterator: DataIterator, steps: int) -> List[Dict[str, torch.Tensor]]:
    return [next(iterator) for _ in range(steps)]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Dict[str, str]:
    """Three sources whose token ids live in disjoint ranges: a in [10, 1000), b in [1000, 2000), c in [2000, 3000)."""
    root = tmp_path_factory.mktemp("sources")
    return {
        name: write_dataset(str(root / name), random_documents(300, low, low + 990, seed=i))
        for i, (name, low) in enumerate([("a", 10), ("b", 1000), ("c", 2000)])
    }


def source_of(tokens: torch.Tensor) -> int:
    body = tokens[(tokens != EOD)]
    ids = set((body // 1000).tolist())
    assert len(ids) == 1, f"a window mixes sources {ids}"
    return ids.pop()


# ---------------------------------------------------------------------------------------------
# blends
# ---------------------------------------------------------------------------------------------


def test_blend_follows_its_weights(tmp_path, sources):
    weights = [0.2, 0.3, 0.5]
    cfg = make_cfg(tmp_path, [x for w, name in zip(weights, "abc") for x in (str(w), sources[name])], split="1,0,0")
    train, _, _ = build(cfg, 3000)
    assert len(train) == 3000
    drawn = np.array([source_of(train[i]["tokens"]) for i in range(len(train))])
    ids = np.array([int(train[i]["dataset_id"]) for i in range(len(train))])
    assert (drawn == ids).all()  # the source id megatron reports is the source the tokens came from
    # A binomial 4-sigma bound at every prefix of the sample order; megatron's greedy blending stays far inside it.
    for n in (50, 300, 1000, 3000):
        counts = np.bincount(drawn[:n], minlength=3)
        for k, w in enumerate(weights):
            assert abs(counts[k] - w * n) <= 4 * np.sqrt(n * w * (1 - w)) + 1, (n, counts)
        assert np.abs(counts - np.array(weights) * n).max() <= 2  # in fact within rounding


def test_threaded_index_build_matches_the_serial_one_and_logs_each_file(tmp_path, sources, caplog):
    """data.num_dataset_builder_threads reaches megatron's builder (several files at once on a cache miss) and
    gives the serial build's samples; rank 0 logs each file and split as it is ready (progress of a long build)."""
    blend = [x for w, name in zip([0.2, 0.3, 0.5], "abc") for x in (str(w), sources[name])]
    serial, _, _ = build(make_cfg(tmp_path / "serial", blend, split="9,1,0"), 400, 40)
    with caplog.at_level(logging.INFO, logger="data_pipeline.datasets"):
        threaded, valid, _ = build(make_cfg(tmp_path / "threads", blend, split="9,1,0", num_dataset_builder_threads=3),
                                   400, 40)
    assert len(threaded) == len(serial) and valid is not None
    assert threaded.config.num_dataset_builder_threads == 3  # what megatron's builder read
    for i in range(0, len(serial), 7):
        assert torch.equal(threaded[i]["tokens"], serial[i]["tokens"])
    ready = [r.getMessage() for r in caplog.records if " ready (" in r.getMessage()]
    for name in "abc":
        for split in ("train", "valid"):
            assert any(sources[name] in m and f" {split} ready" in m for m in ready), (name, split, ready)
    assert any("3 file(s) x 2 split(s)" in r.getMessage() and "num_dataset_builder_threads=3" in r.getMessage()
               for r in caplog.records)


def test_unweighted_blend_is_weighted_by_tokens(tmp_path, sources):
    cfg = make_cfg(tmp_path, [sources["a"], sources["b"]], split="1,0,0")
    train, _, _ = build(cfg, 600)
    assert len(train) >= 600  # the requested count (rounded up per source), not one epoch of each
    assert {int(train[i]["dataset_id"]) for i in range(600)} == {0, 1}


def test_sharded_source_counts_as_one_blend_entry(tmp_path):
    sharded = write_dataset(str(tmp_path / "sharded"), random_documents(300, 10, 1000, seed=5), shard_size_docs=70)
    other = write_dataset(str(tmp_path / "other"), random_documents(100, 1000, 2000, seed=6))
    train, _, _ = build(make_cfg(tmp_path, ["0.25", sharded, "0.75", other], split="1,0,0"), 2000)
    names = [os.path.basename(d.dataset_path) for d in train.datasets]
    assert names == ["sharded_00000", "sharded_00001", "sharded_00002", "sharded_00003", "sharded_00004", "other"]
    assert abs(sum(train.weights[:5]) - 0.25) < 1e-9  # the entry's weight, shared by its shards
    drawn = np.bincount([source_of(train[i]["tokens"]) for i in range(2000)], minlength=2)
    assert abs(drawn[0] - 500) <= 6 and abs(drawn[1] - 1500) <= 6


# ---------------------------------------------------------------------------------------------
# splits
# ---------------------------------------------------------------------------------------------


def test_splits_are_disjoint_and_cover_the_documents(tmp_path):
    # document d consists of the token 10 + d only, so a window shows which documents it holds
    prefix = write_dataset(str(tmp_path / "docs"), [[10 + d] * (3 + d % 7) for d in range(100)])
    cfg = make_cfg(tmp_path, [prefix], split="80,15,5")
    splits = build(cfg, 50, 10, 5)
    expected = [set(range(0, 80)), set(range(80, 95)), set(range(95, 100))]
    for dataset, docs in zip(splits, expected):
        assert set(np.asarray(dataset.document_index).tolist()) == docs  # every document of the split, no other
        seen = set()
        for i in range(len(dataset)):
            tokens = dataset[i]["tokens"]
            seen |= set((tokens[tokens != EOD] - 10).tolist())
        assert seen <= docs
        assert len(docs - seen) <= 2  # only documents wholly inside the dropped last partial window
    assert not (expected[0] & expected[1] or expected[0] & expected[2] or expected[1] & expected[2])


def test_split_without_documents_is_an_error_not_a_hang(tmp_path):
    prefix = write_dataset(str(tmp_path / "small"), [[5, 6, 7]] * 20)
    cfg = make_cfg(tmp_path, [prefix], split="969,30,1")  # 20 documents: the test split is empty
    with pytest.raises(DataError, match=r"small'.*no documents in its test split"):
        build(cfg, 10, 2, 1)
    train, valid, test = build(cfg, 10, 2, 0)  # no test samples wanted: the empty split is not built
    assert test is None and len(train) >= 10 and len(valid) >= 2


def test_index_cache_is_reused(tmp_path, sources):
    cfg = make_cfg(tmp_path, ["0.5", sources["a"], "0.5", sources["b"]], split="1,0,0")
    first = build(cfg, 200)[0]
    cache = tmp_path / "run" / "data_cache"
    files = sorted(os.listdir(cache))
    assert any(f.endswith("shuffle_index.npy") for f in files) and any(f.endswith("dataset_index.npy") for f in files)
    second = build(cfg, 200)[0]
    assert sorted(os.listdir(cache)) == files
    assert all(torch.equal(first[i]["tokens"], second[i]["tokens"]) for i in range(0, 200, 7))


# ---------------------------------------------------------------------------------------------
# data position
# ---------------------------------------------------------------------------------------------


def test_sampler_slices_each_step_by_rank():
    steps = [list(PretrainingSampler(20, 4, micro_batch_size=2, dp_rank=r, dp_size=3)) for r in range(3)]
    assert steps == [[[4, 5], [10, 11]], [[6, 7], [12, 13]], [[8, 9], [14, 15]]]
    # samples 16..19 cannot fill a step of 6: dropped for every rank, so all take the same number of steps


@pytest.fixture(scope="module")
def blend_train(tmp_path_factory, sources):
    tmp = tmp_path_factory.mktemp("resume")
    cfg = make_cfg(tmp, ["0.3", sources["a"], "0.7", sources["b"]], split="1,0,0", reset_position_ids=True)
    return build(cfg, 400)[0]


def global_order(dataset, dp_size: int, micro: int, steps: int, consumed: int = 0) -> List[torch.Tensor]:
    """The samples of `steps` micro-batch steps in global order: rank 0's slice, rank 1's, ..."""
    ranks = [DataIterator(dataset, micro, r, dp_size, consumed_samples=consumed) for r in range(dp_size)]
    out = []
    for _ in range(steps):
        for it in ranks:
            out.extend(next(it)["tokens"])
    return out


def test_data_parallel_ranks_partition_the_global_order(blend_train):
    reference = global_order(blend_train, 1, 8, 6)
    assert [t.tolist() for t in reference] == [blend_train[i]["tokens"].tolist() for i in range(48)]
    for dp in (2, 4):
        ordered = global_order(blend_train, dp, 8 // dp, 6)
        assert all(torch.equal(a, b) for a, b in zip(ordered, reference)) and len(ordered) == 48


@pytest.mark.parametrize("dp_before, dp_after, workers", [(1, 1, 0), (2, 2, 0), (2, 4, 0), (4, 1, 2)])
def test_resume_continues_at_the_same_sample(blend_train, dp_before, dp_after, workers):
    micro, total_steps, stop = 2, 10, 4
    uninterrupted = global_order(blend_train, dp_before, micro, total_steps)
    ranks = [DataIterator(blend_train, micro, r, dp_before, num_workers=workers) for r in range(dp_before)]
    for _ in range(stop):
        for it in ranks:
            next(it)
    states = [it.state_dict() for it in ranks]
    assert all(s == states[0] for s in states) and states[0]["consumed_samples"] == stop * micro * dp_before
    del ranks  # the job dies here
    resumed = []
    new_ranks = [DataIterator(blend_train, micro, r, dp_after) for r in range(dp_after)]
    for it in new_ranks:
        it.load_state_dict(states[0])
    expected = uninterrupted[stop * micro * dp_before:]
    while len(resumed) < len(expected):
        for it in new_ranks:
            resumed.extend(next(it)["tokens"])
    assert all(torch.equal(a, b) for a, b in zip(resumed, expected))


def test_load_state_dict_drops_prefetched_batches(blend_train):
    it = DataIterator(blend_train, 4, num_workers=2)
    first = take(it, 3)
    it.load_state_dict({"consumed_samples": 4, "fingerprint": it.fingerprint})
    again = next(it)
    assert torch.equal(again["tokens"], first[1]["tokens"])
    assert it.state_dict()["consumed_samples"] == 8


@pytest.mark.parametrize(
    "change, named",
    [
        ({"seed": 7}, "seed"),
        ({"seq_length": 32}, "seq_length"),
        ({"weights": ("0.5", "0.5")}, "weight"),
        ({"min_document_length": [0, 20]}, "min_document_length"),
        ({"split": "9,1,0"}, "split_weights"),
    ],
)
def test_resume_with_different_data_is_refused(tmp_path, sources, blend_train, change, named):
    saved = DataIterator(blend_train, 2)
    take(saved, 3)
    state = saved.state_dict()
    weights = change.get("weights", ("0.3", "0.7"))
    cfg = make_cfg(
        tmp_path,
        [weights[0], sources["a"], weights[1], sources["b"]],
        seq_length=change.get("seq_length", 16),
        seed=change.get("seed", 1234),
        split=change.get("split", "1,0,0"),
        reset_position_ids=True,
        min_document_length=change.get("min_document_length", []),
    )
    other = DataIterator(build(cfg, 400)[0], 2)
    with pytest.raises(DataPositionError, match=rf"refusing to resume.*{named}.* in the checkpoint"):
        other.load_state_dict(state)
    other.load_state_dict(state, strict=False)  # an explicit override
    assert other.consumed_samples == 6


def test_regenerated_source_is_refused(tmp_path, blend_train, sources):
    state = DataIterator(blend_train, 2).state_dict()
    prefix = write_dataset(str(tmp_path / "a"), random_documents(310, 10, 1000, seed=0))  # same name, more documents
    cfg = make_cfg(tmp_path, ["0.3", prefix, "0.7", sources["b"]], split="1,0,0", reset_position_ids=True)
    with pytest.raises(DataPositionError, match=r"sources\[0\]\.documents"):
        DataIterator(build(cfg, 400)[0], 2).load_state_dict(state)


def test_same_data_elsewhere_resumes(tmp_path, blend_train, sources):
    """Moving the files (same names, same contents) keeps the fingerprint."""
    state = DataIterator(blend_train, 2, consumed_samples=10).state_dict()
    moved = {}
    for name in "ab":
        (tmp_path / "moved").mkdir(exist_ok=True)
        for ext in (".bin", ".idx", ".meta.json"):
            with open(sources[name] + ext, "rb") as src, open(str(tmp_path / "moved" / name) + ext, "wb") as dst:
                dst.write(src.read())
        moved[name] = str(tmp_path / "moved" / name)
    cfg = make_cfg(tmp_path, ["0.3", moved["a"], "0.7", moved["b"]], split="1,0,0", reset_position_ids=True)
    it = DataIterator(build(cfg, 400)[0], 2)
    it.load_state_dict(state)
    assert torch.equal(next(it)["tokens"][0], blend_train[10]["tokens"])


def _two_ranks_body(rank, world_size, cfg, tokenizer):
    torch.distributed.init_process_group("gloo")
    train = build_datasets(cfg, tokenizer, 400, 0, 0)[0]
    return torch.stack(take(DataIterator(train, 2, rank, world_size), 3)[2]["tokens"].unbind())


def test_two_ranks_build_one_cache_and_read_their_slices(tmp_path, sources, blend_train):
    from tests import distributed

    cfg = make_cfg(tmp_path, ["0.3", sources["a"], "0.7", sources["b"]], split="1,0,0", reset_position_ids=True)
    results = distributed.run_ranks(_two_ranks_body, 2, cfg, StandInTokenizer(), timeout=120)
    # step 2 of 2 ranks x 2 samples: global samples 8..11; rank 0 has 8, 9 and rank 1 has 10, 11
    expected = [blend_train[i]["tokens"] for i in range(8, 12)]
    got = list(results[0]) + list(results[1])
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert os.listdir(tmp_path / "run" / "data_cache")


# ---------------------------------------------------------------------------------------------
# mock data and the shipped config
# ---------------------------------------------------------------------------------------------


def test_mock_data_from_the_tiny_config(tmp_path):
    cfg = load_config(os.path.join(ROOT, "configs/models/glm5-tiny.yaml"), [f"logging.run_dir={tmp_path}"])
    train, valid, test = build_datasets(cfg, None, 64, 8, 0)
    assert test is None
    batch = next(DataIterator(train, cfg.train.micro_batch_size))
    s = cfg.data.seq_length
    assert batch["tokens"].shape == batch["labels"].shape == batch["position_ids"].shape == (4, s)
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
    assert int(batch["tokens"].max()) < cfg.model.vocab_size


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


def test_missing_prefix_is_named(tmp_path, sources):
    cfg = make_cfg(tmp_path, ["0.5", sources["a"], "0.5", str(tmp_path / "nope")])
    with pytest.raises(DataError, match=r"data.data_path entry '.*nope': .*nope\.meta\.json is missing"):
        build(cfg, 10)
    for suffix in (".bin", ".idx"):  # no sidecar: not completed by the preprocessor
        with open(sources["a"] + suffix, "rb") as src, open(str(tmp_path / "bare") + suffix, "wb") as dst:
            dst.write(src.read())
    with pytest.raises(DataError, match=r"entry '.*bare': .*bare\.meta\.json is missing"):
        build(make_cfg(tmp_path, [str(tmp_path / "bare")]), 10)


@pytest.mark.parametrize(
    "data_path, message",
    [
        (["0.5", "a", "b"], "not a list of weight/prefix pairs"),
        (["0.5", "a", "0.5"], "not a list of weight/prefix pairs"),
        (["0.5", "a", "x", "b"], "not a list of weight/prefix pairs"),
        (["a", "0.5", "b", "0.5"], "mixes prefixes with numbers"),
        (["0", "a", "1", "b"], r"gives \['a'\] a weight <= 0"),
        ([], "data.data_path is empty"),
    ],
)
def test_bad_blend_syntax(data_path, message):
    with pytest.raises(DataError, match=message):
        parse_blend(data_path)


def test_parse_blend_forms():
    assert parse_blend(["p"]) == (["p"], None)
    assert parse_blend(["p", "q"]) == (["p", "q"], None)
    assert parse_blend(["30", "p", "70", "q"]) == (["p", "q"], [30.0, 70.0])


def test_tokenizer_larger_than_the_model_vocabulary(tmp_path, sources):
    cfg = make_cfg(tmp_path, [sources["a"]])
    cfg.model.vocab_size = 1000
    with pytest.raises(DataError, match=r"tokenizer has 4096 tokens but model.vocab_size is 1000"):
        build(cfg, 10)


def test_dataset_made_with_a_larger_vocabulary(tmp_path, sources):
    cfg = make_cfg(tmp_path, ["0.5", sources["a"], "0.5", sources["c"]])  # made with a 4096-token tokenizer
    cfg.model.vocab_size = 2048
    with pytest.raises(DataError, match=r"entry '.*a': .*4096 tokens.*model.vocab_size is 2048"):
        build(cfg, 10, tokenizer=StandInTokenizer(vocab_size=2048))


def test_min_document_length_must_match_the_blend(tmp_path, sources):
    cfg = make_cfg(tmp_path, ["0.5", sources["a"], "0.5", sources["b"]], min_document_length=[10])
    with pytest.raises(DataError, match=r"min_document_length has 1 entries but data.data_path has 2 blend entries"):
        build(cfg, 10)
    with pytest.raises(ConfigError, match=r"data.min_document_length has 1 entries"):
        load_config(os.path.join(ROOT, "configs/models/glm5-tiny.yaml"),
                    ['data.data_path=["0.5", a, "0.5", b]', "data.min_document_length=[10]"])
    with pytest.raises(ConfigError, match=r"negative"):
        load_config(os.path.join(ROOT, "configs/models/glm5-tiny.yaml"),
                    ["data.data_path=[a]", "data.min_document_length=[-1]"])


def test_mock_with_a_data_path_is_an_error(tmp_path, sources):
    cfg = make_cfg(tmp_path, [sources["a"]])
    cfg.data.mock = True
    with pytest.raises(DataError, match="data.mock=true but data.data_path is set"):
        build(cfg, 10)


def test_dataset_class_is_a_megatron_gpt_dataset(blend_train):
    assert all(isinstance(d, DocumentGPTDataset) for d in blend_train.datasets)
