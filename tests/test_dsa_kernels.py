"""The DSA Triton kernels (pretrain/model/dsa/kernels) on CPU through Triton's interpreter.

Every kernel is compared with something it does not compute itself:

* index scores: the float64 formula (tests/dsa_references.py's naive loops' einsum form);
* top-k selection: a naive Python sort implementing the documented rule (ties to the lower key
  index), applied to the kernel's own scores, so the check is exact; and the whole `indexer_topk`
  against the reference `pretrain.model.dsa.indexer.indexer_topk` where no ties straddle the boundary;
* sparse MLA forward / backward: the float64 reference path (`pretrain.model.dsa.sparse_mla`) on the same inputs;
* the fused sparse indexer loss: float64 autograd of the KL over gathered keys (`naive_sparse_kl`);
* Delta = rowsum(dO * O): float64;
* the DSA layer with `dsa_kernel_backend=triton` (tests/test_dsa_kernels_backend.py): transformers'
  GlmMoeDsaForCausalLM logits and the reference backend's losses and gradients; the FP8 selection
  (tests/test_dsa_indexer_fp8.py).

Shapes are tiny and ragged (S not a multiple of any block, heads / dims padded inside the kernels).
The same kernels run compiled on the GPU in tests/test_gpu_dsa_kernels.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import triton  # noqa: F401  (the dev extra installs it; the kernels run in its interpreter here)

from pretrain.model.dsa.indexer import (  # noqa: E402
    VisibleKeys, gather_keys, indexer_topk, segment_ids_from_cu_seqlens,
)
from pretrain.model.dsa.kernels.plan import kernel_plan, key_partitions  # noqa: E402
from pretrain.model.dsa.kernels.tuning import DSAKernelTuning, KeyGradient, SelectTuning  # noqa: E402
from pretrain.model.dsa.sparse_mla import sparse_mla_attention as ref_sparse_mla  # noqa: E402
from tests.dsa_references import NEG_INF, ref_topk  # noqa: E402

F64 = torch.float64


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def naive_scores(q, k, w, visible):
    """float64 index scores [b, S, T], -inf where not visible."""
    d = q.shape[-1]
    dots = torch.einsum("bshd,btd->bsht", q.double(), k.double()) * d**-0.5
    out = torch.einsum("bsh,bsht->bst", w.double(), dots.clamp(min=0))
    return out.masked_fill(~visible, NEG_INF)


def visibility(mode: str, b: int, s: int, t: int):
    """VisibleKeys and its dense bool matrix [b, S, T] for causal / dense document mask / cu_seqlens."""
    if mode == "causal":
        keys = VisibleKeys(s, t, "cpu")
    elif mode == "mask":
        doc = torch.tensor([0] * 5 + [1] * 13 + [2] * (s - 18))
        same = (doc[:, None] == doc[None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
        keys = VisibleKeys(s, s, "cpu", attention_mask=(~same)[None, None].expand(b, 1, s, s))
    elif mode == "cp":  # context parallelism: CP rank 1 of 2 holds chunks 1 and 2 of 4, keys are global
        from parallel.context_parallel import local_positions

        cu, pos = torch.tensor([0, 9, 15, 27, t]), local_positions(s, 2, 1)
        seg = segment_ids_from_cu_seqlens(cu, t)
        keys = VisibleKeys(s, t, "cpu", segment_ids=seg, query_positions=pos)
        naive = (torch.arange(t)[None, :] <= pos[:, None]) & (seg[0][None, :] == seg[0][pos][:, None])
        assert torch.equal(keys.rows(0, s)[0], naive)
    else:
        cu = torch.tensor([0, 9, 10, 30, s])
        keys = VisibleKeys(s, s, "cpu", segment_ids=segment_ids_from_cu_seqlens(cu, s))
    return keys, keys.rows(0, s).expand(b, -1, -1)


def test_visible_ranges_the_kernels_cannot_take_are_refused(kern):
    """A dense mask whose rows see non-contiguous keys, or ranges that move backwards: one-line errors
    from `VisibleKeys.ranges`; the kernel's own check catches backwards ranges given to it directly."""
    s = 8
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    holes, backwards = causal.clone(), causal.clone()
    holes[5, 2] = False  # row 5 sees 0-1 and 3-5
    backwards[4, :3] = False  # row 4 sees 3-4, row 5 sees 0-5: lo goes 3 -> 0
    for visible, message in ((holes, "one contiguous range"), (backwards, "never move backwards")):
        with pytest.raises(ValueError, match=message):
            VisibleKeys(s, s, "cpu", attention_mask=(~visible)[None, None]).ranges()
    lo = torch.tensor([[0, 0, 0, 0, 3, 0, 0, 0]], dtype=torch.int32)
    hi = torch.arange(1, s + 1, dtype=torch.int32)[None]
    q, k, w = torch.randn(1, s, 2, 16), torch.randn(1, s, 16), torch.randn(1, s, 2)
    with pytest.raises(ValueError, match="never move backwards"):
        kern["indexer_topk"].indexer_topk(q, k, w, 4, lo, hi)


