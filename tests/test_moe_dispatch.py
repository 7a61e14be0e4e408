"""The sync-free MoE dispatch (`pretrain.model.moe_dispatch`) against megatron-core's own.

* `route_rows` + `PermuteTokens` / `UnpermuteTokens` against megatron's `permute` / `unpermute`
  (masked_select, index_select, scatter_add) in float64: rows, values and gradients;
* a whole MoE layer (router, shared expert, grouped experts) with `LocalTokenDispatcher` against the
  same layer with megatron's all-gather dispatcher, same weights, fp32: output, input gradient and
  every parameter gradient; and no host sync in our dispatch (no `.tolist()`, `.item()`, `.cpu()` or
  `masked_select`, which megatron's path calls).
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import torch
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from parallel.initialize import ensure_single_rank
from pretrain.config import load_config
from pretrain.model.builder import build_model
from pretrain.model.moe_dispatch import LocalTokenDispatcher, PermuteTokens, UnpermuteTokens, route_rows


def random_routing(tokens: int, experts: int, topk: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # k distinct experts per token among the first E - 1: the last expert gets no token (empty groups are legal)
    choice = torch.rand(tokens, experts - 1, generator=g).argsort(dim=1)[:, :topk]
    routing = torch.zeros(tokens, experts, dtype=torch.bool)
    routing[torch.arange(tokens)[:, None], choice] = True
    return routing


def test_permute_and_unpermute_match_megatron_in_float64():
    tokens, experts, topk, hidden = 37, 9, 3, 5
    routing = random_routing(tokens, experts, topk)
    assert bool((routing.sum(1) == topk).all())
    x = torch.randn(tokens, hidden, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)

    rows, row_token, token_rows, per_expert = route_rows(routing, topk)
    perm = PermuteTokens.apply(x, row_token, token_rows)
    ref_perm, _, ref_sorted = moe_utils.permute(x_ref, routing, num_out_tokens=tokens * topk)
    assert torch.equal(row_token, ref_sorted)
    assert torch.equal(per_expert, routing.sum(0))
    assert torch.equal(perm, ref_perm)

    w = torch.randn_like(perm)  # a different function per row, so the k rows of a token differ
    out = UnpermuteTokens.apply(perm * w, row_token, token_rows)
    ref_out = moe_utils.unpermute(ref_perm * w, ref_sorted, restore_shape=x_ref.shape)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref_out.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    # rows index R^T flattened: expert-major, so each row's expert is rows // T
    torch.testing.assert_close(rows // tokens, torch.repeat_interleave(torch.arange(experts), per_expert))


def moe_pair():
    """(MoE layer with our dispatcher, the same layer with megatron's all-gather dispatcher), fp32 CPU."""
    ensure_single_rank()
    cfg = load_config("configs/models/glm5-tiny.yaml", ["model.moe_token_dispatcher_type=allgather", "data.seq_length=32"])
    torch.manual_seed(0)
    reference = build_model(cfg).decoder.layers[1].mlp
    ours_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe_token_dispatcher_type="alltoall"))
    # megatron's all-to-all dispatcher makes a CUDA stream for its host copies; ours never copies to the host
    with mock.patch.object(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", object()):
        ours = build_model(ours_cfg).decoder.layers[1].mlp
    assert type(ours.token_dispatcher) is LocalTokenDispatcher
    assert type(reference.token_dispatcher).__name__ == "MoEAllGatherTokenDispatcher"
    ours.load_state_dict(reference.state_dict())
    return ours, reference, cfg


def run(layer, x, grad):
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    out.backward(grad)
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


def test_moe_layer_with_local_dispatcher_matches_megatron_allgather():
    ours, reference, cfg = moe_pair()
    torch.manual_seed(1)
    x = torch.randn(32, 2, cfg.model.hidden_size)
    grad = torch.randn_like(x)

    def no_host_sync(*args, **kwargs):
        raise AssertionError("host sync in the local dispatch path")

    with mock.patch.object(torch.Tensor, "tolist", no_host_sync), mock.patch.object(torch.Tensor, "item", no_host_sync), \
            mock.patch.object(torch.Tensor, "cpu", no_host_sync), mock.patch.object(torch.Tensor, "masked_select", no_host_sync):
        out, dx, grads = run(ours, x, grad)
    ref_out, ref_dx, ref_grads = run(reference, x, grad)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-6, atol=1e-6)
    assert grads.keys() == ref_grads.keys() and len(grads) >= 4
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-6, atol=1e-6, msg=name)


def test_gather_sum_kernel_matches_float64_in_the_interpreter():
    """The GPU combine kernel (run by Triton's CPU interpreter here) against a float64 gather-sum,
    with a hidden size that is not a multiple of the block and a token with repeated rows."""
    from pretrain.model.moe_dispatch import gather_sum_triton

    torch.manual_seed(0)
    rows = torch.randn(23, 70)
    token_rows = torch.randint(0, 23, (9, 4))
    token_rows[0] = 5
    ref = rows.double()[token_rows].sum(1)
    out = gather_sum_triton(rows, token_rows, block_h=32)
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)
    half = gather_sum_triton(rows.bfloat16(), token_rows, block_h=32)
    ref16 = rows.bfloat16().double()[token_rows].sum(1)
    torch.testing.assert_close(half.double(), ref16.bfloat16().double(), rtol=8e-3, atol=8e-3)
