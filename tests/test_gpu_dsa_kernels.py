"""GPU checks of the DSA Triton kernels (marker `gpu`): top-k, sparse MLA and indexer KL against fp32, no host sync."""

from dataclasses import replace

import pytest
import torch

from pretrain.model.dsa.kernels.tuning import DEFAULT_TUNING, DSAKernelTuning, SelectTuning

pytestmark = pytest.mark.gpu


# ------------------------------------------------------------------------------------------------
# DSA Triton kernels (pretrain/model/dsa/kernels) vs the fp32 reference on the same bf16 inputs
# ------------------------------------------------------------------------------------------------


def _poison():
    """Fill the caching allocator's free memory with NaN so unwritten kernel outputs show up."""
    torch.cuda.synchronize()
    junk = torch.empty(2**30 // 4, device="cuda")
    junk.fill_(float("nan"))
    del junk


def _relmax(a, b):
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("s,topk,mode", [(1000, 256, "causal"), (4096, 2048, "causal"), (3001, 512, "segments")])
@pytest.mark.parametrize("order", ["default", "tokens_m", "keys_m"])
def test_dsa_topk_kernel_on_gpu(s, topk, mode, order):
    from pretrain.model.dsa.indexer import VisibleKeys, index_scores, segment_ids_from_cu_seqlens, select_topk
    from pretrain.model.dsa.kernels import indexer_topk as kt
    from pretrain.model.dsa.kernels import radix_select as ksel

    tuning = DEFAULT_TUNING
    if order != "default":  # both tile orders of the score kernel
        tuning = DSAKernelTuning(score_tiles=(4, 64, 8, 3, False) if order == "tokens_m" else (4, 128, 8, 3, True))

    gen = torch.Generator(device="cuda").manual_seed(s)
    qi = torch.randn(1, s, 32, 128, device="cuda", generator=gen).bfloat16()
    ki = torch.randn(1, s, 128, device="cuda", generator=gen).bfloat16()
    w = torch.randn(1, s, 32, device="cuda", generator=gen) * 32**-0.5
    seg = None
    if mode == "segments":
        seg = segment_ids_from_cu_seqlens(torch.tensor([0, 700, 701, 2500, s], device="cuda"), s)
    keys = VisibleKeys(s, s, "cuda", segment_ids=seg)
    lo, hi = kt.visible_ranges(*keys.ranges())
    vis = keys.rows(0, s)
    _poison()
    buf = torch.empty(1, s, s, device="cuda")
    kt.index_score_rows(qi, ki, w, lo, hi, 0, s, buf, tuning=tuning)
    ref = index_scores(qi.float(), ki.float(), w, vis)
    assert not buf[vis.expand_as(buf)].isnan().any()
    assert _relmax(buf[vis.expand_as(buf)], ref[vis.expand_as(ref)]) < 1e-5
    own = select_topk(buf.masked_fill(~vis, float("-inf")), topk)
    _poison()
    out = torch.empty(1, s, topk, dtype=torch.int32, device="cuda")
    ksel.select_rows(buf, lo, hi, 0, s, topk, out)
    assert torch.equal(out.long(), own)  # exact, ties included
    _poison()
    idx = kt.indexer_topk(qi, ki, w, topk, lo, hi, buffer_bytes=256 * s * 4, tuning=tuning)  # several row blocks
    assert torch.equal(idx.long(), own)


@pytest.mark.parametrize("sample", [True, False], ids=["sampled", "radix_only"])
def test_radix_select_long_rows_on_gpu(sample):
    """Rows long enough for the sampled threshold (16K-40K keys, top-2048): Gaussian rows, rows of wide ties (more
    keys at the threshold than the capacity), ascending rows and rows whose first half is higher; exact against the
    reference selection, with and without the sample."""
    from pretrain.model.dsa.indexer import select_topk
    from pretrain.model.dsa.kernels import radix_select as ksel

    gen = torch.Generator(device="cuda").manual_seed(3)
    n_rows, t, topk = 512, 40000, 2048
    rows = torch.randn(1, n_rows, t, device="cuda", generator=gen)
    rows[:, ::4] = (rows[:, ::4] * 4).round()
    rows[:, 1::4] = torch.linspace(-1, 1, t, device="cuda")
    rows[:, 2::4, : t // 2] += 2.0
    lo = torch.zeros(1, n_rows, dtype=torch.int32, device="cuda")
    hi = (t - 45 * torch.arange(n_rows, device="cuda")).int()[None]  # 40,000 .. 17,005 visible keys
    vis = torch.arange(t, device="cuda")[None, None] < hi[..., None]
    want = select_topk(rows.masked_fill(~vis, float("-inf")), topk)
    _poison()
    out = torch.empty(1, n_rows, topk, dtype=torch.int32, device="cuda")
    ksel.select_rows(rows, lo, hi, 0, n_rows, topk, out, tuning=SelectTuning(sample=sample))
    assert torch.equal(out.long(), want)


def test_dsa_fp8_topk_kernel_on_gpu():
    """FP8 index scores (model.dsa_indexer_fp8) on the GPU's FP8 tensor cores at GLM-5's indexer shapes: scores
    against fp32 on the dequantized rows, the selection exact on its own scores."""
    from pretrain.model.dsa.indexer import VisibleKeys, index_scores, select_topk
    from pretrain.model.dsa.indexer_fp8 import selection_inputs
    from pretrain.model.dsa.kernels import indexer_topk as kt

    s, topk = 3000, 512
    gen = torch.Generator(device="cuda").manual_seed(17)
    qi = torch.randn(1, s, 32, 128, device="cuda", generator=gen).bfloat16()
    ki = torch.randn(1, s, 128, device="cuda", generator=gen).bfloat16()
    w = torch.randn(1, s, 32, device="cuda", generator=gen) * 32**-0.5
    q8, k8, w8, sk = selection_inputs(qi, ki, w)
    keys = VisibleKeys(s, s, "cuda")
    lo, hi = kt.visible_ranges(*keys.ranges())
    vis = keys.rows(0, s)
    _poison()
    buf = torch.empty(1, s, s, device="cuda")
    kt.index_score_rows(q8, k8, w8, lo, hi, 0, s, buf, k_scale=sk)
    ref = index_scores(q8.float(), k8.float(), w8, vis, k_scale=sk)
    assert not buf[vis.expand_as(buf)].isnan().any()
    # Hopper's FP8 MMA may accumulate in fewer than fp32's bits (DeepSeek-V3 report, 3.3.2): a looser bound than
    # bf16's; the selection below is exact on the kernel's own scores either way
    assert _relmax(buf[vis.expand_as(buf)], ref[vis.expand_as(ref)]) < 1e-3
    own = select_topk(buf.masked_fill(~vis, float("-inf")), topk)
    idx = kt.indexer_topk(q8, k8, w8, topk, lo, hi, buffer_bytes=256 * s * 4, k_scale=sk)
    assert torch.equal(idx.long(), own)


@pytest.mark.parametrize("mode", ["causal", "segments"])
def test_dsa_triton_backend_makes_no_host_sync(mode):
    """Top-k and sparse attention forward + backward as a DSA layer calls them (VisibleKeys from the
    layer's inputs) run without a host sync: `set_sync_debug_mode("error")` raises on one. A sync per
    layer stalls the launch queue (the kernel's range check was one)."""
    from pretrain.model.dsa.backend import TritonBackend
    from pretrain.model.dsa.indexer import VisibleKeys, segment_ids_from_cu_seqlens

    s, backend = 2048, TritonBackend()
    gen = torch.Generator(device="cuda").manual_seed(1)
    qi = torch.randn(1, s, 16, 128, device="cuda", generator=gen).bfloat16()
    ki = torch.randn(1, s, 128, device="cuda", generator=gen).bfloat16()
    w = torch.randn(1, s, 16, device="cuda", generator=gen)
    q = (torch.randn(1, s, 16, 576, device="cuda", generator=gen) * 0.5).bfloat16().requires_grad_()
    kv = torch.randn(1, s, 576, device="cuda", generator=gen).bfloat16().requires_grad_()
    cu = torch.tensor([0, 700, 701, 1500, s], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        seg = segment_ids_from_cu_seqlens(cu, s) if mode == "segments" else None
        keys = VisibleKeys(s, s, "cuda", segment_ids=seg)
        idx = backend.topk(qi, ki, w, 512, keys, chunk=1024)
        out, _ = backend.sparse_attention(q, kv, idx, 576**-0.5, 512, chunk=1024)
        out.float().square().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(q.grad).all() and torch.isfinite(kv.grad).all()


def _sparse_inputs(s, h, topk, seed):
    from pretrain.model.dsa.indexer import VisibleKeys, index_scores, select_topk

    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(1, s, h, 576, device="cuda", generator=gen) * 0.5).bfloat16()
    kv = torch.randn(1, s, 576, device="cuda", generator=gen).bfloat16()
    scores = index_scores(torch.randn(1, s, 4, 32, device="cuda", generator=gen),
                          torch.randn(1, s, 32, device="cuda", generator=gen),
                          torch.rand(1, s, 4, device="cuda", generator=gen), VisibleKeys(s, s, "cuda").rows(0, s))
    return q, kv, select_topk(scores, topk).int()


@pytest.mark.parametrize("s,h,topk", [(1000, 64, 256), (4096, 64, 2048), (777, 16, 300), (4096, 16, 2048),
                                      (1000, 8, 256), (2000, 32, 512)])
def test_sparse_mla_kernels_on_gpu(s, h, topk):
    """Every head count's tile config (kernel_config) against the fp32 reference."""
    from pretrain.model.dsa.indexer import gather_keys
    from pretrain.model.dsa.kernels import sparse_mla as km
    from pretrain.model.dsa.sparse_mla import sparse_mla_attention as ref_attn

    q, kv, idx = _sparse_inputs(s, h, topk, s + h)
    scale = 256**-0.5
    q32, kv32 = q.float().requires_grad_(), kv.float().requires_grad_()
    ref, ref_lse = ref_attn(q32, kv32, idx.long(), scale, 512, 64)
    g = torch.randn(ref.shape, device="cuda").bfloat16()
    rdq, rdkv = torch.autograd.grad(ref, (q32, kv32), g.float())
    results = {}
    for det in (False, True):
        qb, kvb = q.clone().requires_grad_(), kv.clone().requires_grad_()
        _poison()
        out, lse = km.sparse_mla_attention(qb, kvb, idx, scale, 512, det)
        _poison()
        dq, dkv = torch.autograd.grad(out, (qb, kvb), g)
        for t in (out, lse, dq, dkv):
            assert not t.isnan().any()
        assert _relmax(out, ref) < 1e-2 and _relmax(lse, ref_lse) < 1e-3
        assert _relmax(dq, rdq) < 2e-2 and _relmax(dkv, rdkv) < 2e-2
        results[det] = (dq, dkv)
        # the indexer loss's target, sum_h P_h, as the backward's by-product
        head_sums = torch.zeros(idx.shape, dtype=torch.float32, device="cuda")
        km.sparse_mla_backward(q, kv, idx, lse, km.output_delta(g, out.detach()), g, scale, 512, det,
                               head_sums=head_sums)
        want = ref_lse.new_zeros(idx.shape)
        for r0 in range(0, s, 512):  # float32 softmax over the selected keys, summed over heads
            sel = gather_keys(kv.float(), idx[:, r0:r0 + 512].long())
            logits = torch.einsum("bchd,bckd->bchk", q[:, r0:r0 + 512].float(), sel) * scale
            want[:, r0:r0 + 512] = logits.masked_fill((idx[:, r0:r0 + 512] < 0)[:, :, None], float("-inf")
                                                      ).softmax(-1).sum(2)
        assert not head_sums.isnan().any() and _relmax(head_sums, want) < 1e-2
    qb, kvb = q.clone().requires_grad_(), kv.clone().requires_grad_()
    dq2, dkv2 = torch.autograd.grad(km.sparse_mla_attention(qb, kvb, idx, scale, 512, True)[0], (qb, kvb), g)
    assert torch.equal(dq2, results[True][0]) and torch.equal(dkv2, results[True][1])  # deterministic mode


@pytest.mark.parametrize("b,s,topk,c,r,h", [(2, 1500, 300, 512, 64, 64), (1, 4096, 2048, 512, 64, 64),
                                             (1, 700, 200, 256, 32, 64), (2, 1500, 300, 512, 64, 16),
                                             (1, 4096, 2048, 512, 64, 16), (1, 700, 200, 256, 32, 16),
                                             (1, 4096, 2048, 512, 64, 8), (2, 1500, 300, 512, 64, 32)])
def test_sparse_mla_warp_specialized_forward_on_gpu(b, s, topk, c, r, h):
    """The warp-specialized forwards (Hopper; 64 heads as the MMA's M, `hopper.forward_heads_m`; 8-32 heads with the
    keys as M, `hopper.forward_keys_m`) against the fp32 reference and the Triton forward: batches, top-k not a
    multiple of their 64-key blocks, rows with no valid slot (output 0, lse -inf), q with a padded head stride,
    another latent / rope width; two runs bitwise equal."""
    from pretrain.model.dsa.kernels import sparse_mla as km
    from pretrain.model.dsa.kernels.hopper.loader import inputs_fit
    from pretrain.model.dsa.kernels.plan import GLUON_HEADS_AS_M, GLUON_KEYS_AS_M, TRITON
    from pretrain.model.dsa.sparse_mla import sparse_mla_attention as ref_attn

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialized forward is Hopper's (sm_90)")
    gen = torch.Generator(device="cuda").manual_seed(b * s + c)
    qs = []
    idxs = []
    for _ in range(b):
        q1, kv1, idx1 = _sparse_inputs(s, 64, topk, len(qs) + s)
        qs.append((q1, kv1))
        idxs.append(idx1)
    d = c + r
    q = torch.stack([x[0][0, :, :h, :d] for x in qs])
    kv = torch.stack([x[1][0, :, :d] for x in qs]).contiguous()
    idx = torch.cat(idxs)
    idx[:, 5] = -1  # a row with no valid slot
    idx[:, 9, 7:] = -1  # and one with seven
    padded = torch.zeros(b, s, h, d + 32, device="cuda", dtype=torch.bfloat16)
    padded[..., :d] = q * (torch.rand(1, device="cuda", generator=gen) + 0.5)
    q = padded[..., :d]  # head stride d + 32
    assert inputs_fit(q, kv)
    assert km.attention_plan(q, kv, c).forward == (GLUON_HEADS_AS_M if h == 64 else GLUON_KEYS_AS_M)
    triton_only = DSAKernelTuning(gluon_forward=False, gluon_forward_keys_m=False)
    assert km.attention_plan(q, kv, c, triton_only).forward == TRITON
    scale = 256**-0.5
    ref, ref_lse = ref_attn(q.float(), kv.float(), idx.long(), scale, c, 64)
    out, lse = km.sparse_mla_forward(q, kv, idx, scale, c)
    out2, lse2 = km.sparse_mla_forward(q, kv, idx, scale, c)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    tout, tlse = km.sparse_mla_forward(q, kv, idx, scale, c, triton_only)
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out[:, 5] == 0).all() and torch.isinf(lse[:, 5]).all() and (lse[:, 5] < 0).all()
    fin = torch.isfinite(ref_lse)  # the reference's softmax over no key is NaN: compare the other rows
    assert torch.equal(torch.isfinite(lse), fin) and int((~fin).sum()) == b * h
    assert _relmax(out[fin], ref[fin]) < 1e-2 and (lse[fin] - ref_lse[fin]).abs().max() < 1e-3
    assert _relmax(out, tout) < 1e-2 and (lse[fin] - tlse[fin]).abs().max() < 1e-4


@pytest.mark.parametrize("b,s,topk,c,r", [(2, 1500, 300, 512, 64), (1, 4096, 2048, 512, 64), (1, 700, 200, 256, 32)])
def test_sparse_mla_warp_specialized_first_pass_on_gpu(monkeypatch, b, s, topk, c, r):
    """The backward's warp-specialized first pass (64 heads, Hopper: the score kernel, then the query gradient's
    own kernel from the stored dS) against the Triton first pass on the same inputs: dq and the stored dS / P rows
    bitwise equal (both accumulate the same products in the same 16-key steps), sum_h P equal up to the order of
    its fp32 sum over heads, dkv up to the order of its fp32 atomics; dO head-major as the DSA layer hands it over,
    batches, top-k not a multiple of the 32- and 64-key blocks, rows with no valid slot, another latent / rope width
    (test_sparse_mla_kernels_on_gpu checks the 64-head backward, through this pass, against the fp32 reference)."""
    from pretrain.model.dsa.kernels import sparse_mla as km
    from pretrain.model.dsa.kernels import sparse_mla_dkv as kd
    from pretrain.model.dsa.kernels.hopper.loader import inputs_fit
    from pretrain.model.dsa.kernels.plan import GLUON, TRITON

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialized first pass is Hopper's (sm_90)")
    parts = [_sparse_inputs(s, 64, topk, 11 * i + s) for i in range(b)]
    q = torch.cat([x[0] for x in parts])[..., :c + r].contiguous()
    kv = torch.cat([x[1] for x in parts])[..., :c + r].contiguous()
    idx = torch.cat([x[2] for x in parts])
    idx[:, 3] = -1
    assert inputs_fit(q, kv) and km.attention_plan(q, kv, c).first_pass == GLUON
    tunings = {True: DEFAULT_TUNING, False: DSAKernelTuning(gluon_first_pass=False)}
    assert km.attention_plan(q, kv, c, tunings[False]).first_pass == TRITON
    scale = 256**-0.5
    out, lse = km.sparse_mla_forward(q, kv, idx, scale, c)
    g = torch.randn(out.shape, device="cuda").bfloat16()
    g_hm = g.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    delta = km.output_delta(g_hm, out)
    stored = {}
    real_scratch = kd.empty_scratch

    def keep(q_, k_, rows):  # the [dS | P] buffer of the last block, to compare
        buf = real_scratch(q_, k_, rows)
        stored["part"] = buf
        return buf

    monkeypatch.setattr(km, "empty_scratch", keep)
    runs = {}
    for on in (False, True):
        hs = torch.zeros(idx.shape, dtype=torch.float32, device="cuda")
        _poison()
        dq, dkv = km.sparse_mla_backward(q, kv, idx, lse, delta, g_hm, scale, c, head_sums=hs, tuning=tunings[on])
        runs[on] = (dq, dkv, hs, stored["part"].clone())
    assert torch.equal(runs[True][0], runs[False][0])
    # sum_h P: the same fp32 P summed over the 64 heads in another order; each order of n positive fp32 terms lies
    # within (n - 1) 2^-24 of the exact sum, so two orders within twice that
    hs_gluon, hs_triton = runs[True][2], runs[False][2]
    assert torch.equal(hs_gluon == 0, hs_triton == 0)
    assert ((hs_gluon - hs_triton).abs() <= 2 * 63 * 2.0**-24 * hs_triton).all()
    valid = (idx[:, -runs[True][3].shape[1]:] >= 0)[..., None].expand(-1, -1, -1, 128)
    assert torch.equal(runs[True][3][valid], runs[False][3][valid])  # dS and P of the last block's valid slots
    assert _relmax(runs[True][1], runs[False][1]) < 1e-2
    assert not runs[True][0].isnan().any() and not runs[True][1].isnan().any()


@pytest.mark.parametrize("h", [16, 64])
def test_sparse_mla_backward_by_key_partitions_on_gpu(h):
    """The backward with its keys walked in partitions (`DSAKernelTuning.key_partition_bytes`: 4096 keys in 3 ranges
    here; the fp32 dq in blocks of query rows) against the fp32 reference, at the fused (16 heads) and separate-pass
    (64) key gradient, dO read head-major in place; and Delta's kernel against float64."""
    from pretrain.model.dsa.kernels import sparse_mla as km
    from pretrain.model.dsa.kernels.plan import key_partitions
    from pretrain.model.dsa.sparse_mla import sparse_mla_attention as ref_attn

    s, topk = 4096, 2048
    q, kv, idx = _sparse_inputs(s, h, topk, 3 * h)
    scale = 256**-0.5
    q32, kv32 = q.float().requires_grad_(), kv.float().requires_grad_()
    ref, _ = ref_attn(q32, kv32, idx.long(), scale, 512, 64)
    g = torch.randn(ref.shape, device="cuda").bfloat16()
    rdq, rdkv = torch.autograd.grad(ref, (q32, kv32), g.float())
    tuning = DSAKernelTuning(key_partition_bytes=6 * 576 * 1366, dq32_bytes=h * 576 * 4 * 1500)
    assert len(key_partitions(s, 576, km.attention_plan(q, kv, 512, tuning).partition_bytes)) == 3
    qb, kvb = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out, _ = km.sparse_mla_attention(qb, kvb, idx, scale, 512, False, tuning)
    g_hm = g.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)  # head-major, as the DSA layer hands dO over
    delta = km.output_delta(g_hm, out.detach())
    assert _relmax(delta, (g.double() * out.detach().double()).sum(-1)) < 1e-5
    _poison()
    dq, dkv = torch.autograd.grad(out, (qb, kvb), g_hm)
    assert not dq.isnan().any() and not dkv.isnan().any()
    assert _relmax(dq, rdq) < 2e-2 and _relmax(dkv, rdkv) < 2e-2


