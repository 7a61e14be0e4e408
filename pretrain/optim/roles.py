"""Muon inside the megatron-core training loop (GLM-5 report, Muon Split; `pretrain.optim.muon`).

megatron-core builds the optimizer around its parameter groups as for AdamW (dense and expert
optimizers chained, weight-decay multipliers, bf16 main weights, gradient clipping over the right
process groups); `build_muon_optimizer` then swaps each inner torch optimizer for `Muon` over the
same parameter groups and parameter order, so the wrappers, the LR / weight-decay schedule and the
sharded checkpoint code stay megatron's.

Which update each parameter takes:

- AdamW: vectors (norm weights, biases), the word embedding and the output layer, the MoE router
  gate with `optimizer.muon_router: adamw` (default: each row is one expert's logit, and whitening
  the gate would mix experts), the DSA indexer's projections with `optimizer.muon_indexer: adamw`
  (default muon: they are ordinary linear maps). The routers' correction bias is a buffer that
  only the loss-free balancing rule moves.
- Muon on blocks (`optimizer.muon_split`, on by default): MLA's q up-projection per head, the kv
  up-projection per head as W_UK and W_UV, a fused GQA QKV per query group (Q, K and V apart);
  grouped experts per expert, always (they are separate matrices stored side by side).
- Muon on the whole matrix: every other 2-D weight. Tensor parallelism splits heads whole, so block
  updates need no communication; a TP-sharded matrix without blocks (the attention output
  projection, MLP weights, column-parallel down projections) is gathered over the TP group,
  orthogonalized, and each rank keeps its slice (every TP rank computes the same product).

Data parallelism: with `optimizer.use_distributed_optimizer: false` megatron's DDP all-reduces
gradients and every data-parallel rank runs the same update; with `true`, ZeRO-2
(`parallel.zero2`, `pretrain.training.zero2_optimizer`): each parameter's gradient is reduced to one
owner rank, which alone keeps its state, orthogonalizes it and broadcasts the result
(`ownership_cost` balances the Newton-Schulz work).
"""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Tuple

import torch
from megatron.core import parallel_state as ps
from megatron.core.utils import unwrap_model

from pretrain.config.schema import GLM5Config
from pretrain.model.dsa import is_indexer_parameter
from pretrain.optim.muon import Muon, MuonSplit


def _subs(optimizer) -> List:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _model_to_inner(sub) -> Dict[int, torch.Tensor]:
    """id(inner optimizer parameter) -> the model parameter it updates."""
    pairs = {}
    if hasattr(sub, "float16_groups"):
        for model_group, main_group in zip(sub.float16_groups, sub.fp32_from_float16_groups):
            for model_p, main_p in zip(model_group, main_group):
                pairs[id(main_p)] = model_p
        for group in getattr(sub, "fp32_from_fp32_groups", []):
            for p in group:
                pairs[id(p)] = p
    for group in sub.optimizer.param_groups:
        for p in group["params"]:
            pairs.setdefault(id(p), p)
    return pairs


def param_role(name: str, p: torch.Tensor, cfg: GLM5Config) -> str:
    """"adamw" or "muon" for a model parameter (see the module docstring)."""
    o = cfg.optimizer
    if p.ndim != 2 or "word_embeddings" in name or "output_layer" in name:
        return "adamw"
    if name.endswith("router.weight"):
        return o.muon_router
    if is_indexer_parameter(name):
        return o.muon_indexer
    return "muon"


