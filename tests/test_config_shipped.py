"""The shipped YAML configs: they load, validate and round-trip, set every value, and match GLM-5's values."""

from __future__ import annotations

import dataclasses
import os

import pytest

from pretrain.ablate.sweep import is_sweep_file
from pretrain.config import SECTIONS, config_to_dict, load_config, moe_layer_pattern, save_config, validate_config
from tests.config_helpers import ABLATIONS, GLM5, MODELS, PROXY, TINY

# Sweep files (configs/ablations/*.yaml with `variants`) are checked by tests/test_ablate.py.
SHIPPED = sorted(MODELS.glob("*.yaml")) + [p for p in sorted(ABLATIONS.glob("*.yaml")) if not is_sweep_file(p)]


# ---------------------------------------------------------------------------------------------
# shipped YAMLs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_config_loads_and_round_trips(path, tmp_path):
    cfg = load_config(path)
    validate_config(cfg)
    out = tmp_path / "run" / "config.yaml"
    save_config(cfg, out)
    save_config(cfg, out)  # overwriting is fine
    assert load_config(out) == cfg
    assert os.listdir(out.parent) == ["config.yaml"]  # no temp file left behind


@pytest.mark.parametrize("path", sorted(MODELS.glob("*.yaml")), ids=lambda p: p.name)
def test_model_configs_set_every_value_explicitly(path):
    import yaml

    doc = yaml.safe_load(path.read_text())
    for name, cls in SECTIONS.items():
        missing = {f.name for f in dataclasses.fields(cls)} - set(doc[name])
        assert not missing, f"{path.name} does not set {name}.{sorted(missing)}"


def test_glm5_matches_hf_reference():
    import transformers

    hf = transformers.GlmMoeDsaConfig()
    m = load_config(GLM5).model
    assert m.hidden_size == hf.hidden_size == 6144
    assert m.num_layers == hf.num_hidden_layers == 78
    assert m.num_attention_heads == hf.num_attention_heads == 64
    assert m.q_lora_rank == hf.q_lora_rank == 2048
    assert m.kv_lora_rank == hf.kv_lora_rank == 512
    assert m.qk_head_dim == hf.qk_nope_head_dim == 192
    assert m.qk_pos_emb_head_dim == hf.qk_rope_head_dim == 64
    assert m.v_head_dim == hf.v_head_dim == 256
    assert m.num_moe_experts == hf.n_routed_experts == 256
    assert m.moe_router_topk == hf.num_experts_per_tok == 8
    assert m.moe_ffn_hidden_size == hf.moe_intermediate_size == 2048
    assert m.moe_shared_expert_intermediate_size == hf.n_shared_experts * hf.moe_intermediate_size
    assert m.ffn_hidden_size == hf.intermediate_size == 12288
    assert m.vocab_size == hf.vocab_size == 154880
    assert m.moe_router_topk_scaling_factor == hf.routed_scaling_factor == 2.5
    assert m.dsa_indexer_n_heads == hf.index_n_heads == 32
    assert m.dsa_indexer_head_dim == hf.index_head_dim == 128
    assert m.dsa_indexer_topk == hf.index_topk == 2048
    assert m.max_position_embeddings == hf.max_position_embeddings == 202752
    assert m.layernorm_epsilon == hf.rms_norm_eps == 1e-5
    assert m.share_embeddings_and_output_weights == hf.tie_word_embeddings is False
    pattern = moe_layer_pattern(m)
    k = hf.first_k_dense_replace
    assert pattern == [0] * k + [1] * (hf.num_hidden_layers - k)
    assert pattern == [int(t == "sparse") for t in hf.mlp_layer_types]


