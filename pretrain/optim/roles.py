"""Muon inside megatron-core's optimizer wrappers: which update each parameter takes (GLM-5 report,
Muon Split; `pretrain.optim.muon`).

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
- Muon on blocks (`param_split`; attention blocks with `optimizer.muon_split`, on by default): MLA's
  q up-projection per head (its rope slice inside the head's block, or its own block), the kv
  up-projection per head as W_UK and W_UV, a fused GQA QKV per query group (Q, K and V apart);
  grouped experts per expert, always (they are separate matrices stored side by side); with
  `optimizer.muon_split_glu` (off by default) every SwiGLU fc1's gate and up halves apart, the
  matrices a model with separate gate_proj / up_proj has (2.2x fewer Newton-Schulz FLOPs for an
  expert's [2F, H] with 2F <= H; off because it trained worse in the optimizer ablation:
  docs/training.md, section Muon).
- Muon on the whole matrix: every other 2-D weight.

Tensor parallelism (`tp_shard`) splits attention heads whole, so head blocks need no communication.
A TP-sharded matrix without head blocks (the attention output projection, MLP weights,
column-parallel down projections) is gathered over its TP group, orthogonalized, and each rank keeps
its slice (every TP rank computes the same product); so is each expert's matrix under expert tensor
parallelism, gathered over the expert-tensor-parallel group.

Data parallelism (`pretrain.optim.build.data_parallel_mode`): megatron's DDP all-reduces gradients
and every data-parallel rank runs the same update, or ZeRO-2 (`pretrain.optim.zero2_grads`,
`pretrain.optim.zero2_owner`): each parameter's gradient is reduced to one owner rank, which alone
keeps its state, orthogonalizes it and broadcasts the result (`ownership_cost` balances the
Newton-Schulz work).
"""

from __future__ import annotations

import logging
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.utils import unwrap_model

from pretrain.config.schema import ModelConfig, OptimizerConfig
from pretrain.model.dsa import is_indexer_parameter
from pretrain.optim.muon import Muon, MuonSplit
from pretrain.optim.muon_staging import newton_schulz_flops

log = logging.getLogger(__name__)


