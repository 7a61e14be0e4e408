"""The ablation attention variants (GLM-5 MLA-256, DeepSeek-style MLA-192, GQA-8) build and train."""

import pytest
import torch

from parallel.initialize import ensure_single_rank
from pretrain.config import load_config
from pretrain.model.builder import build_model

VARIANTS = {
    "mla256": [],
    "mla192": ["model.qk_head_dim=16", "model.qk_pos_emb_head_dim=8", "model.v_head_dim=16", "model.num_attention_heads=6"],
    "gqa8": ["model.multi_latent_attention=false", "model.num_attention_heads=8", "model.num_query_groups=2",
             "model.kv_channels=16", "model.experimental_attention_variant=null"],
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_forward_backward(name):
    cfg = load_config("configs/models/glm5-tiny.yaml", ["model.vocab_size=256", "data.seq_length=16"] + VARIANTS[name])
    ensure_single_rank()
    torch.manual_seed(0)
    model = build_model(cfg)
    ids = torch.randint(0, 256, (2, 16))
    loss = model(ids, torch.arange(16).unsqueeze(0).expand(2, -1), None, labels=ids).mean()
    loss.backward()
    assert torch.isfinite(loss)
    attn = model.decoder.layers[0].self_attention
    if name == "gqa8":
        assert type(attn).__name__ == "SelfAttention"
        # q: 8 heads x 16, k and v: 2 groups x 16 each
        assert attn.linear_qkv.weight.shape == (8 * 16 + 2 * 2 * 16, 64)
    else:
        from megatron.core.transformer.multi_latent_attention import MLASelfAttention

        assert isinstance(attn, MLASelfAttention)  # DSAMLASelfAttention when the indexer is on
        heads, qk, v = cfg.model.num_attention_heads, cfg.model.qk_head_dim, cfg.model.v_head_dim
        assert attn.linear_kv_up_proj.weight.shape == (heads * (qk + v), cfg.model.kv_lora_rank)
    grads = [p.grad for n, p in model.named_parameters() if "indexer" not in n]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
