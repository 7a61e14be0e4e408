"""The sparse MLA forward at 8-32 heads per rank as a warp-specialized Gluon kernel for Hopper, the selected keys as
the MMA's M (GLM-5 report, DSA section; DeepSeek-V3.2 section 2). Same math, arguments and results as the Triton
forward (`sparse_mla._fwd_kernel`):

    s_h(t, j) = scale * q_h(t) . kv[S_t[j]],    o_h(t) = sum_j softmax_j(s_h(t, .)) kv[S_t[j], :C],   lse_h(t)

computed transposed, per block of BN selected keys of token t, so that H = 8-32 heads need no padding to the 64 rows
a warp-group MMA (wgmma) takes as M:

    S^T [BN, H] = K_lat Q_lat^T + K_rope Q_rope^T          (A: the gathered key rows, B: q, both in shared memory)
    O^T [C, H] += K_lat^T P^T                               (A: the same key rows, transposed; B: P^T in shared memory)

with the online softmax along the keys (a max across the consumer's four warps per block; the row sums kept per
thread and reduced once at the end). The loader partition is the 64-head forward's (`loader.key_loader`).

Why: with few heads the Triton forward's M = H rows and its [H, C] fp32 accumulator in four warps are its bound, not
the gathers. docs/dsa.md gives its speed against the Triton forward. Runs where `plan.kernel_plan` says (sm_90,
8 / 16 / 32 heads, C in {256, 512}, R in {32, 64}) for the inputs that `loader.inputs_fit`.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                             warpgroup_mma_wait)

from pretrain.model.dsa.kernels.hopper.loader import (LOADER_REGS, LOADER_WARPS, MAXNREG, forward_epilogue,
                                                      key_loader, token_setup)

CONSUMER_WARPS = 4


@gluon.jit
def _consumer(qlat_s, qrope_s, klat_s, krope_s, pt_s, ready, empty, nv, qk_scale, o_row, s_oh, lse_row,
              H: gl.constexpr, C: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr, num_warps: gl.constexpr):
    SL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                 instr_shape=[16, H, 16])
    m_i = gl.full([H], float("-inf"), gl.float32, gl.SliceLayout(0, SL))
    l_i = gl.zeros([BN, H], gl.float32, SL)  # per-thread partial row sums, reduced after the loop
    acc = gl.zeros([C, H], gl.float32, SL)
    zero = gl.zeros([BN, H], gl.float32, SL)
    n = gl.arange(0, BN, layout=gl.SliceLayout(1, SL))
    for i in range(gl.cdiv(nv, BN)):
        st = i % NBUF
        mbarrier.wait(ready.index(st), i // NBUF & 1)
        fence_async_shared()  # cp.async wrote the stage through the generic proxy; wgmma reads through the async one
        s = warpgroup_mma(klat_s.index(st), qlat_s.permute((1, 0)), zero, use_acc=False, is_async=True)
        s = warpgroup_mma(krope_s.index(st), qrope_s.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        s = gl.where((i * BN + n < nv)[:, None], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[None, :])
        l_i = l_i * alpha[None, :] + p
        m_i = m_new
        acc = acc * alpha[None, :]
        pt_s.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()  # every warp's rows of P^T are in shared memory before the warp group multiplies
        acc = warpgroup_mma(klat_s.index(st).permute((1, 0)), pt_s, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        gl.thread_barrier()  # done with the stage and with P^T
        mbarrier.arrive(empty.index(st), count=1)
    forward_epilogue(acc, m_i, gl.sum(l_i, 0), o_row, s_oh, lse_row, H, C, True, num_warps)


@gluon.jit
def fwd_kernel(q_ptr, kv_ptr, idx_ptr, nv_ptr, o_ptr, lse_ptr, S, s_qb, s_qt, s_qh, s_kb, s_kt, s_ib, s_it,
               s_ob, s_ot, s_oh, qk_scale, H: gl.constexpr, C: gl.constexpr, R: gl.constexpr, BN: gl.constexpr,
               NBUF: gl.constexpr, num_warps: gl.constexpr):
    t, bid, qlat_s, qrope_s, klat_s, krope_s, ready, empty, nv, idx_row = token_setup(
        q_ptr, idx_ptr, nv_ptr, S, s_qb, s_qt, s_qh, s_ib, s_it, H, C, R, BN, NBUF, num_warps)
    pt_s = gl.allocate_shared_memory(gl.bfloat16, [BN, H], gl.NVMMASharedLayout.get_default_for([BN, H], gl.bfloat16))
    gl.warp_specialize([
        (_consumer, (qlat_s, qrope_s, klat_s, krope_s, pt_s, ready, empty, nv, qk_scale,
                     o_ptr + bid * s_ob + t * s_ot, s_oh, lse_ptr + (bid * S + t) * H, H, C, BN, NBUF, num_warps)),
        (key_loader, (klat_s, krope_s, ready, empty, idx_row, kv_ptr + bid * s_kb, s_kt, nv, C, R, BN, NBUF)),
    ], [LOADER_WARPS], [LOADER_REGS])


def forward(q, kv, indices, nvalid, scale_log2: float, c: int, r: int, tiles=(64, 2)):
    """(out [b, s, h, c] in q's dtype, lse [b, s, h] fp32) as `sparse_mla.sparse_mla_forward`, for the shapes the
    plan gives this kernel; indices int32 [b, s, K] with each row's nvalid valid slots first; tiles = (BN keys per
    block: wgmma's M, NBUF stages; 176 KB of shared memory at C = 512): `DSAKernelTuning.keys_m_tiles`."""
    b, s, h = q.shape[:3]
    bn, nbuf = tiles
    out = torch.empty(b, s, h, c, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, s, h, dtype=torch.float32, device=q.device)
    fwd_kernel[(s, b)](q, kv, indices, nvalid, out, lse, s, q.stride(0), q.stride(1), q.stride(2), kv.stride(0),
                       kv.stride(1), indices.stride(0), indices.stride(1), out.stride(0), out.stride(1),
                       out.stride(2), scale_log2, H=h, C=c, R=r, BN=bn, NBUF=nbuf, num_warps=CONSUMER_WARPS,
                       maxnreg=MAXNREG)
    return out, lse
