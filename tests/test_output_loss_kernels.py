"""The chunked output loss's Triton kernels (pretrain/model/output_loss_kernels.py) on CPU through Triton's
interpreter, against float64 full-vocabulary cross-entropy.

Shapes are tiny and ragged: vocabulary widths that are no multiple of the kernels' vocabulary block,
chunks that do not divide the tokens, masked tokens (weight 0) and non-binary weights, labels outside a
rank's vocabulary slice. Tensor parallelism is simulated in one process: each simulated rank runs the
kernels on its slice and `combine_rank_stats` reduces through a thread barrier exactly as the all-reduces
would. The same kernels run compiled on the GPU in tests/test_gpu_output_loss.py.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

import triton  # noqa: F401  (the dev extra installs it; the kernels run in its interpreter here)

from tests.test_output_loss import float64_reference


@pytest.fixture(scope="module")
def kernels():
    """The kernel module; on CPU it is interpreted (tests/conftest.py sets TRITON_INTERPRET=1 before
    triton is imported)."""
    import os

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set")
    from pretrain.model import output_loss_kernels

    return output_loss_kernels


def _problem(n=37, hidden=16, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) * 0.5
    y = torch.randint(0, vocab, (n,), generator=g)
    m = (torch.rand(n, generator=g) > 0.3).double() * torch.rand(n, generator=g, dtype=torch.float64) * 2
    return h, w, y, m


class _ThreadGroup:
    """An all-reduce among `size` threads (one per simulated rank): each thread's tensor is replaced by the
    reduction over all of them."""

    def __init__(self, size):
        self.slots, self.barrier = [None] * size, threading.Barrier(size, timeout=60)

    def reducer(self, rank, op):
        def all_reduce(t):
            self.slots[rank] = t.clone()
            self.barrier.wait()
            stacked = torch.stack(self.slots)
            out = stacked.amax(0) if op == "max" else stacked.sum(0)
            self.barrier.wait()  # everyone has read the slots before the next collective writes them
            return t.copy_(out)
        return all_reduce


def _tp_chunk(kernels, h, w, y, m, bounds, block_v):
    """Simulated TP ranks over vocabulary slices `bounds`, one chunk: per rank (losses, dz, local stats).
    The kernels run one rank after the other (Triton's interpreter is not thread-safe); only the
    collectives of `combine_rank_stats` run in one thread per rank."""
    logits = [(h @ w[v0:v1].t()).contiguous() for v0, v1 in bounds]
    stats = [kernels.row_stats(z, y, v0, block_v=block_v) for z, (v0, _) in zip(logits, bounds)]
    group, combined = _ThreadGroup(len(bounds)), [None] * len(bounds)

    def rank_body(rank):
        combined[rank] = kernels.combine_rank_stats(*stats[rank], group.reducer(rank, "max"),
                                                    group.reducer(rank, "sum"))

    threads = [threading.Thread(target=rank_body, args=(r,)) for r in range(len(bounds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(c is not None for c in combined), "a simulated rank failed"
    out = []
    for z, (v0, _), st, (lse, losses) in zip(logits, bounds, stats, combined):
        out.append((losses, kernels.softmax_grad_(z, y, lse, m, v0, block_v=block_v), st))
    return out


@pytest.mark.parametrize("bounds,block_v", [([(0, 50)], 16), ([(0, 50)], 64), ([(0, 17), (17, 33), (33, 50)], 8)])
def test_kernels_per_rank_statistics_and_gradient_equal_full_vocab_float64(kernels, bounds, block_v):
    h, w, y, m = _problem()
    ref_losses, ref_dh, ref_dw = float64_reference(h, w, y, m)
    y[3], m[3] = 7, 0.0  # a masked token: its loss is still reported, its gradient is zero
    ref_losses[3] = F.cross_entropy(h[3:4] @ w.t(), y[3:4]).detach()
    hf, wf, mf = h.float(), w.float(), m.float()
    out = _tp_chunk(kernels, hf, wf, y, mf, bounds, block_v)
    for (v0, v1), (losses, dz, (row_max, _, target)) in zip(bounds, out):
        torch.testing.assert_close(losses.double(), ref_losses, rtol=1e-5, atol=1e-5)
        z = h @ w[v0:v1].t()
        torch.testing.assert_close(row_max.double(), z.max(1).values, rtol=1e-6, atol=1e-6)
        own = (y >= v0) & (y < v1)  # the target logit comes only from the rank that owns the label
        expect = torch.where(own, z.gather(1, (y - v0).clamp(0, v1 - v0 - 1)[:, None])[:, 0], torch.zeros_like(m))
        torch.testing.assert_close(target.double(), expect, rtol=1e-6, atol=1e-6)
        assert torch.all(dz[3] == 0)
    # dh is the sum of the ranks' dz W_r (the copy-to-TP region's backward), dW their concatenation
    dh = sum(dz.double() @ w[v0:v1] for (v0, v1), (_, dz, _) in zip(bounds, out))
    dw = torch.cat([dz.double().t() @ h for _, dz, _ in out])
    _, ref_dh, ref_dw = float64_reference(h, w, y, m)
    torch.testing.assert_close(dh, ref_dh, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, ref_dw, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk,fp32_grad_weight", [(16, True), (37, True), (5, False), (100, True)])
def test_triton_chunks_equal_full_logits(chunk, fp32_grad_weight):
    from pretrain.model.output_loss import chunked_linear_cross_entropy

    h, w, y, m = _problem()
    ref_losses, ref_dh, ref_dw = float64_reference(h, w, y, m)
    hh, ww = h.float().requires_grad_(), w.float().requires_grad_()
    loss, losses = chunked_linear_cross_entropy(hh, ww, y, m.float(), chunk, impl="triton",
                                                fp32_grad_weight=fp32_grad_weight)
    (2.5 * loss).backward()  # the backward's scalar reaches both gradients
    torch.testing.assert_close(losses.double(), ref_losses, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss.double(), (ref_losses * m).sum(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hh.grad.double(), 2.5 * ref_dh, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ww.grad.double(), 2.5 * ref_dw, rtol=1e-5, atol=1e-5)


def test_triton_path_labels_outside_the_slice_match_the_torch_path():
    """One rank's view under TP without its peers (vocab_start > 0, most labels elsewhere): the kernels'
    gradients, and the losses of the tokens whose label the slice holds, equal the PyTorch path's."""
    from pretrain.model.output_loss import chunked_linear_cross_entropy

    h, w, y, m = _problem(vocab=60)
    outs = []
    for impl in ("torch", "triton"):
        hh, ww = h.float().requires_grad_(), w[20:41].float().requires_grad_()
        loss, losses = chunked_linear_cross_entropy(hh, ww, y, m.float(), 8, vocab_start=20, impl=impl)
        loss.backward()
        outs.append((losses, hh.grad, ww.grad))
    own = (y >= 20) & (y < 41)  # a one-rank loss is meaningful only where the rank owns the label
    assert 0 < int(own.sum()) < len(y)
    torch.testing.assert_close(outs[1][0][own], outs[0][0][own], rtol=1e-5, atol=1e-5)
    for a, b in zip(outs[1][1:], outs[0][1:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fp32_grad_weight_accumulation_keeps_bf16_accuracy_over_many_chunks():
    """Why dW sums in fp32 by default: with bf16 operands, a bf16 running sum (Liger's) loses accuracy as
    chunks grow in number, an fp32 one stays at the bf16 rounding of one product (float64 reference on
    the same bf16 inputs). Measured at 16,384 x 64 x 1,024: 4 / 16 / 64 chunks give relative L2 errors
    2.5e-3 / 2.4e-3 / 2.4e-3 in fp32 and 2.7e-3 / 4.8e-3 / 9.4e-3 in bf16."""
    from pretrain.model.output_loss import chunked_linear_cross_entropy

    g = torch.Generator().manual_seed(1)
    n, hidden, vocab = 4096, 32, 256
    hb = torch.randn(n, hidden, generator=g).bfloat16()
    wb = (torch.randn(vocab, hidden, generator=g) * 0.1).bfloat16()
    y, m = torch.randint(0, vocab, (n,), generator=g), torch.ones(n)
    _, _, ref_dw = float64_reference(hb.double(), wb.double(), y, m.double())

    def error(chunk, fp32):
        ww = wb.clone().requires_grad_()
        chunked_linear_cross_entropy(hb, ww, y, m, chunk, impl="torch", fp32_grad_weight=fp32)[0].backward()
        return ((ww.grad.double() - ref_dw).norm() / ref_dw.norm()).item()

    few_fp32, many_fp32, many_bf16 = error(1024, True), error(64, True), error(64, False)
    assert many_fp32 < 1.2 * few_fp32 < 1e-2
    assert many_bf16 > 2 * many_fp32
