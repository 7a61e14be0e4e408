"""Sequence-chunked output projection + cross-entropy against full float64 logits (one rank and TP=2)."""

import pytest
import torch
import torch.nn.functional as F

from pretrain.model.output_loss import chunked_linear_cross_entropy
from tests.distributed import run_ranks


def _problem(n=37, hidden=16, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) * 0.5
    y = torch.randint(0, vocab, (n,), generator=g)
    m = (torch.rand(n, generator=g) > 0.3).double() * 0.7  # a loss mask times a scale
    return h, w, y, m


def float64_reference(h, w, y, m):
    """Per-token losses and the gradients of sum_i m_i loss_i for logits h W^T (full vocabulary, autograd)."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    per_token = F.cross_entropy(h @ w.t(), y, reduction="none")
    (per_token * m).sum().backward()
    return per_token.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [1, 7, 16, 37, 100])
def test_chunks_equal_full_logits_in_float64(chunk):
    h, w, y, m = _problem()
    ref_losses, ref_dh, ref_dw = float64_reference(h, w, y, m)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, losses = chunked_linear_cross_entropy(hh, ww, y, m, chunk)
    (2.5 * loss).backward()  # the backward's scalar reaches both gradients
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=1e-12)
    torch.testing.assert_close(loss, (ref_losses * m).sum(), rtol=0, atol=1e-12)
    torch.testing.assert_close(hh.grad, 2.5 * ref_dh, rtol=0, atol=1e-12)
    torch.testing.assert_close(ww.grad, 2.5 * ref_dw, rtol=0, atol=1e-12)


def test_fp32_and_batch_shapes():
    h, w, y, m = _problem(n=24)
    ref_losses, ref_dh, ref_dw = float64_reference(h, w, y, m)
    hh = h.float().view(4, 6, -1).clone().requires_grad_()
    ww = w.float().clone().requires_grad_()
    loss, losses = chunked_linear_cross_entropy(hh, ww, y.view(4, 6), m.float().view(4, 6), 5)
    loss.backward()
    assert losses.shape == (4, 6)
    torch.testing.assert_close(losses.view(-1).double(), ref_losses, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hh.grad.view(24, -1).double(), ref_dh, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ww.grad.double(), ref_dw, rtol=1e-5, atol=1e-5)


def test_chunk_size_must_be_positive():
    h, w, y, m = _problem(n=4)
    with pytest.raises(ValueError, match="chunk_size must be positive"):
        chunked_linear_cross_entropy(h, w, y, m, 0)


def _tp_rank(rank, world_size, h, w, y, m, chunk, impl):
    import torch.distributed as dist

    from parallel.initialize import init_distributed

    init_distributed("gloo")
    rows = w.shape[0] // world_size
    hh = h.clone().requires_grad_()
    ww = w[rank * rows:(rank + 1) * rows].clone().requires_grad_()
    loss, losses = chunked_linear_cross_entropy(hh, ww, y, m, chunk, vocab_start=rank * rows, tp_group=dist.group.WORLD,
                                                impl=impl)
    loss.backward()
    return {"loss": loss, "losses": losses, "dh": hh.grad, "dw": ww.grad}


@pytest.mark.parametrize("impl,dtype,tol", [("torch", torch.float64, 1e-12), ("triton", torch.float32, 1e-5)])
def test_vocab_parallel_tp2_equals_full_logits(impl, dtype, tol):
    """Both paths under TP = 2 (gloo); the Triton kernels run in Triton's interpreter on CPU."""
    h, w, y, m = _problem(vocab=52)
    ref_losses, ref_dh, ref_dw = float64_reference(h, w, y, m)
    out = run_ranks(_tp_rank, 2, h.to(dtype), w.to(dtype), y, m.to(dtype), 5, impl)
    for r in out:
        torch.testing.assert_close(r["losses"].double(), ref_losses, rtol=tol, atol=tol)
    # each rank's dh is its vocabulary slice's share; the copy-to-TP region's backward sums them
    torch.testing.assert_close((out[0]["dh"] + out[1]["dh"]).double(), ref_dh, rtol=tol, atol=tol)
    torch.testing.assert_close(torch.cat([out[0]["dw"], out[1]["dw"]]).double(), ref_dw, rtol=tol, atol=tol)


