"""What bounds the sparse attention's key-gradient pass: the Triton pass against a Gluon (Hopper) version of it, and
that version with its writes as atomics, plain stores or none, in one run on one GPU.

    python benchmarks/dsa_dkv_probe.py --heads 64,16 --out dkv_probe.json

The pass (`pretrain/model/dsa/kernels/sparse_mla_dkv.py`) forms, per (query token t, selected slot j),
dkv[S_t[j]] += sum_h dS_h(t, j) [q_h(t)] + P_h(t, j) [dO_h(t)] from the [dS | P] rows the backward's first pass
stores, and adds each 576-wide fp32 row into dkv. The Gluon kernel below computes the same thing another way: each
program (token, column slice) keeps its q / dO columns in shared memory as the B operands of warp-group MMAs
(wgmma, 64 slots as M), streams the [dS | P] blocks through a ring of cp.async stages, and then writes the
[64, DS] fp32 result (WRITE 0: relaxed atomics, the real pass; 1: plain stores to the same rows, racy values,
for cost only; 2: nothing, a store no row takes keeps the products alive; 3, `writer`: the atomics issued by a
second partition of WRITER_WARPS warps that takes each result through two shared-memory buffers, warp
specialization), in the MMA's layout (ATOMIC_VEC 0) or as whole rows per warp with ATOMIC_VEC columns per
thread. Inputs are random (the pass's time does not depend on the values): GLM-5's 576 = 512 + 64 key width,
top-k 2048, the last --rows query rows of an S-token causal sequence, each selecting 2048 keys at random among
those it sees. Reported per variant: ms, ns per (token, slot), and for WRITE 0 and 3 the largest difference from
the Triton pass's dkv relative to its largest value (fp32 atomics in another order: ~1e-6). Not a kernel of the
model: it measures where the pass's time goes (benchmarks/results/README.md).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                             warpgroup_mma_wait)
from triton.runtime.jit import constexpr_function

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.dsa_kernels import save_json, tile_configs, timed  # noqa: E402
from pretrain.model.dsa.kernels import sparse_mla_dkv as tsm_dkv  # noqa: E402

@constexpr_function
def _row_layout(cols, num_warps):
    # 16-byte vectors along a row of `cols` bf16, the rest of the warp down the rows
    per_row = max(1, min(32, cols // 8))
    return gl.BlockedLayout([1, 8], [32 // per_row, per_row], [num_warps, 1], [1, 0])


WRITER_WARPS = gl.constexpr(4)  # the writer partition (WRITE 3): warps ...
WRITER_REGS = gl.constexpr(128)  # ... and registers per thread


@constexpr_function
def _atomic_layout(cols, vec, num_warps):
    vec = max(1, vec)  # 0: the writer partition's rows take one column per thread
    per_row = min(32, cols // vec)
    return gl.BlockedLayout([1, vec], [32 // per_row, per_row], [num_warps, 1], [1, 0])


@gluon.jit
def _write(dkv_ptr, bid, T, idx, cols, x, nv, D: gl.constexpr, WRITE: gl.constexpr):
    ptr = (dkv_ptr + (bid * T + idx.to(gl.int64)) * D)[:, None] + cols[None, :]
    ok = (idx >= 0)[:, None]
    if WRITE == 0:
        gl.atomic_add(ptr, x, mask=ok, sem="relaxed")
    elif WRITE == 1:
        gl.store(ptr, x, mask=ok)
    else:
        gl.store(ptr, x, mask=ok & (nv < 0))


@gluon.jit
def _issue(ring_ds, ring_p, stage, prow, j0, nv, s_pj, H: gl.constexpr, BN: gl.constexpr, ROPE: gl.constexpr,
           LOAD: gl.constexpr):
    # cp.async of slots j0 .. j0 + BN's dS (and P) rows into ring stage `stage`; rows past nv are zero-filled
    j = j0 + gl.arange(0, BN, layout=gl.SliceLayout(1, LOAD))
    h = gl.arange(0, H, layout=gl.SliceLayout(0, LOAD))
    ptr = prow + j.to(gl.int64)[:, None] * s_pj + h[None, :]
    m = (j < nv)[:, None] & (h < H)[None, :]
    async_copy.async_copy_global_to_shared(ring_ds.index(stage), ptr, mask=m)
    if not ROPE:
        async_copy.async_copy_global_to_shared(ring_p.index(stage), ptr + H, mask=m)


@gluon.jit
def _products(q_s, do_s, ring_ds, ring_p, staged, ready, empty, idx_row, prow, dkv_ptr, nv, bid, T, c0, s_pj,
              C: gl.constexpr, R: gl.constexpr, H: gl.constexpr, BN: gl.constexpr, DS: gl.constexpr,
              ROPE: gl.constexpr, NBUF: gl.constexpr, ATOMIC_VEC: gl.constexpr, WRITE: gl.constexpr,
              MMA: gl.constexpr, LOAD: gl.constexpr, num_warps: gl.constexpr):
    # the walk over the token's slot blocks: loads, products and (WRITE < 3) the writes
    nblk = gl.cdiv(nv, BN)
    for i in gl.static_range(NBUF - 1):  # prologue: the first NBUF - 1 blocks in flight
        _issue(ring_ds, ring_p, i, prow, i * BN, nv, s_pj, H, BN, ROPE, LOAD)
        async_copy.commit_group()

    n = gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
    cols = c0 + gl.arange(0, DS, layout=gl.SliceLayout(0, MMA))
    zero = gl.zeros([BN, DS], gl.float32, MMA)
    for i in range(nblk):
        # the stage that block i + NBUF - 1 goes to held block i - 1, whose products were waited for below
        nxt = i + NBUF - 1
        _issue(ring_ds, ring_p, nxt % NBUF, prow, nxt * BN, nv, s_pj, H, BN, ROPE, LOAD)
        async_copy.commit_group()
        async_copy.wait_group(NBUF - 1)  # this thread's copies of block i are done ...
        gl.thread_barrier()  # ... and every thread's
        fence_async_shared()  # cp.async wrote through the generic proxy; wgmma reads through the async one
        st = i % NBUF
        acc = warpgroup_mma(ring_ds.index(st), q_s, zero, use_acc=False, is_async=True)
        if not ROPE:
            acc = warpgroup_mma(ring_p.index(st), do_s, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        gl.thread_barrier()  # no thread refills this stage before every warp's share of the products is done
        j = i * BN + n
        idx = gl.load(idx_row + j, mask=j < nv, other=-1)
        # WRITE 0: relaxed fp32 atomics (the pass itself); 1: plain stores to the same rows (racy values: cost only);
        # 2: nothing written (a store no row takes keeps the products alive); 3: handed to the writer partition
        if WRITE == 3:
            b = i % 2
            mbarrier.wait(empty.index(b), (i // 2 & 1) ^ 1)  # the writer is done with this buffer's last block
            staged.index(b).store(acc)
            mbarrier.arrive(ready.index(b), count=1)
        elif ATOMIC_VEC == 0:  # the MMA's own layout: each thread holds pairs of columns of 8 rows
            _write(dkv_ptr, bid, T, idx, cols, acc, nv, C + R, WRITE)
        else:  # whole rows per warp, ATOMIC_VEC columns per thread (through shared memory)
            AL: gl.constexpr = _atomic_layout(DS, ATOMIC_VEC, num_warps)
            _write(dkv_ptr, bid, T, gl.convert_layout(idx, gl.SliceLayout(1, AL)),
                   c0 + gl.arange(0, DS, layout=gl.SliceLayout(0, AL)), gl.convert_layout(acc, AL), nv, C + R, WRITE)
    async_copy.wait_group(0)


@gluon.jit
def _writer(staged, ready, empty, idx_row, dkv_ptr, nv, bid, T, c0, D: gl.constexpr, BN: gl.constexpr,
            DS: gl.constexpr, ATOMIC_VEC: gl.constexpr, WARPS: gl.constexpr):
    AL: gl.constexpr = _atomic_layout(DS, ATOMIC_VEC, WARPS)
    n = gl.arange(0, BN, layout=gl.SliceLayout(1, AL))
    cols = c0 + gl.arange(0, DS, layout=gl.SliceLayout(0, AL))
    for i in range(gl.cdiv(nv, BN)):
        b = i % 2
        mbarrier.wait(ready.index(b), i // 2 & 1)
        x = staged.index(b).load(AL)
        mbarrier.arrive(empty.index(b), count=1)
        j = i * BN + n
        idx = gl.load(idx_row + j, mask=j < nv, other=-1)
        _write(dkv_ptr, bid, T, idx, cols, x, nv, D, 0)


@gluon.jit
def dkv_kernel(q_ptr, do_ptr, idx_ptr, nv_ptr, part_ptr, dkv_ptr, S, T, r0,
                s_qb, s_qt, s_qh, s_dob, s_dot, s_doh, s_ib, s_it, s_pb, s_pt, s_pj,
                C: gl.constexpr, R: gl.constexpr, H: gl.constexpr, BN: gl.constexpr, DS: gl.constexpr,
                NSL: gl.constexpr, ROPE: gl.constexpr, NBUF: gl.constexpr, ATOMIC_VEC: gl.constexpr,
                WRITE: gl.constexpr, num_warps: gl.constexpr):
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, DS, 16])
    LOAD: gl.constexpr = _row_layout(H, num_warps)
    QL: gl.constexpr = _row_layout(DS, num_warps)
    A_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, H], gl.bfloat16)
    B_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, DS], gl.bfloat16)
    pid = gl.program_id(0).to(gl.int64)
    bid = gl.program_id(1).to(gl.int64)
    t = r0 + pid // NSL
    c0 = (pid % NSL) * DS + (C if ROPE else 0)
    nv = gl.load(nv_ptr + bid * S + t)
    idx_row = idx_ptr + bid * s_ib + t * s_it
    prow = part_ptr + bid * s_pb + (t - r0) * s_pt

    # the token's q (and dO) columns c0 .. c0 + DS as the B operands [H, DS], resident for the whole walk
    hq = gl.arange(0, H, layout=gl.SliceLayout(1, QL))
    cq = c0 + gl.arange(0, DS, layout=gl.SliceLayout(0, QL))
    q_s = gl.allocate_shared_memory(gl.bfloat16, [H, DS], B_SMEM,
                                    gl.load(q_ptr + bid * s_qb + t * s_qt + hq[:, None] * s_qh + cq[None, :]))
    ring_ds = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BN, H], A_SMEM)
    if ROPE:
        do_s = q_s
        ring_p = ring_ds
    else:
        do_s = gl.allocate_shared_memory(gl.bfloat16, [H, DS], B_SMEM,
                                         gl.load(do_ptr + bid * s_dob + t * s_dot + hq[:, None] * s_doh + cq[None, :]))
        ring_p = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BN, H], A_SMEM)

    if WRITE == 3:  # a writer partition adds the results that the products partition leaves in shared memory
        STAGE: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        staged = gl.allocate_shared_memory(gl.float32, [2, BN, DS], STAGE)
        ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for b in gl.static_range(2):
            mbarrier.init(ready.index(b), count=1)
            mbarrier.init(empty.index(b), count=1)
        gl.warp_specialize([
            (_products, (q_s, do_s, ring_ds, ring_p, staged, ready, empty, idx_row, prow, dkv_ptr, nv, bid, T, c0, s_pj,
                         C, R, H, BN, DS, ROPE, NBUF, ATOMIC_VEC, WRITE, MMA, LOAD, num_warps)),
            (_writer, (staged, ready, empty, idx_row, dkv_ptr, nv, bid, T, c0, C + R, BN, DS, ATOMIC_VEC,
                       WRITER_WARPS)),
        ], [WRITER_WARPS], [WRITER_REGS])
    else:  # no writer: staged / ready / empty are never touched (WRITE < 3), any descriptor stands in
        _products(q_s, do_s, ring_ds, ring_p, ring_ds, ring_ds, ring_ds, idx_row, prow, dkv_ptr, nv, bid, T, c0, s_pj,
                  C, R, H, BN, DS, ROPE, NBUF, ATOMIC_VEC, WRITE, MMA, LOAD, num_warps)


def gluon_key_gradient(q, grad_out, indices, nvalid, part, dkv, r0, rows, c, r, cfg, atomic_vec, write):
    """The Gluon pass over query rows r0 .. r0 + rows; cfg = (BN, DS, ring stages, warps)."""
    b, s, h = q.shape[:3]
    bn, ds, nbuf, warps = cfg
    for rope, width, nsl in ((False, ds, c // ds), (True, r, 1)):
        dkv_kernel[(rows * nsl, b)](
            q, grad_out, indices, nvalid, part, dkv, s, dkv.shape[1], r0,
            q.stride(0), q.stride(1), q.stride(2), grad_out.stride(0), grad_out.stride(1), grad_out.stride(2),
            indices.stride(0), indices.stride(1), part.stride(0), part.stride(1), part.stride(2),
            C=c, R=r, H=h, BN=bn, DS=width, NSL=nsl, ROPE=rope, NBUF=nbuf, ATOMIC_VEC=atomic_vec, WRITE=write,
            num_warps=warps, **({"maxnreg": WRITER_REGS.value} if write == 3 else {}))


def inputs(h, s, rows, k, c, r, gen):
    dev = "cuda"
    q = torch.randn(1, s, h, c + r, device=dev, generator=gen).bfloat16()
    do = torch.randn(1, s, h, c, device=dev, generator=gen).bfloat16()
    idx = torch.full((1, s, k), -1, dtype=torch.int32, device=dev)
    t = torch.arange(s - rows, s, device=dev)
    scores = torch.rand(rows, s, device=dev, generator=gen)
    scores = scores.masked_fill(torch.arange(s, device=dev)[None, :] > t[:, None], -1.0)
    idx[0, s - rows:] = scores.topk(k, dim=1).indices.sort(dim=1).values.int()
    idx[0, s - 7:, k - k // 4:] = -1  # a few shorter rows: ragged ends
    nv = (idx >= 0).sum(-1, dtype=torch.int32).contiguous()
    part = torch.randn(1, rows, k, 2 * h, device=dev, generator=gen).bfloat16()
    return q, do, idx, nv, part


WRITES = {"atomic": 0, "store": 1, "none": 2, "writer": 3}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="64,16")
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--rows", type=int, default=2048, help="query rows timed (the last of the sequence)")
    ap.add_argument("--configs", default="64x128x3x4x4,64x128x3x4x1,64x128x3x4x0,64x64x3x4x4,128x128x2x8x4",
                    help="Gluon variants BN x DS x stages x warps x ATOMIC_VEC")
    ap.add_argument("--writes", default="atomic,store,none")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    configs = tile_configs(args.configs)
    if any(len(cfg) != 5 for cfg in configs):
        ap.error("--configs entries are BN x DS x stages x warps x ATOMIC_VEC, e.g. 64x128x3x4x4")
    writes = args.writes.split(",")
    if any(w not in WRITES for w in writes):
        ap.error(f"--writes takes {sorted(WRITES)}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        sys.exit("dsa_dkv_probe: needs a Hopper GPU (sm_90: wgmma)")
    k, c, r = 2048, 512, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {"gpu": torch.cuda.get_device_name(), "seq": args.seq, "rows": args.rows, "rows_out": []}
    for h in [int(x) for x in args.heads.split(",")]:
        q, do, idx, nv, part = inputs(h, args.seq, args.rows, k, c, r, gen)
        r0, pairs = args.seq - args.rows, int(nv.sum())
        ref = torch.zeros(1, args.seq, c + r, dtype=torch.float32, device="cuda")
        tsm_dkv.key_gradient(q, do, idx, nv, part, ref, r0, args.rows, c, r, "tf32")
        runs = [("triton", None, "atomic")] + [("gluon", cfg, w) for cfg in configs for w in writes]
        for name, cfg, write in runs:
            if name == "triton":
                fn = lambda dkv: tsm_dkv.key_gradient(q, do, idx, nv, part, dkv, r0, args.rows, c, r, "tf32")
            else:
                fn = lambda dkv, cfg=cfg, write=write: gluon_key_gradient(
                    q, do, idx, nv, part, dkv, r0, args.rows, c, r, cfg[:4], cfg[4], WRITES[write])
            dkv = torch.zeros_like(ref)
            fn(dkv)
            err = ((dkv - ref).abs().max() / ref.abs().max()).item() if write in ("atomic", "writer") else None
            ms = timed(lambda: fn(dkv), args.reps)
            row = {"heads": h, "kernel": name, "config": list(cfg) if cfg else list(tsm_dkv.dkv_config(h, c)),
                   "write": write, "ms": ms, "ns_per_pair": ms * 1e6 / pairs, "rel_err_vs_triton": err}
            print(row, flush=True)
            res["rows_out"].append(row)
    if args.out:
        save_json(res, args.out)


if __name__ == "__main__":
    main()
