"""Can a warp-specialized kernel lift the 64-head sparse MLA forward? The Triton forward against a Gluon (Hopper)
forward with a loader partition, in one run on one GPU.

    python benchmarks/dsa_fwd_probe.py --seqs 16384 --out fwd_probe.json

The forward (`pretrain/model/dsa/kernels/sparse_mla.py`, `_fwd_kernel`) runs at 230-256 TFLOP/s at GLM-5's shapes
(64 heads, 576 = 512 + 64 key width, top-k 2048), bound by its MMA pipeline with gathered operands, not by the
gathers (benchmarks/results/README.md). Its eight warps both gather each block of selected keys and multiply it.
The Gluon kernel below splits those jobs (warp specialization): LOADER_WARPS warps gather key blocks by cp.async
into NBUF shared-memory stages and signal each through an mbarrier; the eight consumer warps (two warp groups,
each holding half of the [64, 512] fp32 output: wgmma with warps [4, 2]) form S = q k^T, the online softmax and
O += P V, and release each stage after use. Same math, layouts and results as the Triton forward (output in q's
dtype, lse in fp32). Random inputs, causal top-k of random scores; reported per S: ms and TFLOP/s of both (the
convention of `benchmarks/dsa_kernels.py`: 2 * pairs * h * (576 + 512) over all S * k slots), and the largest
differences of the Gluon output and lse from the Triton forward's. Not a kernel of the model: a measurement.
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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.dsa_kernels import save_json, tile_configs, timed  # noqa: E402
from pretrain.model.dsa.kernels import sparse_mla as tsm  # noqa: E402

LOADER_WARPS = gl.constexpr(4)
LOADER_REGS = gl.constexpr(96)
MAXNREG = 168  # (8 consumer + 4 loader warps) x 32 x 168 registers fit the register file


@gluon.jit
def _loader(klat_s, krope_s, ready, empty, idx_row, kv_base, s_kt, nv, C: gl.constexpr, R: gl.constexpr,
            BN: gl.constexpr, NBUF: gl.constexpr):
    # gathers block i of the selection into stage i % NBUF once the consumers released it
    LL: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [LOADER_WARPS, 1], [1, 0])
    LR: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (R // 8), R // 8], [LOADER_WARPS, 1], [1, 0])
    cl = gl.arange(0, C, layout=gl.SliceLayout(0, LL))
    cr = C + gl.arange(0, R, layout=gl.SliceLayout(0, LR))
    for i in range(gl.cdiv(nv, BN)):
        st = i % NBUF
        mbarrier.wait(empty.index(st), (i // NBUF & 1) ^ 1)
        jl = i * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, LL))
        rows = gl.load(idx_row + jl, mask=jl < nv, other=0).to(gl.int64) * s_kt
        async_copy.async_copy_global_to_shared(klat_s.index(st), kv_base + rows[:, None] + cl[None, :],
                                               mask=(jl < nv)[:, None])
        jr = i * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, LR))
        rows_r = gl.load(idx_row + jr, mask=jr < nv, other=0).to(gl.int64) * s_kt
        async_copy.async_copy_global_to_shared(krope_s.index(st), kv_base + rows_r[:, None] + cr[None, :],
                                               mask=(jr < nv)[:, None])
        async_copy.mbarrier_arrive(ready.index(st), increment_count=False)


@gluon.jit
def _consumer(qlat_s, qrope_s, klat_s, krope_s, p_s, ready, empty, nv, qk_scale, o_row, s_oh, lse_row,
              H: gl.constexpr, C: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr, num_warps: gl.constexpr):
    SL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                 instr_shape=[16, BN // (num_warps // 4), 16])
    OL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                 instr_shape=[16, C // (num_warps // 4), 16])
    m_i = gl.full([H], float("-inf"), gl.float32, gl.SliceLayout(1, SL))
    l_i = gl.zeros([H], gl.float32, gl.SliceLayout(1, SL))
    acc = gl.zeros([H, C], gl.float32, OL)
    zero = gl.zeros([H, BN], gl.float32, SL)
    n = gl.arange(0, BN, layout=gl.SliceLayout(0, SL))
    for i in range(gl.cdiv(nv, BN)):
        st = i % NBUF
        mbarrier.wait(ready.index(st), i // NBUF & 1)
        fence_async_shared()  # cp.async wrote the stage through the generic proxy; wgmma reads through the async one
        s = warpgroup_mma(qlat_s, klat_s.index(st).permute((1, 0)), zero, use_acc=False, is_async=True)
        s = warpgroup_mma(qrope_s, krope_s.index(st).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        s = gl.where((i * BN + n < nv)[None, :], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, OL))[:, None]
        p_s.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()  # every warp's share of P is in shared memory before either warp group multiplies
        acc = warpgroup_mma(p_s, klat_s.index(st), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        gl.thread_barrier()  # both warp groups are done with the stage and with P
        mbarrier.arrive(empty.index(st), count=1)
    l_safe = gl.where(l_i > 0, l_i, 1.0)
    out = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, OL))[:, None]
    h = gl.arange(0, H, layout=gl.SliceLayout(1, OL))
    c = gl.arange(0, C, layout=gl.SliceLayout(0, OL))
    gl.store(o_row + h[:, None] * s_oh + c[None, :], out.to(o_row.dtype.element_ty))
    hl = gl.arange(0, H, layout=gl.SliceLayout(1, SL))
    gl.store(lse_row + hl, gl.where(l_i > 0, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf")))


@gluon.jit
def _fwd_kernel(q_ptr, kv_ptr, idx_ptr, nv_ptr, o_ptr, lse_ptr, S, s_qb, s_qt, s_qh, s_kb, s_kt, s_ib, s_it,
                s_ob, s_ot, s_oh, qk_scale, H: gl.constexpr, C: gl.constexpr, R: gl.constexpr, BN: gl.constexpr,
                NBUF: gl.constexpr, num_warps: gl.constexpr):
    t = gl.program_id(0).to(gl.int64)
    bid = gl.program_id(1).to(gl.int64)
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    QR: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (R // 8), R // 8], [num_warps, 1], [1, 0])
    qb = q_ptr + bid * s_qb + t * s_qt
    hq = gl.arange(0, H, layout=gl.SliceLayout(1, QL))
    cq = gl.arange(0, C, layout=gl.SliceLayout(0, QL))
    hr = gl.arange(0, H, layout=gl.SliceLayout(1, QR))
    cr = C + gl.arange(0, R, layout=gl.SliceLayout(0, QR))
    qlat_s = gl.allocate_shared_memory(gl.bfloat16, [H, C], gl.NVMMASharedLayout.get_default_for([H, C], gl.bfloat16),
                                       gl.load(qb + hq[:, None] * s_qh + cq[None, :]))
    qrope_s = gl.allocate_shared_memory(gl.bfloat16, [H, R],
                                        gl.NVMMASharedLayout.get_default_for([H, R], gl.bfloat16),
                                        gl.load(qb + hr[:, None] * s_qh + cr[None, :]))
    klat_s = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BN, C],
                                       gl.NVMMASharedLayout.get_default_for([BN, C], gl.bfloat16))
    krope_s = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BN, R],
                                        gl.NVMMASharedLayout.get_default_for([BN, R], gl.bfloat16))
    p_s = gl.allocate_shared_memory(gl.bfloat16, [H, BN], gl.NVMMASharedLayout.get_default_for([H, BN], gl.bfloat16))
    ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(NBUF):
        mbarrier.init(ready.index(b), count=LOADER_WARPS * 32)  # one cp.async arrival per loader thread
        mbarrier.init(empty.index(b), count=1)
    fence_async_shared()  # q was stored through the generic proxy; wgmma reads it through the async one
    nv = gl.load(nv_ptr + bid * S + t)
    idx_row = idx_ptr + bid * s_ib + t * s_it
    gl.warp_specialize([
        (_consumer, (qlat_s, qrope_s, klat_s, krope_s, p_s, ready, empty, nv, qk_scale, o_ptr + bid * s_ob + t * s_ot,
                     s_oh, lse_ptr + (bid * S + t) * H, H, C, BN, NBUF, num_warps)),
        (_loader, (klat_s, krope_s, ready, empty, idx_row, kv_ptr + bid * s_kb, s_kt, nv, C, R, BN, NBUF)),
    ], [LOADER_WARPS], [LOADER_REGS])


def gluon_forward(q, kv, indices, scale: float, v_dim: int, bn: int, nbuf: int):
    """(out, lse) as `sparse_mla.sparse_mla_forward`; needs h = 64 heads (two warp groups of M = 64)."""
    b, s, h, c, r = tsm.mla_shapes(q, kv, v_dim)
    indices = indices.to(torch.int32)
    nvalid = (indices >= 0).sum(-1, dtype=torch.int32).contiguous()
    out = torch.empty(b, s, h, c, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, s, h, dtype=torch.float32, device=q.device)
    _fwd_kernel[(s, b)](q, kv, indices, nvalid, out, lse, s, q.stride(0), q.stride(1), q.stride(2), kv.stride(0),
                        kv.stride(1), indices.stride(0), indices.stride(1), out.stride(0), out.stride(1),
                        out.stride(2), scale * tsm.LOG2E, H=h, C=c, R=r, BN=bn, NBUF=nbuf, num_warps=8,
                        maxnreg=MAXNREG)
    return out, lse


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
    ap.add_argument("--configs", default="64x2,32x3,32x4", help="Gluon variants BN x NBUF (slots per block, stages)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    configs = tile_configs(args.configs)
    if any(len(cfg) != 2 for cfg in configs):
        ap.error("--configs entries are BN x NBUF, e.g. 64x2")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        sys.exit("dsa_fwd_probe: needs a Hopper GPU (sm_90: wgmma, warp specialization)")
    h, k, scale = 64, 2048, 256**-0.5
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {"gpu": torch.cuda.get_device_name(), "rows": []}
    for s in [int(x) for x in args.seqs.split(",")]:
        q, kv, idx = inputs(s, k, h, gen)
        fl = 2 * s * k * h * (576 + 512)
        ref_out, ref_lse = tsm.sparse_mla_forward(q, kv, idx, scale, 512)
        ms = timed(lambda: tsm.sparse_mla_forward(q, kv, idx, scale, 512), args.reps)
        rows = [{"S": s, "kernel": "triton", "config": list(tsm.kernel_config(h, 512)), "ms": ms,
                 "tflops": fl / ms / 1e9}]
        for bn, nbuf in configs:
            row = {"S": s, "kernel": "gluon", "config": [bn, nbuf]}
            try:
                out, lse = gluon_forward(q, kv, idx, scale, 512, bn, nbuf)
                fin = torch.isfinite(ref_lse)
                row["out_diff"] = ((out.float() - ref_out.float()).abs().max() / ref_out.float().abs().max()).item()
                row["lse_diff"] = (lse[fin] - ref_lse[fin]).abs().max().item()
                row["lse_inf_same"] = bool(torch.equal(torch.isfinite(lse), fin))
                row["ms"] = timed(lambda: gluon_forward(q, kv, idx, scale, 512, bn, nbuf), args.reps)
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
