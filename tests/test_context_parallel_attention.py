"""Context-parallel attention as blocks merged by log-sum-exp (pretrain/model/blockwise_attention.py), against a
float64 naive softmax(QK^T)V with a dense visibility mask built here.

Cases: query rows against 1-3 key blocks (causal squares and non-causal blocks), MLA-like (qk != v head dims) and
GQA shapes, fp32 and fp64; each CP rank's two chunks (`SDPACoreAttention.attend_cp_causal`) at CP 2 and 4, without
and with packed documents (`attend_documents`: a document continued from an earlier chunk is a non-causal block
over its own earlier keys plus a causal square), outputs and the gradients of q, k and v summed over the ranks (what
the gather's reduce-scatter hands back). Multi-rank CP = 1 / 2 / 4 layer equality: tests/test_context_parallel.py.
GPU: cuDNN / FlashAttention-2 in bf16 against the fp32 reference, within twice the error of SDPA's own call.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType

from parallel.context_parallel import local_positions, split_sequence
from pretrain.model import blockwise_attention as bw
from pretrain.model.core_attention import SDPACoreAttention
from pretrain.model.documents import attention_plan, document_layout, query_blocks


def naive(q, k, v, scale, visible):
    """q [b, h, s, d], k / v [b, g, t, *], visible [s, t] or [b, s, t] bool -> [b, h, s, dv] float64."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, dim=1), v.double().repeat_interleave(rep, dim=1)
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    mask = visible if visible.dim() == 3 else visible[None]
    return scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1) @ v


def rows_visibility(rows, s: int, t: int) -> torch.Tensor:
    visible = torch.zeros(s, t, dtype=torch.bool)
    for q0, q1, blocks in rows:
        for k0, k1, causal in blocks:
            block = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
            visible[q0:q1, k0:k1] = block.tril() if causal else block
    return visible


def rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


ROWS = [  # rows 0-3: one causal square; 4-9: a non-causal block and a square; 10-13: three blocks
    (0, 4, ((3, 7, True),)),
    (4, 10, ((0, 2, False), (11, 17, True))),
    (10, 14, ((17, 20, False), (0, 3, False), (7, 11, True))),
]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("heads,groups,dk,dv", [(4, 4, 24, 16), (4, 2, 16, 16), (2, 2, 8, 12)])
def test_blocks_merged_by_lse_match_naive_attention(dtype, tol, heads, groups, dk, dv):
    b, s, t, scale = 2, 14, 20, 0.3
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen, dtype=torch.float64)
               for shape in ((b, heads, s, dk), (b, groups, t, dk), (b, groups, t, dv)))
    grad = torch.randn(b, heads, s, dv, generator=gen, dtype=torch.float64)
    leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    out = bw.blockwise_attention(*leaves, ROWS, scale, bw.CPU)
    got = torch.autograd.grad(out, leaves, grad.to(dtype))
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = naive(*ref_leaves, scale, rows_visibility(ROWS, s, t))
    want = torch.autograd.grad(ref, ref_leaves, grad)
    assert out.dtype == dtype and rel(out, ref) < tol
    for name, g, w in zip("qkv", got, want):
        assert rel(g, w) < tol, name


def core(heads, dk, dv, dropout=0.0):
    config = SimpleNamespace(cp_attention="merged", context_parallel_size=1, attention_dropout=dropout, kv_channels=dk,
                             num_attention_heads=heads, experimental_attention_variant=None)
    return SDPACoreAttention(config, 1, AttnMaskType.causal, k_channels=dk, v_channels=dv, softmax_scale=dk**-0.5)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("documents", [False, True])
