"""GEMMs beside an NCCL reduce, with and without torch's SM carveout for GEMMs, on 2 GPUs.

    torchrun --nproc-per-node 2 lab/comm/gemm_carveout.py --out gemm_carveout.json

The question: does ZeRO-2's per-micro-batch reduce slow the backward's GEMMs because a GEMM sized for every SM
runs a second wave of thread blocks when NCCL holds some SMs, and does `torch._C._set_sm_carveout_experimental`
(GEMMs targeting fewer SMs) take that back? The journal (lab/journal/comm.md) has the answer: no.

For carveouts none, 8, 16 and 66 SMs, each rank times (the mean of wall clock around synchronized CUDA work over
`--reps` repetitions): an 8192^3 bf16 GEMM and eight [8192 x 2048] @ [2048 x 6144] projections alone, and
the same while a 200 MB fp32 reduce to rank 0 runs on a side stream (what ZeRO-2's per-micro-batch reduce does
beside the backward); then the reduce alone. Rank 0 writes the JSON.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from lab.comm.timing import report_and_finish, timed  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    x = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, 6144, device="cuda", dtype=torch.bfloat16)
    bucket = torch.randn(200_000_000 // 4, device="cuda", dtype=torch.float32)  # 200 MB of fp32 gradients
    side = torch.cuda.Stream()

    def beside_reduce(fn):
        def both():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                dist.reduce(bucket, dst=0)
            fn()
        return both

    square = lambda: a @ b  # noqa: E731
    projections = lambda: [x @ w for _ in range(8)]  # noqa: E731
    out = {"gpu": torch.cuda.get_device_name(), "sms": torch.cuda.get_device_properties(0).multi_processor_count,
           "torch": torch.__version__}
    for carveout in (None, 8, 16, 66):
        torch._C._set_sm_carveout_experimental(carveout)
        out[f"carveout_{carveout or 0}"] = {
            "gemm_8192_ms": timed(square, args.reps), "projections_x8_ms": timed(projections, args.reps),
            "gemm_8192_beside_reduce_ms": timed(beside_reduce(square), args.reps),
            "projections_x8_beside_reduce_ms": timed(beside_reduce(projections), args.reps)}
    torch._C._set_sm_carveout_experimental(None)
    out["reduce_alone_ms"] = timed(lambda: dist.reduce(bucket, dst=0), args.reps)
    report_and_finish(out, args.out)


if __name__ == "__main__":
    main()