def param_split(name: str, p: torch.Tensor, cfg: GLM5Config) -> Optional[MuonSplit]:
    """The Muon Split blocks of this rank's shard of a matrix, or None (whole matrix)."""
    m = cfg.model
    tp = ps.get_tensor_model_parallel_world_size()
    if name.endswith("experts.weight1"):  # [hidden, E_local * 2 * ffn], used as .view(E_local, hidden, 2 * ffn)
        e = (m.num_moe_experts or 1) // ps.get_expert_model_parallel_world_size()
        return MuonSplit(e, (p.shape[0],), axis=2)
    if name.endswith("experts.weight2"):  # [E_local * ffn, hidden]
        e = (m.num_moe_experts or 1) // ps.get_expert_model_parallel_world_size()
        return MuonSplit(e, (p.shape[0] // e,), axis=0)
    if not cfg.optimizer.muon_split or is_indexer_parameter(name):
        return None
    heads = m.num_attention_heads // tp
    if name.endswith("linear_q_up_proj.weight"):
        return MuonSplit(heads, (m.qk_head_dim + m.qk_pos_emb_head_dim,), axis=0)
    if name.endswith("linear_kv_up_proj.weight"):
        return MuonSplit(heads, (m.qk_head_dim, m.v_head_dim), axis=0)
    if name.endswith("linear_qkv.weight"):  # GQA: per query group [q heads of the group; k; v]
        groups = (m.num_query_groups or m.num_attention_heads) // tp
        d = p.shape[0] // (groups * (m.num_attention_heads // (m.num_query_groups or m.num_attention_heads) + 2))
        return MuonSplit(groups, (p.shape[0] // groups - 2 * d, d, d), axis=0)
    return None


# Optimizer work of an elementwise update (momentum, AdamW moments) per element, in flop-equivalents
# of bf16 tensor-core time: ~16 bytes of memory traffic at ~4.8 TB/s vs ~800 TFLOP/s (H200).
ELEMENTWISE_FLOPS = 2500.0


def newton_schulz_flops(rows: int, cols: int, steps: int) -> float:
    """Flops of `steps` quintic iterations on one [rows, cols] matrix: 4 m^2 n + 2 m^3 each (m <= n)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4.0 * m * m * n + 2.0 * m**3)


def ownership_cost(cfg: GLM5Config):
    """`cost_fn(name, param)` for ZeRO-2 ownership (`parallel.zero2`): the update's work on this rank
    for a parameter it owns (a TP-sharded whole matrix is orthogonalized gathered, by every TP rank)."""
    steps = cfg.optimizer.muon_num_ns_steps

    def cost(name: str, p: torch.Tensor) -> float:
        elementwise = ELEMENTWISE_FLOPS * p.numel()
        if param_role(name, p, cfg) == "adamw":
            return elementwise
        split = param_split(name, p, cfg)
        if split is not None:
            return elementwise + sum(newton_schulz_flops(b.shape[-2], b.shape[-1], steps) * b.shape[0]
                                     for b in split.blocks(p.detach()))
        rows, cols = p.shape
        tp_group = _tp_group_of(name, p) if getattr(p, "tensor_model_parallel", False) else None
        if tp_group is not None:
            tp = tp_group.size()
            rows, cols = (rows * tp, cols) if p.partition_dim == 0 else (rows, cols * tp)
        return elementwise + newton_schulz_flops(rows, cols, steps)

    return cost


def _tp_group_of(name: str, p: torch.Tensor):
    if name.endswith(("experts.weight1", "experts.weight2")):
        group = ps.get_expert_tensor_parallel_group()
    else:
        group = ps.get_tensor_model_parallel_group()
    return group if group is not None and group.size() > 1 else None


def build_muon_optimizer(cfg: GLM5Config, model_chunks: List, megatron_optimizer):
    """Replace the inner optimizers of `megatron_optimizer` (built as AdamW over `model_chunks`) by Muon."""
    o = cfg.optimizer
    names = {id(p): n for chunk in unwrap_model(list(model_chunks)) for n, p in chunk.named_parameters()}
    for sub in _subs(megatron_optimizer):
        inner = sub.optimizer
        if inner is None:
            continue
        to_model = _model_to_inner(sub)
        splits, adamw, tp_shards = {}, [], {}
        for group in inner.param_groups:
            for p in group["params"]:
                model_p = to_model[id(p)]
                name = names[id(model_p)]
                if param_role(name, model_p, cfg) == "adamw":
                    adamw.append(p)
                    continue
                split = param_split(name, model_p, cfg)
                if split is not None:
                    splits[p] = split
                elif getattr(model_p, "tensor_model_parallel", False):
                    group_tp = _tp_group_of(name, model_p)
                    if group_tp is not None:
                        tp_shards[p] = (model_p.partition_dim, group_tp)
        sub.optimizer = Muon(
            inner.param_groups, lr=o.lr, weight_decay=o.weight_decay, momentum=o.muon_momentum,
            nesterov=o.muon_use_nesterov, ns_steps=o.muon_num_ns_steps, ns_dtype=o.muon_ns_dtype,
            scale_rms=o.muon_scale_rms, adam_betas=(o.adam_beta1, o.adam_beta2), adam_eps=o.adam_eps,
            splits=splits, adamw_params=adamw, tp_shards=tp_shards)
        sub.init_state_fn = init_muon_state
    return megatron_optimizer


def init_muon_state(opt: Muon, config=None) -> None:
    """Zero states (what a checkpoint load fills): momentum for Muon matrices, AdamW moments otherwise."""
    for group in opt.param_groups:
        for p in group["params"]:
            if opt.is_foreign(p) or len(opt.state[p]):  # ZeRO-2: state only where the parameter is owned
                continue
            if opt.uses_muon(group, p):
                opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
            else:
                opt.state[p]["exp_avg"] = torch.zeros_like(p)
                opt.state[p]["exp_avg_sq"] = torch.zeros_like(p)


def muon_roles(optimizer) -> Iterator[Tuple[torch.Tensor, str, Optional[MuonSplit]]]:
    """(inner parameter, "muon" | "adamw", split) for every parameter (for tests and summaries)."""
    for sub in _subs(optimizer):
        inner = sub.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                yield p, ("muon" if inner.uses_muon(group, p) else "adamw"), inner._splits.get(id(p))
