"""Tiny random Hugging Face GLM-5 (`GlmMoeDsaForCausalLM`) checkpoints: the independent reference."""

from __future__ import annotations

import json
import os
from typing import Optional

import torch
from safetensors.torch import load_file, save_file
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM


def tiny_hf_config(layers: int = 3, dense: int = 1, vocab: int = 128, index_topk: int = 64, **kw) -> GlmMoeDsaConfig:
    values = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=24,
        v_head_dim=32,
        index_topk=index_topk,
        index_head_dim=16,
        index_n_heads=4,
        first_k_dense_replace=dense,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        initializer_range=0.1,
    )
    values.update(kw)
    return GlmMoeDsaConfig(**values)


def tiny_hf_model(seed: int, **kw) -> GlmMoeDsaForCausalLM:
    """Random weights, with router weights and correction biases large enough that the expert
    choice depends on both (a zero bias would leave that path untested)."""
    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(tiny_hf_config(**kw)).eval()
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.weight.normal_(0.0, 0.5)
                module.e_score_correction_bias.normal_(0.0, 0.5)
            if hasattr(module, "k_norm"):
                module.k_norm.weight.normal_(1.0, 0.1)
                module.k_norm.bias.normal_(0.0, 0.1)
    return model


def write_hf_checkpoint(path: str, seed: int, layers: int = 3, dense: int = 1, mtp: bool = True,
                        max_shard_size: Optional[str] = None, **kw) -> GlmMoeDsaForCausalLM:
    """An HF directory as GLM-5 ships it: `layers` decoder layers plus, with `mtp`, one MTP layer
    stored as `model.layers.{layers}` (eh_proj, enorm, hnorm, shared_head.norm and a full MoE
    decoder layer). Returns the HF model of the main layers (which ignores the MTP layer)."""
    full = tiny_hf_model(seed, layers=layers + int(mtp), dense=dense, **kw)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    full.save_pretrained(path, **kwargs)
    if not mtp:
        return full
    gen = torch.Generator().manual_seed(seed + 1000)
    h = full.config.hidden_size
    extra = {
        f"model.layers.{layers}.eh_proj.weight": torch.randn(h, 2 * h, generator=gen) * 0.1,
        f"model.layers.{layers}.enorm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
        f"model.layers.{layers}.hnorm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
        f"model.layers.{layers}.shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
    }
    save_file(extra, os.path.join(path, "mtp-extra.safetensors"), metadata={"format": "pt"})
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            data = json.load(f)
        data["weight_map"].update({k: "mtp-extra.safetensors" for k in extra})
        with open(index, "w") as f:
            json.dump(data, f)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.update(
        num_hidden_layers=layers,
        num_nextn_predict_layers=1,
        mlp_layer_types=config["mlp_layer_types"][:layers],
        indexer_types=config["indexer_types"][:layers],
        layer_types=config["layer_types"][:layers],
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    main = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "transformers_version", "model_type")})).eval()
    main.load_state_dict({k: v for k, v in full.state_dict().items() if not k.startswith(f"model.layers.{layers}.")})
    return main


def read_all_tensors(path: str) -> dict:
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out
