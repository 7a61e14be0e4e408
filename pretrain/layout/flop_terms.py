"""The layout planner's FLOP counts: the trainer's own (`pretrain.training.flops`) from the planner's model dims, per
decoder layer and head class, and Muon's Newton-Schulz FLOPs per step (the time model, `pretrain.layout.timing`,
divides them by calibrated rates)."""

from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace
from typing import Dict, Tuple

from pretrain.layout.types import ModelDims
from pretrain.training.flops import training_flops_per_token

__all__ = ["flops_model", "flops_per_token", "per_layer_flops", "newton_schulz_flops"]


def flops_model(dims: ModelDims) -> SimpleNamespace:
    """The attributes pretrain.training.flops reads, from the planner's dims."""
    return SimpleNamespace(
        num_layers=dims.num_layers, hidden_size=dims.hidden, num_attention_heads=dims.heads,
        multi_latent_attention=True, qk_head_dim=dims.qk_head_dim, qk_pos_emb_head_dim=dims.qk_pos_emb_head_dim,
        q_lora_rank=dims.q_lora_rank, kv_lora_rank=dims.kv_lora_rank, v_head_dim=dims.v_head_dim,
        kv_channels=None, num_query_groups=None, window_size=None, ffn_hidden_size=dims.ffn_hidden,
        num_moe_experts=dims.num_experts or None, moe_layer_freq=list(dims.moe_pattern),
        moe_router_topk=dims.topk, moe_ffn_hidden_size=dims.expert_ffn_hidden,
        moe_shared_expert_intermediate_size=dims.shared_expert_ffn_hidden, vocab_size=dims.vocab,
        mtp_num_layers=dims.mtp_depths, experimental_attention_variant="dsa" if dims.dsa_indexer_heads else None,
        dsa_indexer_n_heads=dims.dsa_indexer_heads, dsa_indexer_head_dim=dims.dsa_indexer_head_dim,
        dsa_indexer_topk=dims.dsa_indexer_topk)


def flops_per_token(dims: ModelDims, seq: int) -> Dict[str, object]:
    """flops.py's training FLOPs per token as the trainer counts them (DSA modes from the dims)."""
    return training_flops_per_token(flops_model(dims), seq, dsa_sparse=dims.dsa_sparse_attention,
                                    dsa_indexer=dims.dsa_indexer_loss)


@lru_cache(maxsize=256)
def per_layer_flops(dims: ModelDims, seq: int) -> Tuple[Dict[str, float], Dict[str, float], float]:
    """(per decoder layer FLOPs/token by class, per-head FLOPs/token {output_head, mtp_eh_proj}, total)."""
    f = flops_per_token(dims, seq)
    c: Dict[str, float] = f["components"]
    d = dims.mtp_depths
    slots = dims.num_layers + d
    moe_slots = dims.moe_layers + (d if dims.mtp_layer_is_moe else 0)
    dense_slots = dims.dense_layers + (0 if dims.mtp_layer_is_moe else d)
    layer = {k: c.get(k, 0.0) / slots for k in ("attention_proj", "attention_core", "attention_sparse", "dsa_indexer")}
    layer.update({k: c.get(k, 0.0) / max(moe_slots, 1) for k in ("routed_experts", "shared_expert", "router")})
    layer["dense_mlp"] = c.get("dense_mlp", 0.0) / max(dense_slots, 1)
    head = {"output_head": c["output_head"] / (1 + d), "mtp_eh_proj": c.get("mtp_eh_proj", 0.0) / max(d, 1)}
    return layer, head, f["total"]


@lru_cache(maxsize=64)
def newton_schulz_flops(dims: ModelDims, steps: int = 5) -> float:
    """Newton-Schulz FLOPs of one Muon step over the model's matrices (4 m^2 n + 2 m^3 per iteration, m <= n), cut
    as `pretrain.optim.roles.param_split` cuts them (optimizer.muon_split): the q up-projection per head, the kv
    up-projection per head as W_UK and W_UV, the output projection whole; experts and FFNs whole;
    embedding/output/router on AdamW."""
    h, H = dims.hidden, dims.heads
    ns = lambda a, b: steps * (4 * min(a, b) ** 2 * max(a, b) + 2 * min(a, b) ** 3)
    q_in = dims.q_lora_rank or h
    attn = (ns(h, dims.q_lora_rank) if dims.q_lora_rank else 0) + H * ns(q_in, dims.qk_head)
    attn += ns(h, dims.kv_lora_rank + dims.qk_pos_emb_head_dim)
    attn += H * (ns(dims.kv_lora_rank, dims.qk_head_dim) + ns(dims.kv_lora_rank, dims.v_head_dim))
    attn += ns(H * dims.v_head_dim, h)
    if dims.dsa_indexer_heads:
        attn += (ns(q_in, dims.dsa_indexer_heads * dims.dsa_indexer_head_dim) + ns(h, dims.dsa_indexer_head_dim)
                 + ns(h, dims.dsa_indexer_heads))  # queries, keys, and the per-head weights
    swiglu = lambda f: ns(h, 2 * f) + ns(f, h)
    moe = dims.num_experts * swiglu(dims.expert_ffn_hidden) + (swiglu(dims.shared_expert_ffn_hidden)
                                                               if dims.shared_expert_ffn_hidden else 0)
    per_layer = [attn + (moe if m else swiglu(dims.ffn_hidden)) for m in dims.moe_pattern]
    mtp = dims.mtp_layers * (attn + (moe if dims.mtp_layer_is_moe else swiglu(dims.ffn_hidden)) + ns(h, 2 * h))
    return float(sum(per_layer) + mtp)
