"""Routed experts' grouped GEMM (`pretrain.model.experts.grouped_matmul`) against a float64 loop over experts."""

from __future__ import annotations

import warnings

import torch

from pretrain.model import experts


def _naive(x, w, counts):
    out, start = [], 0
    for e, n in enumerate(counts):
        out.append(x[start:start + n].double() @ w[e].double())
        start += n
    return torch.cat(out)


def test_grouped_matmul_matches_a_float64_loop():
    torch.manual_seed(0)
    counts = [3, 0, 5, 2]
    x, w = torch.randn(sum(counts), 8), torch.randn(len(counts), 8, 4)  # _grouped_mm: 16-byte strides
    out = experts.grouped_matmul(x, w, torch.tensor(counts))
    assert torch.allclose(out.double(), _naive(x, w, counts), rtol=1e-5, atol=1e-5)


def test_per_expert_fallback_is_correct_and_warned_once(monkeypatch):
    """Without a usable torch._grouped_mm the experts loop over experts (a host sync), and say so once."""
    monkeypatch.setattr(experts, "grouped_mm_available", lambda device_type: False)
    torch.manual_seed(1)
    counts = [2, 4, 1]
    x, w = torch.randn(sum(counts), 8), torch.randn(len(counts), 8, 5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = experts.grouped_matmul(x, w, torch.tensor(counts))
        second = experts.grouped_matmul(x, w, torch.tensor(counts))
    loops = [w for w in caught if "per-expert Python loop" in str(w.message)]
    assert len(loops) == 1 and "torch._grouped_mm does not run on cpu" in str(loops[0].message)
    assert torch.equal(first, second)
    assert torch.allclose(first.double(), _naive(x, w, counts), rtol=1e-5, atol=1e-5)
