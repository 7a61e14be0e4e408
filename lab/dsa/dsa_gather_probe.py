"""Is the 16-head sparse MLA forward at the GPU's gather bandwidth? The forward against gather-only kernels, one run.

    python lab/dsa/dsa_gather_probe.py --seqs 16384,32768 --out gather_probe.json

At 8-16 heads the forward costs the same per (query token, selected key) pair, about 0.24 ns on an H200, which is one
gathered 576-value bf16 key row (1,152 bytes) per pair at about 4.7 TB/s (benchmarks/results/README.md, "Cost per
pair"). Whether that is the L2's limit or the kernel's decides whether a different 16-head forward could reach the
issue's 200 TFLOP/s (0.17 ns per pair, 6.6 TB/s). This times, on the same selections (the model's top-k of random
index inputs, causal, top-k 2048):

- `forward`: the model's forward at `--heads` (`kernels.sparse_mla.sparse_mla_forward`);
- `gather BNxWxS`: a kernel with the forward's loop and loads (one program per token, BN selected rows per step,
  W warps, S pipeline stages) that only sums the gathered rows (no products, no softmax): the gathers alone;
- `scatter BNxWxS`: the backward's key-gradient writes alone, one 576-wide fp32 row per pair added into dkv by
  atomics (`gather_TBps` is then half the bytes written: 2,304 a pair);
- the same on a `hot` selection, every token taking keys 0 .. 2047, whose rows stay in L1 / L2.

Reported: ms, ns per pair and TB/s of 1,152 bytes per valid pair. Not a kernel of the model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.dsa_kernels import C, D, SCALE, TOPK, inputs, save_json, tile_configs, timed  # noqa: E402
from pretrain.model.dsa.indexer import VisibleKeys  # noqa: E402
from pretrain.model.dsa.kernels import indexer_topk as ttopk  # noqa: E402
from pretrain.model.dsa.kernels import sparse_mla as tsm  # noqa: E402
from pretrain.model.dsa.kernels.common import gather_block, pow2  # noqa: E402


@triton.jit
def _gather_kernel(kv_ptr, idx_ptr, nv_ptr, out_ptr, s_kt, s_it, C: tl.constexpr, R: tl.constexpr,
                   BC: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BC)
    r = tl.arange(0, BR)
    nv = tl.load(nv_ptr + t)
    acc_l = tl.zeros((BC,), tl.float32)
    acc_r = tl.zeros((BR,), tl.float32)
    for j0 in range(0, nv, BN):
        j, idx, ok, k_lat, k_rope = gather_block(idx_ptr + t * s_it, kv_ptr, j0, nv, s_kt, c, r, C, R, BN)
        acc_l += tl.sum(k_lat.to(tl.float32), 0)
        acc_r += tl.sum(k_rope.to(tl.float32), 0)
    tl.store(out_ptr + t * (C + R) + c, acc_l, mask=c < C)
    tl.store(out_ptr + t * (C + R) + C + r, acc_r, mask=r < R)


@triton.jit
def _scatter_kernel(src_ptr, idx_ptr, nv_ptr, dkv_ptr, s_it, C: tl.constexpr, R: tl.constexpr, BC: tl.constexpr,
                    BR: tl.constexpr, BN: tl.constexpr):
    # the backward's key-gradient write alone: one fp32 row per (token, slot) added into dkv (the token's own row)
    t = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BC)
    r = tl.arange(0, BR)
    nv = tl.load(nv_ptr + t)
    x_l = tl.load(src_ptr + t * (C + R) + c, mask=c < C, other=0.0)
    x_r = tl.load(src_ptr + t * (C + R) + C + r, mask=r < R, other=0.0)
    for j0 in range(0, nv, BN):
        j = j0 + tl.arange(0, BN)
        idx = tl.load(idx_ptr + t * s_it + j, mask=j < nv, other=-1)
        ok = idx >= 0
        row = dkv_ptr + idx.to(tl.int64)[:, None] * (C + R)
        tl.atomic_add(row + c[None, :], tl.broadcast_to(x_l[None, :], (BN, BC)), mask=ok[:, None] & (c[None, :] < C),
                      sem="relaxed")
        tl.atomic_add(row + C + r[None, :], tl.broadcast_to(x_r[None, :], (BN, BR)),
                      mask=ok[:, None] & (r[None, :] < R), sem="relaxed")


def scatter(src, idx, nv, dkv, cfg):
    """src [S, D] fp32 rows added at each token's selected keys into dkv [T, D] fp32 (atomics)."""
    bn, warps, stages = cfg
    _scatter_kernel[(idx.shape[0],)](src, idx, nv, dkv, idx.stride(0), C=C, R=D - C, BC=pow2(C), BR=pow2(D - C),
                                     BN=bn, num_warps=warps, num_stages=stages)


