"""The fused MLA RoPE kernel (pretrain/model/rope.py) in Triton's interpreter, against megatron-core's own unfused
formula (its public `apply_rotary_pos_emb`, tests/rope_reference.py): outputs and gradients bitwise in float32, and
within the interpreter's bf16 rounding in bf16 (the interpreter truncates where the GPU rounds to nearest even; the
GPU test in tests/test_gpu_model.py requires bf16 bit for bit)."""

import pytest
import torch

from pretrain.model.rope import mla_rope
from tests.rope_reference import megatron_rope

SHAPES = [(7, 2, 3, 64, 64), (5, 1, 16, 128, 64), (9, 2, 1, 40, 16)]  # [s, b, heads, d], rope dims r


def _case(shape, dtype, seed=0):
    s, b, h, d, r = shape
    gen = torch.Generator().manual_seed(seed)
    freqs = (torch.rand(s, 1, 1, r // 2, generator=gen) * 40).repeat(1, 1, 1, 2)  # megatron's [f, f] layout
    wide = torch.randn(s, b, h, d + 8, generator=gen).to(dtype)  # t is a strided view, as q_pe of the q projection
    grad = torch.randn(s, b, h, d, generator=gen).to(dtype)
    return freqs, wide, grad


def _both(shape, dtype, mscale):
    freqs, wide, grad = _case(shape, dtype)
    d = shape[3]
    t_ref = wide.clone().requires_grad_(True)
    ref = megatron_rope(t_ref[..., 3:3 + d], freqs, mscale)
    ref.backward(grad)
    t = wide.clone().requires_grad_(True)
    got = mla_rope(freqs, mscale)(t[..., 3:3 + d])
    got.backward(grad)
    return ref, got, t_ref.grad, t.grad


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mscale", [1.0, 1.3])
def test_rope_kernel_is_megatrons_formula_bitwise_in_float32(shape, mscale):
    ref, got, g_ref, g = _both(shape, torch.float32, mscale)
    assert got.is_contiguous() and got.shape == ref.shape
    assert torch.equal(got, ref)
    assert torch.equal(g, g_ref)  # zero outside the view, the rotation's transpose inside


@pytest.mark.parametrize("shape", SHAPES)
def test_rope_kernel_in_bf16_within_rounding(shape):
    """Each output of the rotation is a sum of two rounded products, so both sides lie within 3 roundings of the
    exact value: within 2 x 3 ulps of |a1| + |a2| (the pair it mixes; |cos|, |sin| <= 1); past the rope dims exact."""
    freqs, wide, grad = _case(shape, torch.bfloat16)
    r, d = freqs.shape[-1], shape[3]
    ref, got, g_ref, g = _both(shape, torch.bfloat16, 1.0)
    x = wide[..., 3:3 + d].float()
    pair = x[..., 0:r:2].abs() + x[..., 1:r:2].abs()  # |a1| + |a2| of output i and i + r / 2
    bound = 6 * 2.0**-8 * torch.cat([pair, pair], -1)
    assert ((got[..., :r].float() - ref[..., :r].float()).abs() <= bound).all()
    assert torch.equal(got[..., r:], ref[..., r:])
    dy = grad.float()
    pair = dy[..., :r // 2].abs() + dy[..., r // 2:r].abs()  # dt[2i], dt[2i + 1] mix dy[i] and dy[i + r / 2]
    bound = 6 * 2.0**-8 * torch.stack([pair, pair], -1).flatten(-2)
    gi, gr = g[..., 3:3 + d].float(), g_ref[..., 3:3 + d].float()
    assert ((gi[..., :r] - gr[..., :r]).abs() <= bound).all()
    assert torch.equal(gi[..., r:], gr[..., r:])


def test_rope_kernel_refuses_other_ranks_and_tables():
    freqs = torch.zeros(4, 1, 1, 8)
    rope = mla_rope(freqs)
    with pytest.raises(ValueError, match=r"\[s, b, heads, d\]"):
        rope(torch.zeros(4, 2, 8))
    with pytest.raises(ValueError, match="do not fit"):
        rope(torch.zeros(5, 1, 2, 8))
