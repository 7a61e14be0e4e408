"""Triton sparse MLA attention in absorbed form, forward and backward (GLM-5 report, DSA section;
DeepSeek-V3.2 section 2). The math and the reference are `pretrain.model.dsa.sparse_mla`:

    s_h(t, j) = scale * q_h(t) . kv[S_t[j]]          q: [latent C ; rope R] = 512 + 64 dims at GLM-5
    o_h(t)    = sum_j softmax_j(s_h(t, .)) kv[S_t[j], :C],   lse_h(t) saved (fp32)

One program per query token: its H heads form the MMA's M dimension (all heads share S_t), the
token's selected keys are gathered BN at a time, with an online softmax in fp32 (exp2 domain). On Hopper the forward
and, at 64 heads, the backward's first pass run the Gluon kernels of `kernels.hopper` instead (same results; which
kernel runs where is `plan.kernel_plan`'s decision, docs/dsa.md gives their speeds).

Backward per token recomputes P = exp(s - lse), dP = dO kv[:, :C]^T, dS = P (dP - Delta) scale, with
Delta = rowsum(dO * O), and forms dq = dS kv and the key/value gradient of each gathered block,
dkv[S_t[j]] += dS^T q  (+ P^T dO on the latent part). Keys are shared between tokens, so that sum
runs either through fp32 atomics (fast, order-dependent rounding) or, with `deterministic=True`,
through per-(token, slot) contributions reduced per key in a fixed order (`segment_sum`). From 32
heads the atomic sum comes from a second pass over dS and P stored per (token, slot)
(`sparse_mla_dkv`); with fewer heads this kernel forms it next to dq, and past ~16K keys it walks the keys in
partitions small enough for L2 (`plan.key_partitions`), one launch per partition over all query rows, each token
taking the run of its ascending selection inside the partition.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pretrain.model.dsa.kernels.atomics import add_rows, reduction_mode
from pretrain.model.dsa.kernels.common import (
    LOG2E, block_scores, capability, dot_precision, gather_block, load_query, mla_shapes, pow2, slot_range,
)
from pretrain.model.dsa.kernels.packed_indices import valid_counts
from pretrain.model.dsa.kernels.plan import (GLUON, GLUON_HEADS_AS_M, GLUON_KEYS_AS_M, TRITON, kernel_plan,
                                            key_partitions)
from pretrain.model.dsa.kernels.segment_sum import scatter_rows_deterministic
from pretrain.model.dsa.kernels.sparse_mla_dkv import empty_scratch, key_gradient, scratch_rows
from pretrain.model.dsa.kernels.tuning import DEFAULT_TUNING, DSAKernelTuning, KeyGradient

@triton.jit
def _fwd_kernel(q_ptr, kv_ptr, idx_ptr, nv_ptr, o_ptr, lse_ptr, S, H,
                s_qb, s_qt, s_qh, s_kb, s_kt, s_ib, s_it, s_ob, s_ot, s_oh, qk_scale,
                C: tl.constexpr, R: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr,
                BN: tl.constexpr, PREC: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    bid = tl.program_id(1).to(tl.int64)
    h = tl.arange(0, BH)
    c = tl.arange(0, BC)
    r = tl.arange(0, BR)
    q_lat, q_rope = load_query(q_ptr + bid * s_qb + t * s_qt + h[:, None] * s_qh, h, c, r, H, C, R)
    m_i = tl.full((BH,), float("-inf"), tl.float32)
    l_i = tl.zeros((BH,), tl.float32)
    acc = tl.zeros((BH, BC), tl.float32)
    nv = tl.load(nv_ptr + bid * S + t)
    for j0 in range(0, nv, BN):
        j, idx, ok, k_lat, k_rope = gather_block(idx_ptr + bid * s_ib + t * s_it, kv_ptr + bid * s_kb, j0, nv, s_kt,
                                                  c, r, C, R, BN)
        s = block_scores(q_lat, q_rope, k_lat, k_rope, PREC)
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(k_lat.dtype), k_lat, acc, input_precision=PREC)
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    ob = o_ptr + bid * s_ob + t * s_ot
    tl.store(ob + h[:, None] * s_oh + c[None, :], out.to(o_ptr.dtype.element_ty),
             mask=(h[:, None] < H) & (c[None, :] < C))
    lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(lse_ptr + (bid * S + t) * H + h, lse, mask=h < H)


@triton.jit
def _bwd_kernel(q_ptr, kv_ptr, idx_ptr, nv_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr, part_ptr, hs_ptr,
                dq32_ptr, S, H, T, r0, k_lo, k_hi, first, last, s_qb, s_qt, s_qh, s_kb, s_kt, s_ib, s_it,
                s_dob, s_dot, s_doh,
                s_pb, s_pt, s_pj, s_hb, s_ht, s_db, s_dt, sm_scale, qk_scale,
                C: tl.constexpr, R: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr,
                BN: tl.constexpr, CC: tl.constexpr, PREC: tl.constexpr, DKV: tl.constexpr,
                HEAD_SUMS: tl.constexpr, PART: tl.constexpr, RED: tl.constexpr):
    # q and dO stay resident as the A operands of S = q K^T and dP = dO V^T; the key-side products
    # dS^T q and P^T dO re-read q / dO in CC-wide column slices (L1 / L2 hits), which keeps shared
    # memory to one copy of each.
    t = r0 + tl.program_id(0).to(tl.int64)
    bid = tl.program_id(1).to(tl.int64)
    h = tl.arange(0, BH)
    c = tl.arange(0, BC)
    r = tl.arange(0, BR)
    cc = tl.arange(0, CC)
    nv = tl.load(nv_ptr + bid * S + t)
    if PART:  # only the slots whose keys lie in [k_lo, k_hi) (key_partitions); no loads where there are none
        j_lo, j_hi = slot_range(idx_ptr + bid * s_ib + t * s_it, nv, k_lo, k_hi, 256)
        hl = tl.where(j_hi > j_lo, H, 0)
    else:
        j_lo, j_hi = 0, nv
        hl = H
    hm = h < hl
    qb = q_ptr + bid * s_qb + t * s_qt + h[:, None] * s_qh
    dob = do_ptr + bid * s_dob + t * s_dot + h[:, None] * s_doh
    q_lat, q_rope = load_query(qb, h, c, r, hl, C, R)
    do = tl.load(dob + c[None, :], mask=hm[:, None] & (c[None, :] < C), other=0.0)
    lse2 = tl.load(lse_ptr + (bid * S + t) * H + h, mask=hm, other=0.0) * 1.4426950408889634
    delta = tl.load(delta_ptr + (bid * S + t) * H + h, mask=hm, other=0.0)
    dq_lat = tl.zeros((BH, BC), tl.float32)
    dq_rope = tl.zeros((BH, BR), tl.float32)
    for j0 in range(j_lo, j_hi, BN):
        j, idx, ok, k_lat, k_rope = gather_block(idx_ptr + bid * s_ib + t * s_it, kv_ptr + bid * s_kb, j0, j_hi,
                                                  s_kt, c, r, C, R, BN)
        s = block_scores(q_lat, q_rope, k_lat, k_rope, PREC)
        p = tl.exp2(s * qk_scale - lse2[:, None])
        p = tl.where(ok[None, :] & hm[:, None], p, 0.0)
        if HEAD_SUMS:  # the indexer loss's target, sum_h P_h(t, j), at no extra gather or product
            tl.store(hs_ptr + bid * s_hb + t * s_ht + j, tl.sum(p, 0), mask=j < j_hi)
        dp = tl.dot(do, tl.trans(k_lat), input_precision=PREC)
        ds = p * (dp - delta[:, None]) * sm_scale
        dsc = ds.to(k_lat.dtype)
        dq_lat = tl.dot(dsc, k_lat, dq_lat, input_precision=PREC)
        dq_rope = tl.dot(dsc, k_rope, dq_rope, input_precision=PREC)
        ds_t = tl.trans(dsc)
        p_t = tl.trans(p.to(k_lat.dtype))
        dk_rope = tl.dot(ds_t, q_rope, input_precision=PREC)
        # DKV (`KeyGradient`'s value): 0 = fp32 atomics into dkv, 1 = per-(token, slot) rows into part
        # (deterministic), 2 = no key gradient, 3 = key gradient computed but not written (2 and 3: timing only),
        # 5 = dS and P stored per (token, slot) for the separate key-gradient pass (sparse_mla_dkv).
        pb = part_ptr + bid * s_pb + (t - r0).to(tl.int64) * s_pt + j[:, None] * s_pj
        drow = dkv_ptr + (bid * T + idx.to(tl.int64)) * (C + R)  # each slot's key row in dkv
        if DKV == 5:
            sb = part_ptr + bid * s_pb + (t - r0).to(tl.int64) * s_pt + j[None, :] * s_pj + h[:, None]
            tl.store(sb, dsc, mask=ok[None, :] & hm[:, None])
            tl.store(sb + H, p.to(k_lat.dtype), mask=ok[None, :] & hm[:, None])
        if DKV == 1:
            tl.store(pb + C + r[None, :], dk_rope, mask=ok[:, None] & (r[None, :] < R))
        elif DKV == 0:
            add_rows(drow, C, dk_rope, ok, C + R, RED)
        for c0 in tl.static_range(0, BC, CC):
            cm = (c0 + cc) < C
            q_c = tl.load(qb + c0 + cc[None, :], mask=hm[:, None] & cm[None, :], other=0.0)
            do_c = tl.load(dob + c0 + cc[None, :], mask=hm[:, None] & cm[None, :], other=0.0)
            dk_c = tl.dot(ds_t, q_c, input_precision=PREC)
            dk_c = tl.dot(p_t, do_c, dk_c, input_precision=PREC)
            if DKV == 1:
                tl.store(pb + c0 + cc[None, :], dk_c, mask=ok[:, None] & cm[None, :])
            elif DKV == 3:
                tl.store(drow[:, None] + c0 + cc[None, :], dk_c, mask=ok[:, None] & cm[None, :] & (nv < 0))
            elif DKV == 0:
                add_rows(drow, c0, dk_c, ok, C, RED)
    ml = hm[:, None] & (c[None, :] < C)
    mr = hm[:, None] & (r[None, :] < R)
    dqb = dq_ptr + (bid * S + t).to(tl.int64) * H * (C + R) + h[:, None] * (C + R)
    if PART:  # one launch per key partition, in order: the fp32 sum over partitions is deterministic
        # The first partition starts the fp32 sum (no zeroed buffer), the last writes dq (no copy after); every
        # head takes part, since a token may have no key in the first or the last partition.
        ml = (h[:, None] < H) & (c[None, :] < C)
        mr = (h[:, None] < H) & (r[None, :] < R)
        d32 = dq32_ptr + bid * s_db + (t - r0).to(tl.int64) * s_dt + h[:, None] * (C + R)
        dq_lat += tl.load(d32 + c[None, :], mask=ml & (first == 0), other=0.0)
        dq_rope += tl.load(d32 + C + r[None, :], mask=mr & (first == 0), other=0.0)
        tl.store(d32 + c[None, :], dq_lat, mask=ml & (last == 0))
        tl.store(d32 + C + r[None, :], dq_rope, mask=mr & (last == 0))
        ml = ml & (last != 0)
        mr = mr & (last != 0)
    tl.store(dqb + c[None, :], dq_lat.to(dq_ptr.dtype.element_ty), mask=ml)
    tl.store(dqb + C + r[None, :], dq_rope.to(dq_ptr.dtype.element_ty), mask=mr)


def kernel_config(h: int, c: int, backward: bool = False, tiles=None):
    """(BN, num_warps, num_stages[, CC]) of the Triton kernels: `tiles` (`DSAKernelTuning.triton_tiles`) if given,
    else by heads from H100 / H200 sweeps: with up to 32 heads (per rank) one warp group and deeper pipelining beat
    two warp groups."""
    if tiles is not None:
        return tuple(tiles) if backward else tuple(tiles)[:3]
    small = pow2(h) * pow2(c) <= 64 * 512
    if pow2(h) <= 32 and pow2(c) <= 512:
        return (32, 4, 2, 64) if backward else (64, 4, 2)
    if backward:
        return (64 if small else 32), 8, 1, 64
    return (64 if small else 32), 8, 2


def attention_plan(q, kv, v_dim: int, tuning: DSAKernelTuning = DEFAULT_TUNING, deterministic: bool = False,
                   key_partition_bytes=None):
    """`plan.kernel_plan` for absorbed q [b, s, h, C + R] and kv [b, T, C + R] on their device."""
    h, d = q.shape[2], q.shape[3]
    return kernel_plan(h, int(v_dim), d - int(v_dim), kv.shape[1], capability(q.device), tuning, deterministic,
                       key_partition_bytes)


def sparse_mla_forward(q, kv, indices, scale: float, v_dim: int, tuning: DSAKernelTuning = DEFAULT_TUNING):
    """(out [b, s, h, v_dim] in q's dtype, lse [b, s, h] fp32); indices int32 [b, s, K]."""
    b, s, h, c, r = mla_shapes(q, kv, v_dim)
    indices = indices.to(torch.int32)
    nvalid = valid_counts(indices)
    forward = attention_plan(q, kv, v_dim, tuning).forward
    if forward != TRITON:
        from pretrain.model.dsa.kernels.hopper import forward_heads_m, forward_keys_m
        from pretrain.model.dsa.kernels.hopper.loader import inputs_fit

        if inputs_fit(q, kv) and forward == GLUON_HEADS_AS_M:
            return forward_heads_m.forward(q, kv, indices, nvalid, scale * LOG2E, c, r, tuning.gluon_forward_tiles)
        if inputs_fit(q, kv) and forward == GLUON_KEYS_AS_M:
            return forward_keys_m.forward(q, kv, indices, nvalid, scale * LOG2E, c, r, tuning.keys_m_tiles)
    out = torch.empty(b, s, h, c, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, s, h, dtype=torch.float32, device=q.device)
    bn, warps, stages = kernel_config(h, c, tiles=tuning.triton_tiles)[:3]
    _fwd_kernel[(s, b)](
        q, kv, indices, nvalid, out, lse, s, h,
        q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), indices.stride(0), indices.stride(1),
        out.stride(0), out.stride(1), out.stride(2), scale * LOG2E,
        C=c, R=r, BC=pow2(c), BR=pow2(r), BH=pow2(h), BN=bn, PREC=dot_precision(q), num_warps=warps,
        num_stages=stages)
    return out, lse


