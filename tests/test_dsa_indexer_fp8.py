"""The FP8 index scores of DSA's top-k (`pretrain.model.dsa.indexer_fp8`, `model.dsa_indexer_fp8`).

Checked against things they do not compute: e4m3 rounding against float64 and e4m3's own spacing; the kernel's
FP8 scores against the float64 formula on the dequantized rows; its selection against a naive sort of its own
scores (exact, ties included) and against the reference backend's FP8 selection; the model with the key against
the reference backend, both selecting in FP8.
"""

from __future__ import annotations

import json

import pytest
import torch

import triton  # noqa: F401  (the kernels run in its interpreter here; tests/conftest.py sets TRITON_INTERPRET)

from pretrain.model.dsa.indexer import VisibleKeys, index_scores, indexer_topk
from pretrain.model.dsa.indexer_fp8 import E4M3_MAX, quantize_rows, selection_inputs
from tests.dsa_references import NEG_INF, ref_topk


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


@pytest.fixture()
def ktop(kern):
    return kern["indexer_topk"]


def test_quantize_rows_rounds_to_e4m3_within_its_spacing():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=gen, dtype=torch.float64) * torch.logspace(-3, 3, 5, dtype=torch.float64)[:, None]
    x[1, 2] = 0.0  # an all-zero row: scale 1, zeros
    x8, scale = quantize_rows(x.bfloat16())
    assert x8.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (3, 5)
    assert scale[1, 2] == 1 and (x8[1, 2].float() == 0).all()
    xb = x.bfloat16().double()
    amax = xb.abs().amax(-1)
    assert torch.allclose(scale.double(), torch.where(amax > 0, amax / E4M3_MAX, 1.0), rtol=1e-6)
    y = x8.double() * scale.double()[..., None]
    # e4m3: 3 mantissa bits (rounding error <= 2^-4 relative) down to 2^-6, then a fixed step of 2^-9 (error 2^-10)
    u = xb / scale.double()[..., None]
    bound = torch.maximum(u.abs() * 2.0**-4, torch.full_like(u, 2.0**-10)) * scale.double()[..., None]
    assert ((y - xb).abs() <= bound * (1 + 1e-9)).all()
    assert (x8.double().abs().amax(-1)[amax > 0] == E4M3_MAX).all()  # each row's largest value maps to 448


def test_fp8_scores_are_the_scores_of_the_dequantized_rows():
    gen = torch.Generator().manual_seed(1)
    q, k, w = torch.randn(2, 9, 3, 32, generator=gen), torch.randn(2, 11, 32, generator=gen), torch.randn(2, 9, 3)
    q8, k8, w8, sk = selection_inputs(q.bfloat16(), k.bfloat16(), w)
    got = index_scores(q8, k8, w8, None, k_scale=sk)
    qd = q8.double() * quantize_rows(q.bfloat16())[1].double()[..., None]
    kd = k8.double() * sk.double()[..., None]
    want = index_scores(qd, kd, w.double(), None)
    assert rel(got, want) < 1e-6