@pytest.mark.parametrize("mode", ["causal", "mask", "segments", "cp"])
def test_indexer_scores_and_exact_selection(kern, mode):
    ktop, ksel = kern["indexer_topk"], kern["radix_select"]
    gen = torch.Generator().manual_seed(len(mode))
    b, s, h, d = 2, 37, 3, 16
    if mode == "cp":
        s = 20
    t = {"causal": s + 4, "cp": 2 * s}.get(mode, s)  # a key prefix, or every CP rank's keys: T > S
    q, k, w = torch.randn(b, s, h, d, generator=gen), torch.randn(b, t, d, generator=gen), torch.randn(b, s, h, generator=gen)
    k[:, 3::5] = 0.0  # keys scoring exactly 0 for every query: ties at the top-k boundary
    keys, vis = visibility(mode, b, s, t)
    lo, hi = ktop.visible_ranges(*keys.ranges())
    # ranges are the visible sets, and never move backwards (what lets the model path skip the check)
    assert bool((lo.diff(dim=-1) >= 0).all() & (hi.diff(dim=-1) >= 0).all())
    cols = torch.arange(t)
    assert torch.equal((cols >= lo[..., None]) & (cols < hi[..., None]), vis[: lo.shape[0]])

    buf = torch.full((b, s, t), float("nan"))
    ktop.index_score_rows(q, k, w, lo, hi, 0, s, buf, block_n=16)
    want = naive_scores(q, k, w, vis)
    assert rel(buf[vis], want[vis]) < 1e-6
    scores = buf.masked_fill(~vis, NEG_INF)
    assert int(((scores == 0) & vis).sum()) > b * s  # the tie case is real
    # k = 1 (the edge case) once: the modes differ only in the ranges, which k = 6 covers in each (the radix
    # select's interpreted passes are most of this test's time)
    for topk in (1, 6) if mode == "causal" else (6,):
        out = torch.full((b, s, min(topk, t)), -7, dtype=torch.int32)
        ksel.select_rows(buf, lo, hi, 0, s, topk, out)
        assert torch.equal(out.long(), ref_topk(scores, topk)), topk
        # and the reference path, which selects by the same rule
        assert torch.equal(out.long(), indexer_topk(q, k, w, topk, keys, 5)), topk
    # the whole kernel (scores and selection of rows in several buffer blocks; 40 keys: more than most rows see,
    # and at least T in three of the modes) equals selection on its own scores, and the reference path
    topk = 40
    got = ktop.indexer_topk(q, k, w, topk, lo, hi, buffer_bytes=4 * t * b * 16, block_n=16)
    assert got.dtype == torch.int32 and torch.equal(got.long(), ref_topk(scores, topk))
    assert torch.equal(got.long(), indexer_topk(q, k, w, topk, keys, 5))


@pytest.mark.parametrize("keys_m,bm", [(False, 3), (True, 3), (True, 1)])
def test_index_scores_by_tile_order(kern, keys_m, bm):
    """The score kernel's tile orders (`DSAKernelTuning.score_tiles`: tokens x heads or keys as the MMA's M) against
    float64, ragged (S, heads and dims off every block), documents, rows starting mid-sequence."""
    ktop = kern["indexer_topk"]
    tuning = DSAKernelTuning(score_tiles=(bm, 16, 0, 0, keys_m))
    gen = torch.Generator().manual_seed(5)
    b, s, h, d = 2, 29, 3, 20
    q, k, w = torch.randn(b, s, h, d, generator=gen), torch.randn(b, s, d, generator=gen), torch.randn(b, s, h, generator=gen)
    keys, vis = visibility("segments", b, s, s)
    lo, hi = ktop.visible_ranges(*keys.ranges())
    want = naive_scores(q, k, w, vis)
    buf = torch.full((b, s - 7, s), float("nan"))
    ktop.index_score_rows(q, k, w, lo, hi, 7, s - 7, buf, tuning=tuning)
    v = vis[:, 7:].expand(b, -1, -1)
    assert rel(buf[v], want[:, 7:][v]) < 1e-6
    assert bool((buf[~v & ~buf.isnan()] == NEG_INF).all())  # what is written outside a row's keys is -inf


