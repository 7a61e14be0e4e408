"""SDPA core attention against a float64 naive softmax(QK^T)V, for MLA and GQA shapes."""

import math
from types import SimpleNamespace

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType

from pretrain.model.core_attention import SDPACoreAttention
from pretrain.model.specs import resolve_backend


def naive(q, k, v, scale, mask=None):
    # q [s, b, h, d], k/v [s, b, g, d]; mask True = masked
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q.double(), k.double()) * scale
    s, t = scores.shape[-2:]
    causal = torch.triu(torch.ones(s, t, dtype=torch.bool), 1)
    scores = scores.masked_fill(causal if mask is None else mask, float("-inf"))
    out = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v.double())
    return out.reshape(out.shape[0], out.shape[1], -1)


def make(heads, k_channels, v_channels, cp_attention="bottom_right"):
    config = SimpleNamespace(context_parallel_size=1, attention_dropout=0.0, kv_channels=k_channels,
                             num_attention_heads=heads, experimental_attention_variant=None, cp_attention=cp_attention)
    return SDPACoreAttention(config, 1, AttnMaskType.causal, k_channels=k_channels, v_channels=v_channels,
                             softmax_scale=1 / math.sqrt(k_channels))


@pytest.mark.parametrize("heads,groups,dk,dv", [(4, 4, 32, 32), (4, 4, 40, 24), (8, 2, 16, 16)])
def test_matches_naive(heads, groups, dk, dv):
    s, b = 19, 2
    q = torch.randn(s, b, heads, dk)
    k = torch.randn(s, b, groups, dk)
    v = torch.randn(s, b, groups, dv)
    attn = make(heads, dk, dv)
    out = attn(q, k, v, None)
    ref = naive(q, k, v, dk**-0.5)
    assert out.shape == (s, b, heads * dv)
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_document_mask():
    """A block-diagonal causal mask (two packed documents) is honoured."""
    s, b, h, d = 12, 1, 2, 16
    q, k, v = (torch.randn(s, b, h, d) for _ in range(3))
    doc = torch.tensor([0] * 5 + [1] * 7)
    allowed = (doc[:, None] == doc[None, :]) & torch.tril(torch.ones(s, s, dtype=torch.bool))
    mask = ~allowed
    out = make(h, d, d)(q, k, v, mask.view(1, 1, s, s))
    ref = naive(q, k, v, d**-0.5, mask)
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-5
    # the second document's first token sees only itself
    assert torch.allclose(out[5].view(h, d).double(), v[5, 0].double(), atol=1e-6)


@pytest.mark.parametrize("kind", ["bottom_right", "merged"])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("heads,groups,dk,dv", [(4, 4, 24, 16), (4, 2, 16, 16)])
def test_context_parallel_chunks_match_naive_causal_attention(cp, heads, groups, dk, dv, kind):
    """Each CP rank's two query chunks, attended to the gathered keys without a mask tensor
    (`attend_cp_causal`), give the rows of naive causal attention over the whole sequence at the
    chunks' global positions."""
    from parallel.context_parallel import local_positions, split_sequence

    s, b = 8 * cp, 2
    q = torch.randn(s, b, heads, dk)
    k = torch.randn(s, b, groups, dk)
    v = torch.randn(s, b, groups, dv)
    ref = naive(q, k, v, dk**-0.5)  # [s, b, heads * dv], global order
    attn = make(heads, dk, dv, kind)
    for rank in range(cp):
        out = attn.attend_cp_causal(split_sequence(q, 0, cp, rank), k, v, cp, rank)
        want = ref[local_positions(s // cp, cp, rank)]
        assert out.shape == want.shape
        assert ((out - want).abs().max() / want.abs().max()).item() < 1e-5, rank


@pytest.mark.gpu
def test_context_parallel_chunks_on_gpu_match_the_mask_path():
    """bf16 on CUDA at MLA's head dims (qk 256, v 256): the per-chunk lower-right causal calls (flash /
    memory-efficient kernels) are as close to fp32 attention as the explicit global-causal mask path is
    (within twice its error: both are bf16 kernels, in other summation orders)."""
    from parallel.context_parallel import causal_visibility, local_positions, split_sequence

    torch.manual_seed(0)
    cp, s, b, h = 2, 4096, 1, 16
    q, k, v = (torch.randn(s, b, h, 256, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    attn = make(h, 256, 256)
    for rank in range(cp):
        mine = split_sequence(q, 0, cp, rank)
        out = attn.attend_cp_causal(mine, k, v, cp, rank)
        masked = ~causal_visibility(local_positions(s // cp, cp, rank, q.device), s)
        masked_bf16 = attn.attend(mine, k, v, masked).float()
        exact = attn.attend(mine.float(), k.float(), v.float(), masked)
        err = (out.float() - exact).abs().max().item()
        assert err <= 2 * (masked_bf16 - exact).abs().max().item(), (rank, err)


def test_backend_selection_without_transformer_engine():
    try:
        import transformer_engine.pytorch  # noqa: F401

        pytest.skip("Transformer Engine is installed here")
    except ImportError:
        pass
    assert not resolve_backend("local").is_te
    with pytest.raises(RuntimeError, match="transformer_impl=local"):
        resolve_backend("transformer_engine")


def test_transformer_engine_is_explicit_and_says_once_that_it_is_untested(monkeypatch):
    """TE is never picked silently: `local` is the default, and choosing TE logs one warning."""
    import warnings

    from pretrain.config.schema import ModelConfig
    from pretrain.model import specs

    assert ModelConfig().transformer_impl == "local"
    monkeypatch.setattr(specs, "te_available", lambda: True)  # TESpecProvider builds without TE
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not specs.resolve_backend("local").is_te
        assert specs.resolve_backend("transformer_engine").is_te
        assert specs.resolve_backend("transformer_engine").is_te
    untested = [w for w in caught if "not tested in this project" in str(w.message)]
    assert len(untested) == 1, [str(w.message) for w in caught]
