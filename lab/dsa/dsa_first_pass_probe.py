"""The 64-head sparse MLA backward's first pass, its kernels side by side in one run on one GPU: the Triton first
pass (`sparse_mla._bwd_kernel`, DKV = 5) against the warp-specialized Gluon one (the default on Hopper), which is
two kernels, `hopper.first_pass.scores_kernel` (S, dP, P, dS and their rows, sum_h P) and `hopper.query_gradient`
(dq from the stored dS), each also timed alone; and the key-gradient pass that follows both (`sparse_mla_dkv`).

    python lab/dsa/dsa_first_pass_probe.py --seqs 16384,32768 --dq-configs 64x2,32x4 --out first_pass.json

GLM-5's shapes: 64 heads, 576 = 512 + 64 key width, top-k 2048, batch 1; random inputs, the causal top-k of random
scores (`dsa_fwd_probe.inputs`). A first pass alone is the backward with its key-gradient pass left out; per S:
ms of each (the backward under `KeyGradient.TIMING_FIRST_PASS`, with the head sums, as the DSA layer asks),
TFLOP/s (2 * valid pairs * h * (576 + 512 + 576): S, dP and dq), whether the Gluon pass's dq equals the Triton
pass's bitwise (tests/test_gpu_dsa_kernels.py also compares their [dS | P] rows), and the head sums' largest
relative difference (the same fp32 P summed over heads in another order).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from lab.dsa.dsa_fwd_probe import inputs, require_hopper, stage_configs  # noqa: E402
from benchmarks.dsa_kernels import save_json, timed  # noqa: E402
from pretrain.model.dsa.kernels import sparse_mla as tsm  # noqa: E402
from pretrain.model.dsa.kernels import sparse_mla_dkv as kd  # noqa: E402
from pretrain.model.dsa.kernels.common import LOG2E  # noqa: E402
from pretrain.model.dsa.kernels.hopper import first_pass as gluon_first_pass  # noqa: E402
from pretrain.model.dsa.kernels.hopper import query_gradient  # noqa: E402
from pretrain.model.dsa.kernels.tuning import DSAKernelTuning, KeyGradient  # noqa: E402

# the first pass alone (no key-gradient pass after it), Gluon where the plan takes it, or the Triton one
FIRST_PASS = {on: DSAKernelTuning(key_gradient=KeyGradient.TIMING_FIRST_PASS, gluon_first_pass=on)
              for on in (False, True)}


def first_pass_only(q, kv, idx, lse, delta, g, scale, hs, gluon: bool):
    """The backward without its key-gradient pass: dq."""
    return tsm.sparse_mla_backward(q, kv, idx, lse, delta, g, scale, 512, head_sums=hs, tuning=FIRST_PASS[gluon])[0]


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
            name = "gluon" if on else "triton"
            hs = torch.zeros(idx.shape, dtype=torch.float32, device="cuda")
            dq = first_pass_only(q, kv, idx, lse, delta, g, scale, hs, on)
            runs[on] = (dq, hs)
            row[f"{name}_ms"] = timed(lambda: first_pass_only(q, kv, idx, lse, delta, g, scale, hs, on),
                                      args.reps)
            row[f"{name}_tflops"] = fl / row[f"{name}_ms"] / 1e9
        row["gluon_vs_triton"] = row["triton_ms"] / row["gluon_ms"]
        row["dq_equal"] = bool(torch.equal(runs[True][0], runs[False][0]))
        hs_ref = runs[False][1]
        row["head_sums_maxrel"] = float(((runs[True][1] - hs_ref).abs() / hs_ref.abs().clamp_min(1e-30)).max())
        # the Gluon pass's two kernels alone, over the same row blocks as the backward
        rows = kd.scratch_rows(1, k, h, s, q.element_size())
        part = kd.empty_scratch(q, k, rows)
        dq = torch.empty_like(q)

        def blocks(fn):
            for r0 in range(0, s, rows):
                fn(r0, min(rows, s - r0))

        row["scores_ms"] = timed(lambda: blocks(lambda r0, n: gluon_first_pass.scores(
            q, kv, idx, nvalid, g, lse, delta, part, hs, r0, n, scale, scale * LOG2E, 512, 64)), args.reps)
        for cfg in configs:
            row[f"dq_{cfg[0]}x{cfg[1]}_ms"] = timed(lambda: blocks(lambda r0, n: query_gradient.query_gradient(
                kv, idx, nvalid, dq, part, r0, n, 512, 64, tuple(cfg))), args.reps)
        dkv = torch.zeros(1, s, 576, dtype=torch.float32, device="cuda")
        prec = tsm.dot_precision(q)
        row["key_gradient_ms"] = timed(lambda: blocks(lambda r0, n: kd.key_gradient(
            q, g, idx, nvalid, part, dkv, r0, n, 512, 64, prec)), args.reps)
        print(row, flush=True)
        res["rows"].append(row)
    save_json(res, args.out)


if __name__ == "__main__":
    main()
