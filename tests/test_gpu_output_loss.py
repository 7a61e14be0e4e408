"""GPU checks of the chunked output loss's Triton path (marker `gpu`):
`python -m pytest -q -m gpu tests/test_gpu_output_loss.py` on a CUDA machine; skipped elsewhere.

The compiled kernels in bf16 against the unfused bf16 path (full logits in bf16, cross-entropy in fp32)
and against float64; the interpreted kernels' exact checks are tests/test_output_loss_kernels.py."""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _problem(n, hidden, vocab, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(n, hidden, device="cuda", generator=g) * 0.5
    w = torch.randn(vocab, hidden, device="cuda", generator=g) * 0.05
    y = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    m = (torch.rand(n, device="cuda", generator=g) > 0.2).float() * torch.rand(n, device="cuda", generator=g) * 2
    return h.bfloat16(), w.bfloat16(), y, m


def _full(h, w, y, m):
    """(per-token losses, dh, dW) through full logits: bf16 unfused, or float64 for float64 inputs."""
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    per_token = F.cross_entropy((h @ w.t()).float() if h.dtype != torch.float64 else h @ w.t(), y, reduction="none")
    (per_token * m.to(per_token.dtype)).sum().backward()
    return per_token.detach(), h.grad, w.grad


@pytest.mark.parametrize("fp32_grad_weight", [True, False])
def test_triton_chunked_path_matches_unfused_bf16(fp32_grad_weight):
    from pretrain.model.output_loss import chunked_linear_cross_entropy, use_kernels

    n, hidden, vocab = 3000, 512, 10000  # 1024-token chunks do not divide n; 10,000 is ragged for the block
    h, w, y, m = _problem(n, hidden, vocab)
    assert use_kernels(h, w)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, losses = chunked_linear_cross_entropy(hh, ww, y, m, 1024, fp32_grad_weight=fp32_grad_weight)
    (2.0 * loss).backward()
    ref_losses, ref_dh, ref_dw = _full(h, w, y, m)
    exact_losses, exact_dh, exact_dw = _full(h.double(), w.double(), y, m.double())
    assert (losses - ref_losses).abs().max().item() < 2e-2  # both read the same bf16 logits
    assert rel(hh.grad, 2 * ref_dh) < 1e-2 and rel(ww.grad, 2 * ref_dw) < 1e-2
    # and as close to float64 as the unfused path is
    assert (losses.double() - exact_losses).abs().max().item() < 5e-2
    assert rel(hh.grad, 2 * exact_dh) < 1.5 * rel(ref_dh, exact_dh) + 1e-3
    # a bf16 running sum over 3 chunks adds up to ~2 roundings of dW (tests/test_output_loss_kernels.py)
    assert rel(ww.grad, 2 * exact_dw) < (1.5 if fp32_grad_weight else 2.5) * rel(ref_dw, exact_dw) + 1e-3


def test_triton_kernels_split_vocabulary_combine_like_the_all_reduce():
    """Three vocabulary slices (as TP ranks) on the GPU: per-slice kernels, the all-reduce emulated on
    the stacked statistics, against float64 full-vocabulary losses and the summed / concatenated grads."""
    from pretrain.model import output_loss_kernels as kernels

    n, hidden, vocab = 777, 256, 9000
    h, w, y, m = _problem(n, hidden, vocab, seed=1)
    bounds = [(0, 3000), (3000, 6000), (6000, 9000)]
    logits = [h @ w[a:b].t() for a, b in bounds]
    stats = [torch.stack(kernels.row_stats(z, y, a)) for z, (a, _) in zip(logits, bounds)]
    gmax = torch.stack([s[0] for s in stats]).amax(0)
    total = sum(torch.stack([s[1] * torch.exp(s[0] - gmax), s[2]]) for s in stats)
    for s in stats:  # every rank ends with the same statistics the combine computes
        lse, losses = kernels.combine_rank_stats(s[0], s[1], s[2], lambda t: t.copy_(gmax), lambda t: t.copy_(total))
    exact_losses, exact_dh, exact_dw = _full(h.double(), w.double(), y, m.double())
    assert (losses.double() - exact_losses).abs().max().item() < 5e-2
    dz = [kernels.softmax_grad_(z, y, lse, m, a) for z, (a, _) in zip(logits, bounds)]
    dh = sum(d.double() @ w[a:b].double() for d, (a, b) in zip(dz, bounds))
    dw = torch.cat([d.double().t() @ h.double() for d in dz])
    assert rel(dh, exact_dh) < 1e-2 and rel(dw, exact_dw) < 1e-2
