"""MTP accept length: greedy speculative decoding where the MTP depths draft and the main model verifies.

    python -m pretrain.eval.mtp_accept --checkpoint CKPT [--data PREFIX] [--draft-tokens N] [--samples K]

GLM-5 report (MTP): with parameter-shared MTP layers the accept length at 4 speculative steps is
2.76, vs 2.55 for DeepSeek-V3.2. One decoding step, after context x_1..x_n whose next token t (the
main model's greedy choice) is known:

    draft   d_1 = argmax p^1_n(. | x, t),  d_k = argmax p^k_n(. | x, t, d_1..d_{k-1})   (k = 1..N)
    verify  one main-model forward over x, t, d_1..d_N gives its greedy choice g_j after each of
            t, d_1, .., d_N; d_j is accepted while d_1..d_j all equal g_0..g_{j-1}
    emit    t, d_1..d_a (a accepted drafts); the next step's t is g_a

Depth k at position n reads the embedding of token n + k (`pretrain/model/mtp.py`), so d_k needs
d_{k-1}. The emitted text is exactly the main model's greedy decoding, whatever N, and d_k only
counts while d_1..d_{k-1} were accepted, that is, equal to the greedy text. So the evaluator first
decodes the greedy text of every prompt (prompts batched, --batch at a time), then runs one forward
of all heads over it (teacher forcing): d_k at context end n is depth k's choice at position n - 1,
accepted while it equals the greedy token at n + k. That gives every step of every N from one
forward, the same verdicts as drafting token by token (`speculative_decode`, the literal algorithm,
kept as the reference the tests compare against). The accept length of a step is 1 + a (tokens per
verifying forward, the bonus token included; at most N + 1); reported is its mean over all steps of
all samples, for every N = 1..--draft-tokens. Forwards recompute the whole sequence (no KV cache):
this measures the drafts' quality, not decoding speed. Shared (`mtp_use_repeated_layer`) and
per-depth MTP layers both work. N may exceed the trained depths D when the model's MTP parameters
are one layer (shared depths, or D = 1): depths D+1..N apply that layer again, as DeepSeek-V3 drafts
several tokens with its one MTP module, and as GLM-5 reports 4 steps of a 3-depth shared layer.
Per-depth layers draft at most D tokens.

Prompts are the first --prompt-tokens tokens of held-out documents (the end of the dataset, which
megatron's split gives to validation and test); each sample decodes --new-tokens tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

import torch

# tokens [b, n] -> greedy tokens [1 + D, b, n]: row 0 the main head's choice after each position, row k depth k's.
Predictor = Callable[[torch.Tensor], torch.Tensor]


def model_predictor(model) -> Predictor:
    """Greedy choices of the main head and of every MTP depth of a `GLM5Model`, for a batch of sequences."""

    @torch.no_grad()
    def predict(tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return torch.stack([logits.argmax(-1) for logits in model.mtp_logits(tokens, positions)])

    return predict


def speculative_decode(predict: Predictor, prompt: torch.Tensor, new_tokens: int, drafts: int):
    """Greedy speculative decoding of `new_tokens` tokens after `prompt` [n] with `drafts` MTP drafts per
    step, literally: N drafting forwards and one verifying forward per step (the reference).

    Returns (generated tokens [new_tokens], accept length of every step)."""

    def heads(seq):
        return predict(seq.view(1, -1))[:, 0]

    tokens = prompt.clone()
    nxt = heads(tokens)[0, -1:]
    out, accepts = [], []
    while sum(len(o) for o in out) < new_tokens:
        n = tokens.numel()
        seq = torch.cat([tokens, nxt])
        for depth in range(1, drafts + 1):  # d_k from depth k at the context's last position
            seq = torch.cat([seq, heads(seq)[depth, n - 1 : n]])
        greedy = heads(seq)[0, n:]  # main model's choice after t, d_1, .., d_N
        proposed = seq[n + 1 :]
        accepted = 0
        while accepted < drafts and proposed[accepted] == greedy[accepted]:
            accepted += 1
        emitted = seq[n : n + 1 + accepted]
        out.append(emitted)
        accepts.append(1 + accepted)
        tokens = torch.cat([tokens, emitted])
        nxt = greedy[accepted : accepted + 1]
    return torch.cat(out)[:new_tokens], accepts


def greedy_heads(predict: Predictor, prompts: torch.Tensor, count: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Greedy-decode `count` tokens after each prompt ([b, n], one forward per token), then every head's
    choice over the whole text in one forward: (text [b, n + count], heads [1 + D, b, n + count])."""
    text = prompts
    for _ in range(count):
        text = torch.cat([text, predict(text)[0, :, -1:]], dim=1)
    return text, predict(text)


