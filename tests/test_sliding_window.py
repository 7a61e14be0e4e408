"""Sliding-window attention (`model.window_size`) against a naive masked softmax in float64."""

import math

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType

from parallel.initialize import ensure_single_rank
from pretrain.config import ConfigError, load_config
from pretrain.model.builder import build_model, transformer_config
from pretrain.model.core_attention import SDPACoreAttention
from pretrain.training.flops import training_flops_per_token

TINY = "configs/models/glm5-tiny.yaml"
WINDOW = ["model.experimental_attention_variant=null", "model.window_size=[3,0]"]


def naive(q, k, v, left, doc_mask=None):
    """[s, b, h, d] inputs; loops over queries, softmax over keys j with i - left <= j <= i (and same document)."""
    s, b, h, _ = q.shape
    out = torch.zeros(s, b, h, v.shape[-1], dtype=torch.float64)
    for i in range(s):
        for bi in range(b):
            keys = [j for j in range(max(0, i - left), i + 1) if doc_mask is None or not doc_mask[bi, 0, i, j]]
            scores = torch.stack([(q[i, bi] * k[j, bi]).sum(-1) / math.sqrt(q.shape[-1]) for j in keys])  # [n, h]
            weights = scores.softmax(0)
            out[i, bi] = sum(weights[n].unsqueeze(-1) * v[j, bi] for n, j in enumerate(keys))
    return out.reshape(s, b, -1)


@pytest.mark.parametrize("documents", [False, True])
def test_window_attention_matches_naive_loop(documents):
    cfg = load_config(TINY, WINDOW)
    tcfg = transformer_config(cfg.model, cfg.parallel)
    attn = SDPACoreAttention(tcfg, 1, AttnMaskType.causal, softmax_scale=16 ** -0.5)
    torch.manual_seed(0)
    s, b, h, d = 9, 2, 4, 16
    q, k, v = (torch.randn(s, b, h, d, dtype=torch.float64) for _ in range(3))
    mask = None
    if documents:  # two documents in batch row 0 (a break at 5), one in row 1; True = masked out
        seg = torch.tensor([[0] * 5 + [1] * 4, [0] * 9])
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        mask = ~((seg[:, :, None] == seg[:, None, :]) & causal).unsqueeze(1)
    got = attn(q, k, v, mask)
    torch.testing.assert_close(got, naive(q, k, v, 3, mask))
    dense = load_config(TINY, WINDOW[:1])
    full = SDPACoreAttention(transformer_config(dense.model, dense.parallel), 1, AttnMaskType.causal,
                             softmax_scale=16 ** -0.5)
    assert not torch.allclose(full(q, k, v, mask), got)  # the window changes the result at this length


def test_window_model_trains_end_to_end_and_counts_fewer_flops():
    extra = ["model.moe_token_dispatcher_type=allgather", "model.vocab_size=64"]
    cfg, dense = load_config(TINY, WINDOW + extra), load_config(TINY, WINDOW[:1] + extra)
    ensure_single_rank()
    model, reference = build_model(cfg), build_model(dense)
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, 64, (2, 16))
    positions = torch.arange(16).expand(2, -1)
    loss = model(ids, positions, None, labels=ids)
    loss.mean().backward()
    with torch.no_grad():
        full = reference(ids, positions, None, labels=ids)
    # The first 4 positions see the same keys either way; later ones lose keys to the window.
    torch.testing.assert_close(loss[:, :4], full[:, :4])
    assert not torch.allclose(loss[:, 8:], full[:, 8:])
    assert training_flops_per_token(cfg, 128)["components"]["attention_core"] < \
        training_flops_per_token(dense, 128)["components"]["attention_core"]


@pytest.mark.parametrize("override, message", [
    ("model.window_size=[3,1]", "write [left, 0]"),
    ("model.window_size=[0,0]", "write [left, 0]"),
])
def test_bad_windows_are_refused(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_config(TINY, [WINDOW[0], override])
    with pytest.raises(ConfigError, match="experimental_attention_variant=null"):
        load_config(TINY, ["model.window_size=[3,0]"])
