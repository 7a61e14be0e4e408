"""The 64-head sparse MLA backward's first pass, its kernels side by side in one run on one GPU: the Triton first
pass (`sparse_mla._bwd_kernel`, DKV = 5) against the warp-specialized Gluon one (the default on Hopper), which is
two kernels, `sparse_mla_bwd_ws.scores_kernel` (S, dP, P, dS and their rows, sum_h P) and `sparse_mla_dq_ws`
(dq from the stored dS), each also timed alone; and the key-gradient pass that follows both (`sparse_mla_dkv`).

    python benchmarks/dsa_first_pass_probe.py --seqs 16384,32768 --dq-configs 64x2,32x4 --out first_pass.json

GLM-5's shapes: 64 heads, 576 = 512 + 64 key width, top-k 2048, batch 1; random inputs, the causal top-k of random
scores (`dsa_fwd_probe.inputs`). A first pass alone is the backward with its key-gradient pass left out; per S:
ms of each (with the head sums, as the DSA layer asks), TFLOP/s (2 * valid pairs * h * (576 + 512 + 576): S, dP
and dq), whether the Gluon pass's dq and [dS | P] rows equal the Triton pass's bitwise, and the head sums' largest
relative difference (the same fp32 P summed over heads in another order).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.dsa_fwd_probe import inputs, require_hopper, stage_configs  # noqa: E402
from benchmarks.dsa_kernels import save_json, timed  # noqa: E402
from pretrain.model.dsa.kernels import sparse_mla as tsm  # noqa: E402
from pretrain.model.dsa.kernels import sparse_mla_bwd_ws as bws  # noqa: E402
from pretrain.model.dsa.kernels import sparse_mla_dkv as kd  # noqa: E402
from pretrain.model.dsa.kernels import sparse_mla_dq_ws as dqws  # noqa: E402
from pretrain.model.dsa.kernels.common import LOG2E  # noqa: E402


def first_pass_only(q, kv, idx, lse, delta, g, scale, hs, kept: dict):
    """The backward without its key-gradient pass (dq, and the last block's [dS | P] rows into kept['part'])."""
    real_kg, real_scratch = tsm.key_gradient, tsm.empty_scratch

    def keep(q_, k_, rows):
        kept["part"] = real_scratch(q_, k_, rows)
        return kept["part"]

    tsm.key_gradient, tsm.empty_scratch = (lambda *a, **k: None), keep
    try:
        return tsm.sparse_mla_backward(q, kv, idx, lse, delta, g, scale, 512, head_sums=hs)[0]
    finally:
        tsm.key_gradient, tsm.empty_scratch = real_kg, real_scratch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", default="16384")
    ap.add_argument("--dq-configs", default="64x2,32x4", help="dq kernel variants BN x NBUF (slots per block, stages)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    configs = stage_configs(ap, args.dq_configs, "--dq-configs")
    require_hopper("dsa_first_pass_probe")
    h, k, scale = 64, 2048, 256**-0.5
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {"gpu": torch.cuda.get_device_name(), "rows": []}
    original = bws.ENABLED, dqws.CONFIG
    try:
        for s in [int(x) for x in args.seqs.split(",")]:
            q, kv, idx = inputs(s, k, h, gen)
            out, lse = tsm.sparse_mla_forward(q, kv, idx, scale, 512)
            g = torch.randn(out.shape, device="cuda", generator=gen).bfloat16()
            delta = tsm.output_delta(g, out)
            nvalid = (idx >= 0).sum(-1, dtype=torch.int32).contiguous()
            fl = 2 * float(nvalid.sum()) * h * (576 + 512 + 576)
            row = {"S": s}
            runs = {}
            for on in (False, True):
                bws.ENABLED = on
                name = "gluon" if on else "triton"
                hs, kept = torch.zeros(idx.shape, dtype=torch.float32, device="cuda"), {}
                dq = first_pass_only(q, kv, idx, lse, delta, g, scale, hs, kept)
                runs[on] = (dq, kept["part"], hs)
                row[f"{name}_ms"] = timed(lambda: first_pass_only(q, kv, idx, lse, delta, g, scale, hs, {}),
                                          args.reps)
                row[f"{name}_tflops"] = fl / row[f"{name}_ms"] / 1e9
            row["gluon_vs_triton"] = row["triton_ms"] / row["gluon_ms"]
            valid = (idx[:, -runs[True][1].shape[1]:] >= 0)[..., None].expand(-1, -1, -1, 2 * h)
            row["dq_equal"] = bool(torch.equal(runs[True][0], runs[False][0]))
            row["part_equal"] = bool(torch.equal(runs[True][1][valid], runs[False][1][valid]))
            hs_ref = runs[False][2]
            row["head_sums_maxrel"] = float(((runs[True][2] - hs_ref).abs() / hs_ref.abs().clamp_min(1e-30)).max())
            # the Gluon pass's two kernels alone, over the same row blocks as the backward
            rows = kd.scratch_rows(1, k, h, s, q.element_size())
            part = kd.empty_scratch(q, k, rows)
            dq = torch.empty_like(q)

            def blocks(fn):
                for r0 in range(0, s, rows):
                    fn(r0, min(rows, s - r0))

            row["scores_ms"] = timed(lambda: blocks(lambda r0, n: bws.scores(
                q, kv, idx, nvalid, g, lse, delta, part, hs, r0, n, scale, scale * LOG2E, 512, 64)), args.reps)
            for cfg in configs:
                dqws.CONFIG = tuple(cfg)
                row[f"dq_{cfg[0]}x{cfg[1]}_ms"] = timed(
                    lambda: blocks(lambda r0, n: dqws.query_gradient(kv, idx, nvalid, dq, part, r0, n, 512, 64)),
                    args.reps)
            dqws.CONFIG = original[1]
            dkv = torch.zeros(1, s, 576, dtype=torch.float32, device="cuda")
            prec = tsm.dot_precision(q)
            row["key_gradient_ms"] = timed(lambda: blocks(lambda r0, n: kd.key_gradient(
                q, g, idx, nvalid, part, dkv, r0, n, 512, 64, prec)), args.reps)
            print(row, flush=True)
            res["rows"].append(row)
    finally:
        bws.ENABLED, dqws.CONFIG = original
    save_json(res, args.out)


if __name__ == "__main__":
    main()
