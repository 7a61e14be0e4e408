"""Tokenizer loading, byte-level BPE training and the interface megatron-core reads."""

import json
import pickle
import random

import numpy as np
import pytest

from data_pipeline.tokenizer import Tokenizer, TokenizerError, check_vocab_fits, load_tokenizer
from data_pipeline.train_tokenizer import main as train_main, save_atomic, train_tokenizer

UNICODE_TEXTS = [
    "def f(x):\n    return x ** 2  # square\n",
    "Grüße aus Köln — naïve café, façade, Œuvre; ß ≠ ss.",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "emoji 👩‍👩‍👧‍👦 🇫🇷 ❤️‍🔥 and combining e\u0301 a\u0308 (NFD), zero\u200bwidth",
    "RTL: مرحبا بالعالم, שלום עולם; math 𝔸𝕓𝒸 ∀x∈ℝ",
    "tabs\tand\r\nwindows\rlines, NUL \x00 and DEL \x7f, trailing spaces   \n\n",
]


def random_unicode(rng: random.Random, n: int) -> str:
    """Arbitrary code points, surrogates excluded (not encodable in UTF-8)."""
    chars = []
    while len(chars) < n:
        cp = rng.choice([rng.randrange(0, 0x80), rng.randrange(0x80, 0x800), rng.randrange(0x800, 0x10000),
                         rng.randrange(0x10000, 0x110000)])
        if not 0xD800 <= cp <= 0xDFFF:
            chars.append(chr(cp))
    return "".join(chars)


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    hf = train_tokenizer(UNICODE_TEXTS * 20, vocab_size=400)
    return save_atomic(hf, str(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


def test_trained_tokenizer_round_trips_any_unicode(tok_path):
    tok = load_tokenizer(tok_path)
    assert (tok.vocab_size, tok.eod, tok.pad) == (400, 0, 1)
    texts = UNICODE_TEXTS + [random_unicode(random.Random(seed), 300) for seed in range(20)]
    for text in texts:
        ids = tok.tokenize(text)
        assert tok.detokenize(ids) == text
        assert tok.detokenize(np.asarray(ids, dtype=np.uint16)) == text
        assert max(ids) < tok.vocab_size and tok.eod not in ids and tok.pad not in ids
    # training learned merges: the trained text takes fewer tokens than bytes
    trained_tokens = sum(len(tok.tokenize(t)) for t in UNICODE_TEXTS)
    assert trained_tokens < 0.7 * sum(len(t.encode()) for t in UNICODE_TEXTS)


def test_literal_special_tokens_in_text_stay_text(tok_path):
    tok = load_tokenizer(tok_path)
    text = "a doc about <|endoftext|> and <|pad|> markers"
    ids = tok.tokenize(text)
    assert tok.eod not in ids and tok.pad not in ids
    assert tok.detokenize(ids) == text
    assert tok.detokenize(ids + [tok.eod]) == text + "<|endoftext|>"


def test_batch_matches_single_and_hf_encode_batch(tok_path):
    tok = load_tokenizer(tok_path)
    batch = tok.tokenize_batch(UNICODE_TEXTS)
    assert batch == [tok.tokenize(t) for t in UNICODE_TEXTS]
    slow = tok.hf_tokenizer.encode_batch(UNICODE_TEXTS, add_special_tokens=False)
    assert batch == [e.ids for e in slow]


def _tokenizer_file(tmp_path, special_tokens, name="tokenizer.json"):
    hf = train_tokenizer(["hello world"] * 5, vocab_size=270, special_tokens=special_tokens)
    return save_atomic(hf, str(tmp_path / name))


def test_eod_and_pad_detection(tmp_path):
    tok = load_tokenizer(_tokenizer_file(tmp_path, ["<pad>", "</s>"], "a.json"))
    assert (tok.eod_token, tok.eod, tok.pad_token, tok.pad) == ("</s>", 1, "<pad>", 0)
    tok = load_tokenizer(_tokenizer_file(tmp_path, ["<doc_end>"], "b.json"), eod_token="<doc_end>")
    assert (tok.eod, tok.pad) == (0, None)
    with pytest.raises(TokenizerError, match=r"b\.json has no end-of-document token.*--eod-token"):
        load_tokenizer(str(tmp_path / "b.json"))
    with pytest.raises(TokenizerError, match="tokenizer file not found"):
        load_tokenizer(str(tmp_path / "missing.json"))
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot load tokenizer"):
        load_tokenizer(str(tmp_path / "broken.json"))
    assert load_tokenizer(str(tmp_path.parent / tmp_path.name / "a.json")).path.endswith("a.json")


def _tokenizer_dir(tmp_path, name, special_tokens, eos_token):
    """A directory with tokenizer.json and a tokenizer_config.json naming `eos_token`."""
    directory = tmp_path / name
    directory.mkdir()
    _tokenizer_file(directory, special_tokens)
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos_token}))
    return directory


