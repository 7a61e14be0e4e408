"""The DSA indexer's top-k on one GPU: score GEMM against radix selection, by selection block.

    python lab/dsa/dsa_topk_sweep.py --seqs 16384,32768,131072 --out topk.json

GLM-5's indexer shapes (32 heads x 128, top-k 2048) on random inputs, batch 1, causal. Per S: the whole
`indexer_topk` (scores of each block of query rows into a buffer, then the exact selection), the score
kernel alone over the same blocks (TFLOP/s over the causal pairs: S^2 / 2 * 32 * 128 * 2), and the whole
top-k at each (block, warps[, capacity[, prefetch[, sample]]]) of --select (`SelectTuning`)
(`kernels.radix_select`; capacity 0: no compaction after two radix passes, the five-pass selection; prefetch 0: each
block loaded when it is worked on; sample 0: no sampled threshold); every variant's indices are checked equal to the
default's (the selection is exact, so they must be), and `sampled_share` is the share of rows the default selection
finished from its sampled threshold's copy. With --fp8, the same for FP8 index scores (`model.dsa_indexer_fp8`): the
quantization, the score kernel on e4m3 inputs and the whole top-k, and the recall of the bf16 selection on the
last 256 query rows (`benchmarks/dsa_indexer_fp8.py`). With --score-configs, the score kernel alone at each
tile configuration (`DSAKernelTuning.score_tiles`), bf16 (and FP8 with --fp8), its scores checked against the
default's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.dsa_indexer_fp8 import agreement, ratios  # noqa: E402
from benchmarks.dsa_kernels import TOPK, inputs, save_json, tile_configs, timed  # noqa: E402
from pretrain.model.dsa.indexer_fp8 import selection_inputs  # noqa: E402
from pretrain.model.dsa.indexer import VisibleKeys  # noqa: E402
from pretrain.model.dsa.kernels import indexer_topk as ttopk  # noqa: E402
from pretrain.model.dsa.kernels import radix_select as tsel  # noqa: E402
from pretrain.model.dsa.kernels.tuning import DEFAULT_TUNING, DSAKernelTuning, SelectTuning  # noqa: E402

SELECT = DEFAULT_TUNING.select


def scores_only(qi, ki, w, lo, hi, buffer_bytes=1 << 30, k_scale=None, select=None, tuning=DEFAULT_TUNING):
    """The score kernel over the row blocks `indexer_topk` uses, without the selection (`select(buf, r0, n)`:
    called on each block's scores)."""
    s, t = qi.shape[1], ki.shape[1]
    rows = max(16, min(s, buffer_bytes // (4 * t)) // 16 * 16)
    buf = torch.empty(1, min(rows, s), t, dtype=torch.float32, device=qi.device)
    for r0 in range(0, s, rows):
        ttopk.index_score_rows(qi, ki, w.float(), lo, hi, r0, min(rows, s - r0), buf, k_scale=k_scale, tuning=tuning)
        if select is not None:
            select(buf, r0, min(rows, s - r0))


def sampled_share(qi, ki, w, lo, hi) -> float:
    """The share of query rows that the default selection finished from its sampled threshold's copy."""
    out = torch.empty(1, qi.shape[1], TOPK, dtype=torch.int32, device=qi.device)
    took = torch.zeros(1, dtype=torch.int32, device=qi.device)
    scores_only(qi, ki, w, lo, hi, select=lambda buf, r0, n: tsel.select_rows(buf, lo, hi, r0, n, TOPK, out, took))
    return int(took) / qi.shape[1]


def fp8_row(s, qi, ki, w, lo, hi, reps):
    """The FP8 selection against the bf16 one: times and recall (last 256 rows)."""
    q8, k8, w8, sk = selection_inputs(qi, ki, w)
    row = {"fp8_quantize_ms": timed(lambda: selection_inputs(qi, ki, w), reps),
           "fp8_scores_ms": timed(lambda: scores_only(q8, k8, w8, lo, hi, k_scale=sk), reps),
           "fp8_topk_ms": timed(lambda: ttopk.indexer_topk(q8, k8, w8, TOPK, lo, hi, k_scale=sk), reps)}
    row["fp8_scores_tflops"] = s * s / 2 * 32 * 128 * 2 / row["fp8_scores_ms"] / 1e9
    rows = min(256, s)
    row.update(ratios(agreement(qi[:, s - rows:], ki, w[:, s - rows:], VisibleKeys(s, s, "cuda"), TOPK, s - rows)))
    return row


def score_variants(s, qi, ki, w, lo, hi, reps, configs, k_scale=None):
    """The score kernel at each `DSAKernelTuning.score_tiles` of `configs` (BM x BN x warps x stages x keys-as-M),
    timed over the same row blocks; each one's scores of the last 512 rows checked against the default's."""
    rows, out = min(512, s), []
    ref = torch.empty(1, rows, s, device=qi.device)
    ttopk.index_score_rows(qi, ki, w.float(), lo, hi, s - rows, rows, ref, k_scale=k_scale)
    cols = torch.arange(s, device=qi.device)
    vis = (cols >= lo[0, s - rows:, None]) & (cols < hi[0, s - rows:, None])  # what the kernel must write
    for cfg in configs:
        tuning = DSAKernelTuning(score_tiles=(*cfg[:4], bool(cfg[4])))
        row = {"S": s, "fp8": k_scale is not None, "score_config": list(cfg)}
        try:
            got = torch.full_like(ref, float("nan"))
            ttopk.index_score_rows(qi, ki, w.float(), lo, hi, s - rows, rows, got, k_scale=k_scale, tuning=tuning)
            row["scores_ms"] = ms = timed(lambda: scores_only(qi, ki, w, lo, hi, k_scale=k_scale, tuning=tuning), reps)
            row["scores_tflops"] = s * s / 2 * 32 * 128 * 2 / ms / 1e9
            row["max_rel_diff"] = ((got[0][vis] - ref[0][vis]).abs().max() / ref[0][vis].abs().max()).item()
        except triton.runtime.errors.OutOfResources as e:  # a tile too large for shared memory: say so, go on
            row["error"] = str(e)[:200]
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def point(s, gen, reps, selects, fp8=False, score_configs=()):
    _, _, qi, ki, w = inputs(s, gen)
    lo, hi = ttopk.visible_ranges(*VisibleKeys(s, s, "cuda").ranges())
    row = {"S": s, "scores_ms": timed(lambda: scores_only(qi, ki, w, lo, hi), reps)}
    row["scores_tflops"] = s * s / 2 * 32 * 128 * 2 / row["scores_ms"] / 1e9
    if score_configs:
        row["score_configs"] = score_variants(s, qi, ki, w, lo, hi, reps, score_configs)
        if fp8:
            q8, k8, w8, sk = selection_inputs(qi, ki, w)
            row["score_configs"] += score_variants(s, q8, k8, w8, lo, hi, reps, score_configs, k_scale=sk)
    if fp8:
        row.update(fp8_row(s, qi, ki, w, lo, hi, reps))
    default = (SELECT.block, SELECT.warps, SELECT.capacity, int(SELECT.prefetch), int(SELECT.sample))
    ref = ttopk.indexer_topk(qi, ki, w, TOPK, lo, hi)
    row["sampled_share"] = sampled_share(qi, ki, w, lo, hi)  # rows of < 8K keys never sample
    row["topk"] = []
    for cfg in [default] + [c for c in selects if c != default]:
        block, warps, capacity, prefetch, sample = cfg
        tuning = DSAKernelTuning(select=SelectTuning(block=block, warps=warps, capacity=capacity,
                                                     prefetch=bool(prefetch), sample=bool(sample)))
        got = ttopk.indexer_topk(qi, ki, w, TOPK, lo, hi, tuning=tuning)
        ms = timed(lambda: ttopk.indexer_topk(qi, ki, w, TOPK, lo, hi, tuning=tuning), reps)
        row["topk"].append({"block_warps_capacity_prefetch_sample": list(cfg), "topk_ms": ms,
                            "select_ms": ms - row["scores_ms"], "same_indices": bool(torch.equal(got, ref))})
        print(json.dumps({"S": s, **row["topk"][-1]}), flush=True)
    print(json.dumps({k: v for k, v in row.items() if k != "topk"}), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="16384,32768,131072")
    ap.add_argument("--select", default="512x4x0,512x4x2,512x4x4",
                    help="block x warps [x capacity [x prefetch [x sample]]] (`SelectTuning`) "
                         "variants")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--fp8", action="store_true", help="also time the FP8 selection (model.dsa_indexer_fp8)")
    ap.add_argument("--score-configs", default="", help="also time the score kernel at these score tiles: "
                    "BM x BN x warps x stages x keys-as-M (0/1), e.g. 4x64x8x3x0,8x128x8x3x1")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    selects = tile_configs(args.select)
    if any(len(c) not in (2, 3, 4, 5) for c in selects):
        ap.error("--select entries are block x warps [x capacity [x prefetch [x sample]]], e.g. 512x4, 512x4x2 or "
                 "512x4x2x1x0")
    defaults = (SELECT.capacity, int(SELECT.prefetch), int(SELECT.sample))
    selects = [(*c, *defaults[len(c) - 2:]) for c in selects]
    score_configs = tile_configs(args.score_configs) if args.score_configs else []
    if any(len(c) != 5 for c in score_configs):
        ap.error("--score-configs entries are BM x BN x warps x stages x keys-as-M, e.g. 4x64x8x3x0")
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for s in (int(x) for x in args.seqs.split(",")):
        res["rows"].append(point(s, gen, args.reps, selects, args.fp8, score_configs))
        torch.cuda.empty_cache()
    save_json(res, args.out)


if __name__ == "__main__":
    main()