@pytest.mark.parametrize("causal_prefix", [0, 4])
def test_fp8_score_kernel_and_selection(kern, ktop, causal_prefix):
    """The score kernel on e4m3 q_I / k_I with the key scales against float64; the selection of its scores, and the
    whole FP8 top-k (rows in three buffer blocks), against a naive sort of its own scores (exact) and against the
    reference path's FP8 selection."""
    gen = torch.Generator().manual_seed(2 + causal_prefix)
    b, s, h, d = 2, 37, 3, 32
    t = s + causal_prefix
    q, k, w = torch.randn(b, s, h, d, generator=gen), torch.randn(b, t, d, generator=gen), torch.randn(b, s, h, generator=gen)
    k[:, 3::7] = 0.0  # keys scoring exactly 0: ties at the top-k boundary
    keys = VisibleKeys(s, t, "cpu")
    lo, hi = ktop.visible_ranges(*keys.ranges())
    vis = keys.rows(0, s).expand(b, -1, -1)
    q8, k8, w8, sk = selection_inputs(q.bfloat16(), k.bfloat16(), w)
    buf = torch.full((b, s, t), float("nan"))
    ktop.index_score_rows(q8, k8, w8, lo, hi, 0, s, buf, block_n=16, k_scale=sk)
    want = index_scores(q8.double(), k8.double(), w8.double(), vis, k_scale=sk.double())
    assert rel(buf[vis], want[vis]) < 1e-6
    scores = buf.masked_fill(~vis, NEG_INF)
    for topk in (1, 6) if causal_prefix == 0 else (6,):  # k = 1 once: the prefix changes only the ranges
        got = torch.full((b, s, topk), -7, dtype=torch.int32)
        kern["radix_select"].select_rows(buf, lo, hi, 0, s, topk, got)
        assert torch.equal(got.long(), ref_topk(scores, topk)), topk
        assert torch.equal(got.long(), indexer_topk(q8, k8, w8, topk, keys, 5, k_scale=sk))
    topk = 40  # the whole kernel once: more keys than most rows see
    got = ktop.indexer_topk(q8, k8, w8, topk, lo, hi, buffer_bytes=4 * t * b * 16, block_n=16, k_scale=sk)
    assert torch.equal(got.long(), ref_topk(scores, topk)), topk
    assert torch.equal(got.long(), indexer_topk(q8, k8, w8, topk, keys, 5, k_scale=sk))


def test_backends_select_in_fp8_alike_and_differ_from_bf16(ktop):
    from pretrain.model.dsa.backend import ReferenceBackend, TritonBackend

    gen = torch.Generator().manual_seed(5)
    b, s, h, d = 1, 64, 4, 32
    q = torch.randn(b, s, h, d, generator=gen).bfloat16()
    k = (torch.randn(b, s, d, generator=gen) * torch.rand(b, s, 1, generator=gen)).bfloat16()
    w = torch.randn(b, s, h, generator=gen)
    keys = VisibleKeys(s, s, "cpu")
    fp8 = TritonBackend(indexer_fp8=True).topk(q, k, w, 16, keys, 8)
    assert torch.equal(fp8, ReferenceBackend(indexer_fp8=True).topk(q, k, w, 16, keys, 8))
    bf16 = ReferenceBackend().topk(q, k, w, 16, keys, 8)
    assert not torch.equal(fp8, bf16)  # the key changes what is selected (e4m3 rounding moves near-ties)
    shared = sum(len(set(a.tolist()) & set(c.tolist())) for a, c in zip(fp8[0], bf16[0]))
    assert shared >= 0.9 * int((bf16 >= 0).sum())  # ...but only near the boundary


def test_model_selects_in_fp8_on_both_backends(ktop, tmp_path):
    """Sparse attention and the sparse indexer loss with model.dsa_indexer_fp8: Triton against the reference backend
    (losses and gradients), and every DSA layer's backend selecting in FP8."""
    from pretrain.convert import load_hf_model
    from tests.dsa_helpers import NO_TIE_INDEX_HEADS, hf_checkpoint, lm_step, relative_error, tokens

    hf_checkpoint(tmp_path, 43, layers=2, dense=1, index_topk=6, index_n_heads=NO_TIE_INDEX_HEADS)
    ids_all = tokens(43, 2, 13)  # 12 tokens, 6 of them see more keys than the top-6 (interpreter time grows with them)
    ids, labels = ids_all[:, :-1], ids_all[:, 1:]
    common = dict(mtp_num_layers=None, dsa_indexer_loss_coeff=0.5, dsa_indexer_use_sparse_loss=True,
                  dsa_indexer_fp8=True)
    runs = {}
    for name in ("reference", "triton"):
        _, model = load_hf_model(str(tmp_path), dsa_kernel_backend=name, **common)
        runs[name] = lm_step(model, ids, labels, scale=1.0)
        backends = [m.backend for m in model.modules() if getattr(m, "backend", None) is not None]
        assert len(backends) == 2 and all(bk.indexer_fp8 and bk.name == name for bk in backends)
    (ref_loss, ref_grads, ref_kl), (loss, grads, kl) = runs["reference"], runs["triton"]
    assert relative_error(loss, ref_loss) <= 1e-5
    assert set(kl) == set(ref_kl) and len(kl) == 2
    for n, g in ref_grads.items():
        if g is not None:
            assert relative_error(grads[n], g) <= 1e-4, n


