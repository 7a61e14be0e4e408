"""Tile sweeps, a backward breakdown and a quick accuracy check of the DSA Triton kernels at GLM-5
shapes (one GPU).

    python benchmarks/dsa_kernel_sweep.py --seq 8192 --out sweep.json

Checks top-k (exact on the kernel's own scores) and sparse attention against the fp32 reference on
the same bf16 inputs; times (BLOCK_N, num_warps, num_stages[, CC]) of the sparse attention forward
and backward, the radix-select block, the indexer-loss pieces, and the backward by key-gradient
mode. The chosen defaults live in `pretrain/model/dsa/kernels/` (`kernel_config`, `SELECT_BLOCK`,
`SELECT_CAPACITY`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.dsa_kernels import C, D, H, SCALE, TOPK, inputs, timed  # noqa: E402
from pretrain.model.dsa.indexer import VisibleKeys, index_scores, select_topk  # noqa: E402
from pretrain.model.dsa.kernels import indexer_topk as ttopk  # noqa: E402
from pretrain.model.dsa.kernels import radix_select as tsel  # noqa: E402
from pretrain.model.dsa.kernels import sparse_mla as tsm  # noqa: E402
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
    """Backward time by key-gradient mode (DKV of `_bwd_kernel`): fp32 atomics (the default), plain
    stores of per-(token, slot) rows (the deterministic mode's kernel, without its reduction), the
    key gradient computed but not written, and no key gradient at all; then the deterministic mode."""
    q, kv, qi, ki, w = inputs(s, gen)
    lo, hi = VisibleKeys(s, s, "cuda").ranges()
    idx = ttopk.indexer_topk(qi, ki, w, TOPK, lo, hi)
    q, kv = q.requires_grad_(), kv.requires_grad_()
    g = torch.randn(1, s, H, C, device="cuda", dtype=torch.bfloat16)
    part = torch.empty(1, s, TOPK, D, device="cuda")
    fl = 2 * s * TOPK * H * (2 * D + C + C + D)
    original = tsm.scatter_rows_deterministic
    tsm.scatter_rows_deterministic = lambda launch, indices, dkv, n: launch(0, n, part)
    try:
        for mode, name in enumerate(["atomic", "store", "none", "compute_only"]):
            tsm.DKV_MODE = mode
            o, _ = tsm.sparse_mla_attention(q, kv, idx, SCALE, C, deterministic=(mode == 1))
            ms = timed(lambda: torch.autograd.grad(o, (q, kv), g, retain_graph=True), 3)
            row = {"S": s, "dkv_mode": name, "bwd_ms": ms, "tflops_all_flops": fl / ms / 1e9}
            res["bwd"].append(row)
            print("breakdown", row, flush=True)
    finally:
        tsm.DKV_MODE = None
        tsm.scatter_rows_deterministic = original
    del part
    o, _ = tsm.sparse_mla_attention(q, kv, idx, SCALE, C, deterministic=True)
    ms = timed(lambda: torch.autograd.grad(o, (q, kv), g, retain_graph=True), 3)
    res["bwd"].append({"S": s, "dkv_mode": "deterministic (full)", "bwd_ms": ms, "tflops_all_flops": fl / ms / 1e9})
    print("breakdown", res["bwd"][-1], flush=True)


ORIGINAL_CONFIG = tsm.kernel_config


def kl_breakdown(res, gen, s):
    """Where the sparse indexer loss spends its time (its target comes from the attention backward)."""
    from benchmarks.dsa_kernels import sparse_kl_triton
    from pretrain.model.dsa.indexer_loss import kl_sum
    from pretrain.model.dsa.kernels import indexer_kl as tkl

    q, kv, qi, ki, w = inputs(s, gen)
    lo, hi = VisibleKeys(s, s, "cuda").ranges()
    idx = ttopk.indexer_topk(qi, ki, w, TOPK, lo, hi)
    out, lse = tsm.sparse_mla_forward(q, kv, idx, SCALE, C)
    g = torch.randn_like(out)
    head_sums = torch.zeros(idx.shape, dtype=torch.float32, device="cuda")
    tsm.sparse_mla_backward(q, kv, idx, lse, tsm.output_delta(g, out), g, SCALE, C, head_sums=head_sums)
    qi, ki, w = qi.requires_grad_(), ki.requires_grad_(), w.requires_grad_()
    res_kl = {"S": s}
    res_kl["scores_at_fwd_ms"] = timed(lambda: tkl.index_scores_at(qi, ki, w, idx, 0, s), 3)
    sc = tkl.index_scores_at(qi, ki, w, idx, 0, s)
    gsc = torch.randn_like(sc)
    res_kl["scores_at_bwd_ms"] = timed(lambda: torch.autograd.grad(sc, (qi, ki, w), gsc, retain_graph=True), 3)
    p = head_sums / head_sums.sum(-1, keepdim=True)
    logits = sc.detach().requires_grad_()
    res_kl["torch_kl_fwdbwd_ms"] = timed(lambda: torch.autograd.grad(kl_sum(p, logits, idx >= 0), logits), 3)
    res_kl["total_fwdbwd_ms"] = timed(lambda: sparse_kl_triton(qi.detach(), ki.detach(), w.detach(), idx, head_sums), 3)
    res["kl"] = res_kl
    print("kl", res_kl, flush=True)


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
    for cfg in [(64, 8, 2), (64, 8, 1), (64, 8, 3), (32, 8, 2), (128, 8, 1), (64, 4, 2)]:
        tsm.kernel_config = lambda h, c, backward=False, cfg=cfg: ORIGINAL_CONFIG(h, c, True) if backward else cfg
        row = {"BN": cfg[0], "warps": cfg[1], "stages": cfg[2]}
        try:
            row["fwd_ms"] = timed(lambda: tsm.sparse_mla_attention(q, kv, idx, SCALE, C), 3)
            row["fwd_tflops"] = fl / row["fwd_ms"] / 1e9
        except Exception as e:  # noqa: BLE001 (out of shared memory etc.)
            row["error"] = repr(e)[:200]
        res["fwd"].append(row)
        print("fwd", row, flush=True)
    qg, kvg = q.detach().requires_grad_(), kv.detach().requires_grad_()
    o, _ = tsm.sparse_mla_attention(qg, kvg, idx, SCALE, C)
    for cfg in [(64, 8, 1, 64), (32, 8, 1, 64), (64, 8, 1, 128), (32, 8, 1, 32), (64, 4, 1, 64)]:
        tsm.kernel_config = lambda h, c, backward=False, cfg=cfg: cfg if backward else ORIGINAL_CONFIG(h, c)
        row = {"BN": cfg[0], "warps": cfg[1], "stages": cfg[2], "CC": cfg[3]}
        try:
            row["bwd_ms"] = timed(lambda: torch.autograd.grad(o, (qg, kvg), g, retain_graph=True), 3)
            row["bwd_tflops"] = 2 * s * TOPK * H * (2 * D + C + C + D) / row["bwd_ms"] / 1e9
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:200]
        res["bwd"].append(row)
        print("bwd", row, flush=True)
    tsm.kernel_config = ORIGINAL_CONFIG
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
        tsel.SELECT_BLOCK, tsel.SELECT_WARPS = block, warps
        row = {"BLOCK": block, "warps": warps}
        try:
            row["select_ms"] = timed(lambda: tsel.select_rows(buf, lo32, hi32, 0, s, TOPK, out), 3)
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:200]
        res["select"].append(row)
        print("select", row, flush=True)
    tsel.SELECT_BLOCK, tsel.SELECT_WARPS = 512, 4
    kl_breakdown(res, gen, s)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