ADDED_TOKEN = {"__type": "AddedToken", "content": "<doc_end>", "lstrip": False, "normalized": False,
               "rstrip": False, "single_word": False, "special": True}


@pytest.mark.parametrize("eos_token", ["<doc_end>", ADDED_TOKEN], ids=["string", "added_token"])
def test_eod_from_tokenizer_config_matches_transformers(tmp_path, eos_token):
    """eos_token of tokenizer_config.json, in both forms transformers writes, as transformers reads it;
    it wins over a usual name ("</s>") and loses to an explicit one."""
    from transformers import AutoTokenizer

    directory = _tokenizer_dir(tmp_path, "tok", ["</s>", "<doc_end>"], eos_token)
    tok = load_tokenizer(str(directory))
    reference = AutoTokenizer.from_pretrained(str(directory))
    assert (tok.eod_token, tok.eod) == (reference.eos_token, reference.eos_token_id) == ("<doc_end>", 1)
    assert load_tokenizer(str(directory), eod_token="</s>").eod == 0
    (directory / "tokenizer_config.json").unlink()
    assert pickle.loads(pickle.dumps(tok)).eod == 1  # the copy keeps the resolved token without the file
    assert load_tokenizer(str(directory)).eod_token == "</s>"  # without the file: the usual names


def test_tokenizer_config_problems_are_named(tmp_path):
    directory = _tokenizer_dir(tmp_path, "absent", ["</s>"], "<|im_end|>")
    with pytest.raises(TokenizerError, match=r"no end-of-document token \(looked for <\|im_end\|>: eos_token of "
                                             r"tokenizer_config\.json\); pass --eod-token"):
        load_tokenizer(str(directory))
    (directory / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"cannot read .*tokenizer_config\.json"):
        load_tokenizer(str(directory))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": 7}))
    with pytest.raises(TokenizerError, match="eos_token is a int"):
        load_tokenizer(str(directory))


@pytest.mark.parametrize("eod", ["<|end_of_text|>", "<\uff5cend\u2581of\u2581sentence\uff5c>"], ids=["llama3", "deepseek"])
def test_llama3_and_deepseek_end_tokens_are_known(tmp_path, eod):
    tok = load_tokenizer(_tokenizer_file(tmp_path, ["<pad>", eod]))
    assert (tok.eod_token, tok.eod, tok.pad) == (eod, 1, 0)


