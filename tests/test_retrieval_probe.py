"""The retrieval probe's generator (data_pipeline.retrieval_probe) and evaluator (pretrain.eval.retrieval)."""

import math
import random
import re

import pytest
import torch

from data_pipeline.retrieval_probe import COPY_PREFIX, COPY_SPAN, filler_tokens, make_probe, make_sample
from pretrain.eval import retrieval_copy
from pretrain.eval.retrieval import scores_by_length


def chars(text):
    return [ord(c) for c in text]


def text(ids):
    return "".join(chr(i) for i in ids)


@pytest.mark.parametrize("kind, pairs", [("kv", 1), ("kv", 3), ("passkey", 1)])
def test_probe_format(kind, pairs):
    filler = filler_tokens(chars, None, 5000)
    for probe in make_probe(chars, filler, [300, 700], samples=5, seed=1, kind=kind, pairs=pairs):
        prompt, answer = probe["prompt"], probe["answer"]
        assert len(prompt) + len(answer) == probe["length"]
        body, value, key = text(prompt), probe["value"], probe["key"]
        assert re.fullmatch(r"\d{5}", value)
        if kind == "kv":
            assert text(answer) == f'{value}"' and body.endswith(f'\nassert {key} == "')
            needle = f'\n{key} = "{value}"\n'
            assert len(set(re.findall(r'\nkey_[a-z]{4} = "', body))) == pairs  # distinct distractor keys
        else:
            assert text(answer) == f"{value}\n" and body.endswith("\nassert passkey == ")
            needle = f"\npasskey = {value}  # remember the passkey\n"
        assert body[probe["needle_at"]:].startswith(needle) and body.count(needle) == 1
        assert probe["depth"] == probe["needle_at"] / len(prompt)
    depths = [p["depth"] for p in make_probe(chars, filler, [700], samples=20, seed=2)]
    assert min(depths) < 0.3 and max(depths) > 0.7  # needles spread over the context


def test_answer_tokens_follow_the_joint_tokenization():
    """A tokenizer that merges a quote with the next digit: the answer starts with the merged token."""

    def merging(s):
        out, i = [], 0
        while i < len(s):
            if s[i] == '"' and i + 1 < len(s) and s[i + 1].isdigit():
                out.append(1000 + int(s[i + 1]))
                i += 2
            else:
                out.append(ord(s[i]))
                i += 1
        return out

    probe = make_sample(merging, filler_tokens(merging, None, 2000), 400, random.Random(0))
    key, value = probe["key"], probe["value"]
    tail = f'\nassert {key} == "{value}"'
    assert probe["prompt"][-len(merging(f"\nassert {key} == ")):] == merging(f"\nassert {key} == ")
    assert (probe["prompt"] + probe["answer"])[-len(merging(tail)):] == merging(tail)
    assert probe["answer"][0] == 1000 + int(value[0])


def test_generator_refuses_lengths_it_cannot_fill():
    with pytest.raises(ValueError, match="too short"):
        make_sample(chars, chars("x" * 100), 10, random.Random(0))
    with pytest.raises(ValueError, match="filler has 50 tokens"):
        make_sample(chars, chars("x" * 50), 200, random.Random(0))


def windowed_oracle(window: int):
    """Reads only the last `window` tokens; answers the queried key's value when it sees its needle."""

    def logits(tokens):
        ids = tokens.tolist()
        body = text(ids)
        start = body.rfind(' == "') + len(' == "')  # first answer position
        key = re.findall(r"assert (key_[a-z]{4}) == \"", body)[-1]
        found = re.search(rf'{key} = "(\d+)"', text(ids[-window:]))
        answer = (found.group(1) if found else "00000") + '"'
        out = torch.zeros(len(ids), 128)
        for j, ch in enumerate(answer):
            if start - 1 + j < len(ids):
                out[start - 1 + j, ord(ch)] = 1.0
        return out

    return logits


def test_accuracy_per_length_against_an_oracle_with_a_known_window():
    filler = filler_tokens(chars, None, 5000)
    probes = make_probe(chars, filler, [200, 400, 800], samples=12, seed=3, pairs=2)
    window = 300
    expected, expected_nll = {}, {}
    for length in (200, 400, 800):
        mine = [p for p in probes if p["length"] == length]
        # The model's input is the prompt plus all but the last answer token; the needle's key starts
        # one token after needle_at (the needle begins with a newline).
        seen = [p["needle_at"] + 1 >= len(p["prompt"]) + len(p["answer"]) - 1 - window for p in mine]
        expected[length] = sum(seen) / len(seen)
        # The oracle's logits are 1 on its guess and 0 on the other 127 characters: a right token costs
        # log(e + 127) - 1 nats, a wrong one log(e + 127). Unseen, it guesses 00000 (then the quote).
        nll = []
        for p, s in zip(mine, seen):
            guess = (p["value"] if s else "00000") + '"'
            right = sum(a == b for a, b in zip(guess, p["value"] + '"'))
            nll.append(math.log(math.e + 127) - right / len(guess))
        expected_nll[length] = sum(nll) / len(nll)
    assert expected[200] == 1.0 and 0.0 < expected[400] < 1.0  # the probe set exercises both outcomes
    got = scores_by_length(windowed_oracle(window), probes)
    assert {k: v["accuracy"] for k, v in got.items()} == pytest.approx(expected)
    assert {k: v["nll"] for k, v in got.items()} == pytest.approx(expected_nll)


