"""Tile sweeps, a backward breakdown and a quick accuracy check of the DSA Triton kernels at GLM-5
shapes (one GPU).

    python lab/dsa/dsa_kernel_sweep.py --seq 8192 --out sweep.json

Checks top-k (exact on the kernel's own scores) and sparse attention against the fp32 reference on
the same bf16 inputs; times (BLOCK_N, num_warps, num_stages[, CC]) of the Triton sparse attention forward
and backward (`DSAKernelTuning.triton_tiles`), the radix-select block (`SelectTuning`), and the backward by
key-gradient mode (`KeyGradient`). The chosen defaults are `DSAKernelTuning`'s and `kernel_config`'s.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.dsa_kernels import C, D, H, SCALE, TOPK, inputs, timed  # noqa: E402
from pretrain.model.dsa.indexer import VisibleKeys, index_scores, select_topk  # noqa: E402
from pretrain.model.dsa.kernels import indexer_topk as ttopk  # noqa: E402
from pretrain.model.dsa.kernels import radix_select as tsel  # noqa: E402
from pretrain.model.dsa.kernels import sparse_mla as tsm  # noqa: E402
from pretrain.model.dsa.kernels.tuning import DSAKernelTuning, KeyGradient, SelectTuning  # noqa: E402
from pretrain.model.dsa.sparse_mla import sparse_mla_attention as ref_attn  # noqa: E402


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


def check(s, topk, gen):
    q, kv, qi, ki, w = inputs(s, gen)
    lo, hi = VisibleKeys(s, s, "cuda").ranges()
    idx = ttopk.indexer_topk(qi, ki, w, topk, lo, hi)
    scores = index_scores(qi.float(), ki.float(), w, VisibleKeys(s, s, "cuda").rows(0, s))
    ref_idx = select_topk(scores, topk)
    same = (idx.long() == ref_idx).float().mean().item()
    picked = scores.gather(-1, idx.long().clamp(min=0)).masked_fill(idx < 0, 0).sum()
    best = scores.gather(-1, ref_idx.clamp(min=0)).masked_fill(ref_idx < 0, 0).sum()
    q, kv = q.requires_grad_(), kv.requires_grad_()
    out, lse = tsm.sparse_mla_attention(q, kv, idx, SCALE, C)
    q32, kv32 = q.detach().float().requires_grad_(), kv.detach().float().requires_grad_()
    rout, rlse = ref_attn(q32, kv32, idx.long(), SCALE, C, 64)
    g = torch.randn_like(out)
    dq, dkv = torch.autograd.grad(out, (q, kv), g)
    rdq, rdkv = torch.autograd.grad(rout, (q32, kv32), g.float())
    dq2, dkv2 = torch.autograd.grad(tsm.sparse_mla_attention(q, kv, idx, SCALE, C, True)[0], (q, kv), g)
    return {"S": s, "topk": topk, "topk_same_slots": same, "topk_score_sum_rel": abs(picked - best).item() / abs(best).item(),
            "out": rel(out, rout), "lse": rel(lse, rlse), "dq": rel(dq, rdq), "dkv": rel(dkv, rdkv),
            "det_dq_equal": bool(torch.equal(dq, dq2)), "det_dkv": rel(dkv2, rdkv)}


def check_topk(s, topk, gen):
    """Kernel scores vs fp32 reference scores; selection vs select_topk on the kernel's own scores."""
    q, kv, qi, ki, w = inputs(s, gen)
    keys = VisibleKeys(s, s, "cuda")
    lo, hi = ttopk.visible_ranges(*keys.ranges())
    ref = index_scores(qi.float(), ki.float(), w, keys.rows(0, s))
    vis = keys.rows(0, s).expand_as(ref)
    out = {"S": s, "topk": topk}
    buf = torch.full((1, s, s), float("nan"), device="cuda")
    ttopk.index_score_rows(qi, ki, w, lo, hi, 0, s, buf)
    out["scores_rel"] = rel(buf[vis], ref[vis])
    idx = torch.full((1, s, min(topk, s)), -7, device="cuda", dtype=torch.int32)
    tsel.select_rows(buf, lo, hi, 0, s, topk, idx)
    own = select_topk(buf.masked_fill(~vis, float("-inf")), topk)
    out["select_exact"] = bool(torch.equal(idx.long(), own))
    out["select_mismatch_rows"] = int((idx.long() != own).any(-1).sum())
    return out


