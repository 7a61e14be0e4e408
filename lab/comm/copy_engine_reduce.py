"""Compute beside a gradient transfer: NCCL's reduce (default and 4 thread blocks) against a copy-engine peer write.

    torchrun --nproc-per-node 2 lab/comm/copy_engine_reduce.py --out copy_engine_reduce.json

The question: ZeRO-2's per-micro-batch reduce slows the backward's kernels that run beside it (lab/journal/comm.md).
Is that the SMs NCCL's kernels hold (then moving the bytes with the GPU's copy engines, through a peer mapping of the
owner's buffer, takes it back) or the memory system and power that any transfer costs (then it does not)?

Each rank times (wall clock around synchronized CUDA work, mean of `--reps`, every pair warmed up first) three
compute loads alone and beside each transfer of a 200 MB fp32 bucket on a side stream:
- `nccl`: `dist.reduce` to rank 0 (default NCCL settings);
- `nccl_4ctas`: the same on a group limited to 4 thread blocks;
- `copy_engine`: rank 1 writes the bucket into rank 0's buffer (torch symmetric memory, `copy_` to the peer
  mapping = cudaMemcpyAsync on a copy engine), then rank 0 adds it to its own (one elementwise kernel).
The loads: an 8192^3 bf16 GEMM; eight [8192 x 2048] @ [2048 x 6144] projections; causal SDPA forward + backward
at 4K x 16 heads x 192. A transfer that lasts longer than the load shows up in the "beside" time, so each transfer's
time alone is recorded too. Rank 0 writes the JSON; both ranks' numbers are in it.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from lab.comm.timing import report_and_finish, timed  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--mbytes", type=int, default=200)
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    import torch.distributed._symmetric_memory as symm_mem

    n = args.mbytes * 1_000_000 // 4
    bucket = torch.randn(n, device="cuda")
    owned = torch.zeros(n, device="cuda")
    recv = symm_mem.empty(n, device="cuda", dtype=torch.float32)
    handle = symm_mem.rendezvous(recv, dist.group.WORLD.group_name)
    peer_recv = handle.get_buffer(1 - rank, (n,), torch.float32)
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.max_ctas = 4
    group4 = dist.new_group([0, 1], pg_options=opts)
    side = torch.cuda.Stream()

    def nccl():
        dist.reduce(bucket, dst=0)

    def nccl_4ctas():
        dist.reduce(bucket, dst=0, group=group4)

    def copy_engine():
        # rank 1 -> rank 0: the write, then a signal; rank 0 waits for the signal and adds.
        if rank == 1:
            peer_recv.copy_(bucket)
            handle.put_signal(0)
        else:
            handle.wait_signal(1)
            owned.add_(recv)

    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    x = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, 6144, device="cuda", dtype=torch.bfloat16)
    q, k, v = (torch.randn(1, 16, 4096, 192, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def attention():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    loads = {"gemm_8192": lambda: a @ b, "projections_x8": lambda: [x @ w for _ in range(8)], "sdpa_4k_fwd_bwd": attention}
    transfers = {"nccl": nccl, "nccl_4ctas": nccl_4ctas, "copy_engine": copy_engine}

    def beside(transfer, load):
        def both():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                transfer()
            load()
            torch.cuda.current_stream().wait_stream(side)
        return both

    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "bucket_mbytes": args.mbytes,
           "nccl_version": ".".join(map(str, torch.cuda.nccl.version()))}
    mine = {f"{t}_alone_ms": timed(fn, args.reps, warmups=2, align_ranks=True) for t, fn in transfers.items()}
    for name, load in loads.items():
        mine[f"{name}_alone_ms"] = timed(load, args.reps, warmups=2, align_ranks=True)
        for t, fn in transfers.items():
            mine[f"{name}_beside_{t}_ms"] = timed(beside(fn, load), args.reps, warmups=2, align_ranks=True)
    gathered = [None, None]
    dist.all_gather_object(gathered, mine)
    out["rank0"], out["rank1"] = gathered
    report_and_finish(out, args.out)


if __name__ == "__main__":
    main()
