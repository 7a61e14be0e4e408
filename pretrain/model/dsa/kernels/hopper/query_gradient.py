"""The sparse MLA backward's query gradient as a warp-specialized Gluon kernel for Hopper (GLM-5 report, DSA
section; DeepSeek-V3.2 section 2): per query token t with its H = 64 heads as the MMA's M,

    dq(t) = sum_j dS(t, j) kv[S_t[j]]        (dS: [H, K] bf16, stored by the first pass per (token, slot))

Why its own pass: the first pass (`first_pass.scores_kernel`) keeps q and dO resident (137 KB of shared
memory), which leaves room for two key stages only; with dq in it as well, each stage was held from its gather
through S, dP and dS to dq's product, a chain the two stages could not hide. Here a loader partition gathers
each block of BN selected key rows with its dS rows (`part`, [slot, head]) into one of NBUF stages (the forward's
`gather_block`, the next block's indices loaded ahead), and eight consumer warps, two warp groups each holding
half of dq's columns, multiply (wgmma, A = dS^T's view, MN-major). No atomics: deterministic. Runs with
`first_pass`.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                             warpgroup_mma_wait)

from pretrain.model.dsa.kernels.hopper.loader import (LOADER_REGS, LOADER_WARPS, MAXNREG, block_rows, gather_block,
                                                      key_stages)


@gluon.jit
def _loader(klat_s, krope_s, ds_s, ready, empty, idx_row, kv_base, s_kt, part_row, s_pj, nv, H: gl.constexpr,
            C: gl.constexpr, R: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr):
    DLD: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (H // 8), H // 8], [LOADER_WARPS, 1], [1, 0])
    hd = gl.arange(0, H, layout=gl.SliceLayout(0, DLD))
    rows, rows_r = block_rows(idx_row, 0, nv, s_kt, BN, R, LOADER_WARPS)
    for i in range(gl.cdiv(nv, BN)):
        st = i % NBUF
        mbarrier.wait(empty.index(st), (i // NBUF & 1) ^ 1)
        jd = i * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, DLD))
        async_copy.async_copy_global_to_shared(ds_s.index(st), part_row + jd.to(gl.int64)[:, None] * s_pj
                                               + hd[None, :], mask=(jd < nv)[:, None])
        # the stage's key rows; its arrival on ready[st] also covers the dS copies above
        gather_block(klat_s, krope_s, ready, i, rows, rows_r, kv_base, nv, C, R, BN, NBUF, LOADER_WARPS)
        rows, rows_r = block_rows(idx_row, i + 1, nv, s_kt, BN, R, LOADER_WARPS)


@gluon.jit
def _consumer(klat_s, krope_s, ds_s, ready, empty, nv, dq_row, H: gl.constexpr, C: gl.constexpr, R: gl.constexpr,
              BN: gl.constexpr, NBUF: gl.constexpr, num_warps: gl.constexpr):
    WN: gl.constexpr = num_warps // 4
    DL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WN], instr_shape=[16, C // WN, 16])
    RL: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WN], instr_shape=[16, R // WN, 16])
    dq_lat = gl.zeros([H, C], gl.float32, DL)
    dq_rope = gl.zeros([H, R], gl.float32, RL)
    for i in range(gl.cdiv(nv, BN)):
        st = i % NBUF
        mbarrier.wait(ready.index(st), i // NBUF & 1)
        fence_async_shared()  # cp.async wrote the stage through the generic proxy; wgmma reads through the async one
        ds = ds_s.index(st).permute((1, 0))
        dq_lat = warpgroup_mma(ds, klat_s.index(st), dq_lat, is_async=True)
        dq_rope = warpgroup_mma(ds, krope_s.index(st), dq_rope, is_async=True)
        dq_lat, dq_rope = warpgroup_mma_wait(num_outstanding=0, deps=(dq_lat, dq_rope))
        gl.thread_barrier()  # both warp groups are done with the stage
        mbarrier.arrive(empty.index(st), count=1)
    hd = gl.arange(0, H, layout=gl.SliceLayout(1, DL))
    cd = gl.arange(0, C, layout=gl.SliceLayout(0, DL))
    gl.store(dq_row + hd[:, None] * (C + R) + cd[None, :], dq_lat.to(dq_row.dtype.element_ty))
    hr = gl.arange(0, H, layout=gl.SliceLayout(1, RL))
    cr = C + gl.arange(0, R, layout=gl.SliceLayout(0, RL))
    gl.store(dq_row + hr[:, None] * (C + R) + cr[None, :], dq_rope.to(dq_row.dtype.element_ty))


@gluon.jit
def dq_kernel(kv_ptr, idx_ptr, nv_ptr, dq_ptr, part_ptr, S, r0, s_kb, s_kt, s_ib, s_it, s_pb, s_pt, s_pj,
              H: gl.constexpr, C: gl.constexpr, R: gl.constexpr, BN: gl.constexpr, NBUF: gl.constexpr,
              num_warps: gl.constexpr):
    t = r0 + gl.program_id(0).to(gl.int64)
    bid = gl.program_id(1).to(gl.int64)
    klat_s, krope_s, ready, empty = key_stages(C, R, BN, NBUF)
    ds_s = gl.allocate_shared_memory(gl.bfloat16, [NBUF, BN, H],
                                     gl.NVMMASharedLayout.get_default_for([BN, H], gl.bfloat16))
    nv = gl.load(nv_ptr + bid * S + t)
    gl.warp_specialize([
        (_consumer, (klat_s, krope_s, ds_s, ready, empty, nv, dq_ptr + (bid * S + t) * H * (C + R), H, C, R, BN,
                     NBUF, num_warps)),
        (_loader, (klat_s, krope_s, ds_s, ready, empty, idx_ptr + bid * s_ib + t * s_it, kv_ptr + bid * s_kb, s_kt,
                   part_ptr + bid * s_pb + (t - r0) * s_pt, s_pj, nv, H, C, R, BN, NBUF)),
    ], [LOADER_WARPS], [LOADER_REGS])


def query_gradient(kv, indices, nvalid, dq, part, r0: int, rows: int, c: int, r: int, tiles=(64, 2)):
    """dq rows r0 .. r0 + rows ([b, s, h, c + r] contiguous, written) from part [b, rows', k, 2h] (dS first);
    tiles = (BN selected keys per block, NBUF stages): `DSAKernelTuning.dq_tiles`."""
    b, s, h = dq.shape[:3]
    bn, nbuf = tiles
    dq_kernel[(rows, b)](kv, indices, nvalid, dq, part, s, r0, kv.stride(0), kv.stride(1), indices.stride(0),
                         indices.stride(1), part.stride(0), part.stride(1), part.stride(2), H=h, C=c, R=r, BN=bn,
                         NBUF=nbuf, num_warps=8, maxnreg=MAXNREG)
