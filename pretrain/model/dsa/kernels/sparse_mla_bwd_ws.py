"""The sparse MLA backward's first pass as a warp-specialized Gluon kernel for Hopper (GLM-5 report, DSA section;
DeepSeek-V3.2 section 2). Same math, inputs and results as the Triton first pass (`sparse_mla._bwd_kernel` with
DKV = 5, whose docstring states it): per query token t with its H = 64 heads as the MMA's M,

    P = exp(s - lse),  dP = dO kv[S_t, :C]^T,  dS = P (dP - Delta) scale,  dq = dS kv[S_t]

and dS, P stored (bf16) per (token, slot) for the key-gradient pass (`sparse_mla_dkv`), plus sum_h P per slot
when asked (the indexer loss's target). As in the warp-specialized forward (`sparse_mla_fwd_ws`, whose loader
partition this kernel shares), a loader partition gathers each block of BN selected key rows into one of NBUF
shared-memory stages; the eight consumer warps (two warp groups, each holding half of dq's columns) form S and dP
(wgmma, warps [4, 2]: each warp group half of the block's keys), dS in shared memory as the A operand of dq's
products, and release the stage. q and dO stay resident in shared memory (137 KB), so blocks are 32 keys. Measured
on an H200 (benchmarks/results/README.md, "The backward's first pass, warp-specialized"): the 64-head backward
1.06-1.07x (201 TFLOP/s at 16K), with dq, dS / P and the head sums bitwise the Triton first pass's.

Runs where `supported` says (as the forward: CUDA sm_90, bf16, 64 heads, C in {256, 512}, R in {32, 64});
`sparse_mla` takes the Triton first pass elsewhere.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                             warpgroup_mma_wait)

from pretrain.model.dsa.kernels import sparse_mla_fwd_ws as fwd_ws
from pretrain.model.dsa.kernels.sparse_mla_fwd_ws import LOADER_REGS, LOADER_WARPS, MAXNREG, key_loader, key_stages

CONFIG = (32, 2)  # (BN selected keys per block, NBUF stages): with q and dO, 221 KB of shared memory
ENABLED = True  # False: the Triton first pass everywhere (`benchmarks/dsa_heads_sweep.py --ws off,on` times both)


@gluon.jit
def _consumer(qlat_s, qrope_s, do_s, klat_s, krope_s, ds_s, ready, empty, nv, lse_row, delta_row, dq_row,
              part_row, s_pj, hs_row, sm_scale, qk_scale, H: gl.constexpr, C: gl.constexpr, R: gl.constexpr,
              BN: gl.constexpr, NBUF: gl.constexpr, HEAD_SUMS: gl.constexpr, num_warps: gl.constexpr):
    WN: gl.constexpr = num_warps // 4
    SL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WN], instr_shape=[16, BN // WN, 16])
    DL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WN], instr_shape=[16, C // WN, 16])
    RL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WN], instr_shape=[16, R // WN, 16])
    # dS and P rows go out per (slot, head): heads contiguous, 8 per thread (16 bytes)
    PL: gl.constexpr = gl.BlockedLayout([8, 1], [H // 8, 32 // (H // 8)], [1, num_warps], [0, 1])
    h = gl.arange(0, H, layout=gl.SliceLayout(1, SL))
    lse2 = gl.load(lse_row + h) * 1.4426950408889634
    delta = gl.load(delta_row + h)
    dq_lat = gl.zeros([H, C], gl.float32, DL)
    dq_rope = gl.zeros([H, R], gl.float32, RL)
    zero = gl.zeros([H, BN], gl.float32, SL)
    n = gl.arange(0, BN, layout=gl.SliceLayout(0, SL))
    hp = gl.arange(0, H, layout=gl.SliceLayout(1, PL))
    np_ = gl.arange(0, BN, layout=gl.SliceLayout(0, PL))
    for i in range(gl.cdiv(nv, BN)):
        st = i % NBUF
        mbarrier.wait(ready.index(st), i // NBUF & 1)
        fence_async_shared()  # cp.async wrote the stage through the generic proxy; wgmma reads through the async one
        klat = klat_s.index(st)
        krope = krope_s.index(st)
        s = warpgroup_mma(qlat_s, klat.permute((1, 0)), zero, use_acc=False, is_async=True)
        s = warpgroup_mma(qrope_s, krope.permute((1, 0)), s, is_async=True)
        dp = warpgroup_mma(do_s, klat.permute((1, 0)), zero, use_acc=False, is_async=True)
        s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
        ok = i * BN + n < nv
        p = gl.where(ok[None, :], gl.exp2(s * qk_scale - lse2[:, None]), 0.0)
        if HEAD_SUMS:  # the indexer loss's target, sum_h P_h(t, j)
            gl.store(hs_row + i * BN + n, gl.sum(p, 0), mask=ok)
        dsc = (p * (dp - delta[:, None]) * sm_scale).to(gl.bfloat16)
        ds_s.store(dsc)
        jp = i * BN + np_
        pm = (jp < nv)[None, :]
        prow = part_row + jp.to(gl.int64)[None, :] * s_pj + hp[:, None]
        gl.store(prow, gl.convert_layout(dsc, PL), mask=pm)
        gl.store(prow + H, gl.convert_layout(p.to(gl.bfloat16), PL), mask=pm)
        fence_async_shared()
        gl.thread_barrier()  # every warp's share of dS is in shared memory before either warp group multiplies
        dq_lat = warpgroup_mma(ds_s, klat, dq_lat, is_async=True)
        dq_rope = warpgroup_mma(ds_s, krope, dq_rope, is_async=True)
        dq_lat, dq_rope = warpgroup_mma_wait(num_outstanding=0, deps=(dq_lat, dq_rope))
        gl.thread_barrier()  # both warp groups are done with the stage and with dS
        mbarrier.arrive(empty.index(st), count=1)
    hd = gl.arange(0, H, layout=gl.SliceLayout(1, DL))
    cd = gl.arange(0, C, layout=gl.SliceLayout(0, DL))
    gl.store(dq_row + hd[:, None] * (C + R) + cd[None, :], dq_lat.to(dq_row.dtype.element_ty))
    hr = gl.arange(0, H, layout=gl.SliceLayout(1, RL))
    cr = C + gl.arange(0, R, layout=gl.SliceLayout(0, RL))
    gl.store(dq_row + hr[:, None] * (C + R) + cr[None, :], dq_rope.to(dq_row.dtype.element_ty))


@gluon.jit
def first_pass_kernel(q_ptr, kv_ptr, idx_ptr, nv_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, part_ptr, hs_ptr, S, r0,
                       s_qb, s_qt, s_qh, s_kb, s_kt, s_ib, s_it, s_dob, s_dot, s_doh, s_pb, s_pt, s_pj, s_hb, s_ht,
                       sm_scale, qk_scale, H: gl.constexpr, C: gl.constexpr, R: gl.constexpr, BN: gl.constexpr,
                       NBUF: gl.constexpr, HEAD_SUMS: gl.constexpr, num_warps: gl.constexpr):
    t = r0 + gl.program_id(0).to(gl.int64)
    bid = gl.program_id(1).to(gl.int64)
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    QR: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (R // 8), R // 8], [num_warps, 1], [1, 0])
    qb = q_ptr + bid * s_qb + t * s_qt
    dob = do_ptr + bid * s_dob + t * s_dot
    hq = gl.arange(0, H, layout=gl.SliceLayout(1, QL))
    cq = gl.arange(0, C, layout=gl.SliceLayout(0, QL))
    hr = gl.arange(0, H, layout=gl.SliceLayout(1, QR))
    cr = C + gl.arange(0, R, layout=gl.SliceLayout(0, QR))
    lat: gl.constexpr = gl.NVMMASharedLayout.get_default_for([H, C], gl.bfloat16)
    qlat_s = gl.allocate_shared_memory(gl.bfloat16, [H, C], lat, gl.load(qb + hq[:, None] * s_qh + cq[None, :]))
    qrope_s = gl.allocate_shared_memory(gl.bfloat16, [H, R],
                                        gl.NVMMASharedLayout.get_default_for([H, R], gl.bfloat16),
                                        gl.load(qb + hr[:, None] * s_qh + cr[None, :]))
    do_s = gl.allocate_shared_memory(gl.bfloat16, [H, C], lat, gl.load(dob + hq[:, None] * s_doh + cq[None, :]))
    klat_s, krope_s, ready, empty = key_stages(C, R, BN, NBUF)
    ds_s = gl.allocate_shared_memory(gl.bfloat16, [H, BN], gl.NVMMASharedLayout.get_default_for([H, BN], gl.bfloat16))
    fence_async_shared()  # q and dO were stored through the generic proxy; wgmma reads them through the async one
    nv = gl.load(nv_ptr + bid * S + t)
    idx_row = idx_ptr + bid * s_ib + t * s_it
    row = (bid * S + t) * H
    gl.warp_specialize([
        (_consumer, (qlat_s, qrope_s, do_s, klat_s, krope_s, ds_s, ready, empty, nv, lse_ptr + row,
                     delta_ptr + row, dq_ptr + row * (C + R), part_ptr + bid * s_pb + (t - r0) * s_pt, s_pj,
                     hs_ptr + bid * s_hb + t * s_ht, sm_scale, qk_scale, H, C, R, BN, NBUF, HEAD_SUMS, num_warps)),
        (key_loader, (klat_s, krope_s, ready, empty, idx_row, kv_ptr + bid * s_kb, s_kt, nv, C, R, BN, NBUF)),
    ], [LOADER_WARPS], [LOADER_REGS])


def supported(q: torch.Tensor, kv: torch.Tensor, h: int, c: int, r: int) -> bool:
    """Whether this kernel runs the first pass: ENABLED and what the warp-specialized forward needs."""
    return ENABLED and fwd_ws.supported(q, kv, h, c, r, enabled=True)


def first_pass(q, kv, indices, nvalid, grad_out, lse, delta, dq, part, head_sums, r0: int, rows: int, scale: float,
               scale_log2: float, c: int, r: int):
    """The first pass over query rows r0 .. r0 + rows: dq rows (q's dtype, [b, s, h, c + r] contiguous), part
    [b, rows', k, 2h] (dS, then P), head_sums [b, s, k] fp32 += sum_h P when given (else None)."""
    b, s, h = q.shape[:3]
    bn, nbuf = CONFIG
    hs = head_sums if head_sums is not None else lse
    hstr = head_sums.stride()[:2] if head_sums is not None else (0, 0)
    first_pass_kernel[(rows, b)](
        q, kv, indices, nvalid, grad_out, lse, delta, dq, part, hs, s, r0,
        q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), indices.stride(0), indices.stride(1),
        grad_out.stride(0), grad_out.stride(1), grad_out.stride(2), part.stride(0), part.stride(1), part.stride(2),
        hstr[0], hstr[1], scale, scale_log2, H=h, C=c, R=r, BN=bn, NBUF=nbuf, HEAD_SUMS=head_sums is not None,
        num_warps=8, maxnreg=MAXNREG)
