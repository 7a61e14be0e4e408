"""The torchtitan peer of benchmarks/model_step.py is built at our config's dims.

Parameter counts: torchtitan's DeepSeek-V3 built from glm5-tiny against our model built from the same
config, differing by exactly the parts torchtitan lacks, derived by hand from the config: the DSA
indexer of every layer, and (without MTP) our MTP layer. A wrong width, rank, head dim, expert count
or dense/MoE layout on the peer's side changes its count and fails. torchtitan is installed by
tests/run.sh (pure Python, no dependencies); a missing install fails here, it is not skipped.
"""

import dataclasses
import math

import pytest
import torch

from benchmarks import peer_torchtitan as peer
from pretrain.config import load_config, moe_layer_pattern
from pretrain.model.summary import count_parameters


def indexer_params(m) -> int:
    """One lightning indexer: wq_b q_lora x H_I*d_I, wk h x d_I, k_norm (LayerNorm, weight + bias) d_I,
    weights_proj h x H_I."""
    n_i, d_i, h = m.dsa_indexer_n_heads, m.dsa_indexer_head_dim, m.hidden_size
    return m.q_lora_rank * n_i * d_i + h * d_i + 2 * d_i + h * n_i


def mla_params(m) -> int:
    h, n = m.hidden_size, m.num_attention_heads
    q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * n * (m.qk_head_dim + m.qk_pos_emb_head_dim)
    kv = (h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + m.kv_lora_rank
          + m.kv_lora_rank * n * (m.qk_head_dim + m.v_head_dim))
    return q + kv + n * m.v_head_dim * h


def moe_layer_params(m) -> int:
    """Attention + MoE decoder layer without the indexer: two norms, router, routed and shared SwiGLU experts."""
    h = m.hidden_size
    experts = m.num_moe_experts * 3 * h * m.moe_ffn_hidden_size
    return mla_params(m) + 2 * h + m.num_moe_experts * h + experts + 3 * h * m.moe_shared_expert_intermediate_size


def mtp_layer_params(m) -> int:
    """One MTP depth: enorm, hnorm, eh_proj 2h x h, a MoE decoder layer, the final norm."""
    h = m.hidden_size
    return 2 * h + 2 * h * h + moe_layer_params(m) + h


def ours(cfg) -> int:
    counts = count_parameters(cfg)
    routers_bias = cfg.model.num_moe_experts * (sum(moe_layer_pattern(cfg.model)) + 1)  # a buffer, not a parameter
    return sum(counts["main"].values()) + sum(counts["mtp"].values()) - routers_bias


def peer_count(m, depths: int) -> int:
    with torch.device("meta"):
        model = peer.build_config(m, 128, "sdpa", depths).build()
    return sum(p.numel() for p in model.parameters())


def test_peer_matches_our_dims_minus_indexer_and_mtp():
    cfg = load_config("configs/models/glm5-tiny.yaml")
    m = cfg.model
    assert m.mtp_num_layers and m.mtp_use_repeated_layer and m.experimental_attention_variant == "dsa"
    layers_with_indexer = m.num_layers + 1  # the MTP layer has one too
    ours_total = ours(cfg)
    assert peer_count(m, 0) == ours_total - layers_with_indexer * indexer_params(m) - mtp_layer_params(m)
    # one peer MTP depth = our (shared) MTP layer
    assert peer_count(m, 1) == ours_total - layers_with_indexer * indexer_params(m)


def test_peer_step_loss_and_gradients_on_cpu():
    """At init the logits are near zero, so each cross entropy is about ln(vocab) and torchtitan's MTP
    loss about ln(vocab) * (1 + mtp_loss_scaling_factor); every parameter gets a gradient."""
    m = load_config("configs/models/glm5-tiny.yaml").model
    torch.manual_seed(0)
    step = peer.PeerStep(m, 64, "sdpa", m.mtp_num_layers, "cpu", torch.float32)
    ids = torch.randint(0, m.vocab_size, (2, 64))
    loss = step(ids, torch.randint(0, m.vocab_size, (2, 64)))
    loss.backward()
    expected = math.log(m.vocab_size) * (1 + m.mtp_loss_scaling_factor)
    assert abs(loss.item() - expected) < 0.05 * expected
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in step.parameters())


def test_peer_rejects_unmappable_configs():
    m = load_config("configs/models/glm5-tiny.yaml").model
    with pytest.raises(ValueError, match="tied embeddings"):
        peer.check_mappable(dataclasses.replace(m, share_embeddings_and_output_weights=True))
    with pytest.raises(ValueError, match="dense-first"):
        peer.first_dense_layers(dataclasses.replace(m, moe_layer_freq=[1, 0]))
    with pytest.raises(ValueError, match="attention must be one of"):
        peer.build_config(m, 128, "eager")
