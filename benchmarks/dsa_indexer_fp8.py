"""How much FP8 index scores change DSA's top-k selection (`model.dsa_indexer_fp8`, `pretrain.model.dsa.indexer_fp8`).

Per DSA layer (or on synthetic indexer inputs), the bf16 selection S and the FP8 one S8 of every query row, and
    recall      = sum_t |S8_t & S_t| / sum_t |S_t|
    mass_recall = sum_t P_t(S8_t) / sum_t P_t(S_t),   P_t = softmax over t's visible keys of the bf16 index scores
(the share of the indexer's own distribution that the FP8 selection keeps; 1 = nothing lost). Both selections
run on the reference path (`indexer.index_scores`, `select_topk`) in fp32 on the dequantized e4m3 rows, i.e.
what the FP8 kernel computes up to summation order. With a model, also the held-out LM loss of the same
sequences with each selection (`lm_loss_bf16`, `lm_loss_fp8`: the same weights, only the top-k switched).

    python benchmarks/dsa_indexer_fp8.py --checkpoint runs/dsa/sparse/checkpoints --data data/stdlib --sequences 4
    python benchmarks/dsa_indexer_fp8.py --synthetic --seq 16384 --heads 32 --dim 128 --topk 2048 --rows 256

`--synthetic`: Gaussian q_I, k_I (a LayerNorm'd key has unit-variance entries) and head weights w ~ N(0, 1/H);
the last `--rows` query rows of a causal sequence (they see every key). What selections of a trained indexer lose
needs `--checkpoint`; `--config` (a fresh initialization) only tries the script.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from pretrain.model.dsa.indexer import VisibleKeys, default_chunk, index_scores, select_topk  # noqa: E402
from pretrain.model.dsa.indexer_fp8 import selection_inputs  # noqa: E402


def agreement(q, k, w, keys: VisibleKeys, topk: int, r0: int = 0) -> Dict[str, float]:
    """Sums over query rows r0.. of q [b, s, H, d] (rows r0 + i of `keys`): |S8 & S|, |S|, P(S8), P(S)."""
    q8, k8, w8, sk = selection_inputs(q, k, w)
    b, s, h = q.shape[:3]
    t = k.shape[1]
    chunk = default_chunk(h * t)
    sums = {"shared": 0.0, "selected": 0.0, "mass_fp8": 0.0, "mass_bf16": 0.0}
    for c0 in range(0, s, chunk):
        c1 = min(s, c0 + chunk)
        vis = keys.rows(r0 + c0, r0 + c1)
        ref = index_scores(q[:, c0:c1], k, w[:, c0:c1], vis)
        sel = select_topk(ref, topk)
        sel8 = select_topk(index_scores(q8[:, c0:c1], k8, w8[:, c0:c1], vis, k_scale=sk), topk)
        # summed, not scattered: an empty slot (-1, clamped to key 0) must not overwrite a selected key 0
        chosen = torch.zeros(ref.shape, dtype=torch.int32, device=ref.device)
        chosen.scatter_add_(-1, sel.clamp(min=0).long(), (sel >= 0).int())
        sums["shared"] += float(((chosen.gather(-1, sel8.clamp(min=0).long()) > 0) & (sel8 >= 0)).sum())
        sums["selected"] += float((sel >= 0).sum())
        p = torch.softmax(ref, dim=-1)
        sums["mass_bf16"] += float((p.gather(-1, sel.clamp(min=0).long()) * (sel >= 0)).sum())
        sums["mass_fp8"] += float((p.gather(-1, sel8.clamp(min=0).long()) * (sel8 >= 0)).sum())
    return sums


def ratios(sums: Dict[str, float]) -> Dict[str, float]:
    return {"recall": sums["shared"] / max(sums["selected"], 1.0),
            "mass_recall": sums["mass_fp8"] / max(sums["mass_bf16"], 1e-30)}


def add(total: Dict[str, float], part: Dict[str, float]) -> Dict[str, float]:
    return {key: total.get(key, 0.0) + value for key, value in part.items()}


def indexer_inputs(q, k, w, topk, keys, indices):
    """What `agreement` needs of a recorded top-k call (`dsa_topk_recording.TopkRecorder`)."""
    return q.detach(), k.detach(), w.detach(), keys, topk


def synthetic(args) -> Dict[str, Dict[str, float]]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(args.seed)
    s, h, d = args.seq, args.heads, args.dim
    rows = min(args.rows, s)
    q = torch.randn(1, rows, h, d, generator=g, device=device).bfloat16()
    k = torch.randn(1, s, d, generator=g, device=device).bfloat16()
    w = torch.randn(1, rows, h, generator=g, device=device) * h**-0.5
    keys = VisibleKeys(s, s, device)
    return {"synthetic": ratios(agreement(q, k, w, keys, args.topk, r0=s - rows))}


def lm_loss(model, seqs, fp8: bool, sparse: bool = True) -> float:
    """Mean next-token loss of `seqs` with every DSA layer's top-k in FP8 (or bf16), or with dense attention
    (`sparse=False`: the scale against which the selection's effect reads), the weights unchanged."""
    from pretrain.eval.checkpoint import device_of

    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None),
                                                                          "dsa_sparse_attention")}
    for config in configs.values():
        config.dsa_sparse_attention = sparse
    for m in model.modules():
        if getattr(m, "backend", None) is not None:
            m.backend.indexer_fp8 = fp8
    device, total, count = device_of(model), 0.0, 0
    with torch.no_grad():
        for tokens in seqs:
            ids, labels = tokens[:-1].view(1, -1).to(device), tokens[1:].view(1, -1).to(device)
            loss = model(ids, torch.arange(ids.shape[1], device=device).view(1, -1), None, labels=labels)
            total, count = total + float(loss.float().sum()), count + loss.numel()
    return total / count


