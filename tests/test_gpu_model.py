"""GPU checks of the model (marker `gpu`): grouped GEMM, SDPA at MLA dims, the DSA reference path, bf16 steps."""

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

    from pretrain.model.core_attention import GPU_BACKENDS
    from torch.nn.attention import sdpa_kernel

    b, h, s = 2, 16, 1024
    q, k = (torch.randn(b, h, s, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(b, h, s, 256, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel(GPU_BACKENDS, set_priority=True):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=256**-0.5)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, scale=256**-0.5)
    assert rel(out, ref) < 1e-2


def test_tiny_model_bf16_step_is_finite_and_paths_agree():
    """A bf16 smoke test: both expert paths (grouped GEMM, megatron's SequentialMLP) run a finite
    forward/backward on the GPU and their losses agree within bf16 noise (2%, near log(vocab), so it
    says little). The tight check, MoE outputs and every expert gradient in fp32, is test_experts.py."""
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


def test_dsa_reference_path_on_gpu_matches_fp64():
    """Top-k and sparse absorbed attention (GLM-5 dims: 576 / 512, top-k 256 of 1024) on CUDA in bf16
    against float64 on the CPU: same selection as torch.topk on the CPU scores, attention and its
    gradients within bf16 tolerance."""
    from pretrain.model.dsa.indexer import VisibleKeys, index_scores, indexer_topk, select_topk
    from pretrain.model.dsa.sparse_mla import sparse_mla_attention

    torch.manual_seed(0)
    b, s, h, topk = 1, 1024, 16, 256
    qi, ki, wi = torch.randn(b, s, 8, 128), torch.randn(b, s, 128), torch.randn(b, s, 8)
    idx = indexer_topk(qi.cuda(), ki.cuda(), wi.cuda(), topk, VisibleKeys(s, s, "cuda"), chunk=128)
    ref_idx = select_topk(index_scores(qi.double(), ki.double(), wi.double(), VisibleKeys(s, s, "cpu").rows(0, s)), topk)
    # fp32 scores on the GPU vs fp64 on the CPU: the selected sets agree except at near-ties
    same = (idx.cpu().sort(-1).values == ref_idx.sort(-1).values).float().mean().item()
    assert same > 0.99
    q = torch.randn(b, s, h, 576, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(b, s, 576, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out, _ = sparse_mla_attention(q, kv, idx, 576**-0.5, 512, chunk=256)
    grad = torch.randn_like(out)
    out.backward(grad)
    q64, kv64 = q.detach().cpu().double().requires_grad_(), kv.detach().cpu().double().requires_grad_()
    ref, _ = sparse_mla_attention(q64, kv64, idx.cpu(), 576**-0.5, 512, chunk=256)
    ref.backward(grad.cpu().double())
    assert rel(out.cpu(), ref) < 1e-2
    assert rel(q.grad.cpu(), q64.grad) < 2e-2 and rel(kv.grad.cpu(), kv64.grad) < 2e-2


def test_tiny_dsa_model_sparse_step_on_gpu():
    """The tiny model with sparse attention and the sparse indexer loss: a bf16 forward/backward is
    finite, its logits track fp32 within bf16 tolerance, and the indexer receives a gradient."""
    from parallel.initialize import ensure_single_rank
    from pretrain.config import load_config
    from pretrain.model.builder import build_model

    ensure_single_rank()
    over = ["model.dsa_sparse_attention=true", "model.dsa_indexer_topk=16", "model.dsa_indexer_loss_coeff=1.0",
            "model.dsa_indexer_use_sparse_loss=true", "model.mtp_num_layers=null", "data.seq_length=64"]
    torch.manual_seed(0)
    fp32 = build_model(load_config("configs/models/glm5-tiny.yaml", over))
    bf16 = build_model(load_config("configs/models/glm5-tiny.yaml", over + ["model.bf16=true", "model.params_dtype=bfloat16"]))
    bf16.load_state_dict({k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v
                          for k, v in fp32.state_dict().items()})
    ids = torch.randint(0, 512, (2, 64), device="cuda")
    pos = torch.arange(64, device="cuda").unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        ref = fp32(ids, pos, None)
    out = bf16(ids, pos, None)
    assert torch.isfinite(out).all() and rel(out, ref) < 5e-2
    bf16(ids, pos, None, labels=ids).mean().backward()
    grads = [p.grad for n, p in bf16.named_parameters() if ".indexer." in n]
    assert grads and all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("shape", [(4096, 1, 16, 128, 64), (4096, 2, 16, 64, 64), (1000, 2, 1, 128, 64)])
def test_fused_mla_rope_is_megatrons_formula_bitwise_in_bf16(shape):
    """The MLA RoPE kernel (pretrain/model/rope.py) against megatron-core's unfused formula on CUDA: bf16 outputs and
    gradients bit for bit (the kernel rounds where PyTorch's elementwise operations round), on a strided view."""
    from pretrain.model.rope import mla_rope
    from tests.rope_reference import megatron_rope

    s, b, h, d, r = shape
    freqs = (torch.rand(s, 1, 1, r // 2, device="cuda") * s).repeat(1, 1, 1, 2)
    wide = torch.randn(s, b, h, d + 64, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(s, b, h, d, device="cuda", dtype=torch.bfloat16)
    t_ref, t = wide.clone().requires_grad_(True), wide.clone().requires_grad_(True)
    ref = megatron_rope(t_ref[..., 64:], freqs)
    got = mla_rope(freqs)(t[..., 64:])
    ref.backward(grad)
    got.backward(grad)
    assert torch.equal(got, ref) and torch.equal(t.grad, t_ref.grad)
