"""MLA with latent keys (`pretrain.model.latent_attention`), the layer plain MLA uses under context parallelism and
DSA builds on: which classes the spec picks, and against megatron-core's own MLA (the independent reference) the
same state-dict keys and shapes (a checkpoint of either loads strictly into the other) and the same logits and
gradients on the same weights."""

from types import SimpleNamespace

import pytest
import torch
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from parallel.initialize import ensure_single_rank
from pretrain.config import load_config
from pretrain.model import specs
from pretrain.model.builder import build_model
from pretrain.model.core_attention import SDPACoreAttention
from pretrain.model.dsa import DSACoreAttention, DSAMLASelfAttention
from pretrain.model.latent_attention import LatentCoreAttention, LatentMLASelfAttention

PLAIN_MLA = ["model.vocab_size=256", "data.seq_length=16", "model.experimental_attention_variant=null",
             "model.mtp_num_layers=0"]


def test_spec_picks_dsa_latent_or_megatron_mla():
    def cfg(variant, cp):
        return SimpleNamespace(experimental_attention_variant=variant, context_parallel_size=cp)

    assert specs.mla_classes(cfg("dsa", 1)) == (DSAMLASelfAttention, DSACoreAttention)
    assert specs.mla_classes(cfg("dsa", 2)) == (DSAMLASelfAttention, DSACoreAttention)
    assert specs.mla_classes(cfg(None, 2)) == (LatentMLASelfAttention, LatentCoreAttention)
    assert specs.mla_classes(cfg(None, 1)) == (MLASelfAttention, SDPACoreAttention)
    # DSA is the latent layer plus the indexer; the latent core has none
    assert issubclass(DSAMLASelfAttention, LatentMLASelfAttention) and issubclass(DSACoreAttention, LatentCoreAttention)


def _forward_backward(model, ids):
    logits = model(ids, torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids), None)
    logits.float().square().mean().backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_latent_layer_matches_megatron_mla_and_its_state_dict(monkeypatch):
    cfg = load_config("configs/models/glm5-tiny.yaml", PLAIN_MLA)
    ensure_single_rank()
    torch.manual_seed(0)
    reference = build_model(cfg)  # megatron's MLASelfAttention + SDPA (no CP)
    monkeypatch.setattr(specs, "mla_classes", lambda config: (LatentMLASelfAttention, LatentCoreAttention))
    latent = build_model(cfg)
    layers = [layer.self_attention for layer in latent.decoder.layers]
    assert all(type(a) is LatentMLASelfAttention and type(a.core_attention) is LatentCoreAttention for a in layers)
    assert all(type(layer.self_attention) is MLASelfAttention for layer in reference.decoder.layers)

    want = {k: tuple(v.shape) for k, v in reference.state_dict().items() if torch.is_tensor(v)}
    got = {k: tuple(v.shape) for k, v in latent.state_dict().items() if torch.is_tensor(v)}
    assert got == want
    latent.load_state_dict(reference.state_dict(), strict=True)

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_grads = _forward_backward(reference, ids)
    logits, grads = _forward_backward(latent, ids)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
