"""Document-isolated attention without a mask tensor (pretrain/model/documents.py, document_attention.py).

Reference: a float64 naive softmax(QK^T)V under megatron's dense block-diagonal causal mask, built here from the
packed tokens by `data_pipeline.packing.block_causal_mask` (what megatron's `_get_ltor_masks_and_position_ids`
builds, checked in tests/test_packing.py). Cases: MLA-like (qk != v head dims) and GQA shapes, micro-batch 2
with different documents per sample, context parallelism 1 / 2 / 4 (each rank's two query chunks against the
whole sequence's keys), a sliding window, and gradients. GPU: the FlashAttention varlen path against the same
reference in bf16.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType

from data_pipeline.packing import block_causal_mask, collate_batch, pack_sample
from parallel.context_parallel import local_positions, split_sequence
from pretrain.model.core_attention import SDPACoreAttention
from pretrain.model.documents import attention_plan, document_layout, query_blocks, rope_positions

EOD, PAD = 0, -1


def windows(b: int, s: int, docs_per_window: int, seed: int = 0) -> torch.Tensor:
    """b windows of s + 1 tokens with EODs at random places (documents of very different lengths)."""
    gen = torch.Generator().manual_seed(seed)
    text = torch.randint(1, 50, (b, s + 1), generator=gen)
    for row in range(b):
        text[row, torch.randint(0, s, (docs_per_window,), generator=gen)] = EOD
    return text


def batch_of(text: torch.Tensor, reset_positions: bool = True) -> dict:
    return collate_batch([pack_sample(t, EOD, PAD, reset_positions, True, False) for t in text])


def naive(q, k, v, scale, masked):
    """q [s, b, h, d], k / v [t, b, g, *], masked [b, s, t] (True = masked) -> [s, b, h * dv] float64."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.double().repeat_interleave(rep, dim=2), v.double().repeat_interleave(rep, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q.double(), k) * scale
    probs = scores.masked_fill(masked[:, None], float("-inf")).softmax(-1)
    out = torch.einsum("bhst,tbhd->sbhd", probs, v)
    return out.reshape(out.shape[0], out.shape[1], -1)


def make(heads, dk, dv, window=None):
    config = SimpleNamespace(cp_attention="merged", context_parallel_size=1, attention_dropout=0.0, kv_channels=dk, window_size=window,
                             num_attention_heads=heads, experimental_attention_variant=None)
    return SDPACoreAttention(config, 1, AttnMaskType.causal, k_channels=dk, v_channels=dv, softmax_scale=dk**-0.5)