def test_per_token_view_keeps_values_and_carries_the_sums_gradient():
    from pretrain.model.output_loss import per_token_view

    h, w, y, m = _problem(n=12)
    m = (m > 0).double()
    ref_losses, ref_dh, ref_dw = float64_reference(h, w, y, m)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, losses = chunked_linear_cross_entropy(hh, ww, y, m, 5)
    out = per_token_view(loss, losses, m)
    torch.testing.assert_close(out.double(), ref_losses, rtol=1e-6, atol=1e-6)
    (out * m).sum().backward()  # what megatron's loss function does with the model's output
    torch.testing.assert_close(hh.grad, ref_dh, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ww.grad, ref_dw, rtol=1e-6, atol=1e-6)


def test_liger_fused_linear_cross_entropy_matches_full_logits():
    """Liger's Triton kernels, here in Triton's interpreter (CPU), against float64 full logits."""
    from pretrain.compat import patch_triton_interpreter
    from pretrain.model.output_loss import liger_linear_cross_entropy

    patch_triton_interpreter()
    h, w, y, m = _problem(n=21)
    m = (m > 0).double()
    _, ref_dh, ref_dw = float64_reference(h, w, y, m)
    ref_sum = (F.cross_entropy(h @ w.t(), y, reduction="none") * m).sum()
    hh, ww = h.float().clone().requires_grad_(), w.float().clone().requires_grad_()
    loss = liger_linear_cross_entropy(hh, ww, y, m)
    loss.backward()
    torch.testing.assert_close(loss.double(), ref_sum, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hh.grad.double(), ref_dh, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ww.grad.double(), ref_dw, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="0/1 loss mask"):
        liger_linear_cross_entropy(hh, ww, y, m * 0.5)


def _no_gradient_work(monkeypatch):
    """The chunked loss with every gradient-only step made to raise: the softmax gradient kernel, dW's
    buffer and its accumulation."""
    from pretrain.model import output_loss, output_loss_kernels

    def refuse(*_args, **_kwargs):
        raise AssertionError("a gradient was computed where none is needed")

    monkeypatch.setattr(output_loss, "accumulate_grad_weight", refuse)
    monkeypatch.setattr(output_loss, "grad_weight_buffer", refuse)
    monkeypatch.setattr(output_loss_kernels, "softmax_grad_", refuse)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_no_grad_evaluation_computes_no_gradient(monkeypatch, impl):
    """Under no_grad (evaluation) no dz, dh, dW or fp32 dW buffer; the loss equals float64 cross-entropy."""
    h, w, y, m = _problem()
    ref_losses, _, _ = float64_reference(h, w, y, m)
    _no_gradient_work(monkeypatch)
    hh, ww = h.float().requires_grad_(), w.float().requires_grad_()  # parameters, as in eval of a model
    with torch.no_grad():
        loss, losses = chunked_linear_cross_entropy(hh, ww, y, m.float(), 8, impl=impl)
    torch.testing.assert_close(losses.double(), ref_losses, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss.double(), (ref_losses * m).sum(), rtol=1e-5, atol=1e-5)


def test_frozen_weight_gets_no_grad_weight(monkeypatch):
    """Only dh where the weight is frozen: no dW buffer, no dW GEMM; dh equals the float64 reference."""
    from pretrain.model import output_loss

    h, w, y, m = _problem()
    _, ref_dh, _ = float64_reference(h, w, y, m)
    monkeypatch.setattr(output_loss, "grad_weight_buffer", None)  # calling it raises TypeError
    monkeypatch.setattr(output_loss, "accumulate_grad_weight", None)
    hh = h.clone().requires_grad_()
    chunked_linear_cross_entropy(hh, w, y, m, 7)[0].backward()
    torch.testing.assert_close(hh.grad, ref_dh, rtol=0, atol=1e-12)
