"""GPU checks (marker `gpu`; run through the device tool, skipped elsewhere)."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_grouped_matmul_matches_per_expert_loop(dtype, tol):
    from pretrain.model.experts import grouped_matmul

    torch.backends.cuda.matmul.allow_tf32 = False
    counts = torch.tensor([0, 37, 128, 5, 0, 300, 1, 41])  # empty and ragged groups
    x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=dtype)
    w = torch.randn(len(counts), 256, 512, device="cuda", dtype=dtype) / 16
    out = torch.full((x.shape[0], 512), float("nan"), device="cuda", dtype=dtype)
    out.copy_(grouped_matmul(x, w, counts))
    ref = torch.cat([c.double() @ w[e].double() for e, c in enumerate(torch.split(x, counts.tolist()))])
    assert not out.isnan().any()
    assert rel(out, ref) < tol


def test_sdpa_core_attention_mla_shapes_match_fp64():
    """cuDNN-first SDPA at GLM-5's MLA head dims (qk 256, v 256), bf16, against float64."""
    import torch.nn.functional as F

    from pretrain.model.core_attention import _GPU_BACKENDS
    from torch.nn.attention import sdpa_kernel

    b, h, s = 2, 16, 1024
    q, k = (torch.randn(b, h, s, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(b, h, s, 256, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel(_GPU_BACKENDS, set_priority=True):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=256**-0.5)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, scale=256**-0.5)
    assert rel(out, ref) < 1e-2


def test_tiny_model_bf16_step_is_finite_and_paths_agree():
    """The grouped-GEMM and megatron local (SequentialMLP) expert paths give the same loss."""
    import dataclasses

    from parallel.initialize import ensure_single_rank
    from pretrain.config import load_config
    from pretrain.convert.hf_mapping import rules
    from pretrain.model.builder import build_model

    ensure_single_rank()
    cfg = load_config("configs/models/glm5-tiny.yaml", ["model.bf16=true", "model.params_dtype=bfloat16"])
    torch.manual_seed(0)
    grouped = build_model(cfg)
    local_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe_grouped_gemm=False))
    local = build_model(local_cfg)
    # move the weights across layouts through the HF naming (an independent mapping)
    hf = {}
    g_state = grouped.state_dict()
    for r in rules(cfg.model):
        hf.update(r.to_theirs(g_state[r.ours]))
    local.load_state_dict({r.ours: r.to_ours(hf.__getitem__) for r in rules(local_cfg.model)}, strict=False)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 128), device="cuda")
    pos = torch.arange(128, device="cuda").unsqueeze(0).expand(2, -1)
    losses = []
    for model in (grouped, local):
        loss = model(ids, pos, None, labels=ids).float().mean()
        loss.backward()
        assert torch.isfinite(loss)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=2e-2)