def test_preprocess_eod_token_flag(tmp_path, capsys):
    """`glm5-preprocess --eod-token NAME --append-eod` ends each document with NAME's id; without the
    flag, a tokenizer with no usual end token is refused with a message naming the flag."""
    from data_pipeline import preprocess
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    path = _tokenizer_file(tmp_path, ["<pad>", "<doc_end>"])
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in UNICODE_TEXTS[:3]))
    argv = ["--input", str(tmp_path / "docs.jsonl"), "--tokenizer", path, "--output-prefix", str(tmp_path / "out"),
            "--append-eod", "--workers", "1"]
    assert preprocess.main(argv) == 2
    assert "pass --eod-token" in capsys.readouterr().err
    assert preprocess.main(argv + ["--eod-token", "<doc_end>"]) == 0
    dataset = IndexedDataset(str(tmp_path / "out"))
    assert len(dataset) == 3 and all(int(dataset[i][-1]) == 1 for i in range(3))


def test_megatron_gpt_dataset_reads_eod_pad_and_identifiers(tok_path, tmp_path):
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import Split

    from data_pipeline.indexed import DatasetWriter

    tok = load_tokenizer(tok_path)
    docs = [tok.tokenize(t) + [tok.eod] for t in UNICODE_TEXTS]
    with DatasetWriter(str(tmp_path / "ds"), np.uint16) as writer:
        for doc in docs:
            writer.add_document(np.asarray(doc, dtype=np.uint16))
        writer.close({})
    seq = sum(map(len, docs)) - 1
    cfg = GPTDatasetConfig(random_seed=1, sequence_length=seq, blend=None, split="1,0,0", tokenizer=tok,
                           reset_position_ids=True, reset_attention_mask=False, eod_mask_loss=True,
                           create_attention_mask=False)
    indexed = IndexedDataset(str(tmp_path / "ds"))
    dataset = GPTDataset(indexed, str(tmp_path / "ds"), np.arange(len(docs), dtype=np.int32), 1, Split.train, cfg)
    assert dataset._pad_token_id == tok.pad
    sample = dataset[0]
    eod_at = (sample["tokens"] == tok.eod).nonzero().flatten().tolist()
    assert len(eod_at) == len(docs) - 1  # the last eod is the final label
    assert all(float(sample["loss_mask"][i]) == 0.0 for i in eod_at)
    assert all(int(sample["position_ids"][i + 1]) == 0 for i in eod_at)
    # the tokenizer file enters megatron's cache hash
    other = load_tokenizer(_tokenizer_file(tmp_path, ["<|endoftext|>", "<|pad|>"]))
    assert json.dumps(tok.unique_identifiers) != json.dumps(other.unique_identifiers)


def test_pickle_round_trip(tok_path):
    tok = load_tokenizer(tok_path)
    clone = pickle.loads(pickle.dumps(tok))
    assert isinstance(clone, Tokenizer) and clone.unique_identifiers == tok.unique_identifiers
    assert clone.tokenize("x <|endoftext|>") == tok.tokenize("x <|endoftext|>")


def test_check_vocab_fits():
    check_vocab_fits(400, 400)
    with pytest.raises(ValueError, match=r"tokenizer has 401 tokens but model.vocab_size is 400; set model.vocab_size >= 401"):
        check_vocab_fits(401, 400)


def test_train_tokenizer_cli(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"text": t}) for t in UNICODE_TEXTS * 10] + ["{broken", json.dumps({"body": "x"})]
    corpus.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out" / "tokenizer.json"
    argv = ["--input", str(corpus), "--vocab-size", "320", "--output", str(out)]
    assert train_main(argv) == 0
    assert "malformed_json: 1" in capsys.readouterr().out
    tok = load_tokenizer(str(out))
    assert tok.vocab_size == 320 and tok.detokenize(tok.tokenize(UNICODE_TEXTS[2])) == UNICODE_TEXTS[2]
    assert sorted(p.name for p in out.parent.iterdir()) == ["tokenizer.json"]  # no partial left
    with pytest.raises(SystemExit) as exit_info:
        train_main(argv)
    assert exit_info.value.code == 2
    assert train_main(argv + ["--strict", "--overwrite"]) == 2
    assert f"{corpus}:{len(UNICODE_TEXTS) * 10 + 1}: malformed_json" in capsys.readouterr().err