def gather(kv, idx, nv, cfg):
    """kv [1, T, D], idx [S, K] (one sequence's selections), nv [S] -> [S, D] fp32 sums of the selected rows."""
    s = idx.shape[0]
    out = torch.empty(s, D, dtype=torch.float32, device=kv.device)
    bn, warps, stages = cfg
    _gather_kernel[(s,)](kv, idx, nv, out, kv.stride(1), idx.stride(0), C=C, R=D - C, BC=pow2(C), BR=pow2(D - C),
                         BN=bn, num_warps=warps, num_stages=stages)
    return out


def rows_for(name, s, h, kv, q, idx, cfgs, reps):
    nv = (idx >= 0).sum(-1, dtype=torch.int32).contiguous()
    pairs = int(nv.sum())
    out = []

    def row(label, ms):
        r = {"selection": name, "S": s, "heads": h, "kernel": label, "ms": ms, "ns_per_pair": ms * 1e6 / pairs,
             "gather_TBps": pairs * D * 2 / ms / 1e9}
        print(json.dumps(r), flush=True)
        out.append(r)

    row("forward", timed(lambda: tsm.sparse_mla_forward(q, kv, idx, SCALE, C), reps))
    # the gather kernel reads the selected rows: its sums against torch's for the last 8 tokens
    got = gather(kv, idx[0], nv[0], cfgs[0])[-8:]
    sel = idx[0, -8:].long()
    want = torch.where((sel >= 0)[..., None], kv[0][sel.clamp(min=0)].float(), 0.0).sum(1)
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-2):
        raise RuntimeError(f"gather kernel sums differ from torch's by {(got - want).abs().max().item()}")
    for cfg in cfgs:
        row("gather " + "x".join(map(str, cfg)), timed(lambda: gather(kv, idx[0], nv[0], cfg), reps))
    # the writes: 2,304 bytes of fp32 atomics per pair (gather_TBps then reads as bytes written / 2)
    src = torch.randn(s, D, device=kv.device)
    dkv = torch.zeros(kv.shape[1], D, device=kv.device)
    want = torch.zeros_like(dkv).index_add_(0, idx[0, -8:][idx[0, -8:] >= 0].long(),
                                            src[-8:, None].expand(-1, idx.shape[-1], -1)[idx[0, -8:] >= 0])
    scatter(src[-8:], idx[0, -8:], nv[0, -8:], dkv, cfgs[0])
    if not torch.allclose(dkv, want, rtol=1e-5, atol=1e-4):
        raise RuntimeError("scatter kernel rows differ from torch's index_add")
    for cfg in cfgs:
        row("scatter " + "x".join(map(str, cfg)), timed(lambda: scatter(src, idx[0], nv[0], dkv, cfg), reps))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="16384,32768")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--configs", default="64x4x2,64x4x3,32x4x3,64x8x2,128x8x2", help="BN x warps x stages")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "rows": []}
    for s in (int(x) for x in args.seqs.split(",")):
        q, kv, qi, ki, w = inputs(s, gen)
        q = q[:, :, :args.heads].contiguous()
        lo, hi = VisibleKeys(s, s, "cuda").ranges()
        idx = ttopk.indexer_topk(qi, ki, w, TOPK, lo, hi)
        hot = torch.arange(TOPK, device="cuda", dtype=torch.int32).expand(1, s, TOPK)
        hot = torch.where(hot <= torch.arange(s, device="cuda")[None, :, None], hot, -1).contiguous()
        for name, sel in (("random", idx), ("hot", hot)):
            res["rows"] += rows_for(name, s, args.heads, kv, q, sel, tile_configs(args.configs), args.reps)
    save_json(res, args.out)


if __name__ == "__main__":
    main()