def breakdown(res, gen, s=4096):
    """Backward time by key-gradient mode (`KeyGradient`): fp32 atomics in the fused kernel, the key gradient
    computed but not written, and no key gradient at all; then the deterministic mode."""
    q, kv, qi, ki, w = inputs(s, gen)
    lo, hi = VisibleKeys(s, s, "cuda").ranges()
    idx = ttopk.indexer_topk(qi, ki, w, TOPK, lo, hi)
    q, kv = q.requires_grad_(), kv.requires_grad_()
    g = torch.randn(1, s, H, C, device="cuda", dtype=torch.bfloat16)
    fl = 2 * s * TOPK * H * (2 * D + C + C + D)
    for mode, name in ((KeyGradient.FUSED, "atomic"), (KeyGradient.TIMING_NONE, "none"),
                       (KeyGradient.TIMING_UNWRITTEN, "compute_only")):
        o, _ = tsm.sparse_mla_attention(q, kv, idx, SCALE, C, False, DSAKernelTuning(key_gradient=mode))
        ms = timed(lambda: torch.autograd.grad(o, (q, kv), g, retain_graph=True), 3)
        row = {"S": s, "dkv_mode": name, "bwd_ms": ms, "tflops_all_flops": fl / ms / 1e9}
        res["bwd"].append(row)
        print("breakdown", row, flush=True)
    o, _ = tsm.sparse_mla_attention(q, kv, idx, SCALE, C, deterministic=True)
    ms = timed(lambda: torch.autograd.grad(o, (q, kv), g, retain_graph=True), 3)
    res["bwd"].append({"S": s, "dkv_mode": "deterministic (full)", "bwd_ms": ms, "tflops_all_flops": fl / ms / 1e9})
    print("breakdown", res["bwd"][-1], flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {"gpu": torch.cuda.get_device_name(), "checks": [], "fwd": [], "bwd": [], "scores": []}
    for s, k in ((1000, 256), (4096, TOPK)):
        for fn in (check_topk, check):
            try:
                res["checks"].append(fn(s, k, gen))
            except Exception as e:  # noqa: BLE001
                res["checks"].append({"S": s, "error": repr(e)[:300]})
            print(res["checks"][-1], flush=True)
    breakdown(res, gen, 4096)
    s = args.seq
    q, kv, qi, ki, w = inputs(s, gen)
    lo, hi = VisibleKeys(s, s, "cuda").ranges()
    idx = ttopk.indexer_topk(qi, ki, w, TOPK, lo, hi)
    fl = 2 * s * TOPK * H * (C + D)
    g = torch.randn(1, s, H, C, device="cuda", dtype=torch.bfloat16)
    triton_only = DSAKernelTuning(gluon_forward=False, gluon_forward_keys_m=False, gluon_first_pass=False)
    for cfg in [(64, 8, 2), (64, 8, 1), (64, 8, 3), (32, 8, 2), (128, 8, 1), (64, 4, 2)]:
        # the forward takes the first three entries; the backward keeps its default config
        tuning = replace(triton_only, triton_tiles=cfg + (tsm.kernel_config(H, C, True)[3],))
        row = {"BN": cfg[0], "warps": cfg[1], "stages": cfg[2]}
        try:
            row["fwd_ms"] = timed(lambda: tsm.sparse_mla_forward(q, kv, idx, SCALE, C, tuning), 3)
            row["fwd_tflops"] = fl / row["fwd_ms"] / 1e9
        except Exception as e:  # noqa: BLE001 (out of shared memory etc.)
            row["error"] = repr(e)[:200]
        res["fwd"].append(row)
        print("fwd", row, flush=True)
    qg, kvg = q.detach().requires_grad_(), kv.detach().requires_grad_()
    for cfg in [(64, 8, 1, 64), (32, 8, 1, 64), (64, 8, 1, 128), (32, 8, 1, 32), (64, 4, 1, 64)]:
        row = {"BN": cfg[0], "warps": cfg[1], "stages": cfg[2], "CC": cfg[3]}
        try:
            o, _ = tsm.sparse_mla_attention(qg, kvg, idx, SCALE, C, False, replace(triton_only, triton_tiles=cfg))
            row["bwd_ms"] = timed(lambda: torch.autograd.grad(o, (qg, kvg), g, retain_graph=True), 3)
            row["bwd_tflops"] = 2 * s * TOPK * H * (2 * D + C + C + D) / row["bwd_ms"] / 1e9
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:200]
        res["bwd"].append(row)
        print("bwd", row, flush=True)
    buf = torch.empty(1, s, s, device="cuda")
    lo32, hi32 = ttopk.visible_ranges(lo, hi)
    out = torch.empty(1, s, TOPK, device="cuda", dtype=torch.int32)
    for bm, bn, warps in [(4, 64, 8)]:
        row = {"BM": bm, "BN": bn, "warps": warps}
        try:
            row["scores_ms"] = timed(lambda: ttopk.index_score_rows(qi, ki, w, lo32, hi32, 0, s, buf, bm, bn, warps), 3)
            row["tflops"] = s * s / 2 * 32 * 128 * 2 / row["scores_ms"] / 1e9
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:200]
        res["scores"].append(row)
        print("scores", row, flush=True)
    res["select"] = []
    for block, warps in [(512, 4), (1024, 4), (2048, 4)]:
        select = SelectTuning(block=block, warps=warps)
        row = {"BLOCK": block, "warps": warps}
        try:
            row["select_ms"] = timed(lambda: tsel.select_rows(buf, lo32, hi32, 0, s, TOPK, out, tuning=select), 3)
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:200]
        res["select"].append(row)
        print("select", row, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