def test_radix_select_tie_rule_and_special_values(kern):
    ktop, ksel = kern["indexer_topk"], kern["radix_select"]
    rows = torch.tensor([
        [0.0, -0.0, 0.0, -0.0, 1.0, -1.0, 0.0, 2.0, -3.0, 0.0, 0.0, 0.0],  # zeros of both signs tie
        [-1.0, -2.0, -1.0, -5.0, -1.0, -1.0, -2.0, -2.0, -7.0, -1.0, -1e-30, 1e-30],  # negatives, denormal-ish
        [5.0] * 12,  # all equal: the lowest indices
        [3.4e38, -3.4e38, 1.0, 1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
    ])
    n, t = rows.shape
    lo = torch.zeros(1, n, dtype=torch.int32)
    hi = torch.full((1, n), t, dtype=torch.int32)
    hi[0, 3] = 7  # a row with only 7 visible keys
    scores = rows.clone()
    scores[3, 7:] = NEG_INF
    for topk in (1, 3, 5, 8, 12):
        out = torch.full((1, n, topk), -7, dtype=torch.int32)
        ksel.select_rows(rows[None].clone(), lo, hi, 0, n, topk, out)
        assert torch.equal(out[0].long(), ref_topk(scores, topk)[:, :topk]), topk
    out = torch.empty(1, n, 3, dtype=torch.int32)
    ksel.select_rows(rows[None].clone(), lo, hi, 0, n, 3, out)
    assert out[0, 2].tolist() == [0, 1, 2]
    assert out[0, 0].tolist() == [0, 4, 7]  # 2.0, 1.0 and the first of the (signed) zeros, ascending
    with pytest.raises(ValueError, match="contiguous|backwards"):
        ktop.visible_ranges(torch.tensor([[0, 2, 1]]), torch.tensor([[1, 2, 3]]))


def _order_key(x: torch.Tensor) -> torch.Tensor:
    """The kernel's order-preserving key of fp32 values, in float64-free integer arithmetic."""
    bits = x.float().view(torch.int32).long().masked_fill(x == 0, 0)
    return torch.where(bits < 0, ~bits & 0xFFFFFFFF, bits + 2**31)


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no_prefetch"])
def test_radix_select_compaction_both_ways(kern, prefetch):
    """Rows whose candidates after two radix passes fit the capacity are finished on a compacted copy, the
    others on the full row; both give the naive top-k (the tie rule included); blocks of 64 (several per row and per
    candidate list), each loaded one iteration ahead or not."""
    ksel = kern["radix_select"]
    gen = torch.Generator().manual_seed(11)
    n, t, topk = 6, 300, 20  # 2 rows of each kind below
    rows = torch.randn(n, t, generator=gen)
    rows[::3] = rows[::3].round()  # coarse values: wide ties at the boundary, buckets beyond the capacity
    rows[1::3] = rows[1::3] * 1e-3 + 7.0  # one exponent: the first two digits leave a wide bucket
    lo = torch.zeros(1, n, dtype=torch.int32)
    hi = torch.full((1, n), t, dtype=torch.int32)
    tuning = SelectTuning(prefetch=prefetch, block=64, capacity=2, scratch_bytes=8 * 40 * 4)  # 4 rows a launch: 4
    cap = ksel.select_capacity(topk, t, tuning)
    # which rows compact: the K-th largest key's top 16 bits, counted as the kernel counts them
    keys = _order_key(rows)
    kth = keys.sort(dim=-1, descending=True).values[:, topk - 1]
    n_cand = ((keys >> 16) >= (kth[:, None] >> 16)).sum(-1)
    fits = n_cand <= cap
    assert cap == 40 and bool(fits.any()) and bool((~fits).any())
    out = torch.full((1, n, topk), -7, dtype=torch.int32)
    ksel.select_rows(rows[None].clone(), lo, hi, 0, n, topk, out, tuning=tuning)
    assert torch.equal(out[0].long(), ref_topk(rows[None], topk)[0])
    tuning = replace(tuning, capacity=100)  # capacity >= the row: never compacts
    assert ksel.select_capacity(topk, t, tuning) == 0
    out2 = torch.full((1, n, topk), -7, dtype=torch.int32)
    ksel.select_rows(rows[None].clone(), lo, hi, 0, n, topk, out2, tuning=tuning)
    assert torch.equal(out2, out)


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no_prefetch"])
def test_radix_select_sampled_threshold(kern, prefetch):
    """The sampled threshold (8 chunks of 2 keys here): rows where the keys at or above it number K..capacity are
    selected from that copy, the others (too few: a sample above its row's K-th largest; too many: ties) by the
    radix passes; every row gives the naive top-k. Which rows take which way is predicted from the sample in
    PyTorch and both must occur."""
    ksel = kern["radix_select"]
    # n / 128 = 2 keys per chunk here
    tuning = SelectTuning(prefetch=prefetch, block=64, sample_chunks=8, sample_chunk=16, sample_min_chunk=2)
    gen = torch.Generator().manual_seed(12)
    n_rows, t, topk = 10, 300, 20  # 2 rows of each kind below
    rows = torch.randn(n_rows, t, generator=gen)
    rows[::5] = rows[::5].round()  # wide ties: more candidates than the capacity
    rows[1::5] = torch.linspace(-1, 1, t)  # ascending: the chunks' last keys decide
    rows[2::5, :150] += 3.0  # the first half above the second
    lo = torch.zeros(1, n_rows, dtype=torch.int32)
    hi = torch.full((1, n_rows), t, dtype=torch.int32)
    cap = ksel.select_capacity(topk, t, tuning)
    assert cap == 40
    # the sample and its threshold as the kernel forms them
    ch = min(t // 128, 16)
    a = torch.arange(8 * ch)
    keys = _order_key(rows)
    sample = keys[:, (a // ch) * t // 8 + a % ch]
    r = max(1, min(8 * ch, topk * 8 * ch * 3 // (2 * t)))
    threshold = sample.sort(dim=-1, descending=True).values[:, r - 1]
    count = (keys >= threshold[:, None]).sum(-1)
    sampled = (count >= topk) & (count <= cap)
    assert bool(sampled.any()) and bool((~sampled).any())
    out = torch.full((1, n_rows, topk), -7, dtype=torch.int32)
    took = torch.zeros(1, dtype=torch.int32)
    ksel.select_rows(rows[None].clone(), lo, hi, 0, n_rows, topk, out, sampled=took, tuning=tuning)
    assert torch.equal(out[0].long(), ref_topk(rows[None], topk)[0])
    assert int(took) == int(sampled.sum())  # the rows predicted to take the sample's copy, and no other
    out2 = torch.full((1, n_rows, topk), -7, dtype=torch.int32)
    ksel.select_rows(rows[None].clone(), lo, hi, 0, n_rows, topk, out2, tuning=replace(tuning, sample=False))
    assert torch.equal(out2, out)


def sparse_case(seed: int, b=2, s=21, h=5, c=24, r=8, topk=12):
    """bf16-free fp32 inputs and causal top-k style indices (valid slots first, -1 after)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, c + r, generator=gen)
    kv = torch.randn(b, s, c + r, generator=gen)
    scores = torch.rand(b, s, s, generator=gen).masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), NEG_INF)
    idx = ref_topk(scores, topk)
    return q, kv, idx


DKV_PATHS = ["split", "fused_atomic", "deterministic", "split_partitioned", "fused_atomic_partitioned", "split_vector",
             "fused_atomic_vector"]
SMALL_TILES = (16, 4, 1, 16)


# Every key-gradient path with the small tiles (several blocks per loop: the stricter case); the default tiles
# with the three unpartitioned scalar paths only (partitions and vector adds do not depend on the tile sizes).
@pytest.mark.parametrize("config, dkv", [(SMALL_TILES, d) for d in DKV_PATHS]
                         + [(None, d) for d in ("split", "fused_atomic", "deterministic")],
                         ids=[f"small_tiles-{d}" for d in DKV_PATHS]
                         + [f"default-{d}" for d in ("split", "fused_atomic", "deterministic")])
def test_sparse_mla_kernel_matches_reference(kern, monkeypatch, dkv, config):
    """Each key-gradient path: the separate pass over stored dS and P (the default from 32 heads), the fused
    kernel's atomics (the default below), the deterministic reduction; the two atomic paths also with the keys
    walked in partitions (4 ranges of 6 keys, the fused kernel's fp32 dq accumulated over 3 blocks of query rows),
    and with their rows added four columns at a time (`DSAKernelTuning.vector_atomics`, the interpreter's form of
    the GPU's 16-byte reductions). The backward runs as the DSA layer calls it (dO head-major, the head sums asked
    for); through autograd (`SparseMLAFunction.backward`, which passes the tuning and the deterministic flag on)
    in the partitioned fused and the deterministic cases."""
    sm = kern["sparse_mla"]
    deterministic, partitioned = dkv == "deterministic", dkv.endswith("partitioned")
    fused_parts = dkv == "fused_atomic_partitioned"
    tuning = DSAKernelTuning(vector_atomics=dkv.endswith("_vector"))
    if tuning.vector_atomics:
        from pretrain.model.dsa.kernels import atomics

        assert atomics.reduction_mode(torch.zeros(1), 24, 8, vector=True) == 1
    mode = {"split": KeyGradient.SEPARATE, "fused_atomic": KeyGradient.FUSED,
            "deterministic": None}[dkv.removesuffix("_partitioned").removesuffix("_vector")]
    tuning = replace(tuning, key_gradient=mode)
    if partitioned:
        # the fused kernel through its default budget, the separate pass through an explicit one
        budget = "fused_partition_bytes" if mode is KeyGradient.FUSED else "key_partition_bytes"
        tuning = replace(tuning, dq32_bytes=2 * 5 * 32 * 4 * 8, **{budget: 6 * 32 * 6})
        budget = kernel_plan(5, 24, 8, 21, None, tuning).partition_bytes
        assert key_partitions(21, 32, budget) == [(0, 6), (6, 12), (12, 18), (18, 21)]
    if config is not None:  # several key blocks and latent column slices per token; blocks of query rows
        tuning = replace(tuning, triton_tiles=config, dkv_tiles=(16, 16, 4, 1),
                         dkv_scratch_bytes=2 * 12 * 2 * 5 * 4 * 8)  # 8 of 21 rows per block
    # what the backward launched: the fused kernel's partition flags, the separate pass's key ranges
    flags, ranges = [], set()
    bwd_kernel, key_gradient = sm._bwd_kernel, sm.key_gradient

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kw):
                flags.append(kw["PART"])
                return bwd_kernel[grid](*args, **kw)
            return run

    def spy_key_gradient(*args, **kw):
        ranges.add(args[-1])
        return key_gradient(*args, **kw)

    monkeypatch.setattr(sm, "_bwd_kernel", Spy())
    monkeypatch.setattr(sm, "key_gradient", spy_key_gradient)
    q, kv, idx = sparse_case(3)
    scale = 0.3
    q1, kv1 = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out, lse = sm.sparse_mla_attention(q1, kv1, idx.int(), scale, 24, deterministic, tuning)
    q2, kv2 = q.double().requires_grad_(), kv.double().requires_grad_()
    ref, ref_lse = ref_sparse_mla(q2, kv2, idx, scale, 24, 7)
    assert rel(out, ref) < 1e-5 and rel(lse, ref_lse) < 1e-6
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    rdq, rdkv = torch.autograd.grad(ref, (q2, kv2), g.double())

    def check_launches():
        # the fused kernel walks 4 key ranges per block of 8 query rows (3 blocks); the separate pass's first
        # kernel runs once per block and only its key-gradient pass walks the ranges
        assert flags == ([True] * 12 if fused_parts else [False] * len(flags)) and flags
        parts = {(0, 6), (6, 12), (12, 18), (18, 21)} if partitioned else {None}
        assert ranges == (parts if mode is KeyGradient.SEPARATE else set())
        flags.clear(), ranges.clear()

    # the backward's by-product, the indexer loss's target: sum_h P_h at every slot (0 on empty ones); dO given
    # head-major here ([h, b, s, c] in memory, as W_UV's product hands it over), read in place
    head_sums = torch.zeros(idx.shape, dtype=torch.float32)
    g_hm = g.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    assert not g_hm.is_contiguous() and torch.equal(g_hm, g)
    dq_h, dkv_h = sm.sparse_mla_backward(q, kv, idx.int(), lse.detach(), sm.output_delta(g_hm, out.detach()), g_hm,
                                         scale, 24, deterministic, head_sums=head_sums, tuning=tuning)
    assert rel(dq_h, rdq) < 1e-5 and rel(dkv_h, rdkv) < 1e-5
    check_launches()
    want = torch.einsum("bshd,bskd->bshk", q.double(), gather_keys(kv.double(), idx)) * scale
    want = want.masked_fill((idx < 0)[:, :, None], NEG_INF).softmax(-1).sum(2)
    assert (want[idx < 0] == 0).all() and rel(head_sums, want) < 1e-6
    if deterministic or fused_parts:  # through autograd
        dq, dkv = torch.autograd.grad(out, (q1, kv1), g)
        assert rel(dq, rdq) < 1e-5 and rel(dkv, rdkv) < 1e-5
        check_launches()
        if deterministic:  # bitwise reproducible: a second run (another dO layout, head sums on) gives the same bits
            assert torch.equal(dq, dq_h) and torch.equal(dkv, dkv_h)


@pytest.mark.parametrize("c", [24, 300])
def test_output_delta_kernel_matches_float64(kern, c):
    """Delta = rowsum(dO * O) from the kernel against float64: bf16 inputs, rows not a multiple of the kernel's
    block, columns spanning one or two column blocks, dO and O in other layouts (read in place)."""
    sm = kern["sparse_mla"]
    gen = torch.Generator().manual_seed(11)
    out = torch.randn(2, 19, 3, c, generator=gen).bfloat16()
    grad = torch.randn(19, 2, 3, c, generator=gen).bfloat16().transpose(0, 1)
    want = (grad.double() * out.double()).sum(-1)
    got = sm.output_delta(grad, out)
    assert got.dtype == torch.float32 and got.shape == (2, 19, 3)
    assert rel(got, want) < 1e-6
    head_major = grad.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)  # [h, b, s, c] in memory
    assert torch.equal(sm.output_delta(head_major, out.transpose(0, 1).contiguous().transpose(0, 1)), got)
    with pytest.raises(ValueError, match="differ"):
        sm.output_delta(grad[:, :5], out)


def test_unpack_kernel_matches_the_naive_rule(kern):
    """The one-pass unpack of int16-packed top-k indices against the rule written out per element: -1 stays -1
    (an empty slot), any other value is its unsigned 16-bit reading (keys 32768..65534 wrap to negative int16);
    a size not a multiple of the kernel's block, and a non-contiguous input."""
    gen = torch.Generator().manual_seed(3)
    idx = torch.randint(-1, 65535, (2, 37, 130), generator=gen, dtype=torch.int32)
    idx[0, 0, :5] = torch.tensor([-1, 0, 32767, 32768, 65534])
    packed = idx.to(torch.int16)
    naive = torch.tensor([-1 if v == -1 else v % 65536 for v in packed.flatten().tolist()], dtype=torch.int32)
    assert torch.equal(naive.view(idx.shape), idx)  # the rule inverts the packing
    got = kern["packed_indices"].unpack(packed)
    assert got.dtype == torch.int32 and torch.equal(got, idx)
    assert torch.equal(kern["packed_indices"].unpack(packed.transpose(1, 2)), idx.transpose(1, 2))
    with pytest.raises(ValueError, match="int16"):
        kern["packed_indices"].unpack(idx)


def test_valid_counts_match_a_python_count(kern):
    """`valid_counts`, the sparse kernels' per-row count of non-negative slots, against a Python count per row:
    valid slots anywhere in the row, rows with none or all, a width past the kernel's block (2,048), int64 indices,
    a non-contiguous batch stride."""
    count = kern["packed_indices"].valid_counts
    gen = torch.Generator().manual_seed(5)
    for shape, dtype in (((2, 9, 37), torch.int32), ((1, 4, 2500), torch.int64), ((3, 5, 1), torch.int32)):
        idx = torch.randint(-3, 50, shape, generator=gen, dtype=dtype)
        idx[0, 0] = -1
        if shape[1] > 1:
            idx[-1, 1] = 7
        want = torch.tensor([[sum(v >= 0 for v in row) for row in rows] for rows in idx.tolist()], dtype=torch.int32)
        got = count(idx)
        assert got.dtype == torch.int32 and torch.equal(got, want)
    wide = torch.randint(-1, 9, (4, 6, 40), generator=gen, dtype=torch.int32)
    assert torch.equal(count(wide[::2, :, :33]), (wide[::2, :, :33] >= 0).sum(-1).int())
    with pytest.raises(ValueError, match="int32 / int64"):
        count(wide.short())


@pytest.mark.parametrize("mode", [0, 1])
def test_add_rows_matches_naive(kern, mode):
    """The key gradients' row adds (`atomics.add_rows`) against a float64 loop: rows selected twice or more sum
    their adds, empty slots add nothing, columns start at an offset and stop at a limit inside the tile. Mode 1 is
    the interpreter's form of the GPU's 16-byte vector reductions (the same grouping of four columns); mode 2
    itself runs in tests/test_gpu_dsa_kernels.py and its PTX is checked below."""
    from tests.dsa_atomics_kernel import run_add_rows

    got, want = run_add_rows(mode, "cpu")
    assert rel(got, want) < 1e-6


def test_reduction_mode_rules(kern):
    from pretrain.model.dsa.kernels import atomics

    buf = torch.zeros(4, 8)
    assert atomics.reduction_mode(buf, 512, 64) == 0  # the default: tl.atomic_add (vector form measured no faster)
    assert atomics.reduction_mode(buf, 512, 64, vector=True) == 1  # the interpreter's stand-in for the GPU's form
    assert atomics.reduction_mode(buf, 24, 6, vector=True) == 0  # a width not a multiple of 4: no 16-byte groups
    assert atomics.reduction_mode(buf.double(), 512, 64, vector=True) == 0


def test_gpu_build_adds_key_rows_with_vector_reductions():
    """Each key-gradient kernel compiled for sm_90 on this CPU machine (Triton's own ptxas): with RED=2 its fp32 rows
    go out only as red.global.add.v4.f32, with RED=0 only as scalar atomics (Triton 3.6 lowers tl.atomic_add
    so whatever the layout), four times as many."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tests.dsa_sm90_build"], capture_output=True, text=True, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    for kernel in ("sparse_mla._bwd_kernel", "sparse_mla_dkv._dkv_kernel", "indexer_kl._sparse_kl_kernel"):
        vec, scalar = counts[f"{kernel} RED=2"], counts[f"{kernel} RED=0"]
        assert vec["scalar"] == 0 and vec["vector"] > 0, (kernel, vec)
        assert scalar["vector"] == 0 and scalar["scalar"] == 4 * vec["vector"], (kernel, scalar)


def naive_selected_scores(q, k, w, idx):
    """Index scores at the selected keys, gathered: [b, s, K], -inf on empty slots."""
    b, _, _, d = q.shape
    keys = k[torch.arange(b)[:, None, None], idx.clamp(min=0)]  # [b, s, K, d]
    z = torch.einsum("bshd,bskd->bshk", q, keys)
    return (z.relu() * w[..., None]).sum(2).mul(d**-0.5).masked_fill(idx < 0, NEG_INF)


def selected_lse(q, k, w, idx):
    """log sum exp over each row's selected keys' scores, 0 for a row without keys."""
    out = torch.logsumexp(naive_selected_scores(q, k, w, idx), -1)
    return torch.where(torch.isinf(out), 0.0, out)


def naive_sparse_kl(q, k, w, idx, p):
    """float64 autograd: mean over tokens of sum_j p log p - p log softmax(I)_j at the selected keys."""
    valid = idx >= 0
    scores = naive_selected_scores(q, k, w, idx)
    kl = torch.where(valid, torch.xlogy(p, p) - p * torch.log_softmax(scores, -1), 0.0)
    return kl.sum() / (q.shape[0] * q.shape[1])


@pytest.mark.parametrize("mode", ["causal", "segments", "cp"])
def test_topk_lse_of_the_selection(kern, mode):
    """`indexer_topk`'s lse: log sum exp of the index scores at the keys it selected, against float64 (rows with
    fewer visible keys than k, documents, keys gathered over context parallelism; rows in two buffer blocks)."""
    kt = kern["indexer_topk"]
    gen = torch.Generator().manual_seed(6)
    b, s, hi, d = 2, 20 if mode == "cp" else 37, 3, 16
    t = 2 * s if mode == "cp" else s
    q, k, w = torch.randn(b, s, hi, d, generator=gen), torch.randn(b, t, d, generator=gen), torch.rand(b, s, hi, generator=gen)
    keys, _ = visibility(mode, b, s, t)
    lo, hi_ = kt.visible_ranges(*keys.ranges())
    lse = torch.full((b, s), float("nan"))
    idx = kt.indexer_topk(q, k, w, 7, lo, hi_, buffer_bytes=4 * t * b * 16, lse=lse)
    want = selected_lse(q.double(), k.double(), w.double(), idx.long())
    assert bool((idx < 0).any()) and rel(lse, want) < 1e-6
    with pytest.raises(ValueError, match="lse"):
        kt.indexer_topk(q, k, w, 7, lo, hi_, lse=lse, k_scale=torch.ones(b, t))


# A given lse only spares the kernel its own pass over the selection: it is crossed with the cases where the lse
# meets something else (rows in blocks, more keys than queries, the normalized target, the plain case), not with
# the key-gradient reductions (deterministic, vector) or the tile order (heads_m), which take the lse alike from
# either source.
@pytest.mark.parametrize("case, lse", [(case, False) for case in ("atomic", "deterministic", "vector", "row_blocks",
                                                                  "cp_keys", "heads_m", "normalize")]
                         + [(case, True) for case in ("atomic", "row_blocks", "cp_keys", "normalize")],
                         ids=lambda v: {False: "own_lse", True: "given_lse"}.get(v, v) if isinstance(v, bool) else v)
def test_sparse_kl_kernel_matches_float64(kern, case, lse):
    """The fused sparse indexer loss: loss, target mass and the gradients of q_I, k_I and w against float64
    autograd; empty slots, rows with no key (padding), an unnormalized target row (the P factor), the target asked
    for in row blocks, key rows added four columns at a time, the deterministic reduction, more keys than
    queries (the keys gathered over context parallelism), heads as the products' M; with lse formed by the kernel
    or given (float64, as the top-k's would be). `normalize`: the kernel gets raw head sums (rows of any scale, a
    row of zeros) and a gradient factor, and matches float64 over the normalized rows with scaled gradients."""
    tuning = DSAKernelTuning(vector_atomics=case == "vector")
    kl = kern["indexer_kl"]
    if case == "heads_m":
        tuning = replace(tuning, kl_tiles=tuning.kl_tiles[:3] + (0,))
    gen = torch.Generator().manual_seed(4)
    b, s, hi, d, topk = 2, 29, 3, 16, 9
    t = s + 6 if case == "cp_keys" else s
    q, k = torch.randn(b, s, hi, d, generator=gen), torch.randn(b, t, d, generator=gen)
    w = torch.randn(b, s, hi, generator=gen)
    scores = torch.rand(b, s, t, generator=gen).masked_fill(~torch.ones(s, t, dtype=torch.bool).tril(t - s), NEG_INF)
    idx = ref_topk(scores, topk)
    idx[1, 5] = -1  # a token with no key
    valid = idx >= 0
    p = torch.rand(b, s, topk, generator=gen).masked_fill(~valid, 0.0)
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-30)
    p[0, 20] *= 0.7
    calls = []
    normalize, grad_scale = case == "normalize", 2.5 if case == "normalize" else 1.0
    given_p = p
    if normalize:  # raw head sums: each row at its own scale (as sum_h P_h sums to h), one row all zeros
        given_p = p * (1.0 + 15.0 * torch.rand(b, s, 1, generator=gen))
        given_p[0, 3] = 0.0
        p = given_p.double() / given_p.double().sum(-1, keepdim=True).clamp(min=1e-300)

    def target(r0, r1, rows_idx):
        calls.append((r0, r1))
        assert torch.equal(rows_idx, idx[:, r0:r1].int())
        return given_p[:, r0:r1]

    rows = 8 if case == "row_blocks" else None
    given = selected_lse(q.double(), k.double(), w.double(), idx).float() if lse else None
    loss, (dq, dk, dw), psum = kl.sparse_kl(q, k, w, idx.int(), target, rows, deterministic=case == "deterministic",
                                            lse=given, normalize=normalize, grad_scale=grad_scale, tuning=tuning)
    assert calls == ([(0, 8), (8, 16), (16, 24), (24, 29)] if rows else [(0, s)])
    leaves = [x.double().requires_grad_() for x in (q, k, w)]
    ref = naive_sparse_kl(*leaves, idx, p.double())
    ref_grads = [g * grad_scale for g in torch.autograd.grad(ref, leaves)]
    assert ref.item() > 1e-2 and abs(loss.item() - ref.item()) < 1e-6 * ref.item()
    assert abs(psum.item() - p.double().sum().item() / (b * s)) < 1e-6
    for name, got, want in zip("qkw", (dq, dk, dw), ref_grads):
        assert got.dtype == torch.float32 and want.abs().max() > 0 and rel(got, want) < 1e-5, name
    assert dq[1, 5].abs().max() == 0 and dw[1, 5].abs().max() == 0
