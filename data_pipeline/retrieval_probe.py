"""Synthetic long-context retrieval probes: key-value, passkey and copy needles in a haystack of real text.

    python -m data_pipeline.retrieval_probe --tokenizer data/tokenizer.json --data data/stdlib \\
        --lengths 1024 4096 --samples 50 --output probe.jsonl

A sample of `length` tokens is filler (consecutive held-out tokens of a dataset, or a repeated
neutral text), one or more needles inserted at random depths, and a query at the end whose answer is
one needle's value (Needle-in-a-Haystack / passkey retrieval, Mohtashami & Jaggi 2023; the
key-value form is the multi-key variant of RULER, Hsieh et al. 2024). The text is Python-shaped, so
a model trained on source code can read it:

    kv:       needle  `\\nkey_qzpx = "48213"\\n`   query  `\\nassert key_qzpx == "`   answer  `48213"`
    passkey:  needle  `\\npasskey = 48213  # remember the passkey\\n`   query  `\\nassert passkey == `
              answer  `48213\\n`

    copy:     needle  a span of COPY_SPAN tokens drawn at random from the filler's tokens   query  its first
              COPY_PREFIX tokens   answer  the rest of the span

A copy probe is induction-style retrieval (Olsson et al. 2022): nothing but the earlier span predicts the answer,
and a model copies it only if it attends back to where the prefix occurred, `distance` tokens before the query. A
sliding window shorter than the distance cannot; dense attention and DSA's selection can. It asks only for induction
heads (a mechanism models form early in training, Olsson et al.), not for reading what a key in the text names.

With `pairs` > 1 (kv only) the other needles carry other keys and values (distractors). The answer's
tokens are what the tokenizer gives for query + answer beyond its common prefix with the query
alone, so a BPE merge across the boundary never leaves the model an impossible continuation. A
sample is {"kind", "length", "prompt": [ids], "answer": [ids], "key", "value", "needle_at": token
index of the queried needle, "depth": needle_at / len(prompt)}; prompt + answer is exactly `length`
tokens. The evaluator (`python -m pretrain.eval.retrieval`) counts a sample correct when the model's
greedy choice is right at every answer position.
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
from typing import Callable, Dict, List, Sequence

from pretrain.config.schema import DataConfig

Encode = Callable[[str], List[int]]
KINDS = ("kv", "passkey", "copy")
COPY_SPAN, COPY_PREFIX = 24, 4  # copy probes: span tokens, of which the query repeats the first COPY_PREFIX
DEFAULT_SPLIT = DataConfig.split  # data.split's default
NEUTRAL_FILLER = "# The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _texts(kind: str, key: str, value: str):
    if kind == "kv":
        return f'\n{key} = "{value}"\n', f'\nassert {key} == "', f'{value}"'
    return f"\npasskey = {value}  # remember the passkey\n", "\nassert passkey == ", f"{value}\n"


def make_sample(encode: Encode, filler: Sequence[int], length: int, rng: random.Random, kind: str = "kv",
                pairs: int = 1, value_digits: int = 5) -> Dict[str, object]:
    """One probe of exactly `length` tokens (see the module docstring); `filler` must be long enough."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind in ("passkey", "copy") and pairs != 1:
        raise ValueError(f"{kind} probes have one needle (pairs=1)")
    if kind == "copy":
        if not filler:
            raise ValueError("copy probes draw their span from the filler, which is empty")
        span = [filler[rng.randrange(len(filler))] for _ in range(COPY_SPAN)]
        return _assemble(kind, length, [span], 0, span[:COPY_PREFIX], span[COPY_PREFIX:], filler, rng,
                         " ".join(map(str, span[:COPY_PREFIX])), " ".join(map(str, span[COPY_PREFIX:])))
    keys = set()
    while len(keys) < pairs:
        keys.add("key_" + "".join(rng.choice(string.ascii_lowercase) for _ in range(4)))
    keys = sorted(keys)
    values = [str(rng.randrange(10 ** (value_digits - 1), 10**value_digits)) for _ in keys]
    target = rng.randrange(pairs)
    needles = [encode(_texts(kind, k, v)[0]) for k, v in zip(keys, values)]
    _, query, answer_text = _texts(kind, keys[target], values[target])
    query_ids, full = encode(query), encode(query + answer_text)
    cut = _common_prefix(query_ids, full)
    query_ids, answer = full[:cut], full[cut:]
    return _assemble(kind, length, needles, target, query_ids, answer, filler, rng, keys[target], values[target])


