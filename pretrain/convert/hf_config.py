"""Hugging Face `GlmMoeDsaConfig` (config.json) <-> our `ModelConfig`."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict

from pretrain.config import moe_layer_pattern
from pretrain.config.errors import ConfigError
from pretrain.config.schema import ModelConfig


class ConversionError(ValueError):
    """A checkpoint or config that cannot be converted; the message says which tensor/key."""


def model_config_from_hf(hf: Dict[str, Any], **overrides: Any) -> ModelConfig:
    """Translate a GLM-5 (`glm_moe_dsa`) config.json; `overrides` are ModelConfig fields."""
    if hf.get("model_type") not in (None, "glm_moe_dsa"):
        raise ConversionError(f"expected a glm_moe_dsa config.json, got model_type={hf.get('model_type')!r}")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ConversionError("attention_bias / mlp_bias checkpoints are not supported (GLM-5 has no biases)")
    if not hf.get("norm_topk_prob", True):
        raise ConversionError("norm_topk_prob=false is not supported: the sigmoid router normalizes top-k weights")
    n_layers = hf["num_hidden_layers"]
    indexer_types = list(hf.get("indexer_types") or [])
    if indexer_types and (len(indexer_types) != n_layers or set(indexer_types) - {"full", "shared"}):
        raise ConversionError(
            f"indexer_types must list 'full' or 'shared' for each of the {n_layers} layers, got {indexer_types}"
        )
    mlp_types = hf.get("mlp_layer_types") or (
        ["dense"] * hf.get("first_k_dense_replace", 3) + ["sparse"] * n_layers
    )[:n_layers]
    rope = hf.get("rope_parameters") or {"rope_type": "default", "rope_theta": hf.get("rope_theta", 10000.0)}
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("default", "yarn"):
        raise ConversionError(f"rope_type {rope_type!r} is not supported (use default or yarn)")
    n_mtp = int(hf.get("num_nextn_predict_layers", 0) or 0)
    n_experts = hf.get("n_routed_experts")
    values: Dict[str, Any] = dict(
        num_layers=n_layers,
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=hf["num_attention_heads"],
        vocab_size=hf["vocab_size"],
        max_position_embeddings=hf["max_position_embeddings"],
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-5),
        latent_layernorm_epsilon=1e-6,  # GlmMoeDsaRMSNorm's default for q/kv latent norms
        init_method_std=hf.get("initializer_range", 0.02),
        multi_latent_attention=True,
        q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=hf["kv_lora_rank"],
        qk_head_dim=hf["qk_nope_head_dim"],
        qk_pos_emb_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        rope_type="rope" if rope_type == "default" else "yarn",
        rotary_base=float(rope["rope_theta"]),
        num_moe_experts=n_experts,
        moe_layer_freq=[1 if t == "sparse" else 0 for t in mlp_types],
        moe_ffn_hidden_size=hf.get("moe_intermediate_size"),
        moe_shared_expert_intermediate_size=(hf.get("moe_intermediate_size") or 0) * hf.get("n_shared_experts", 0) or None,
        moe_router_topk=hf.get("num_experts_per_tok", 8),
        moe_router_topk_scaling_factor=hf.get("routed_scaling_factor", 1.0),
        moe_router_num_groups=hf.get("n_group") if hf.get("n_group", 1) > 1 else None,
        moe_router_group_topk=hf.get("topk_group") if hf.get("n_group", 1) > 1 else None,
        # GLM-5 trains 3 depths that share the one stored MTP layer.
        mtp_num_layers=3 if n_mtp == 1 else (n_mtp or None),
        mtp_use_repeated_layer=n_mtp <= 1,
        experimental_attention_variant="dsa",
        dsa_indexer_n_heads=hf.get("index_n_heads", 32),
        dsa_indexer_head_dim=hf.get("index_head_dim", 128),
        dsa_indexer_topk=hf.get("index_topk", 2048),
        # The reference model attends to the indexer's top-k keys: so does the imported one.
        dsa_sparse_attention=True,
        dsa_indexer_types=indexer_types if any(t != "full" for t in indexer_types) else None,
    )
    if rope_type == "yarn":
        values.update(
            rotary_scaling_factor=rope["factor"],
            original_max_position_embeddings=rope.get("original_max_position_embeddings", 4096),
            beta_fast=rope.get("beta_fast", 32.0),
            beta_slow=rope.get("beta_slow", 1.0),
            mscale=rope.get("mscale", 1.0),
            mscale_all_dim=rope.get("mscale_all_dim", 0.0),
        )
    if n_experts is None:
        values.update(num_moe_experts=None, moe_ffn_hidden_size=None, moe_shared_expert_intermediate_size=None)
    unknown = set(overrides) - {f.name for f in dataclasses.fields(ModelConfig)}
    if unknown:
        raise ConfigError(f"unknown model override(s) {sorted(unknown)}; see pretrain/config/schema.py ModelConfig")
    values.update(overrides)
    return ModelConfig(**values)


def hf_config_from_model(model: ModelConfig) -> Dict[str, Any]:
    """A config.json for `GlmMoeDsaForCausalLM` describing `model` (MLA + DSA models only)."""
    if not model.multi_latent_attention:
        raise ConversionError("only MLA models can be exported to GlmMoeDsaForCausalLM (GQA has no HF counterpart)")
    pattern = moe_layer_pattern(model)
    shared = model.moe_shared_expert_intermediate_size or 0
    rope: Dict[str, Any] = {"rope_type": "default" if model.rope_type == "rope" else "yarn", "rope_theta": model.rotary_base}
    if model.rope_type == "yarn":
        rope.update(
            factor=model.rotary_scaling_factor,
            original_max_position_embeddings=model.original_max_position_embeddings,
            beta_fast=model.beta_fast,
            beta_slow=model.beta_slow,
            mscale=model.mscale,
            mscale_all_dim=model.mscale_all_dim,
        )
    n_mtp = 0 if not model.mtp_num_layers else (1 if model.mtp_use_repeated_layer else model.mtp_num_layers)
    return {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "num_hidden_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_attention_heads,
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_position_embeddings,
        "tie_word_embeddings": model.share_embeddings_and_output_weights,
        "rms_norm_eps": model.layernorm_epsilon,
        "initializer_range": model.init_method_std,
        "q_lora_rank": model.q_lora_rank,
        "kv_lora_rank": model.kv_lora_rank,
        "qk_nope_head_dim": model.qk_head_dim,
        "qk_rope_head_dim": model.qk_pos_emb_head_dim,
        "v_head_dim": model.v_head_dim,
        "rope_parameters": rope,
        "n_routed_experts": model.num_moe_experts,
        "moe_intermediate_size": model.moe_ffn_hidden_size,
        "n_shared_experts": (shared // model.moe_ffn_hidden_size) if model.moe_ffn_hidden_size else 0,
        "num_experts_per_tok": model.moe_router_topk,
        "routed_scaling_factor": model.moe_router_topk_scaling_factor or 1.0,
        "n_group": model.moe_router_num_groups or 1,
        "topk_group": model.moe_router_group_topk or 1,
        "norm_topk_prob": True,
        "mlp_layer_types": ["sparse" if p else "dense" for p in pattern],
        "first_k_dense_replace": pattern.index(1) if 1 in pattern else model.num_layers,
        "num_nextn_predict_layers": n_mtp,
        "index_n_heads": model.dsa_indexer_n_heads,
        "index_head_dim": model.dsa_indexer_head_dim,
        "index_topk": model.dsa_indexer_topk,
        "indexer_types": list(model.dsa_indexer_types or ["full"] * model.num_layers),
        "attention_bias": False,
        "hidden_act": "silu",
        "dtype": "bfloat16" if model.bf16 else "float32",
    }
