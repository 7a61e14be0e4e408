"""What the Hopper Gluon kernels share (GLM-5 report, DSA section; DeepSeek-V3.2 section 2): a loader partition that
gathers a token's selected key rows into shared-memory stages (`key_loader`), the forward programs' setup (the query
resident in shared memory, the stages and their mbarriers: `token_setup`) and their epilogue (o = acc / l and
lse = m + log l: `forward_epilogue`), and the tensor checks they need (`inputs_fit`).

LOADER_WARPS warps gather each block of BN selected key rows into one of NBUF stages by cp.async with per-row
addresses and signal it through an mbarrier (one cp.async arrival per loader thread); the consumer partition
releases the stage through a second mbarrier.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

LOADER_WARPS = gl.constexpr(4)
LOADER_REGS = gl.constexpr(96)
MAXNREG = 168  # (8 consumer + 4 loader warps) x 32 x 168 registers fit the register file


def inputs_fit(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether q and kv can take the Gluon kernels: CUDA bf16 tensors, kv rows 16-byte aligned (the loader's cp.async
    copies 16-byte pieces of each key row). The shapes and the GPU are `plan.kernel_plan`'s part."""
    return (q.is_cuda and q.dtype == torch.bfloat16 and kv.dtype == torch.bfloat16 and kv.stride(1) % 8 == 0
            and kv.data_ptr() % 16 == 0)


@gluon.jit
def key_stages(C: gl.constexpr, R: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr):
    """The NBUF shared-memory stages of BN key rows (latent [BN, C], rope [BN, R]) that a loader partition fills
    (`gather_block`), and their ready / empty mbarriers, initialized: (klat_s, krope_s, ready, empty)."""
    klat_s = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BN, C],
                                       gl.NVMMASharedLayout.get_default_for([BN, C], gl.bfloat16))
    krope_s = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BN, R],
                                        gl.NVMMASharedLayout.get_default_for([BN, R], gl.bfloat16))
    ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(NBUF):
        mbarrier.init(ready.index(b), count=LOADER_WARPS * 32)  # one cp.async arrival per loader thread
        mbarrier.init(empty.index(b), count=1)
    return klat_s, krope_s, ready, empty


@gluon.jit
def resident_query(qb, s_qh, H: gl.constexpr, C: gl.constexpr, R: gl.constexpr, num_warps: gl.constexpr):
    """A token's H query rows (latent [H, C] and rope [H, R] parts, head stride s_qh) loaded into shared memory, where
    they stay for the whole selection: (qlat_s, qrope_s). The caller fences before wgmma reads them."""
    QL: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    QR: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (R // 8), R // 8], [num_warps, 1], [1, 0])
    hq = gl.arange(0, H, layout=gl.SliceLayout(1, QL))
    cq = gl.arange(0, C, layout=gl.SliceLayout(0, QL))
    hr = gl.arange(0, H, layout=gl.SliceLayout(1, QR))
    cr = C + gl.arange(0, R, layout=gl.SliceLayout(0, QR))
    qlat_s = gl.allocate_shared_memory(gl.bfloat16, [H, C], gl.NVMMASharedLayout.get_default_for([H, C], gl.bfloat16),
                                       gl.load(qb + hq[:, None] * s_qh + cq[None, :]))
    qrope_s = gl.allocate_shared_memory(gl.bfloat16, [H, R],
                                        gl.NVMMASharedLayout.get_default_for([H, R], gl.bfloat16),
                                        gl.load(qb + hr[:, None] * s_qh + cr[None, :]))
    return qlat_s, qrope_s


@gluon.jit
def token_setup(q_ptr, idx_ptr, nv_ptr, S, s_qb, s_qt, s_qh, s_ib, s_it, H: gl.constexpr, C: gl.constexpr,
                R: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr, num_warps: gl.constexpr):
    """What a forward program (token t = program 0, batch bid = program 1) sets up before its partitions start: the
    resident query, the key stages and their mbarriers, the token's valid-slot count and its index row:
    (t, bid, qlat_s, qrope_s, klat_s, krope_s, ready, empty, nv, idx_row)."""
    t = gl.program_id(0).to(gl.int64)
    bid = gl.program_id(1).to(gl.int64)
    qlat_s, qrope_s = resident_query(q_ptr + bid * s_qb + t * s_qt, s_qh, H, C, R, num_warps)
    klat_s, krope_s, ready, empty = key_stages(C, R, BN, NBUF)
    fence_async_shared()  # q was stored through the generic proxy; wgmma reads it through the async one
    nv = gl.load(nv_ptr + bid * S + t)
    return t, bid, qlat_s, qrope_s, klat_s, krope_s, ready, empty, nv, idx_ptr + bid * s_ib + t * s_it


@gluon.jit
def forward_epilogue(acc, m_i, l_sum, o_row, s_oh, lse_row, H: gl.constexpr, C: gl.constexpr,
                     KEYS_M: gl.constexpr, num_warps: gl.constexpr):
    """The end of a forward program: o_h = acc_h / l_h (0 where the token has no key) stored in o's dtype, and
    lse_h = (m_h + log2 l_h) ln 2 (fp32, -inf where no key). acc is [H, C] with heads as the MMA's M, or [C, H]
    with KEYS_M (then o is stored along C through a blocked layout, coalesced); m_i and l_sum are [H], in a slice of
    the score layout."""
    l_safe = gl.where(l_sum > 0, l_sum, 1.0)
    OL: gl.constexpr = acc.type.layout
    if KEYS_M:
        out = (acc / l_safe[None, :]).to(o_row.dtype.element_ty)
        # stored along C (coalesced): the accumulator's layout holds each thread's values along H
        OB: gl.constexpr = gl.BlockedLayout([8, 1], [32, 1], [num_warps, 1], [0, 1])
        out = gl.convert_layout(out, OB)
        c = gl.arange(0, C, layout=gl.SliceLayout(1, OB))
        h = gl.arange(0, H, layout=gl.SliceLayout(0, OB))
        gl.store(o_row + h[None, :] * s_oh + c[:, None], out)
    else:
        out = acc / gl.convert_layout(l_safe, gl.SliceLayout(1, OL))[:, None]
        h = gl.arange(0, H, layout=gl.SliceLayout(1, OL))
        c = gl.arange(0, C, layout=gl.SliceLayout(0, OL))
        gl.store(o_row + h[:, None] * s_oh + c[None, :], out.to(o_row.dtype.element_ty))
    hl = gl.arange(0, H, layout=l_sum.type.layout)
    gl.store(lse_row + hl, gl.where(l_sum > 0, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf")))


@gluon.jit
def block_rows(idx_row, i, nv, s_kt, BN: gl.constexpr, R: gl.constexpr, num_warps: gl.constexpr):
    """The kv row offsets of block i's BN selected keys, in the layouts `gather_block` copies the latent and rope
    parts with (0 past nv). Loaders fetch them a block ahead, so that the index load's latency is not on the
    path from a stage's release to its next gather."""
    LL: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    LR: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (R // 8), R // 8], [num_warps, 1], [1, 0])
    jl = i * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, LL))
    jr = i * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, LR))
    return (gl.load(idx_row + jl, mask=jl < nv, other=0).to(gl.int64) * s_kt,
            gl.load(idx_row + jr, mask=jr < nv, other=0).to(gl.int64) * s_kt)


