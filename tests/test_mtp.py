"""MTP: the depth outputs against a naive re-implementation, and depth-shared parameters."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import GlmMoeDsaForCausalLM

from parallel.initialize import ensure_single_rank
from pretrain.config import load_config
from pretrain.convert.hf_config import hf_config_from_model
from pretrain.convert.hf_mapping import rules
from pretrain.model.builder import build_model

SEQ, BATCH = 12, 2


def tiny_cfg(**model_overrides):
    overrides = ["model.vocab_size=256", f"data.seq_length={SEQ}", "model.moe_token_dispatcher_type=allgather"]
    overrides += [f"model.{k}={v}" for k, v in model_overrides.items()]
    return load_config("configs/models/glm5-tiny.yaml", overrides)


def build(cfg, seed=0):
    ensure_single_rank()
    torch.manual_seed(seed)
    model = build_model(cfg)
    with torch.no_grad():  # non-trivial norm weights, so a mixed-up norm cannot go unnoticed
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
    return model


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def test_mtp_depths_match_naive_formula(tmp_path):
    """h^k = FinalNorm(Layer(W_eh [ENorm(Emb(t_{i+k})); HNorm(h^{k-1})])), logits^k = Head(h^k).

    The reference runs the decoder layers in transformers' GlmMoeDsa implementation (MTP layer
    weights loaded as an extra decoder layer) and writes the MTP formula out by hand."""
    cfg = tiny_cfg()
    m = cfg.model
    model = build(cfg).eval()
    ours = {r.ours: r for r in rules(m)}
    state = model.state_dict()
    hf_state = {}
    for name, rule in ours.items():
        hf_state.update(rule.to_theirs(state[name]))
    hf_cfg = hf_config_from_model(dataclasses.replace(m, num_layers=m.num_layers + 1, moe_layer_freq=[0, 1, 1]))
    hf_cfg.update(index_topk=SEQ, num_nextn_predict_layers=0)
    # transformers reads the per-expert tensors and packs them itself
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    save_file(hf_state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hf = GlmMoeDsaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert hf.model.layers[m.num_layers].mlp.experts.gate_up_proj.shape[0] == m.num_moe_experts
    L = m.num_layers
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, m.vocab_size, (BATCH, SEQ), generator=gen)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    causal = torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool)).expand(BATCH, 1, SEQ, SEQ)
    with torch.no_grad():
        hf.config.num_hidden_layers = L  # main model: the first L layers, then the final norm
        h = hf.model(ids).last_hidden_state
        rope = hf.model.rotary_emb(h, pos)
        prefix = "mtp.layers.0."
        tokens = ids
        expected = [hf.lm_head(h)]
        for _ in range(m.mtp_num_layers):
            tokens = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)  # t_{i+k}; 0 past the end
            e = rms_norm(hf.model.embed_tokens(tokens), state[prefix + "enorm.weight"], m.layernorm_epsilon)
            hn = rms_norm(h, state[prefix + "hnorm.weight"], m.layernorm_epsilon)
            x = torch.cat([e, hn], dim=-1) @ state[prefix + "eh_proj.weight"].t()
            y, _ = hf.model.layers[L](x, attention_mask=causal, position_embeddings=rope, position_ids=pos)
            h = rms_norm(y, state[prefix + "final_layernorm.weight"], m.layernorm_epsilon)
            expected.append(hf.lm_head(h))
        got = model.mtp_logits(ids, pos)
    assert len(got) == 1 + m.mtp_num_layers
    for depth, (g, e) in enumerate(zip(got, expected)):
        err = ((g - e).abs().max() / e.abs().max()).item()
        assert err <= 1e-5, f"depth {depth}: relative error {err}"


def test_shared_mtp_gradient_is_sum_of_depths():
    """One parameter set serves all depths; its gradient equals the sum of the gradients of
    megatron's one-layer-per-depth MTP holding three copies of the same weights."""
    shared_cfg = tiny_cfg()
    unshared_cfg = tiny_cfg(mtp_use_repeated_layer="false")
    shared, unshared = build(shared_cfg, seed=1), build(unshared_cfg, seed=2)
    depths = shared_cfg.model.mtp_num_layers
    assert len(shared.mtp.layers) == 1 and len(unshared.mtp.layers) == depths
    assert not any(n.startswith("mtp.layers.1.") for n, _ in shared.named_parameters())

    src = shared.state_dict()
    dst = {}
    for name, tensor in unshared.state_dict().items():
        key = name
        if name.startswith("mtp.layers."):
            key = "mtp.layers.0." + name.split(".", 3)[3]
        dst[name] = src[key].clone() if torch.is_tensor(src[key]) else src[key]
    unshared.load_state_dict(dst)

    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, 256, (BATCH, SEQ), generator=gen)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)
    losses = []
    for model in (shared, unshared):
        model.train()
        loss = model(ids, pos, None, labels=labels).mean()
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)

    grads_unshared = dict(unshared.named_parameters())
    checked = 0
    for name, p in shared.named_parameters():
        if not name.startswith("mtp.layers.0."):
            continue
        suffix = name[len("mtp.layers.0."):]
        parts = [grads_unshared[f"mtp.layers.{d}.{suffix}"].grad for d in range(depths)]
        if p.grad is None:
            assert all(g is None or not g.any() for g in parts), name
            continue
        total = torch.stack(parts).sum(0)
        assert torch.allclose(p.grad, total, rtol=1e-5, atol=1e-7), name
        # every depth contributes (the sum is not just one depth's gradient)
        assert all(g.abs().sum() > 0 for g in parts) or "indexer" in name, name
        checked += 1
    assert checked > 10


def test_each_depth_loss_is_tracked():
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    cfg = tiny_cfg()
    model = build(cfg).train()
    MTPLossLoggingHelper.tracker.clear()
    ids = torch.randint(0, 256, (BATCH, SEQ))
    model(ids, torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1), None, labels=ids).mean().backward()
    values = MTPLossLoggingHelper.tracker["values"]
    assert values.shape == (cfg.model.mtp_num_layers,)
    # a random model's cross-entropy is near log(vocab) at every depth
    assert torch.all((values > 0.5 * torch.log(torch.tensor(256.0))) & (values < 2 * torch.log(torch.tensor(256.0))))