@triton.jit
def _delta_kernel(do_ptr, o_ptr, delta_ptr, n_rows, S, H, s_dob, s_dot, s_doh, s_ob, s_ot, s_oh,
                  C: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    # Delta = rowsum(dO * O) over BR (batch, token, head) rows per program, products summed in fp32: no upcast
    # copies, and dO / O in any layout with unit feature stride (the latent gradient arrives head-major).
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    bi, ti, hi = rows // (S * H), (rows // H) % S, rows % H
    dob = do_ptr + bi * s_dob + ti * s_dot + hi * s_doh
    ob = o_ptr + bi * s_ob + ti * s_ot + hi * s_oh
    c = tl.arange(0, BC)
    acc = tl.zeros((BR,), tl.float32)
    for c0 in tl.static_range(0, C, BC):
        m = (rows[:, None] < n_rows) & ((c0 + c[None, :]) < C)
        do = tl.load(dob[:, None] + c0 + c[None, :], mask=m, other=0.0).to(tl.float32)
        o = tl.load(ob[:, None] + c0 + c[None, :], mask=m, other=0.0).to(tl.float32)
        acc += tl.sum(do * o, 1)
    tl.store(delta_ptr + rows, acc, mask=rows < n_rows)


def output_delta(grad_out: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Delta = rowsum(dO * O) [b, s, h] in fp32, one kernel reading dO and O once (its torch form, two fp32 upcasts
    and their product, kept 3 GiB of temporaries alive at the glm5-proxy 32K step's memory peak)."""
    b, s, h, c = out.shape
    if grad_out.shape != out.shape:
        raise ValueError(f"output_delta: dO {tuple(grad_out.shape)} and O {tuple(out.shape)} differ")
    grad_out, out = unit_feature_stride(grad_out), unit_feature_stride(out)
    delta = torch.empty(b, s, h, dtype=torch.float32, device=out.device)
    n = b * s * h
    br, bc = 16, min(pow2(c), 256)
    _delta_kernel[(triton.cdiv(n, br),)](grad_out, out, delta, n, s, h, *grad_out.stride()[:3], *out.stride()[:3],
                                         C=c, BR=br, BC=bc, num_warps=4)
    return delta


def unit_feature_stride(t: torch.Tensor) -> torch.Tensor:
    """`t` itself where its last dim is contiguous (the kernels take any other strides), else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def sparse_mla_backward(q, kv, indices, lse, delta, grad_out, scale: float, v_dim: int,
                        deterministic: bool = False, head_sums=None, key_partition_bytes=None,
                        tuning: DSAKernelTuning = DEFAULT_TUNING):
    """(dq in q's dtype, dkv in kv's dtype) from the forward's lse and Delta = rowsum(dO * O) (fp32).
    `head_sums`: a zeroed [b, s, K] fp32 tensor that receives sum_h P_h(t, j) at every valid slot (the
    sparse indexer loss's target, `indexer_loss.kl_from_attention_backward`). `key_partition_bytes`: see
    `plan.key_partitions` (None: the tuning's, then the plan's default; 0: one pass); the deterministic path takes
    none."""
    b, s, h, c, r = mla_shapes(q, kv, v_dim)
    t = kv.shape[1]
    indices = indices.to(torch.int32)
    nvalid = valid_counts(indices)
    grad_out, lse, delta = unit_feature_stride(grad_out), lse.contiguous(), delta.contiguous()
    dq = torch.empty(b, s, h, c + r, dtype=q.dtype, device=q.device)
    dkv = torch.zeros(b, t, c + r, dtype=torch.float32, device=q.device)
    bn, warps, stages, cc = kernel_config(h, c, backward=True, tiles=tuning.triton_tiles)
    prec = dot_precision(q)
    plan = attention_plan(q, kv, v_dim, tuning, deterministic, key_partition_bytes)
    mode = plan.key_gradient.dkv

    if head_sums is not None and (head_sums.shape != indices.shape or head_sums.dtype != torch.float32
                                  or head_sums.stride(-1) != 1):
        raise ValueError(f"head_sums must be fp32 {tuple(indices.shape)} with unit last stride")
    hs = head_sums if head_sums is not None else dkv
    parts = key_partitions(t, c + r, plan.partition_bytes)
    partitioned = len(parts) > 1
    # Mode 5's first pass writes no key gradient, so only its key-gradient pass walks the partitions; the
    # fused kernel (mode 0) walks them itself and sums dq over them in fp32.
    dq_parts = partitioned and mode == 0
    # rows of the fp32 dq accumulator per block (partitioned fused kernel), and of the [dS | P] buffer (mode 5)
    block = s
    if dq_parts:
        block = max(1, min(s, tuning.dq32_bytes // (b * h * (c + r) * 4)))
    if mode == 5:
        block = min(block, scratch_rows(b, indices.shape[-1], h, s, q.element_size(), tuning.dkv_scratch_bytes))
    # unpartitioned, the kernel never touches dq32 (PART is off): dq stands in for the pointer
    dq32 = torch.empty(b, block, h, c + r, dtype=torch.float32, device=q.device) if dq_parts else dq
    red = reduction_mode(dkv, c, r, vector=tuning.vector_atomics)

    def launch(r0, rows, part, dkv_mode, keys=(0, t)):
        split = keys != (0, t)
        pstrides = part.stride()[:3] if part.dim() == 4 else (0, 0, 0)
        first, last = int(keys[0] == 0), int(keys[1] == t)  # the first / last key partition (dq32's sum)
        _bwd_kernel[(rows, b)](
            q, kv, indices, nvalid, grad_out, lse, delta, dq, dkv, part, hs, dq32, s, h, t, r0, keys[0], keys[1],
            first, last,
            q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), indices.stride(0),
            indices.stride(1), grad_out.stride(0), grad_out.stride(1), grad_out.stride(2), *pstrides,
            hs.stride(0), hs.stride(1), dq32.stride(0), dq32.stride(1), scale, scale * LOG2E, C=c, R=r, BC=pow2(c),
            BR=pow2(r), BH=pow2(h), BN=bn, CC=min(cc, pow2(c)), PREC=prec, DKV=dkv_mode,
            HEAD_SUMS=head_sums is not None, PART=split, RED=red, num_warps=warps, num_stages=stages)

    if mode == 1:
        scatter_rows_deterministic(lambda r0, rows, part: launch(r0, rows, part, 1), indices, dkv, s)
    elif mode == 5:  # blocks of query rows within the [dS | P] buffer
        part = empty_scratch(q, indices.shape[-1], block)
        gluon = plan.first_pass == GLUON
        if gluon:
            from pretrain.model.dsa.kernels.hopper import first_pass
            from pretrain.model.dsa.kernels.hopper.loader import inputs_fit

            gluon = inputs_fit(q, kv)
        for r0 in range(0, s, block):
            rows = min(block, s - r0)
            if gluon:  # 64 heads on Hopper: the warp-specialized first pass
                first_pass.first_pass(q, kv, indices, nvalid, grad_out, lse, delta, dq, part, head_sums, r0, rows,
                                      scale, scale * LOG2E, c, r, tuning.first_pass_tiles, tuning.dq_tiles)
            else:
                launch(r0, rows, part, mode)
            if plan.key_gradient is KeyGradient.TIMING_FIRST_PASS:
                continue
            for keys in parts:
                key_gradient(q, grad_out, indices, nvalid, part, dkv, r0, rows, c, r, prec,
                             keys if partitioned else None, tuning=tuning)
    elif partitioned:  # blocks of query rows within the fp32 dq accumulator
        for r0 in range(0, s, block):
            rows = min(block, s - r0)
            for keys in parts:  # in order: the first starts dq32's sum, the last writes dq
                launch(r0, rows, dkv, mode, keys)
    else:
        launch(0, s, dkv, mode)
    return dq, dkv.to(kv.dtype)


class SparseMLAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, indices, scale: float, v_dim: int, deterministic: bool, tuning: DSAKernelTuning):
        indices = indices.to(torch.int32)
        out, lse = sparse_mla_forward(q, kv, indices, scale, v_dim, tuning)
        ctx.save_for_backward(q, kv, indices, out, lse)
        ctx.scale, ctx.v_dim, ctx.deterministic, ctx.tuning = scale, v_dim, deterministic, tuning
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, kv, indices, out, lse = ctx.saved_tensors
        grad_out = unit_feature_stride(grad_out)
        delta = output_delta(grad_out, out)
        dq, dkv = sparse_mla_backward(q, kv, indices, lse, delta, grad_out, ctx.scale, ctx.v_dim, ctx.deterministic,
                                      tuning=ctx.tuning)
        return dq, dkv, None, None, None, None, None


def sparse_mla_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, v_dim: int,
                         deterministic: bool = False, tuning: DSAKernelTuning = DEFAULT_TUNING):
    """Triton version of `pretrain.model.dsa.sparse_mla.sparse_mla_attention` (same arguments and results).
    The valid slots of each row of `indices` must come first (-1 after them), as both top-k paths
    produce them."""
    if not math.isfinite(scale):
        raise ValueError(f"softmax scale must be finite, got {scale}")
    return SparseMLAFunction.apply(q, kv, indices, float(scale), int(v_dim), bool(deterministic), tuning)