def test_accuracy_script_counts_against_python_sets(tmp_path, capsys):
    """benchmarks/dsa_indexer_fp8.py: recall and mass recall against Python sets and a float64 softmax on the same
    selections; the script on synthetic inputs and the tiny model; its refusals."""
    from benchmarks.dsa_indexer_fp8 import agreement, main, ratios

    gen = torch.Generator().manual_seed(7)
    b, s, h, d, topk = 1, 24, 2, 16, 5
    q, k, w = torch.randn(b, s, h, d, generator=gen).bfloat16(), torch.randn(b, s, d, generator=gen).bfloat16(), \
        torch.randn(b, s, h, generator=gen)
    keys = VisibleKeys(s, s, "cpu")
    got = ratios(agreement(q, k, w, keys, topk))
    vis = keys.rows(0, s).expand(b, -1, -1)
    ref = index_scores(q, k, w, vis)
    q8, k8, w8, sk = selection_inputs(q, k, w)
    sel, sel8 = select(ref, topk), select(index_scores(q8, k8, w8, vis, k_scale=sk), topk)
    p = torch.softmax(ref.double(), -1)
    shared = sum(len(a & c) for a, c in zip(sel, sel8))
    mass = sum(float(p[0, t, sorted(a)].sum()) for t, a in enumerate(sel))
    mass8 = sum(float(p[0, t, sorted(a)].sum()) for t, a in enumerate(sel8))
    assert got["recall"] == pytest.approx(shared / sum(map(len, sel)))
    assert got["mass_recall"] == pytest.approx(mass8 / mass, rel=1e-6)
    assert shared < sum(map(len, sel))  # e4m3 moved some near-ties here: the counts are not trivially 1

    out = tmp_path / "fp8.json"
    assert main(["--synthetic", "--seq", "300", "--heads", "4", "--dim", "32", "--topk", "40", "--rows", "50",
                 "--out", str(out)]) == 0
    row = json.loads(out.read_text())["layers"]["synthetic"]
    assert 0.5 < row["recall"] <= 1.0 and 0.9 < row["mass_recall"] <= 1.0 + 1e-9
    assert main(["--config", "configs/models/glm5-tiny.yaml", "--sequences", "1", "--out", str(out)]) == 0
    layers = json.loads(out.read_text())["layers"]
    assert "all" in layers and len(layers) >= 2 and all(0 < r["recall"] <= 1 for r in layers.values())
    losses = [layers["all"][f"lm_loss_{name}"] for name in ("dense", "bf16", "fp8")]
    assert all(0 < x < 20 for x in losses) and losses[0] != losses[1]  # dense attention really was switched on
    capsys.readouterr()
    for bad, msg in [(["--synthetic", "--rows", "0"], "--rows must be >= 1"),
                     (["--config", "configs/models/glm5-tiny.yaml", "model.dsa_indexer_fp8=true",
                       "model.dsa_indexer_use_sparse_loss=true"], "already selects in FP8"),
                     (["--config", "configs/models/glm5-tiny.yaml", "model.experimental_attention_variant=null"],
                      "is not a DSA model")]:
        with pytest.raises(SystemExit):
            main(bad)
        assert msg in capsys.readouterr().err


def select(scores, topk):
    """Each row's top-k as a Python set of key indices (float64 sort; the scores here have no ties)."""
    out = []
    for row in scores[0].double():
        finite = [(float(v), j) for j, v in enumerate(row) if v != float("-inf")]
        out.append({j for _, j in sorted(finite, key=lambda x: (-x[0], x[1]))[:topk]})
    return out