def from_model(args, ap) -> Dict[str, Dict[str, float]]:
    from benchmarks.dsa_topk_recording import TopkRecorder, dsa_model, recorded_forwards, sequences

    try:
        cfg, model = dsa_model(args.checkpoint, args.config, ["model.dsa_sparse_attention=true", *args.overrides])
    except ValueError as e:
        ap.error(str(e))
    if cfg.model.dsa_indexer_fp8:
        ap.error("the model already selects in FP8 (model.dsa_indexer_fp8=true): run it with the bf16 selection")
    per_layer: Dict[int, Dict[str, float]] = {}
    for calls in recorded_forwards(cfg, model, TopkRecorder(indexer_inputs), args.data, args.sequences, args.seed):
        for layer, (q, k, w, keys, top) in enumerate(calls):
            per_layer[layer] = add(per_layer.get(layer, {}), agreement(q, k, w, keys, top))
    if not per_layer:
        ap.error("no DSA top-k was called: does the model have DSA layers with an indexer?")
    out = {str(layer): ratios(sums) for layer, sums in sorted(per_layer.items())}
    total: Dict[str, float] = {}
    for sums in per_layer.values():
        total = add(total, sums)
    out["all"] = ratios(total)
    seqs = sequences(cfg, args.data, args.sequences, args.seed)
    out["all"].update(lm_loss_dense=lm_loss(model, seqs, False, sparse=False), lm_loss_bf16=lm_loss(model, seqs, False),
                      lm_loss_fp8=lm_loss(model, seqs, True))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a DSA checkpoint (save dir or step dir)")
    src.add_argument("--config", help="a DSA model config, randomly initialized (to try the script)")
    src.add_argument("--synthetic", action="store_true", help="Gaussian indexer inputs, no model")
    ap.add_argument("--data", default=None, help="dataset prefix of held-out documents (default: random tokens)")
    ap.add_argument("--sequences", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16384, help="--synthetic: keys (sequence length)")
    ap.add_argument("--heads", type=int, default=32, help="--synthetic: index heads")
    ap.add_argument("--dim", type=int, default=128, help="--synthetic: index head dim")
    ap.add_argument("--topk", type=int, default=2048, help="--synthetic: keys selected per row")
    ap.add_argument("--rows", type=int, default=256, help="--synthetic: the last query rows measured")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    for name in ("sequences", "seq", "heads", "dim", "topk", "rows"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.synthetic and args.overrides:
        ap.error(f"--synthetic takes no config overrides, got {args.overrides}")
    t0 = time.time()
    result = synthetic(args) if args.synthetic else from_model(args, ap)
    print(f"{'layer':>10}{'recall':>10}{'mass_recall':>13}")
    for layer, row in result.items():
        print(f"{layer:>10}{row['recall']:>10.4f}{row['mass_recall']:>13.4f}")
    if "lm_loss_fp8" in result.get("all", {}):
        row = result["all"]
        print(f"held-out LM loss: dense attention {row['lm_loss_dense']:.5f}, top-k from bf16 scores "
              f"{row['lm_loss_bf16']:.5f}, from FP8 scores {row['lm_loss_fp8']:.5f} "
              f"({row['lm_loss_fp8'] - row['lm_loss_bf16']:+.5f})")
    print(f"({time.time() - t0:.0f} s)")
    if args.out:
        record = {"date": time.strftime("%Y-%m-%d"), "source": args.checkpoint or args.config or "synthetic",
                  "data": args.data, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                  "args": {k: v for k, v in vars(args).items() if k != "out"}, "layers": result}
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