def test_cp_ranks_and_their_gradients_match_naive_causal_attention(cp, documents, caplog):
    """Every rank's two chunks against the gathered keys; outputs per rank, gradients summed over the ranks."""
    from pretrain.notices import forget_said

    s, b, heads, groups, dk, dv = 16 * cp, 2, 4, 2, 24, 16
    gen = torch.Generator().manual_seed(cp)
    q, k, v = (torch.randn(shape, generator=gen) for shape in ((s, b, heads, dk), (s, b, groups, dk),
                                                                (s, b, groups, dv)))
    grad = torch.randn(s, b, heads * dv, generator=gen)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    visible = causal.expand(b, s, s)
    layout = None
    if documents:  # documents crossing chunk boundaries (chunks of 8 tokens), one longer than a chunk
        starts = [[0, 3, 13, 14, 30], [0, 21]]
        cu = torch.tensor([r * s + x for r, row in enumerate(starts) for x in row] + [b * s], dtype=torch.int32)
        layout = document_layout(cu, None, b, s)
        doc = layout[:, 0].long()
        visible = causal & (doc[:, :, None] == doc[:, None, :])
    attn = core(heads, dk, dv)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    forget_said()
    with caplog.at_level(logging.INFO, logger="pretrain.model.core_attention"):
        for rank in range(cp):
            mine = split_sequence(leaves[0], 0, cp, rank)
            if documents:
                out = attn.attend_documents(mine, leaves[1], leaves[2],
                                            attention_plan(layout, query_blocks(s // cp, cp, rank, s)))
            else:
                out = attn.attend_cp_causal(mine, leaves[1], leaves[2], cp, rank)
            rows = local_positions(s // cp, cp, rank)
            ref_rank = naive(*(x.permute(1, 2, 0, 3) for x in (q[rows], k, v)), dk**-0.5, visible[:, rows])
            assert rel(out, ref_rank.permute(2, 0, 1, 3).reshape(s // cp, b, -1)) < 1e-5, rank
            (out * split_sequence(grad, 0, cp, rank)).sum().backward()
    assert "merged by log-sum-exp (flash attention for CPU)" in caplog.text
    ref_leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref = naive(*(x.permute(1, 2, 0, 3) for x in ref_leaves), dk**-0.5, visible)
    ref.permute(2, 0, 1, 3).reshape(s, b, -1).backward(grad.double())
    for name, got, want in zip("qkv", leaves, ref_leaves):
        assert rel(got.grad, want.grad) < 1e-5, name


def test_dropout_keeps_the_bottom_right_calls_and_says_so(caplog):
    from pretrain.notices import forget_said

    q, k, v = torch.randn(8, 1, 2, 8), torch.randn(16, 1, 2, 8), torch.randn(16, 1, 2, 8)
    attn = core(2, 8, 8, dropout=0.1)
    forget_said()
    with caplog.at_level(logging.INFO, logger="pretrain.model.core_attention"):
        assert attn.attend_blocks(q, k, v, [bw.bottom_right_rows(0, 8, 0, 16)], "context-parallel attention") is None
    assert "bottom-right causal SDPA calls" in caplog.text and "attention dropout" in caplog.text
    with pytest.raises(ValueError, match="at least as many keys"):
        bw.bottom_right_rows(0, 8, 4, 10)


@pytest.mark.gpu
@pytest.mark.parametrize("cp", [2, 4])
def test_gpu_kernels_match_fp32_attention(cp):
    """bf16 on CUDA at MLA's head dims (qk 256, v 256): the merged blocks (cuDNN on Hopper) are as close to fp32
    attention as SDPA's own bf16 call on the same rows (within twice its error), gradients included."""
    torch.manual_seed(0)
    s, b, h, d = 4096, 1, 16, 256
    q, k, v = (torch.randn(s, b, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    kernel, why = bw.choose_kernel(*(x.permute(1, 2, 0, 3) for x in (q, k, v)), 0.0)
    assert kernel is not None, why
    if torch.cuda.get_device_capability()[0] == 9:
        assert kernel is bw.CUDNN
    attn = core(h, d, d)
    rank = cp - 1
    rows = local_positions(s // cp, cp, rank, q.device)
    masked = torch.arange(s, device="cuda")[None, :] > rows[:, None]
    grad = torch.randn(s // cp, b, h * d, device="cuda", dtype=torch.bfloat16)

    def run(fn, dtype):
        leaves = [x.detach().to(dtype).clone().requires_grad_() for x in (split_sequence(q, 0, cp, rank), k, v)]
        out = fn(*leaves)
        out.backward(grad.to(dtype))
        return [out.float()] + [x.grad.float() for x in leaves]

    merged = run(lambda *x: attn.attend_cp_causal(*x, cp, rank), torch.bfloat16)
    sdpa = run(lambda *x: attn.attend(*x, masked), torch.bfloat16)
    exact = run(lambda *x: attn.attend(*x, masked), torch.float32)
    for name, m, o, e in zip(("out", "dq", "dk", "dv"), merged, sdpa, exact):
        assert (m - e).abs().max() <= 2 * (o - e).abs().max() + 1e-3 * e.abs().max(), name