def steps_from_heads(text: Sequence[int], heads: torch.Tensor, prompt_len: int, new_tokens: int,
                     drafts: int) -> List[int]:
    """Accept length of every decoding step of one sample, read off the teacher-forced heads [1 + D, L]
    over its greedy text (module docstring); `text` holds at least prompt_len + new_tokens + drafts tokens."""
    steps, n = [], prompt_len
    while n - prompt_len < new_tokens:
        accepted = 0
        while accepted < drafts and int(heads[1 + accepted, n - 1]) == int(text[n + 1 + accepted]):
            accepted += 1
        steps.append(1 + accepted)
        n += 1 + accepted
    return steps


def accept_lengths(predict: Predictor, prompts: Sequence[torch.Tensor], new_tokens: int, max_drafts: int,
                   say=lambda line: None, batch: int = 8) -> Dict[str, float]:
    """{"accept_len@N": mean accept length per step} for N = 1..max_drafts over every prompt."""
    steps: Dict[int, List[int]] = {n: [] for n in range(1, max_drafts + 1)}
    by_length: Dict[int, List[torch.Tensor]] = {}
    for prompt in prompts:  # equal lengths decode together
        by_length.setdefault(prompt.numel(), []).append(prompt)
    for length, group in by_length.items():
        for i in range(0, len(group), batch):
            # new_tokens + max_drafts greedy tokens: the last step's drafts are judged too
            text, heads = greedy_heads(predict, torch.stack(group[i : i + batch]), new_tokens + max_drafts)
            for b in range(text.shape[0]):
                row, row_heads = text[b].tolist(), heads[:, b].cpu()
                for drafts in steps:
                    steps[drafts] += steps_from_heads(row, row_heads, length, new_tokens, drafts)
    metrics = {}
    for drafts, taken in steps.items():
        metrics[f"accept_len@{drafts}"] = sum(taken) / len(taken)
        say(f"{drafts} draft token{'s' * (drafts > 1)}: mean accept length {metrics[f'accept_len@{drafts}']:.3f} "
            f"over {len(taken)} steps")
    return metrics


def draft_overrides(model_cfg, drafts: int) -> List[str]:
    """Config overrides that let the model draft `drafts` tokens: none within its trained MTP depths; past
    them, more depths applying its one MTP layer (ValueError where the depths have layers of their own)."""
    depths = model_cfg.mtp_num_layers or 0
    if depths == 0:
        raise ValueError("the checkpoint's model has no MTP layers (model.mtp_num_layers=0): nothing drafts")
    if drafts < 1:
        raise ValueError(f"--draft-tokens must be >= 1, got {drafts}")
    if drafts <= depths:
        return []
    if depths > 1 and not model_cfg.mtp_use_repeated_layer:
        raise ValueError(f"--draft-tokens must be in 1..{depths} (the model's {depths} MTP depths have layers of "
                         f"their own; drafting past them needs one shared layer), got {drafts}")
    return [f"model.mtp_num_layers={drafts}", "model.mtp_use_repeated_layer=true"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.eval.mtp_accept", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="checkpoint save dir (newest step) or step dir")
    parser.add_argument("--data", default=None, help="dataset prefix (default: the checkpoint's first data_path)")
    parser.add_argument("--draft-tokens", type=int, default=None,
                        help="N (default: the model's MTP depths; more only with one shared MTP layer)")
    parser.add_argument("--samples", type=int, default=16, help="held-out documents (prompts)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per sample")
    parser.add_argument("--batch", type=int, default=8, help="prompts decoded together")
    parser.add_argument("--json", type=Path, default=None, help="write {'metrics': {...}} here")
    args = parser.parse_args(argv)
    from pretrain.notices import configure_logging

    configure_logging()
    for name in ("samples", "prompt_tokens", "new_tokens", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    from pretrain.eval.checkpoint import (
        checkpoint_config,
        default_data_prefix,
        device_of,
        held_out_documents,
        load_for_eval,
    )

    try:
        _, cfg = checkpoint_config(args.checkpoint)
        depths = cfg.model.mtp_num_layers or 0
        drafts = depths if args.draft_tokens is None else args.draft_tokens
        overrides = draft_overrides(cfg.model, drafts)
        prefix = args.data or default_data_prefix(cfg)
        docs = held_out_documents(prefix, args.prompt_tokens, args.samples, cfg.data.split)
    except (FileNotFoundError, ValueError) as err:
        print(f"mtp_accept: {err}", file=sys.stderr)
        return 2
    if overrides:
        print(f"drafting {drafts} tokens with {depths} trained MTP depth{'s' * (depths > 1)}: depths "
              f"{depths + 1}..{drafts} apply the model's one MTP layer again")
    cfg, model = load_for_eval(args.checkpoint, overrides)
    device = device_of(model)
    prompts = [torch.as_tensor(d[: args.prompt_tokens], device=device) for d in docs]
    print(f"{len(prompts)} prompts of {args.prompt_tokens} tokens from {prefix}, {args.new_tokens} new tokens each")
    metrics = accept_lengths(model_predictor(model), prompts, args.new_tokens, drafts, say=print, batch=args.batch)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"metrics": metrics, "checkpoint": args.checkpoint, "data": prefix,
                                         "mtp_depths_trained": depths, "samples": len(prompts),
                                         "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens},
                                        indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
