"""The 64-head sparse MLA forward's two kernels side by side in one run on one GPU: the Triton forward
(`sparse_mla._fwd_kernel`) and the warp-specialized Gluon forward (`hopper.forward_heads_m`, the default on Hopper).

    python lab/dsa/dsa_fwd_probe.py --seqs 4096,16384,32768 --out fwd_probe.json

GLM-5's shapes: 64 heads, 576 = 512 + 64 key width, top-k 2048, batch 1; random inputs, the causal top-k of random
scores. Per S: ms and TFLOP/s of each (the convention of `benchmarks/dsa_kernels.py`: 2 * S * k * h * (576 + 512)),
the Gluon kernel at each --configs (BN x NBUF: selected keys per block, shared-memory stages), and the largest
differences of its output (relative to the largest value) and lse from the Triton forward's.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from benchmarks.dsa_kernels import save_json, tile_configs, timed  # noqa: E402
from pretrain.model.dsa.kernels import sparse_mla as tsm  # noqa: E402
from pretrain.model.dsa.kernels.tuning import DSAKernelTuning  # noqa: E402


def stage_configs(ap: argparse.ArgumentParser, text: str, flag: str) -> list:
    """A Gluon kernel's BN x NBUF variants from `flag`'s text (one-line argparse error otherwise)."""
    configs = tile_configs(text)
    if any(len(cfg) != 2 for cfg in configs):
        ap.error(f"{flag} entries are BN x NBUF, e.g. 64x2")
    return configs


def require_hopper(name: str) -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        sys.exit(f"{name}: needs a Hopper GPU (sm_90: wgmma, warp specialization)")


def inputs(s, k, h, gen):
    dev = "cuda"
    q = (torch.randn(1, s, h, 576, device=dev, generator=gen) * 0.5).bfloat16()
    kv = torch.randn(1, s, 576, device=dev, generator=gen).bfloat16()
    idx = torch.full((1, s, k), -1, dtype=torch.int32, device=dev)
    for r0 in range(0, s, 2048):  # causal top-k of random scores, 2048 rows at a time
        t = torch.arange(r0, min(s, r0 + 2048), device=dev)
        sc = torch.rand(len(t), s, device=dev, generator=gen)
        sc = sc.masked_fill(torch.arange(s, device=dev)[None, :] > t[:, None], -1.0)
        top = sc.topk(k, dim=1)
        sel = torch.where(top.values >= 0, top.indices, s)  # invisible keys last, then dropped
        sel = sel.sort(dim=1).values
        idx[0, r0:r0 + len(t)] = torch.where(sel < s, sel, -1).int()
    return q, kv, idx


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="16384")
    ap.add_argument("--configs", default="64x2,32x3", help="Gluon variants BN x NBUF (slots per block, stages)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    configs = stage_configs(ap, args.configs, "--configs")
    require_hopper("dsa_fwd_probe")
    h, k, scale = 64, 2048, 256**-0.5
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {"gpu": torch.cuda.get_device_name(), "rows": []}
    for s in [int(x) for x in args.seqs.split(",")]:
        q, kv, idx = inputs(s, k, h, gen)
        fl = 2 * s * k * h * (576 + 512)
        def fwd(tuning):
            return tsm.sparse_mla_forward(q, kv, idx, scale, 512, tuning)

        triton_only = DSAKernelTuning(gluon_forward=False)
        ref_out, ref_lse = fwd(triton_only)
        ms = timed(lambda: fwd(triton_only), args.reps)
        rows = [{"S": s, "kernel": "triton", "config": list(tsm.kernel_config(h, 512)), "ms": ms,
                 "tflops": fl / ms / 1e9}]
        for cfg in configs:
            gluon = DSAKernelTuning(gluon_forward_tiles=tuple(cfg))
            row = {"S": s, "kernel": "gluon", "config": list(cfg)}
            try:
                out, lse = fwd(gluon)
                fin = torch.isfinite(ref_lse)
                row["out_diff"] = ((out.float() - ref_out.float()).abs().max() / ref_out.float().abs().max()).item()
                row["lse_diff"] = (lse[fin] - ref_lse[fin]).abs().max().item()
                row["lse_inf_same"] = bool(torch.equal(torch.isfinite(lse), fin))
                row["ms"] = timed(lambda: fwd(gluon), args.reps)
                row["tflops"] = fl / row["ms"] / 1e9
            except Exception as e:  # noqa: BLE001 (out of shared memory etc.)
                row["error"] = repr(e)[:400]
            rows.append(row)
        for row in rows:
            print(row, flush=True)
        res["rows"] += rows
    save_json(res, args.out)


if __name__ == "__main__":
    main()