def _assemble(kind: str, length: int, needles: List[List[int]], target: int, query_ids: List[int],
              answer: List[int], filler: Sequence[int], rng: random.Random, key: str, value: str) -> Dict[str, object]:
    """Filler with the needles at random depths, then the query: a sample of exactly `length` tokens."""
    room = length - len(query_ids) - len(answer) - sum(len(n) for n in needles)
    if room < 0:
        raise ValueError(f"length {length} is too short for the needles and the query ({length - room} tokens)")
    if len(filler) < room:
        raise ValueError(f"filler has {len(filler)} tokens, {room} needed for length {length}")
    start = rng.randrange(len(filler) - room + 1)
    hay = list(filler[start : start + room])
    cuts = sorted(rng.randrange(room + 1) for _ in needles)
    prompt, prev, needle_at = [], 0, 0
    for i, (cut_at, needle) in enumerate(zip(cuts, needles)):
        prompt += hay[prev:cut_at]
        if i == target:
            needle_at = len(prompt)
        prompt += needle
        prev = cut_at
    prompt += hay[prev:] + query_ids
    return {"kind": kind, "length": length, "prompt": prompt, "answer": answer, "key": key, "value": value,
            "needle_at": needle_at, "depth": needle_at / len(prompt), "distance": len(prompt) - needle_at}


def make_probe(encode: Encode, filler: Sequence[int], lengths: Sequence[int], samples: int, seed: int = 0,
               kind: str = "kv", pairs: int = 1) -> List[Dict[str, object]]:
    """`samples` probes per length, reproducible from `seed`."""
    rng = random.Random(seed)
    return [make_sample(encode, filler, length, rng, kind, pairs) for length in lengths for _ in range(samples)]


def filler_tokens(encode: Encode, data_prefix: str = None, tokens: int = 0, split: str = DEFAULT_SPLIT) -> List[int]:
    """At least `tokens` filler tokens: the dataset's last documents concatenated, only from those that
    `split` (the run's `data.split`) keeps out of training, or without a dataset the neutral text repeated.
    Too few held-out tokens is an error: the filler never reaches into training documents."""
    if data_prefix is None:
        unit = encode(NEUTRAL_FILLER)
        return unit * (tokens // len(unit) + 1)
    from data_pipeline.datasets import held_out_document_range
    from data_pipeline.indexed import megatron_indexed_dataset

    begin, end = held_out_document_range(data_prefix, split)
    dataset = megatron_indexed_dataset().IndexedDataset(data_prefix)
    out: List[int] = []
    for i in range(end - 1, begin - 1, -1):
        out += [int(t) for t in dataset.get(i)]
        if len(out) >= tokens:
            return out
    raise ValueError(f"{data_prefix} has {len(out)} held-out tokens (documents {begin}..{end - 1}, outside the train "
                     f"share of data.split={split!r}), fewer than the {tokens} filler tokens needed")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data_pipeline.retrieval_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="tokenizer.json")
    parser.add_argument("--data", default=None, help="dataset prefix for the filler (default: a neutral text)")
    parser.add_argument("--lengths", type=int, nargs="+", required=True)
    parser.add_argument("--samples", type=int, default=50, help="probes per length")
    parser.add_argument("--kind", choices=KINDS, default="kv")
    parser.add_argument("--pairs", type=int, default=1, help="key-value needles per probe (kv)")
    parser.add_argument("--split", default=DEFAULT_SPLIT,
                        help="the training run's data.split: the filler reads only documents outside its train share")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", required=True, help="JSONL file, one probe per line")
    args = parser.parse_args(argv)
    from data_pipeline.tokenizer import load_tokenizer

    try:
        tok = load_tokenizer(args.tokenizer)
        filler = filler_tokens(tok.tokenize, args.data, 2 * max(args.lengths), args.split)
        probes = make_probe(tok.tokenize, filler, args.lengths, args.samples, args.seed, args.kind, args.pairs)
    except ValueError as err:
        print(f"retrieval_probe: {err}", file=sys.stderr)
        return 2
    with open(args.output, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(p) + "\n" for p in probes)
    print(f"wrote {len(probes)} probes to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
