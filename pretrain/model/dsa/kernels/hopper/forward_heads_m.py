"""The sparse MLA forward at 64 heads per rank as a warp-specialized Gluon kernel for Hopper (GLM-5 report, DSA
section; DeepSeek-V3.2 section 2). Same math, arguments and results as the Triton forward (`sparse_mla._fwd_kernel`,
whose docstring states it): per query token t with its H = 64 heads as the MMA's M,

    s_h(t, j) = scale * q_h(t) . kv[S_t[j]],    o_h(t) = sum_j softmax_j(s_h(t, .)) kv[S_t[j], :C],   lse_h(t)

Why a second kernel: the Triton forward is bound by its MMA pipeline, because the same eight warps gather each block
of selected keys (cp.async with per-row addresses) and multiply it. Here the jobs are split (warp specialization,
`gl.warp_specialize`): the loader partition (`loader.key_loader`) gathers each block of BN selected key rows into one
of NBUF shared-memory stages; the eight consumer warps, two warp groups each holding half of the [64, C] fp32 output
(wgmma with warps [4, 2]), form S = q k^T over the latent and rope parts, the online softmax (exp2 domain), P in
shared memory and O += P V, and release the stage. q stays resident in shared memory; 229,924 bytes in all, one
program per SM. docs/dsa.md gives its speed against the Triton forward. No atomics: deterministic like the Triton
one. Runs where `plan.kernel_plan` says (sm_90, 64 heads, C in {256, 512}, R in {32, 64}) for the inputs that
`loader.inputs_fit`.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                             warpgroup_mma_wait)

from pretrain.model.dsa.kernels.hopper.loader import (LOADER_REGS, LOADER_WARPS, MAXNREG, forward_epilogue,
                                                      key_loader, token_setup)


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
    forward_epilogue(acc, m_i, l_i, o_row, s_oh, lse_row, H, C, False, num_warps)


@gluon.jit
def fwd_kernel(q_ptr, kv_ptr, idx_ptr, nv_ptr, o_ptr, lse_ptr, S, s_qb, s_qt, s_qh, s_kb, s_kt, s_ib, s_it,
               s_ob, s_ot, s_oh, qk_scale, H: gl.constexpr, C: gl.constexpr, R: gl.constexpr, BN: gl.constexpr,
               NBUF: gl.constexpr, num_warps: gl.constexpr):
    t, bid, qlat_s, qrope_s, klat_s, krope_s, ready, empty, nv, idx_row = token_setup(
        q_ptr, idx_ptr, nv_ptr, S, s_qb, s_qt, s_qh, s_ib, s_it, H, C, R, BN, NBUF, num_warps)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [H, BN], gl.NVMMASharedLayout.get_default_for([H, BN], gl.bfloat16))
    gl.warp_specialize([
        (_consumer, (qlat_s, qrope_s, klat_s, krope_s, p_s, ready, empty, nv, qk_scale, o_ptr + bid * s_ob + t * s_ot,
                     s_oh, lse_ptr + (bid * S + t) * H, H, C, BN, NBUF, num_warps)),
        (key_loader, (klat_s, krope_s, ready, empty, idx_row, kv_ptr + bid * s_kb, s_kt, nv, C, R, BN, NBUF)),
    ], [LOADER_WARPS], [LOADER_REGS])


def forward(q, kv, indices, nvalid, scale_log2: float, c: int, r: int, tiles=(64, 2)):
    """(out [b, s, h, c] in q's dtype, lse [b, s, h] fp32) as `sparse_mla.sparse_mla_forward`, for the shapes the
    plan gives this kernel; indices int32 [b, s, K] with each row's nvalid valid slots first; scale_log2 = scale *
    log2(e); tiles = (BN keys per block, NBUF stages): `DSAKernelTuning.gluon_forward_tiles`."""
    b, s, h = q.shape[:3]
    bn, nbuf = tiles
    out = torch.empty(b, s, h, c, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, s, h, dtype=torch.float32, device=q.device)
    fwd_kernel[(s, b)](q, kv, indices, nvalid, out, lse, s, q.stride(0), q.stride(1), q.stride(2), kv.stride(0),
                       kv.stride(1), indices.stride(0), indices.stride(1), out.stride(0), out.stride(1),
                       out.stride(2), scale_log2, H=h, C=c, R=r, BN=bn, NBUF=nbuf, num_warps=8, maxnreg=MAXNREG)
    return out, lse
