"""GPU: the sync-free MoE dispatch's combine kernel and a whole MoE layer in bf16 against megatron's path."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_gather_sum_kernel_matches_float64_on_gpu():
    from pretrain.model.moe_dispatch import gather_sum_triton

    torch.manual_seed(0)
    rows = torch.randn(4096 * 8, 2048, device="cuda", dtype=torch.bfloat16)
    token_rows = torch.randperm(rows.shape[0], device="cuda").view(4096, 8)
    out = gather_sum_triton(rows, token_rows)
    ref = rows.double()[token_rows].sum(1)
    # one rounding of the fp32 sum to bf16
    torch.testing.assert_close(out.double(), ref, rtol=8e-3, atol=1e-2)


def test_local_dispatch_moe_layer_matches_megatron_alltoall_in_bf16():
    """glm5-tiny's MoE layer on the GPU: our dispatcher against megatron's all-to-all dispatcher (bf16)."""
    import dataclasses

    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from parallel.initialize import ensure_single_rank
    from pretrain.config import load_config
    from pretrain.model.builder import build_model
    from pretrain.model.moe_dispatch import LocalTokenDispatcher

    ensure_single_rank()
    cfg = load_config("configs/models/glm5-tiny.yaml", ["model.moe_token_dispatcher_type=alltoall", "data.seq_length=256"])
    torch.manual_seed(0)
    ours = build_model(cfg).decoder.layers[1].mlp.cuda().bfloat16()
    assert type(ours.token_dispatcher) is LocalTokenDispatcher
    reference = build_model(cfg).decoder.layers[1].mlp.cuda().bfloat16()
    reference.load_state_dict(ours.state_dict())
    reference.token_dispatcher.__class__ = MoEAlltoAllTokenDispatcher  # megatron's own methods
    x = torch.randn(256, 2, cfg.model.hidden_size, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    outs = []
    for layer in (ours, reference):
        xi = x.clone().requires_grad_(True)
        out, _ = layer(xi)
        out.backward(grad)
        outs.append((out.float(), xi.grad.float(), layer.experts.weight1.grad.float()))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
