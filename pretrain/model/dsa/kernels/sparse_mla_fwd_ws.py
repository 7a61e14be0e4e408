"""The sparse MLA forward as a warp-specialized Gluon kernel for Hopper (GLM-5 report, DSA section; DeepSeek-V3.2
section 2). Same math, arguments and results as the Triton forward (`sparse_mla._fwd_kernel`, whose docstring
states it): per query token t with its H = 64 heads as the MMA's M,

    s_h(t, j) = scale * q_h(t) . kv[S_t[j]],    o_h(t) = sum_j softmax_j(s_h(t, .)) kv[S_t[j], :C],   lse_h(t)

Why a second kernel: the Triton forward runs at 230-256 TFLOP/s at GLM-5's shapes, bound by its MMA pipeline,
because the same eight warps gather each block of selected keys (cp.async with per-row addresses) and multiply
it. Here the jobs are split (warp specialization, `gl.warp_specialize`): LOADER_WARPS warps gather each block of
BN selected key rows into one of NBUF shared-memory stages and signal it through an mbarrier (one cp.async arrival
per loader thread); the eight consumer warps, two warp groups each holding half of the [64, C] fp32 output (wgmma
with warps [4, 2]), form S = q k^T over the latent and rope parts, the online softmax (exp2 domain), P in shared
memory and O += P V, and release the stage. q stays resident in shared memory; 229,924 bytes in all, one program
per SM. Measured on an H200 (benchmarks/results/README.md, "The sparse MLA forward, warp-specialized"): 1.61-1.71x
the Triton forward at 4K-32K tokens, 408-460 TFLOP/s (380 at 128K).

Runs where `supported` says (CUDA sm_90, bf16, 64 heads, C in {256, 512}, R in {32, 64}); `sparse_mla` takes the
Triton forward elsewhere (on other GPUs it says so once in the log). No atomics: deterministic like the Triton one.
"""

from __future__ import annotations

import functools
import logging

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                             warpgroup_mma_wait)

log = logging.getLogger(__name__)

CONFIG = (64, 2)  # (BN selected keys per block, NBUF stages): the H200 probe's best (32 x 3 ran at the Triton speed)
ENABLED = True  # False: the Triton forward everywhere (`benchmarks/dsa_heads_sweep.py --ws off,on` times both)


LOADER_WARPS = gl.constexpr(4)
LOADER_REGS = gl.constexpr(96)
MAXNREG = 168  # (8 consumer + 4 loader warps) x 32 x 168 registers fit the register file


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


def forward(q, kv, indices, nvalid, scale_log2: float, c: int, r: int):
    """(out [b, s, h, c] in q's dtype, lse [b, s, h] fp32) as `sparse_mla.sparse_mla_forward`, for the shapes
    `supported` accepts; indices int32 [b, s, K] with each row's nvalid valid slots first; scale_log2 = scale *
    log2(e)."""
    b, s, h = q.shape[:3]
    bn, nbuf = CONFIG
    out = torch.empty(b, s, h, c, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, s, h, dtype=torch.float32, device=q.device)
    fwd_kernel[(s, b)](q, kv, indices, nvalid, out, lse, s, q.stride(0), q.stride(1), q.stride(2), kv.stride(0),
                        kv.stride(1), indices.stride(0), indices.stride(1), out.stride(0), out.stride(1),
                        out.stride(2), scale_log2, H=h, C=c, R=r, BN=bn, NBUF=nbuf, num_warps=8, maxnreg=MAXNREG)
    return out, lse


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


_SAID = set()


def supported(q: torch.Tensor, kv: torch.Tensor, h: int, c: int, r: int, enabled=None, heads=(64,)) -> bool:
    """Whether this kernel runs the forward: ENABLED (or `enabled`), CUDA sm_90, bf16 q and kv, h = 64 (or in
    `heads`: the other Hopper kernels share these checks), c in {256, 512}, r in {32, 64}, kv rows 16-byte aligned. A
    CUDA GPU of another generation gets the Triton kernels and one log line saying so."""
    if not ((ENABLED if enabled is None else enabled) and q.is_cuda and q.dtype == torch.bfloat16
            and kv.dtype == torch.bfloat16):
        return False
    if h not in heads or c not in (256, 512) or r not in (32, 64):
        return False
    if kv.stride(1) % 8 or kv.data_ptr() % 16:  # the loader's cp.async copies 16-byte pieces of each key row
        return False
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    major = _capability(index)[0]
    if major != 9:
        if major not in _SAID:
            _SAID.add(major)
            log.info("DSA sparse attention: the warp-specialized kernels need sm_90 (this GPU is sm_%d0); "
                     "using the Triton ones", major)
        return False
    return True