def test_copy_probe_format():
    filler = list(range(1000, 6000))  # distinct tokens: the span's prefix occurs only where it was put
    for probe in make_probe(chars, filler, [100, 300], samples=6, seed=4, kind="copy"):
        prompt, answer, at = probe["prompt"], probe["answer"], probe["needle_at"]
        span = prompt[at : at + COPY_SPAN]
        assert len(prompt) + len(answer) == probe["length"] and set(span) <= set(filler)
        assert prompt[-COPY_PREFIX:] == span[:COPY_PREFIX] and answer == span[COPY_PREFIX:]
        assert probe["distance"] == len(prompt) - at and probe["depth"] == at / len(prompt)
        assert probe["key"] == " ".join(map(str, span[:COPY_PREFIX]))
    with pytest.raises(ValueError, match="copy probes have one needle"):
        make_sample(chars, filler, 100, random.Random(0), kind="copy", pairs=2)


def induction_oracle(window: int, vocab: int):
    """At each position, finds the latest earlier occurrence of the last COPY_PREFIX tokens within the last
    `window` tokens and predicts the token after it (token 0 when there is none)."""

    def logits(tokens):
        ids = tokens.tolist()
        out = torch.zeros(len(ids), vocab)
        for p in range(len(ids)):
            key, guess = ids[p - COPY_PREFIX + 1 : p + 1], 0
            for q in range(p - COPY_PREFIX, max(p - window, -1), -1):
                if q >= 0 and ids[q : q + COPY_PREFIX] == key and q + COPY_PREFIX <= p:
                    guess = ids[q + COPY_PREFIX]
                    break
            out[p, guess] = 1.0
        return out

    return logits


def test_copy_accuracy_against_an_oracle_with_a_known_window():
    """A copy probe is right for a windowed copier exactly when the span's start lies within its window of the
    query: what tells a sliding window from full attention."""
    filler, window, vocab = list(range(1000, 6000)), 150, 6000
    probes = make_probe(chars, filler, [100, 300], samples=10, seed=5, kind="copy")
    got = scores_by_length(induction_oracle(window, vocab), probes)
    for length in (100, 300):
        mine = [p for p in probes if p["length"] == length]
        # the first answer token is predicted at the query's last position, len(prompt) - 1: the window reaches back
        # to len(prompt) - window, so the span (at len(prompt) - distance) is found when distance <= window; each
        # later answer position moves the window and the span's next tokens by one alike
        seen = [p["distance"] <= window for p in mine]
        assert got[length]["accuracy"] == pytest.approx(sum(seen) / len(seen))
        wrong = math.log(math.e + vocab - 1)
        assert got[length]["nll"] == pytest.approx(sum(wrong - s for s in seen) / len(seen))
    assert got[100]["accuracy"] == 1.0 and 0.0 < got[300]["accuracy"] < 1.0


def test_copy_eval_refuses_another_kind(capsys):
    assert retrieval_copy.main(["--checkpoint", "x", "--kind", "kv"]) == 2
    assert "--kind is copy here" in capsys.readouterr().err


def _numbered_documents(path, count, length=10):
    """Document d holds the token d + 1 `length` times, so every token names its document."""
    import numpy as np

    from data_pipeline.indexed import DatasetWriter

    prefix = str(path / "numbered")
    with DatasetWriter(prefix, np.uint16) as writer:
        for d in range(count):
            writer.add_document(np.full(length, d + 1, dtype=np.uint16))
        writer.close({})
    return prefix


def test_held_out_text_never_reaches_training_documents(tmp_path):
    """With split 90,10,0 over 20 documents, 18 and 19 are held out: filler and eval documents come from
    them only, and asking for more than they hold is a one-line error, not training text."""
    from pretrain.eval.checkpoint import held_out_documents

    prefix = _numbered_documents(tmp_path, 20)
    filler = filler_tokens(chars, prefix, 20, split="90,10,0")
    assert sorted(set(filler)) == [19, 20]
    with pytest.raises(ValueError, match=r"^\S+ has 20 held-out tokens \(documents 18\.\.19.*'90,10,0'.*25 filler"):
        filler_tokens(chars, prefix, 25, split="90,10,0")
    docs = held_out_documents(prefix, 5, 8, split="90,10,0")
    assert [int(d[0]) for d in docs] == [20, 19]  # two documents, not eight reaching into training's
    with pytest.raises(ValueError, match="no held-out document of 5 tokens or more"):
        held_out_documents(prefix, 5, 1, split="100,0,0")