def dense_masks(batch) -> torch.Tensor:
    return torch.cat([block_causal_mask(t, EOD) for t in batch["tokens"]])  # [b, s, s]


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("heads,groups,dk,dv", [(4, 4, 24, 16), (4, 2, 16, 16)])
def test_documents_match_the_dense_mask(cp, heads, groups, dk, dv):
    """Every rank's queries (its two chunks under CP) see exactly their own document's earlier keys."""
    s, b = 48, 2
    batch = batch_of(windows(b, s, 5))
    layout = document_layout(batch["cu_seqlens"], batch["position_ids"], b, s)
    q, k, v = torch.randn(s, b, heads, dk), torch.randn(s, b, groups, dk), torch.randn(s, b, groups, dv)
    ref = naive(q, k, v, dk**-0.5, dense_masks(batch))
    attn = make(heads, dk, dv)
    for rank in range(cp):
        mine = split_sequence(q, 0, cp, rank)
        plan = attention_plan(layout, query_blocks(s // cp, cp, rank, s))
        assert plan.isolated
        out = attn.attend_documents(mine, k, v, plan)
        want = ref[local_positions(s // cp, cp, rank)]
        assert ((out - want).abs().max() / want.abs().max()).item() < 1e-6, rank


def test_forward_takes_the_layout_and_gradients_match():
    s, b, h, d = 40, 2, 2, 16
    batch = batch_of(windows(b, s, 4, seed=1), reset_positions=False)  # megatron's MLA / GQA take no restarts
    layout = document_layout(batch["cu_seqlens"], batch["position_ids"], b, s)
    q, k, v = (torch.randn(s, b, h, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = make(h, d, d)(q, k, v, layout)
    ref = naive(q, k, v, d**-0.5, dense_masks(batch))
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    assert (out - ref).abs().max().item() < 1e-10
    for g, w in zip(got, want):
        assert (g - w).abs().max().item() < 1e-10


def test_sliding_window_within_documents():
    s, b, h, d, window = 40, 1, 2, 8, (5, 0)
    batch = batch_of(windows(b, s, 3, seed=2), reset_positions=False)
    layout = document_layout(batch["cu_seqlens"], batch["position_ids"], b, s)
    q, k, v = (torch.randn(s, b, h, d) for _ in range(3))
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    masked = dense_masks(batch) | (j < i - window[0])
    out = make(h, d, d, window)(q, k, v, layout)
    ref = naive(q, k, v, d**-0.5, masked)
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-6


def test_megatron_attention_refuses_restarted_positions():
    """Where megatron's MLA / GQA applied RoPE by window positions, a layout that restarts them is refused."""
    s, h, d = 16, 2, 8
    batch = batch_of(windows(1, s, 2, seed=5))
    layout = document_layout(batch["cu_seqlens"], batch["position_ids"], 1, s)
    q, k, v = (torch.randn(s, 1, h, d) for _ in range(3))
    with pytest.raises(ValueError, match="data.reset_position_ids"):
        make(h, d, d)(q, k, v, layout)


def test_layout_positions_and_starts_against_the_sample():
    s, b = 64, 3
    text = windows(b, s, 6, seed=3)
    batch = batch_of(text)
    layout = document_layout(batch["cu_seqlens"], batch["position_ids"], b, s)
    assert layout.shape == (b, 2, s) and layout.dtype == torch.int32
    for row in range(b):
        tokens = batch["tokens"][row].tolist()
        start, starts = 0, []
        for i, t in enumerate(tokens):
            starts.append(start)
            if t == EOD:
                start = i + 1
        assert layout[row, 0].tolist() == starts
    assert torch.equal(rope_positions(layout, torch.arange(s)), batch["position_ids"])
    # neither documents nor restarted positions: no layout at all (the model's plain causal path)
    plain = collate_batch([pack_sample(t, EOD, PAD, False, False, False) for t in text])
    assert document_layout(plain["cu_seqlens"], plain["position_ids"], b, s) is None
    # positions restart but documents see each other: a layout whose plan is not isolated
    loose = collate_batch([pack_sample(t, EOD, PAD, True, False, False) for t in text])
    loose_layout = document_layout(loose["cu_seqlens"], loose["position_ids"], b, s)
    plan = attention_plan(loose_layout, query_blocks(s))
    assert not plan.isolated and plan.positions_reset


@pytest.mark.gpu
@pytest.mark.parametrize("cp", [1, 2])
def test_varlen_path_on_gpu(cp):
    """bf16 on CUDA at MLA's head dims (256, 256): FlashAttention varlen (one call) and the per-piece SDPA calls
    both within twice the bf16 dense-mask path's error of fp32 attention."""
    from pretrain.model.document_attention import choose_method, document_attention

    torch.manual_seed(0)
    s, b, h, d = 4096, 1, 16, 256
    batch = batch_of(windows(b, s, 9))
    layout = document_layout(batch["cu_seqlens"], batch["position_ids"], b, s).cuda()
    q, k, v = (torch.randn(s, b, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    attn = make(h, d, d)
    masks = dense_masks(batch).cuda()
    for rank in range(cp):
        mine = split_sequence(q, 0, cp, rank)
        rows = local_positions(s // cp, cp, rank, q.device)
        plan = attention_plan(layout, query_blocks(s // cp, cp, rank, s))
        assert choose_method(mine, v, None, 0.0) == "varlen"
        exact = attn.attend(mine.float(), k.float(), v.float(), masks[:, rows].unsqueeze(1))
        masked = attn.attend(mine, k, v, masks[:, rows].unsqueeze(1)).float()
        bound = 2 * (masked - exact).abs().max().item()

        def piece(q_, k_, v_, lower_right, mask=None):
            return attn.attend(q_, k_, v_, mask, AttnMaskType.causal, lower_right=lower_right)

        for method in ("varlen", "split"):
            out = document_attention(mine, k, v, plan, d**-0.5, piece, method=method).float()
            assert (out - exact).abs().max().item() <= bound, (method, rank)


def test_plan_is_linear_in_the_sequence():
    """The plan of a 128K window with a few hundred documents: pieces and nothing of size S x S."""
    s = 131072
    batch = batch_of(windows(1, s, 300, seed=4))
    layout = document_layout(batch["cu_seqlens"], batch["position_ids"], 1, s)
    plan = attention_plan(layout, query_blocks(s // 4, 4, 1, s))
    assert sum(q1 - q0 for q0, q1, _, _ in plan.pieces[0]) == s // 4
    assert math.prod(layout.shape) * 4 < 2**21  # 1 MiB


def fake_varlen(with_window: bool):
    """FlashAttention varlen's contract in float64 (bottom-right causal per segment), with the newer keyword
    signature (scale, window_size, enable_gqa) or the 2.10 one (is_causal only)."""

    def run(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, enable_gqa=False, causal=True):
        assert q.dim() == 3 and q.is_contiguous() and k.is_contiguous() and cu_q.dtype == torch.int32
        assert causal and (enable_gqa or k.shape[1] == q.shape[1])
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
        for i in range(cu_q.numel() - 1):
            q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
            assert q1 - q0 <= max_q and k1 - k0 <= max_k and k1 - k0 >= q1 - q0
            rep = q.shape[1] // k.shape[1]
            kk, vv = (t[k0:k1].double().repeat_interleave(rep, dim=1) for t in (k, v))
            scores = torch.einsum("qhd,khd->hqk", q[q0:q1].double(), kk) * scale
            i_ = torch.arange(q1 - q0)[:, None] + (k1 - k0) - (q1 - q0)
            scores = scores.masked_fill(torch.arange(k1 - k0)[None, :] > i_, float("-inf"))
            out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)
        return out.to(q.dtype)

    if with_window:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1), enable_gqa=False):
            return run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, enable_gqa, window_size == (-1, 0))
    else:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
            return run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal=is_causal)
    return varlen_attn


@pytest.mark.parametrize("with_window", [True, False])
@pytest.mark.parametrize("cp", [1, 2])
def test_varlen_packing_against_the_dense_mask(monkeypatch, with_window, cp):
    """The varlen path's packing (queries as they lie, keys tiled or gathered per piece, offsets, GQA, scale,
    output layout) checked on CPU through a float64 stand-in for `varlen_attn` with its documented contract."""
    from pretrain.model import document_attention

    monkeypatch.setattr(document_attention, "_varlen", lambda: fake_varlen(with_window))
    s, b, heads, groups, d = 48, 2, 4, 2, 16
    batch = batch_of(windows(b, s, 5, seed=7))
    layout = document_layout(batch["cu_seqlens"], batch["position_ids"], b, s)
    q, k, v = torch.randn(s, b, heads, d), torch.randn(s, b, groups, d), torch.randn(s, b, groups, d)
    scale = 0.3  # not d^-1/2: the 2.10 signature has no scale argument
    ref = naive(q, k, v, scale, dense_masks(batch))
    for rank in range(cp):
        plan = attention_plan(layout, query_blocks(s // cp, cp, rank, s))
        out = document_attention.varlen_attention(split_sequence(q, 0, cp, rank), k, v, plan, scale)
        want = ref[local_positions(s // cp, cp, rank)]
        assert out.shape == want.shape and ((out - want).abs().max() / want.abs().max()).item() < 1e-5, rank