@gluon.jit
def gather_block(klat_s, krope_s, ready, i, rows, rows_r, kv_base, nv, C: gl.constexpr, R: gl.constexpr,
                 BN: gl.constexpr, NBUF: gl.constexpr, num_warps: gl.constexpr):
    """Block i of a token's selection (BN key rows at `block_rows`' offsets, latent and rope parts) gathered by this
    partition's num_warps warps into stage i % NBUF by cp.async; each thread arrives on ready[stage] when its copies
    land. Rows past nv are zero-filled."""
    LL: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    LR: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (R // 8), R // 8], [num_warps, 1], [1, 0])
    st = i % NBUF
    cl = gl.arange(0, C, layout=gl.SliceLayout(0, LL))
    cr = C + gl.arange(0, R, layout=gl.SliceLayout(0, LR))
    jl = i * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, LL))
    async_copy.async_copy_global_to_shared(klat_s.index(st), kv_base + rows[:, None] + cl[None, :],
                                           mask=(jl < nv)[:, None])
    jr = i * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, LR))
    async_copy.async_copy_global_to_shared(krope_s.index(st), kv_base + rows_r[:, None] + cr[None, :],
                                           mask=(jr < nv)[:, None])
    async_copy.mbarrier_arrive(ready.index(st), increment_count=False)


@gluon.jit
def key_loader(klat_s, krope_s, ready, empty, idx_row, kv_base, s_kt, nv, C: gl.constexpr, R: gl.constexpr,
               BN: gl.constexpr, NBUF: gl.constexpr):
    """The loader partition (LOADER_WARPS warps): gathers block i of a token's selection into stage i % NBUF
    (`gather_block`) once the consumers released it, with the next block's indices already loaded."""
    rows, rows_r = block_rows(idx_row, 0, nv, s_kt, BN, R, LOADER_WARPS)
    for i in range(gl.cdiv(nv, BN)):
        mbarrier.wait(empty.index(i % NBUF), (i // NBUF & 1) ^ 1)
        gather_block(klat_s, krope_s, ready, i, rows, rows_r, kv_base, nv, C, R, BN, NBUF, LOADER_WARPS)
        rows, rows_r = block_rows(idx_row, i + 1, nv, s_kt, BN, R, LOADER_WARPS)


__all__ = ["LOADER_REGS", "LOADER_WARPS", "MAXNREG", "block_rows", "forward_epilogue", "gather_block", "inputs_fit",
           "key_loader", "key_stages", "resident_query", "token_setup"]