def test_glm5_values_hf_defaults_do_not_carry():
    # The HF class defaults rope_theta to 1e4; the released model uses 1e6 (GLM-5's public model config).
    m = load_config(GLM5).model
    assert (m.rotary_base, m.rope_type, m.latent_layernorm_epsilon) == (1e6, "rope", 1e-6)
    assert (m.moe_router_score_function, m.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert (m.moe_router_bias_update_rate, m.moe_aux_loss_coeff) == (1e-3, 1e-4)
    assert (m.mtp_num_layers, m.mtp_use_repeated_layer, m.experimental_attention_variant) == (3, True, "dsa")
    assert m.bf16 is True
    assert load_config(GLM5).data.seq_length == 4096


def test_tiny_and_proxy_shapes():
    t = load_config(TINY)
    assert (t.model.num_layers, t.model.hidden_size, t.model.vocab_size, t.model.transformer_impl) == (2, 64, 8192,
                                                                                                        "local")
    assert moe_layer_pattern(t.model) == [0, 1]
    assert (t.train.micro_batch_size, t.train.global_batch_size, t.model.bf16) == (4, 8, False)
    p = load_config(PROXY)
    assert moe_layer_pattern(p.model) == [0] + [1] * 11
    assert (p.model.qk_head_dim, p.model.qk_pos_emb_head_dim, p.model.v_head_dim) == (192, 64, 256)


def test_attention_ablations():
    proxy = load_config(PROXY)
    mla256 = load_config(ABLATIONS / "attn-mla256.yaml")
    assert mla256.model == proxy.model and mla256.optimizer == proxy.optimizer and mla256.train == proxy.train
    mla192 = load_config(ABLATIONS / "attn-mla192.yaml").model
    assert (mla192.num_attention_heads, mla192.qk_head_dim, mla192.qk_pos_emb_head_dim, mla192.v_head_dim) == (
        24, 128, 64, 128)
    gqa = load_config(ABLATIONS / "attn-gqa8.yaml").model
    assert not gqa.multi_latent_attention and gqa.experimental_attention_variant is None
    assert (gqa.num_attention_heads, gqa.num_query_groups, gqa.kv_channels) == (16, 8, 128)
    # Everything outside attention is the proxy's.
    assert dataclasses.replace(gqa, multi_latent_attention=True, num_query_groups=None, kv_channels=None,
                               experimental_attention_variant="dsa") == proxy.model


def test_config_to_dict_sections():
    d = config_to_dict(load_config(TINY))
    assert list(d) == list(SECTIONS)
    assert d["model"]["moe_layer_freq"] == [0, 1]


@pytest.mark.parametrize("name,pattern", [("glm5-width.yaml", [0, 1]), ("glm5-width-128k.yaml", [0, 0])])
def test_width_slices_have_every_glm5_layer_dimension(name, pattern):
    """configs/scaling/glm5-width*.yaml: GLM-5's layer dimensions (the transformers reference config), cut to two
    layers; only depth, MTP, the attention mode and the output loss may differ from the 744B config."""
    import transformers

    hf = transformers.GlmMoeDsaConfig()
    m = load_config(MODELS.parent / "scaling" / name).model
    dims = {"hidden_size": hf.hidden_size, "ffn_hidden_size": hf.intermediate_size,
            "num_attention_heads": hf.num_attention_heads, "vocab_size": hf.vocab_size,
            "q_lora_rank": hf.q_lora_rank, "kv_lora_rank": hf.kv_lora_rank, "qk_head_dim": hf.qk_nope_head_dim,
            "qk_pos_emb_head_dim": hf.qk_rope_head_dim, "v_head_dim": hf.v_head_dim,
            "num_moe_experts": hf.n_routed_experts, "moe_router_topk": hf.num_experts_per_tok,
            "moe_ffn_hidden_size": hf.moe_intermediate_size,
            "moe_shared_expert_intermediate_size": hf.n_shared_experts * hf.moe_intermediate_size,
            "dsa_indexer_n_heads": hf.index_n_heads, "dsa_indexer_head_dim": hf.index_head_dim,
            "dsa_indexer_topk": hf.index_topk}
    assert {k: getattr(m, k) for k in dims} == dims
    assert (m.num_layers, moe_layer_pattern(m)) == (2, pattern)
    full = load_config(GLM5).model
    differ = {f.name for f in dataclasses.fields(m) if getattr(m, f.name) != getattr(full, f.name)}
    assert differ <= {"num_layers", "moe_layer_freq", "mtp_num_layers", "rotary_base", "dsa_sparse_attention",
                      "dsa_indexer_loss_coeff", "dsa_indexer_use_sparse_loss", "output_loss_backend",
                      "output_chunk_size"}, differ
