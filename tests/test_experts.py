"""Routed experts: `GroupedGemmExperts` (moe_grouped_gemm: true) against megatron's per-expert loop.

The reference is megatron-core's `SequentialMLP` (moe_grouped_gemm: false), one `linear_fc1` /
`linear_fc2` pair per expert, given the same weights: expert e's `linear_fc1.weight` [2F, H] is
`weight1.view(E, H, 2F)[e].T` and its `linear_fc2.weight` [H, F] is `weight2.view(E, F, H)[e].T`
(megatron's GroupedMLP layout, written out here by hand). Router and shared expert are shared by
name. In fp32 on the CPU the two MoE layers must give the same output, input gradient and gradient
of every expert weight up to summation order (1e-5 relative, per tensor), through both grouped
backends: `torch._grouped_mm` and the per-expert fallback.
"""

from __future__ import annotations

import dataclasses
import warnings
from unittest import mock

import pytest
import torch

from parallel.initialize import ensure_single_rank
from pretrain.compat import grouped_mm_available
from pretrain.config import load_config
from pretrain.model import experts
from pretrain.model.builder import build_model

SEQ, BATCH, TOL = 64, 4, 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def moe_layers():
    """(grouped MoE layer, per-expert-loop MoE layer) holding the same weights, fp32 CPU."""
    ensure_single_rank()
    cfg = load_config("configs/models/glm5-tiny.yaml", ["model.moe_token_dispatcher_type=allgather",
                                                        f"data.seq_length={SEQ}"])
    assert cfg.model.moe_grouped_gemm and cfg.model.moe_layer_freq[1] == 1
    torch.manual_seed(0)
    grouped = build_model(cfg).decoder.layers[1].mlp
    local_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe_grouped_gemm=False))
    local = build_model(local_cfg).decoder.layers[1].mlp
    assert type(grouped.experts).__name__ == "GroupedGemmExperts"
    assert type(local.experts).__name__ == "SequentialMLP"

    m = cfg.model
    n, h, f = m.num_moe_experts, m.hidden_size, m.moe_ffn_hidden_size
    state = {k: v for k, v in grouped.state_dict().items() if not k.startswith("experts.")}
    w1 = grouped.experts.weight1.detach().view(n, h, 2 * f)
    w2 = grouped.experts.weight2.detach().view(n, f, h)
    for e in range(n):
        state[f"experts.local_experts.{e}.linear_fc1.weight"] = w1[e].T.contiguous()
        state[f"experts.local_experts.{e}.linear_fc2.weight"] = w2[e].T.contiguous()
    result = local.load_state_dict(state, strict=False)
    assert not result.unexpected_keys and all(k.endswith("_extra_state") for k in result.missing_keys)
    return grouped, local, (n, h, f)


def run(layer, x: torch.Tensor, grad: torch.Tensor):
    x = x.clone().requires_grad_()
    out, _ = layer(x)
    out.backward(grad)
    return out.detach(), x.grad


@pytest.mark.parametrize("backend", ["torch._grouped_mm", "per-expert fallback"])
def test_grouped_experts_match_megatron_per_expert_loop(backend):
    if backend == "torch._grouped_mm" and not grouped_mm_available("cpu"):
        pytest.fail("torch._grouped_mm does not run on this CPU build: the grouped kernel path is untested")
    use_kernel = backend == "torch._grouped_mm"
    grouped, local, (n, h, f) = moe_layers()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(SEQ, BATCH, h, generator=gen)
    grad = torch.randn(SEQ, BATCH, h, generator=gen)
    kernel = mock.Mock(wraps=torch._grouped_mm)
    with mock.patch.object(experts, "grouped_mm_available", lambda device: use_kernel), \
            mock.patch.object(torch, "_grouped_mm", kernel):
        out_g, dx_g = run(grouped, x, grad)
    assert kernel.call_count == (2 if use_kernel else 0)  # fc1 and fc2 of the forward
    out_l, dx_l = run(local, x, grad)

    assert rel_err(out_g, out_l) <= TOL
    assert rel_err(dx_g, dx_l) <= TOL
    g1 = grouped.experts.weight1.grad.view(n, h, 2 * f)
    g2 = grouped.experts.weight2.grad.view(n, f, h)
    for e, expert in enumerate(local.experts.local_experts):
        ref1, ref2 = expert.linear_fc1.weight.grad, expert.linear_fc2.weight.grad
        assert ref1.abs().max() > 0 and ref2.abs().max() > 0, f"expert {e} got no tokens: nothing compared"
        assert rel_err(g1[e].T, ref1) <= TOL, f"expert {e} fc1 gradient"
        assert rel_err(g2[e].T, ref2) <= TOL, f"expert {e} fc2 gradient"
    named_local = dict(local.named_parameters())
    for name, param in grouped.named_parameters():  # router and shared expert
        if not name.startswith("experts."):
            assert rel_err(param.grad, named_local[name].grad) <= TOL, name


# grouped_matmul itself (the compat-helper's checks): against a float64 loop, and the warned fallback
def _float64_loop(x, w, counts):
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
    assert torch.allclose(out.double(), _float64_loop(x, w, counts), rtol=1e-5, atol=1e-5)


def test_per_expert_fallback_is_correct_and_warned_once(monkeypatch):
    """Without a usable torch._grouped_mm the experts loop over experts (a host sync), and say so once."""
    monkeypatch.setattr(experts, "grouped_mm_available", lambda device_type: False)
    experts._warn_expert_loop.cache_clear()  # warned once per process: an earlier test may have taken it
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
    assert torch.allclose(first.double(), _float64_loop(x, w, counts), rtol=1e-5, atol=1e-5)
