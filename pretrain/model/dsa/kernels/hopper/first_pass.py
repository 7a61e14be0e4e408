"""The sparse MLA backward's first pass as warp-specialized Gluon kernels for Hopper (GLM-5 report, DSA section;
DeepSeek-V3.2 section 2). Same math, inputs and results as the Triton first pass (`sparse_mla._bwd_kernel` with
DKV = 5, whose docstring states it): per query token t with its H = 64 heads as the MMA's M,

    P = exp(s - lse),  dP = dO kv[S_t, :C]^T,  dS = P (dP - Delta) scale,  dq = dS kv[S_t]

and dS, P stored (bf16) per (token, slot) for the key-gradient pass (`sparse_mla_dkv`), plus sum_h P per slot
when asked (the indexer loss's target). Two kernels:

- `scores_kernel`: q and dO stay resident in shared memory (137 KB), which leaves room for two stages of BN = 32
  key rows. The forward's loader partition (`key_loader`) fills them; two score warp groups take the blocks in
  turn, one stage each, so that one group's products (S and dP, wgmma over all BN keys) run while the other forms
  P and dS and writes their rows. A group releases its stage as soon as its products are formed.
- `query_gradient.dq_kernel`: dq from the stored dS, gathering the key rows again.

Why dq is not in the score kernel: its [64, C + R] fp32 accumulator needs eight warps' registers, and each stage was
then held from its gather through S, dP, dS and dq, a chain two stages could not hide. dq and dS / P are bitwise the
Triton first pass's. sum_h P is reduced within each warp in the store layout (not across warps through shared
memory, whose port the other group's products keep busy), so the head sums add the same fp32 values in another order
than the Triton pass (each order within (64 - 1) 2^-24 of the exact sum). docs/dsa.md gives its speed.

Runs where `plan.kernel_plan` says (sm_90, 64 heads, the separate key-gradient pass, C in {256, 512}, R in {32, 64})
for the inputs that `loader.inputs_fit`; `sparse_mla` takes the Triton first pass elsewhere.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                             warpgroup_mma_wait)

from pretrain.model.dsa.kernels.hopper.loader import LOADER_REGS, LOADER_WARPS, MAXNREG, key_loader, key_stages
from pretrain.model.dsa.kernels.hopper.query_gradient import query_gradient

SCORE_REGS = gl.constexpr(160)  # the second score warp group's register budget (a worker partition's)


@gluon.jit
def _scores(qlat_s, qrope_s, do_s, klat_s, krope_s, ready, empty, nv, lse_row, delta_row, part_row, s_pj, hs_row,
            sm_scale, qk_scale, H: gl.constexpr, C: gl.constexpr, R: gl.constexpr, BN: gl.constexpr,
            NBUF: gl.constexpr, FIRST: gl.constexpr, HEAD_SUMS: gl.constexpr, num_warps: gl.constexpr):
    """One score warp group: blocks FIRST, FIRST + NBUF, ... (stage FIRST). S and dP over all BN keys (wgmma), the
    stage released as soon as they are formed, then P, dS and their rows to global memory while the other warp
    group's products run."""
    SL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                 instr_shape=[16, BN, 16])
    # dS and P rows go out per (slot, head): heads contiguous, 8 per thread (16 bytes)
    PL: gl.constexpr = gl.BlockedLayout([8, 1], [H // 8, 32 // (H // 8)], [1, num_warps], [0, 1])
    h = gl.arange(0, H, layout=gl.SliceLayout(1, SL))
    lse2 = gl.load(lse_row + h) * 1.4426950408889634
    delta = gl.load(delta_row + h)
    zero = gl.zeros([H, BN], gl.float32, SL)
    n = gl.arange(0, BN, layout=gl.SliceLayout(0, SL))
    hp = gl.arange(0, H, layout=gl.SliceLayout(1, PL))
    np_ = gl.arange(0, BN, layout=gl.SliceLayout(0, PL))
    for i in range(FIRST, gl.cdiv(nv, BN), NBUF):
        mbarrier.wait(ready.index(FIRST), i // NBUF & 1)
        fence_async_shared()  # cp.async wrote the stage through the generic proxy; wgmma reads through the async one
        klat = klat_s.index(FIRST)
        s = warpgroup_mma(qlat_s, klat.permute((1, 0)), zero, use_acc=False, is_async=True)
        s = warpgroup_mma(qrope_s, krope_s.index(FIRST).permute((1, 0)), s, is_async=True)
        dp = warpgroup_mma(do_s, klat.permute((1, 0)), zero, use_acc=False, is_async=True)
        s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
        gl.thread_barrier()  # the warp group is done with the stage
        mbarrier.arrive(empty.index(FIRST), count=1)
        ok = i * BN + n < nv
        p = gl.where(ok[None, :], gl.exp2(s * qk_scale - lse2[:, None]), 0.0)
        dsc = (p * (dp - delta[:, None]) * sm_scale).to(gl.bfloat16)
        jp = i * BN + np_
        pm = (jp < nv)[None, :]
        prow = part_row + jp.to(gl.int64)[None, :] * s_pj + hp[:, None]
        gl.store(prow, gl.convert_layout(dsc, PL), mask=pm)
        # P in fp32 goes to the store layout once, where each warp holds all heads of its slots: sum_h P is then
        # a reduction within the warp. In the MMA's layout it crossed the four warps through shared memory, whose
        # port the other warp group's products keep busy (about 1,900 of the 3,000 cycles of this part per block).
        p = gl.convert_layout(p, PL)
        if HEAD_SUMS:  # the indexer loss's target, sum_h P_h(t, j)
            gl.store(hs_row + jp, gl.sum(p, 0), mask=jp < nv)
        gl.store(prow + H, p.to(gl.bfloat16), mask=pm)


@gluon.jit
def scores_kernel(q_ptr, kv_ptr, idx_ptr, nv_ptr, do_ptr, lse_ptr, delta_ptr, part_ptr, hs_ptr, S, r0, s_qb, s_qt,
                  s_qh, s_kb, s_kt, s_ib, s_it, s_dob, s_dot, s_doh, s_pb, s_pt, s_pj, s_hb, s_ht, sm_scale, qk_scale,
                  H: gl.constexpr, C: gl.constexpr, R: gl.constexpr, BN: gl.constexpr, HEAD_SUMS: gl.constexpr,
                  num_warps: gl.constexpr):
    """The first pass without dq: per token, dS and P rows (and sum_h P) from two score warp groups taking the
    blocks in turn (one shared-memory stage each) and the loader partition."""
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
    klat_s, krope_s, ready, empty = key_stages(C, R, BN, 2)
    fence_async_shared()  # q and dO were stored through the generic proxy; wgmma reads them through the async one
    nv = gl.load(nv_ptr + bid * S + t)
    idx_row = idx_ptr + bid * s_ib + t * s_it
    row = (bid * S + t) * H
    lse_row = lse_ptr + row
    delta_row = delta_ptr + row
    part_row = part_ptr + bid * s_pb + (t - r0) * s_pt
    hs_row = hs_ptr + bid * s_hb + t * s_ht
    gl.warp_specialize([  # the score warp groups take the blocks in turn, with one stage each
        (_scores, (qlat_s, qrope_s, do_s, klat_s, krope_s, ready, empty, nv, lse_row, delta_row, part_row, s_pj,
                   hs_row, sm_scale, qk_scale, H, C, R, BN, 2, 0, HEAD_SUMS, num_warps)),
        (_scores, (qlat_s, qrope_s, do_s, klat_s, krope_s, ready, empty, nv, lse_row, delta_row, part_row, s_pj,
                   hs_row, sm_scale, qk_scale, H, C, R, BN, 2, 1, HEAD_SUMS, num_warps)),
        (key_loader, (klat_s, krope_s, ready, empty, idx_row, kv_ptr + bid * s_kb, s_kt, nv, C, R, BN, 2)),
    ], [num_warps, LOADER_WARPS], [SCORE_REGS, LOADER_REGS])


def first_pass(q, kv, indices, nvalid, grad_out, lse, delta, dq, part, head_sums, r0: int, rows: int, scale: float,
               scale_log2: float, c: int, r: int, tiles=(32,), dq_tiles=(64, 2)):
    """The first pass over query rows r0 .. r0 + rows: `scores`, then dq rows (q's dtype, [b, s, h, c + r]
    contiguous) from the stored dS (`query_gradient`). tiles, dq_tiles: `DSAKernelTuning.first_pass_tiles`,
    `dq_tiles`."""
    scores(q, kv, indices, nvalid, grad_out, lse, delta, part, head_sums, r0, rows, scale, scale_log2, c, r, tiles)
    query_gradient(kv, indices, nvalid, dq, part, r0, rows, c, r, dq_tiles)


def scores(q, kv, indices, nvalid, grad_out, lse, delta, part, head_sums, r0: int, rows: int, scale: float,
           scale_log2: float, c: int, r: int, tiles=(32,)):
    """The score kernel over query rows r0 .. r0 + rows: part [b, rows', k, 2h] (dS, then P); head_sums [b, s, k]
    fp32 receives sum_h P at the valid slots when given (else None); tiles = (BN selected keys per block,): two
    stages (one per score warp group), with q and dO 217 KB."""
    b, s, h = q.shape[:3]
    hs = head_sums if head_sums is not None else lse
    hstr = head_sums.stride()[:2] if head_sums is not None else (0, 0)
    scores_kernel[(rows, b)](
        q, kv, indices, nvalid, grad_out, lse, delta, part, hs, s, r0,
        q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), indices.stride(0), indices.stride(1),
        grad_out.stride(0), grad_out.stride(1), grad_out.stride(2), part.stride(0), part.stride(1), part.stride(2),
        hstr[0], hstr[1], scale, scale_log2, H=h, C=c, R=r, BN=tiles[0], HEAD_SUMS=head_sums is not None,
        num_warps=4, maxnreg=MAXNREG)