def sub_optimizers(optimizer) -> List:
    """The megatron optimizer wrappers inside `optimizer` (a ChainedOptimizer's parts, or itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def inner_to_model_params(sub) -> Dict[int, torch.Tensor]:
    """id(inner optimizer parameter) -> the model parameter it updates (its fp32 main copy's model
    weight in bf16 training, itself otherwise), for one megatron optimizer wrapper."""
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


def is_expert_parameter(name: str) -> bool:
    """A routed expert's weight (grouped `experts.weight1/2` or `experts.local_experts.*`; not the
    shared expert): sharded over the expert-tensor-parallel group. By name, because megatron marks
    them `allreduce=False` only with expert parallelism."""
    return ".experts." in name


def param_role(name: str, p: torch.Tensor, optimizer_cfg: OptimizerConfig) -> str:
    """"adamw" or "muon" for a model parameter (see the module docstring)."""
    if p.ndim != 2 or "word_embeddings" in name or "output_layer" in name:
        return "adamw"
    if name.endswith("router.weight"):
        return optimizer_cfg.muon_router
    if is_indexer_parameter(name):
        return optimizer_cfg.muon_indexer
    return "muon"


def param_split(name: str, p: torch.Tensor, model_cfg, *, tp_size: int = 1, ep_size: int = 1,
                split_attention: bool = True, split_glu: bool = False,
                q_rope_own_block: bool = False) -> Optional[MuonSplit]:
    """The Muon Split blocks of this rank's shard of a matrix (megatron-core parameter names), or None.

    `model_cfg` is the model section (ours, or megatron's TransformerConfig: the same field names);
    `tp_size` / `ep_size` turn its head / query-group / expert counts into this rank's. Grouped
    experts are always split per expert (weight1 [hidden, E_local * 2 * ffn] as the layer views it,
    [E_local, hidden, 2 * ffn]; weight2 [E_local * ffn, hidden] by rows). With `split_attention`:
    MLA's q up-projection per head (with `q_rope_own_block` the rope slice of each head is a block of
    its own), its kv up-projection per head as W_UK and W_UV, a fused GQA QKV per query group as
    [q heads of the group; k; v]. With `split_glu`, a SwiGLU fc1 (megatron's linear_fc1 [gate; up]
    rows, under TP this rank's [gate_r; up_r]; a grouped expert's [hidden, gate | up] columns) is
    cut into gate and up. The DSA indexer's projections stay whole.
    """
    if p.ndim != 2:
        return None
    experts = model_cfg.num_moe_experts or 0
    if experts and name.endswith("experts.weight1"):
        local = experts // ep_size
        halves = (p.shape[1] // (2 * local),) * 2 if split_glu else ()
        return MuonSplit(local, (p.shape[0],), axis=2, cols=halves)
    if experts and name.endswith("experts.weight2"):
        local = experts // ep_size
        return MuonSplit(local, (p.shape[0] // local,), axis=0)
    if is_indexer_parameter(name):
        return None
    if split_glu and name.endswith("linear_fc1.weight"):  # every MLP here is SwiGLU (the model builder's)
        return MuonSplit(1, (p.shape[0] // 2,) * 2, axis=0)
    if not split_attention:
        return None
    heads = model_cfg.num_attention_heads // tp_size
    if name.endswith("linear_q_up_proj.weight"):
        qk, rope = model_cfg.qk_head_dim, model_cfg.qk_pos_emb_head_dim
        return MuonSplit(heads, (qk, rope) if q_rope_own_block else (qk + rope,), axis=0)
    if name.endswith("linear_kv_up_proj.weight"):
        return MuonSplit(heads, (model_cfg.qk_head_dim, model_cfg.v_head_dim), axis=0)
    if name.endswith("linear_qkv.weight"):
        query_groups = model_cfg.num_query_groups or model_cfg.num_attention_heads
        groups = query_groups // tp_size
        d = p.shape[0] // (groups * (model_cfg.num_attention_heads // query_groups + 2))
        return MuonSplit(groups, (p.shape[0] // groups - 2 * d, d, d), axis=0)
    return None


def tp_group_of(name: str, p: torch.Tensor):
    """The tensor-parallel group `p` is sharded over (expert weights: the expert-tensor-parallel
    group), or None when that group has one rank."""
    group = ps.get_expert_tensor_parallel_group() if is_expert_parameter(name) else ps.get_tensor_model_parallel_group()
    return group if group is not None and group.size() > 1 else None


# Weights whose Muon Split blocks are attention heads / query groups: TP keeps them whole on a rank.
HEAD_SPLIT_WEIGHTS = ("linear_q_up_proj.weight", "linear_kv_up_proj.weight", "linear_qkv.weight")


def tp_shard(name: str, p: torch.Tensor, split: Optional[MuonSplit]) -> Optional[Tuple[int, object]]:
    """(partition dim, group) when Muon must orthogonalize `p`'s update gathered over its TP group,
    else None. Attention head / query-group blocks are whole on every TP rank; other blocks are not
    (expert tensor parallelism cuts every expert's ffn dimension, TP every fc1's gate and up)."""
    if not getattr(p, "tensor_model_parallel", False):
        return None
    if split is not None and name.endswith(HEAD_SPLIT_WEIGHTS):
        return None
    group = tp_group_of(name, p)
    return None if group is None else (p.partition_dim, group)


def _local_split(name: str, p: torch.Tensor, optimizer_cfg: OptimizerConfig, model_cfg: ModelConfig):
    return param_split(name, p, model_cfg, tp_size=ps.get_tensor_model_parallel_world_size(),
                       ep_size=ps.get_expert_model_parallel_world_size(), split_attention=optimizer_cfg.muon_split,
                       split_glu=optimizer_cfg.muon_split_glu)


# Optimizer work of an elementwise update (momentum, AdamW moments) per element, in flop-equivalents
# of bf16 tensor-core time: ~16 bytes of memory traffic at ~4.8 TB/s vs ~800 TFLOP/s (H200).
ELEMENTWISE_FLOPS = 2500.0


def ownership_cost(optimizer_cfg: OptimizerConfig, model_cfg: ModelConfig):
    """`cost_fn(name, param)` for ZeRO-2 ownership (`pretrain.optim.zero2_grads`): the update's work
    on this rank for a parameter it owns (a TP-sharded matrix or block is orthogonalized gathered,
    by every rank of its TP group)."""
    steps = optimizer_cfg.muon_num_ns_steps

    def cost(name: str, p: torch.Tensor) -> float:
        elementwise = ELEMENTWISE_FLOPS * p.numel()
        if param_role(name, p, optimizer_cfg) == "adamw":
            return elementwise
        split = _local_split(name, p, optimizer_cfg, model_cfg)
        shard = tp_shard(name, p, split)
        tp = 1 if shard is None else shard[1].size()
        if split is None:
            rows, cols = p.shape
            if shard is not None:
                rows, cols = (rows * tp, cols) if shard[0] == 0 else (rows, cols * tp)
            return elementwise + newton_schulz_flops(rows, cols, steps)
        cut = None if shard is None else split.shard_dim(shard[0])
        work = 0.0
        for block in split.blocks(p.detach()):
            shape = list(block.shape)
            if cut is not None:
                shape[cut] *= tp
            work += newton_schulz_flops(shape[1], shape[2], steps) * shape[0]
        return elementwise + work

    return cost


def build_muon_optimizer(optimizer_cfg: OptimizerConfig, model_cfg: ModelConfig, model_chunks: List,
                         megatron_optimizer):
    """Replace the inner optimizers of `megatron_optimizer` (built as AdamW over `model_chunks`) by Muon."""
    o = optimizer_cfg
    names = {id(p): n for chunk in unwrap_model(list(model_chunks)) for n, p in chunk.named_parameters()}
    for sub in sub_optimizers(megatron_optimizer):
        inner = sub.optimizer
        if inner is None:
            continue
        to_model = inner_to_model_params(sub)
        splits, adamw, tp_shards = {}, [], {}
        for group in inner.param_groups:
            for p in group["params"]:
                model_p = to_model[id(p)]
                name = names[id(model_p)]
                if param_role(name, model_p, o) == "adamw":
                    adamw.append(p)
                    continue
                split = _local_split(name, model_p, o, model_cfg)
                if split is not None:
                    splits[p] = split
                shard = tp_shard(name, model_p, split)
                if shard is not None:
                    tp_shards[p] = shard
        sub.optimizer = Muon(
            inner.param_groups, lr=o.lr, weight_decay=o.weight_decay, momentum=o.muon_momentum,
            nesterov=o.muon_use_nesterov, ns_steps=o.muon_num_ns_steps, ns_dtype=o.muon_ns_dtype,
            scale_rms=o.muon_scale_rms, adam_betas=(o.adam_beta1, o.adam_beta2), adam_eps=o.adam_eps,
            splits=splits, adamw_params=adamw, tp_shards=tp_shards)
        sub.init_state_fn = init_muon_state
    if o.muon_pipeline_balance and ps.get_pipeline_model_parallel_world_size() > 1:
        balance_pipeline([sub.optimizer for sub in sub_optimizers(megatron_optimizer) if sub.optimizer is not None])
    return megatron_optimizer


def balance_pipeline(muons: List[Muon]) -> None:
    """`optimizer.muon_pipeline_balance`: pair each Muon with the same sub-optimizer of every pipeline rank
    (`pretrain.optim.muon_pipeline`). Ranks holding different numbers of them (a stage without experts) could not
    pair their exchanges: then none is balanced, and the log says so."""
    from pretrain.optim.muon_pipeline import PipelineBalance

    group = ps.get_pipeline_model_parallel_group()
    counts: List = [None] * dist.get_world_size(group)
    dist.all_gather_object(counts, len(muons), group=group)
    if len(set(counts)) > 1:
        log.warning("optimizer.muon_pipeline_balance is not applied: the pipeline ranks hold %s Muon optimizers "
                    "(dense, expert), which cannot be paired; each rank runs its own Newton-Schulz", counts)
        return
    for tag, muon in enumerate(muons):
        muon.pipeline_balance = PipelineBalance(group, tag)


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
    for sub in sub_optimizers(optimizer):
        inner = sub.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                yield p, ("muon" if inner.uses_muon(group, p) else "adamw"), inner.split_of(p)
