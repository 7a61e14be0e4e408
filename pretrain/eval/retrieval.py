"""Long-context retrieval accuracy per length (synthetic key-value / passkey / copy probes).

    python -m pretrain.eval.retrieval --checkpoint CKPT --lengths 1024 2048 4096 [--samples 50] [--kind kv]
    python -m pretrain.eval.retrieval_copy --checkpoint CKPT --lengths 1024 2048   # = --kind copy

Probes come from `data_pipeline.retrieval_probe` (needles in held-out text of the checkpoint's
dataset, tokenized with its tokenizer; or --probes FILE written by that module). A probe is correct
when the model's greedy choice equals the answer at every answer position, given the prompt and the
answer's earlier tokens (teacher forcing; the same verdict as greedy decoding of the answer, in one
forward). Reported per length: accuracy, and the answer's mean negative log-likelihood per token
(nats, teacher-forced), a graded reading for models too small or too briefly trained to retrieve
exactly: a model that finds the needle gives its value a lower NLL than one that guesses. Lengths
beyond the trained `data.seq_length` are evaluated with a warning: the probe is meant for lengths
the model was trained on. Metrics: `retrieval@L` and `retrieval_nll@L` (kv, passkey), `copy@L` and
`copy_nll@L` (copy).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

import torch

from data_pipeline.retrieval_probe import KINDS

# tokens [n] -> logits [n, vocab] (or anything whose argmax over the last dim is the greedy choice)
LogitsFn = Callable[[torch.Tensor], torch.Tensor]


def score(logits_fn: LogitsFn, probe: Dict[str, object], device=None) -> Tuple[bool, float]:
    """(greedy choice right at every answer position, mean NLL per answer token in nats)."""
    prompt, answer = list(probe["prompt"]), list(probe["answer"])
    tokens = torch.tensor(prompt + answer[:-1], device=device)
    logits = logits_fn(tokens)[len(prompt) - 1 :].float()
    target = torch.tensor(answer, device=logits.device)
    nll = torch.nn.functional.cross_entropy(logits, target)
    return logits.argmax(-1).tolist() == answer, float(nll)


def scores_by_length(logits_fn: LogitsFn, probes: Sequence[Dict[str, object]],
                     device=None) -> Dict[int, Dict[str, float]]:
    """{length: {"accuracy": fraction of probes right, "nll": mean over probes of the answer NLL}}."""
    hits: Dict[int, List[Tuple[bool, float]]] = defaultdict(list)
    for probe in probes:
        hits[int(probe["length"])].append(score(logits_fn, probe, device))
    return {length: {"accuracy": sum(h for h, _ in s) / len(s), "nll": sum(n for _, n in s) / len(s)}
            for length, s in sorted(hits.items())}


def model_logits_fn(model) -> LogitsFn:
    @torch.no_grad()
    def logits(tokens: torch.Tensor) -> torch.Tensor:
        ids = tokens.view(1, -1)
        positions = torch.arange(ids.shape[1], device=ids.device).view(1, -1)
        return model(ids, positions, None)[0]

    return logits


def main(argv=None, prog: str = "python -m pretrain.eval.retrieval") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="checkpoint save dir (newest step) or step dir")
    parser.add_argument("--lengths", type=int, nargs="+", default=None, help="default: the trained seq_length")
    parser.add_argument("--samples", type=int, default=50, help="probes per length")
    parser.add_argument("--kind", choices=KINDS, default="kv")
    parser.add_argument("--pairs", type=int, default=1, help="key-value needles per probe")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", default=None, help="filler dataset prefix (default: the checkpoint's)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the checkpoint's)")
    parser.add_argument("--probes", type=Path, default=None, help="JSONL of data_pipeline.retrieval_probe instead")
    parser.add_argument("--json", type=Path, default=None, help="write {'metrics': {...}} here")
    args = parser.parse_args(argv)
    from pretrain.notices import configure_logging

    configure_logging()
    from data_pipeline.retrieval_probe import filler_tokens, make_probe
    from data_pipeline.tokenizer import load_tokenizer
    from pretrain.eval.checkpoint import checkpoint_config, default_data_prefix, device_of, load_for_eval

    try:
        _, cfg = checkpoint_config(args.checkpoint)
        if args.probes:
            probes = [json.loads(line) for line in args.probes.read_text().splitlines() if line.strip()]
        else:
            lengths = args.lengths or [cfg.data.seq_length]
            tokenizer = args.tokenizer or cfg.data.tokenizer
            if not tokenizer:
                raise ValueError("the checkpoint's config names no tokenizer: pass --tokenizer")
            encode = load_tokenizer(tokenizer).tokenize
            filler = filler_tokens(encode, args.data or default_data_prefix(cfg), 2 * max(lengths), cfg.data.split)
            probes = make_probe(encode, filler, lengths, args.samples, args.seed, args.kind, args.pairs)
    except (FileNotFoundError, ValueError) as err:
        print(f"retrieval: {err}", file=sys.stderr)
        return 2
    cfg, model = load_for_eval(args.checkpoint)
    longest = max(int(p["length"]) for p in probes)
    if longest > cfg.data.seq_length:
        warnings.warn(f"probes up to {longest} tokens, longer than the trained data.seq_length={cfg.data.seq_length}",
                      stacklevel=1)
    scores = scores_by_length(model_logits_fn(model), probes, device_of(model))
    metrics, name = {}, "copy" if all(p.get("kind") == "copy" for p in probes) else "retrieval"
    for length, got in scores.items():
        print(f"length {length:>7}: accuracy {got['accuracy']:.3f}, answer NLL {got['nll']:.3f} nats/token")
        metrics[f"{name}@{length}"] = got["accuracy"]
        metrics[f"{name}_nll@{length}"] = got["nll"]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"metrics": metrics, "checkpoint": args.checkpoint, "kind": args.kind,
                                         "samples_per_length": args.samples}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