@pytest.mark.parametrize("mode", [0, 2])
def test_add_rows_vector_reductions_on_gpu(mode):
    """The key gradients' row adds as Triton's scalar atomics (mode 0, the default) and as 16-byte vector reductions
    (mode 2, red.global.add.v4.f32 on sm_90+, `DSAKernelTuning.vector_atomics`) against a float64 loop; repeated rows
    sum."""
    from pretrain.model.dsa.kernels import atomics
    from tests.dsa_atomics_kernel import run_add_rows

    if mode == 2:
        assert atomics.reduction_mode(torch.zeros(4, 8, device="cuda"), 512, 64, vector=True) == (
            2 if torch.cuda.get_device_capability() >= (9, 0) else 0)
        if torch.cuda.get_device_capability() < (9, 0):
            pytest.skip("red.global.add.v4.f32 needs sm_90")
    got, want = run_add_rows(mode, "cuda")
    assert _relmax(got, want) < 1e-6


@pytest.mark.parametrize("keys_m", [1, 0], ids=["slots_m", "heads_m"])
@pytest.mark.parametrize("heads", [32, 16])
def test_sparse_kl_kernel_on_gpu(heads, keys_m):
    """The fused sparse indexer loss (bf16 q_I / k_I, GLM-5's 32 x 128 indexer and the proxy's 16), its selection and
    lse from the top-k kernel, against float64: lse, and the loss and gradients of autograd of the KL over the
    gathered keys; with and without the given lse, atomic and deterministic (bitwise repeatable)."""
    from pretrain.model.dsa.indexer import VisibleKeys
    from pretrain.model.dsa.kernels import indexer_kl as kk
    from pretrain.model.dsa.kernels import indexer_topk as kt

    tuning = replace(DEFAULT_TUNING, kl_tiles=DEFAULT_TUNING.kl_tiles[:3] + (keys_m,))
    s, topk = 1500, 512
    gen = torch.Generator(device="cuda").manual_seed(8)
    qi = torch.randn(1, s, heads, 128, device="cuda", generator=gen).bfloat16()
    ki = torch.randn(1, s, 128, device="cuda", generator=gen).bfloat16()
    w = torch.randn(1, s, heads, device="cuda", generator=gen) * heads**-0.5
    sel_lse = torch.empty(1, s, device="cuda")
    idx = kt.indexer_topk(qi, ki, w, topk, *VisibleKeys(s, s, "cuda").ranges(), lse=sel_lse)
    valid = idx >= 0
    p = torch.rand(idx.shape, device="cuda", generator=gen).masked_fill(~valid, 0.0)
    p = p / p.sum(-1, keepdim=True)
    leaves = [t.double().requires_grad_() for t in (qi, ki, w)]
    q64, k64, w64 = leaves
    keys = k64[0][idx.clamp(min=0).long()]  # [1, s, K, d]
    z = torch.einsum("bshd,bskd->bshk", q64, keys)
    scores = (z.relu() * w64[..., None]).sum(2).mul(128**-0.5).masked_fill(~valid, float("-inf"))
    assert _relmax(sel_lse, torch.logsumexp(scores, -1).detach()) < 1e-5
    ref = torch.where(valid, torch.xlogy(p, p) - p * torch.log_softmax(scores, -1), 0.0).sum() / s
    ref_grads = torch.autograd.grad(ref, leaves)
    runs = {}
    for det, given in ((False, True), (False, False), (True, True), (True, True)):
        _poison()
        loss, grads, psum = kk.sparse_kl(qi, ki, w, idx, lambda r0, r1, _i: p[:, r0:r1], 700, det,
                                         sel_lse if given else None, tuning=tuning)
        assert abs(loss.item() - ref.item()) < 1e-3 * ref.item() and abs(psum.item() - 1.0) < 1e-5
        for a, e in zip(grads, ref_grads):
            assert not a.isnan().any() and _relmax(a, e) < 2e-2
        if det and det in runs:
            assert all(torch.equal(a, b) for a, b in zip(grads, runs[det]))
        runs[det] = grads
    # raw head sums (each row at its own scale) normalized by the kernel, gradients scaled by it (the DSA layer's call)
    raw = p * torch.linspace(1.0, 16.0, s, device="cuda")[None, :, None]
    loss, grads, psum = kk.sparse_kl(qi, ki, w, idx, lambda r0, r1, _i: raw[:, r0:r1], 700, False, sel_lse,
                                     normalize=True, grad_scale=3.0, tuning=tuning)
    assert abs(loss.item() - ref.item()) < 1e-3 * ref.item() and abs(psum.item() - 1.0) < 1e-5
    for a, e in zip(grads, ref_grads):
        assert not a.isnan().any() and _relmax(a, 3.0 * e) < 2e-2


def test_packed_indices_round_trip_on_gpu():
    """The int16 packing of kept top-k indices wraps and unwraps on CUDA as on CPU (32768..65534, -1); the valid-slot
    counts of the same rows against PyTorch's count."""
    from pretrain.model.dsa.indexer import pack_indices, unpack_indices

    idx = torch.randint(-1, 65535, (2, 300, 64), device="cuda", dtype=torch.int32)
    idx[0, 0, :3] = torch.tensor([32767, 32768, 65534], device="cuda")
    packed = pack_indices(idx, 65535)
    assert packed.dtype == torch.int16 and torch.equal(unpack_indices(packed), idx)
    from pretrain.model.dsa.kernels.packed_indices import valid_counts

    assert torch.equal(valid_counts(idx), (idx >= 0).sum(-1, dtype=torch.int32))
