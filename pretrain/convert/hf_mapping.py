"""Parameter names and layouts: our megatron-core model <-> Hugging Face `GlmMoeDsaForCausalLM`.

Every rule maps one of our tensors to one or more HF tensors by copies, concatenations and
transposes only, so a round trip is bitwise exact. Layout facts the rules encode:

* SwiGLU `linear_fc1` is [gate; up] stacked on the output dim (HF keeps gate_proj / up_proj).
* Grouped experts keep megatron's `GroupedMLP` memory layout: `weight1` [H, E*2F] is E blocks of
  [H, 2F] = [gate_e; up_e]^T, `weight2` [E*F, H] is E blocks of down_e^T.
* MLA projections need no permutation: megatron's MLA applies interleaved RoPE on the same
  [nope | rope] per-head layout HF uses.
* HF stores MTP layer d as `model.layers.{num_layers + d}` (eh_proj, enorm, hnorm,
  shared_head.norm and a full decoder layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List

import torch

from pretrain.config import moe_layer_pattern
from pretrain.config.schema import ModelConfig

Getter = Callable[[str], torch.Tensor]


@dataclass(frozen=True)
class Rule:
    ours: str
    theirs: tuple
    kind: str = "copy"  # copy | cat | experts_fc1 | experts_fc2

    def to_ours(self, get: Getter) -> torch.Tensor:
        srcs = [get(name) for name in self.theirs]
        if self.kind == "copy":
            return srcs[0]
        if self.kind == "cat":
            return torch.cat(srcs, dim=0)
        if self.kind == "experts_fc1":  # theirs: gate_0, up_0, gate_1, up_1, ...
            blocks = [torch.cat(srcs[i : i + 2], dim=0).t() for i in range(0, len(srcs), 2)]
            stacked = torch.stack(blocks)  # [E, H, 2F]
            return stacked.reshape(stacked.shape[1], -1)
        if self.kind == "experts_fc2":  # theirs: down_0, down_1, ...
            stacked = torch.stack([s.t() for s in srcs])  # [E, F, H]
            return stacked.reshape(-1, stacked.shape[-1])
        raise ValueError(self.kind)

    def to_theirs(self, tensor: torch.Tensor) -> Dict[str, torch.Tensor]:
        if self.kind == "copy":
            return {self.theirs[0]: tensor}
        if self.kind == "cat":
            parts = torch.chunk(tensor, len(self.theirs), dim=0)
            return {n: p.contiguous() for n, p in zip(self.theirs, parts)}
        if self.kind == "experts_fc1":
            n_experts = len(self.theirs) // 2
            blocks = tensor.reshape(n_experts, tensor.shape[0], -1)  # [E, H, 2F]
            out = {}
            for e in range(n_experts):
                gate, up = torch.chunk(blocks[e].t(), 2, dim=0)
                out[self.theirs[2 * e]] = gate.contiguous()
                out[self.theirs[2 * e + 1]] = up.contiguous()
            return out
        if self.kind == "experts_fc2":
            n_experts = len(self.theirs)
            blocks = tensor.reshape(n_experts, -1, tensor.shape[-1])  # [E, F, H]
            return {self.theirs[e]: blocks[e].t().contiguous() for e in range(n_experts)}
        raise ValueError(self.kind)


_ATTENTION = [
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
    ("self_attention.linear_kv_down_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
    ("self_attention.kv_layernorm.weight", "self_attn.kv_a_layernorm.weight"),
    ("self_attention.linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight"),
    ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
]
_Q_LORA = [
    ("self_attention.linear_q_down_proj.weight", "self_attn.q_a_proj.weight"),
    ("self_attention.q_layernorm.weight", "self_attn.q_a_layernorm.weight"),
    ("self_attention.linear_q_up_proj.weight", "self_attn.q_b_proj.weight"),
]
_INDEXER = [
    ("self_attention.core_attention.indexer.linear_wq_b.weight", "self_attn.indexer.wq_b.weight"),
    ("self_attention.core_attention.indexer.linear_wk.weight", "self_attn.indexer.wk.weight"),
    ("self_attention.core_attention.indexer.k_norm.weight", "self_attn.indexer.k_norm.weight"),
    ("self_attention.core_attention.indexer.k_norm.bias", "self_attn.indexer.k_norm.bias"),
    ("self_attention.core_attention.indexer.linear_weights_proj.weight", "self_attn.indexer.weights_proj.weight"),
]


def _layer_rules(cfg: ModelConfig, ours: str, theirs: str, moe: bool, own_indexer: bool = True) -> Iterator[Rule]:
    pairs = list(_ATTENTION)
    pairs += _Q_LORA if cfg.q_lora_rank is not None else [("self_attention.linear_q_proj.weight", "self_attn.q_proj.weight")]
    if cfg.experimental_attention_variant == "dsa" and own_indexer:
        pairs += _INDEXER
    for a, b in pairs:
        yield Rule(ours + a, (theirs + b,))
    if not moe:
        yield Rule(ours + "mlp.linear_fc1.weight", (theirs + "mlp.gate_proj.weight", theirs + "mlp.up_proj.weight"), "cat")
        yield Rule(ours + "mlp.linear_fc2.weight", (theirs + "mlp.down_proj.weight",))
        return
    yield Rule(ours + "mlp.router.weight", (theirs + "mlp.gate.weight",))
    if cfg.moe_router_enable_expert_bias:
        yield Rule(ours + "mlp.router.expert_bias", (theirs + "mlp.gate.e_score_correction_bias",))
    experts = range(cfg.num_moe_experts)
    hf_exp = theirs + "mlp.experts."
    if cfg.moe_grouped_gemm:
        fc1 = tuple(f"{hf_exp}{e}.{p}_proj.weight" for e in experts for p in ("gate", "up"))
        yield Rule(ours + "mlp.experts.weight1", fc1, "experts_fc1")
        yield Rule(ours + "mlp.experts.weight2", tuple(f"{hf_exp}{e}.down_proj.weight" for e in experts), "experts_fc2")
    else:
        for e in experts:
            local = f"{ours}mlp.experts.local_experts.{e}."
            yield Rule(local + "linear_fc1.weight", (f"{hf_exp}{e}.gate_proj.weight", f"{hf_exp}{e}.up_proj.weight"), "cat")
            yield Rule(local + "linear_fc2.weight", (f"{hf_exp}{e}.down_proj.weight",))
    if cfg.moe_shared_expert_intermediate_size:
        shared = theirs + "mlp.shared_experts."
        yield Rule(ours + "mlp.shared_experts.linear_fc1.weight", (shared + "gate_proj.weight", shared + "up_proj.weight"), "cat")
        yield Rule(ours + "mlp.shared_experts.linear_fc2.weight", (shared + "down_proj.weight",))


def mtp_stored_layers(cfg: ModelConfig) -> int:
    if not cfg.mtp_num_layers:
        return 0
    return 1 if cfg.mtp_use_repeated_layer else cfg.mtp_num_layers


def rules(cfg: ModelConfig) -> List[Rule]:
    """All tensors of the whole (TP=1, EP=1, PP=1) model."""
    if not cfg.multi_latent_attention:
        raise ValueError("HF conversion covers MLA models only")
    pattern = moe_layer_pattern(cfg)
    out = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",))]
    types = cfg.dsa_indexer_types or ["full"] * cfg.num_layers
    for i, moe in enumerate(pattern):
        out += _layer_rules(cfg, f"decoder.layers.{i}.", f"model.layers.{i}.", bool(moe), types[i] == "full")
    out.append(Rule("decoder.final_layernorm.weight", ("model.norm.weight",)))
    for d in range(mtp_stored_layers(cfg)):
        ours, theirs = f"mtp.layers.{d}.", f"model.layers.{cfg.num_layers + d}."
        for a, b in [("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"), ("final_layernorm", "shared_head.norm")]:
            out.append(Rule(f"{ours}{a}.weight", (f"{theirs}{b}.weight",)))
        out += _layer_rules(cfg, ours + "transformer_layer.", theirs, bool(pattern[-1]))
    if not cfg.share_embeddings_and_output_weights:
        out.append(Rule("output_layer.weight", ("lm_head.weight",)))
    return out
