"""torchtitan's DeepSeek-V3 model at our config's dims: the peer row of benchmarks/model_step.py.

torchtitan (pytorch/torchtitan, release 0.3.0, `torchtitan.models.deepseek_v3`) implements the same
architecture family as GLM-5: MLA attention with q/kv LoRA, a SwiGLU dense FFN in the first layers,
then token-choice MoE layers with a shared expert, sigmoid scores and a load-balancing expert bias,
and DeepSeek-V3's multi-token prediction. `build_config` maps `cfg.model` onto its config builder
(`build_mla_moe_layers`) field by field, so one forward+backward of both models does the same
matrix work per token. What matches and what cannot:

* same: hidden size, layers, heads, q_lora_rank, kv_lora_rank, qk (no-rope) / rope / v head dims,
  vocabulary, dense FFN width and first-k-dense layout (`moe_layer_freq`), experts, top-k, expert
  width, shared expert width, sigmoid scores with top-k renormalisation and scale
  (`moe_router_topk_scaling_factor`), expert bias (routing only), RoPE theta, untied embeddings,
  RMSNorm epsilons, MTP depths and their loss weight.
* differs: no DSA lightning indexer (torchtitan has none; our dense-attention variants carry it
  untrained); the MTP depths each own their layer (ours share one, `mtp_use_repeated_layer`), so
  the same compute with more parameters; no sequence-level auxiliary loss (torchtitan balances
  with the expert bias alone, updated in an optimizer hook that this forward+backward never runs);
  attention is torchtitan's own: "flex" (its default for language models, `flex_attention` compiled
  with max-autotune, causal block mask) or "sdpa" (its `ScaledDotProductAttention` module with
  `is_causal`, cuDNN then Flash, the kernels our variants use); experts run its `torch._grouped_mm`
  path (`GroupedExperts`); the loss is its `cross_entropy_loss` / `MTPLoss`; weights are
  initialised by its own init (truncated normal at our `init_method_std`, depth-scaled outputs).
  No torch.compile of the blocks, like our variants.

Requirements (model modules only; torchtitan's other dependencies are not imported):
torchtitan==0.3.0 and, for the imports its model package makes, spmd-types==0.3.1 and tyro
(itself needing docstring-parser and typeguard); all pure Python, installed with --no-deps.
torchtitan 0.3.0 follows torch nightly. With torch 2.11 its model package needs one name that torch lacks
(`provide_fsdp_mesh_dims_name`), and its flex attention does not run (`create_block_mask` lacks
`separate_full_blocks`): there the peer runs with its SDPA module only (`check_attention_backend` says so).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Dict, List

import torch
from torch import nn

REQUIREMENTS = "torchtitan==0.3.0 spmd-types==0.3.1 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1"
ATTENTION_BACKENDS = ("flex", "sdpa")
DIFFERENCES = [
    "no DSA lightning indexer (torchtitan has none)",
    "MTP depths each own a layer (ours share one): same compute, more parameters",
    "no sequence-level aux loss; expert bias not updated (optimizer hook, outside the step)",
    "attention: torchtitan's own backend (flex: compiled flex_attention; sdpa: its SDPA module)",
    "experts: torchtitan GroupedExperts (torch._grouped_mm), local token dispatch",
    "loss: torchtitan cross_entropy_loss / MTPLoss on full bf16 logits",
]


def provide_fsdp_mesh_dims_name() -> None:
    """torchtitan 0.3.0 follows torch nightly: its DeepSeek-V3 package imports
    `torch.distributed.fsdp.DataParallelMeshDims` (torch >= 2.12) for the annotations of its FSDP helpers,
    which a one-GPU step never calls. On an older torch the name is given a placeholder class, and said so."""
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):
        print(f"torchtitan peer: torch {torch.__version__} lacks torch.distributed.fsdp.DataParallelMeshDims; "
              "a placeholder stands in (only torchtitan's FSDP helpers, unused here, annotate with it)")
        fsdp.DataParallelMeshDims = type("DataParallelMeshDims", (), {})


def check_attention_backend(attention: str) -> None:
    """torchtitan's flex path passes `separate_full_blocks` to `create_block_mask` (torch >= 2.12)."""
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"torchtitan attention must be one of {ATTENTION_BACKENDS}, got {attention!r}")
    if attention == "flex":
        import inspect

        from torch.nn.attention.flex_attention import create_block_mask

        if "separate_full_blocks" not in inspect.signature(create_block_mask).parameters:
            raise ValueError(f"torchtitan's flex attention needs a newer torch than {torch.__version__} "
                             "(create_block_mask(separate_full_blocks=...)); use the torchtitan-sdpa variant")


def import_torchtitan():
    """The torchtitan modules the peer uses, or a one-line error naming what to install."""
    provide_fsdp_mesh_dims_name()
    try:
        from torchtitan.components.loss import cross_entropy_loss
        from torchtitan.models import deepseek_v3
        from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
        from torchtitan.models.common.attention import ScaledDotProductAttention
        from torchtitan.models.common.param_init import depth_scaled_std
        from torchtitan.models.deepseek_v3 import mtp
    except ImportError as err:
        import importlib.util

        if importlib.util.find_spec("torchtitan") is None or isinstance(err, ModuleNotFoundError):
            raise ImportError(f"the torchtitan peer needs `pip install --no-deps {REQUIREMENTS}` ({err})") from err
        raise ImportError(f"torchtitan does not import with torch {torch.__version__} ({err})") from err
    return dict(deepseek_v3=deepseek_v3, mtp=mtp, ComplexRoPE=ComplexRoPE, Embedding=Embedding, Linear=Linear,
                RMSNorm=RMSNorm, ScaledDotProductAttention=ScaledDotProductAttention,
                depth_scaled_std=depth_scaled_std, cross_entropy_loss=cross_entropy_loss)


def first_dense_layers(m) -> int:
    """Number of leading dense layers; torchtitan supports only dense-first-then-MoE stacks."""
    from pretrain.config import moe_layer_pattern

    pattern = moe_layer_pattern(m)
    k = pattern.index(1) if 1 in pattern else len(pattern)
    if any(p == 0 for p in pattern[k:]):
        raise ValueError(f"torchtitan peer: moe_layer_freq {pattern} is not dense-first-then-MoE")
    return k


def check_mappable(m) -> None:
    """Reject config features torchtitan's DeepSeek-V3 cannot express, before building anything."""
    problems = []
    if not m.multi_latent_attention:
        problems.append("multi_latent_attention=false")
    if m.share_embeddings_and_output_weights:
        problems.append("tied embeddings")
    if m.add_bias_linear:
        problems.append("add_bias_linear=true")
    if m.normalization != "RMSNorm":
        problems.append(f"normalization={m.normalization}")
    if m.rope_type != "rope":
        problems.append(f"rope_type={m.rope_type}")
    if m.window_size:
        problems.append("window_size")
    if m.moe_router_num_groups:
        problems.append("grouped routing (moe_router_num_groups)")
    if m.num_moe_experts and m.moe_shared_expert_intermediate_size and (
            m.moe_shared_expert_intermediate_size % m.moe_ffn_hidden_size):
        problems.append("moe_shared_expert_intermediate_size not a multiple of moe_ffn_hidden_size")
    if problems:
        raise ValueError(f"torchtitan peer cannot match this config: {', '.join(problems)}")


def build_config(m, seq_length: int, attention: str = "flex", mtp_depths: int = 0):
    """torchtitan `DeepSeekV3Model.Config` with the dims of our `ModelConfig` `m`."""
    check_attention_backend(attention)
    check_mappable(m)
    tt = import_torchtitan()
    dsv3, mtp = tt["deepseek_v3"], tt["mtp"]
    std, h = m.init_method_std, m.hidden_size
    linear_init = {"weight": partial(nn.init.trunc_normal_, std=std), "bias": nn.init.zeros_}
    norm_init = {"weight": nn.init.ones_}

    def depth_init(layer_id):
        return {"weight": partial(nn.init.trunc_normal_, std=tt["depth_scaled_std"](std, layer_id)),
                "bias": nn.init.zeros_}

    def depth_experts_init(layer_id):
        scaled = partial(nn.init.trunc_normal_, std=tt["depth_scaled_std"](std, layer_id))
        return {"w1_EFD": partial(nn.init.trunc_normal_, std=std), "w2_EDF": scaled, "w3_EFD": scaled}

    moe = bool(m.num_moe_experts)
    layers = dsv3.build_mla_moe_layers(
        n_layers=m.num_layers, n_dense_layers=first_dense_layers(m) if moe else m.num_layers, dim=h,
        n_heads=m.num_attention_heads, q_lora_rank=m.q_lora_rank or 0, kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.qk_head_dim, qk_rope_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim,
        mscale=1.0, dense_hidden_dim=m.ffn_hidden_size,
        moe_hidden_dim=m.moe_ffn_hidden_size or 1, num_experts=m.num_moe_experts or 1,
        num_shared_experts=(m.moe_shared_expert_intermediate_size or 0) // (m.moe_ffn_hidden_size or 1),
        router_top_k=m.moe_router_topk, router_score_func=m.moe_router_score_function,
        router_route_scale=m.moe_router_topk_scaling_factor or 1.0,
        # megatron renormalises sigmoid top-k scores (topk > 1) before the scaling factor
        router_route_norm=m.moe_router_score_function == "sigmoid" and m.moe_router_topk > 1,
        attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
        linear_init=linear_init, norm_init=norm_init, depth_init=depth_init,
        depth_experts_init=depth_experts_init,
        rope=tt["ComplexRoPE"].Config(dim=m.qk_pos_emb_head_dim, max_seq_len=seq_length, theta=m.rotary_base,
                                      scaling="none"),
    )
    for layer in layers:
        layer.attention_norm.eps = layer.ffn_norm.eps = m.layernorm_epsilon
        layer.attention.q_norm.eps = layer.attention.kv_norm.eps = m.latent_layernorm_epsilon
        if attention == "sdpa":
            layer.attention.inner_attention = tt["ScaledDotProductAttention"].Config()
        if layer.moe is not None:
            layer.moe.load_balance_coeff = m.moe_router_bias_update_rate if m.moe_router_enable_expert_bias else None
            if not m.moe_shared_expert_intermediate_size:
                layer.moe.shared_experts = None
    RMSNorm, Linear = tt["RMSNorm"], tt["Linear"]
    mtp_layers = [
        mtp.MTPTransformerBlock.Config(
            attention=dataclasses.replace(layers[-1].attention), feed_forward=layers[-1].feed_forward,
            moe=layers[-1].moe, attention_norm=layers[-1].attention_norm, ffn_norm=layers[-1].ffn_norm,
            enorm=RMSNorm.Config(normalized_shape=h, eps=m.layernorm_epsilon, param_init=norm_init),
            hnorm=RMSNorm.Config(normalized_shape=h, eps=m.layernorm_epsilon, param_init=norm_init),
            eh_proj=Linear.Config(in_features=2 * h, out_features=h, bias=False, param_init=linear_init),
            mtp_norm=RMSNorm.Config(normalized_shape=h, eps=m.layernorm_epsilon, param_init=norm_init))
        for _ in range(mtp_depths)
    ]
    return dsv3.DeepSeekV3Model.Config(
        vocab_size=m.vocab_size, dim=h,
        tok_embeddings=tt["Embedding"].Config(num_embeddings=m.vocab_size, embedding_dim=h,
                                              param_init={"weight": partial(nn.init.normal_, std=std)}),
        norm=RMSNorm.Config(normalized_shape=h, eps=m.layernorm_epsilon, param_init=norm_init),
        lm_head=Linear.Config(in_features=h, out_features=m.vocab_size, param_init=linear_init),
        layers=layers, mtp_layers=mtp_layers,
    )


def build_model(config, device: str, dtype: torch.dtype) -> nn.Module:
    """Build on the meta device, materialise on `device` and run torchtitan's own init, as its trainer does."""
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device(device))
    # parameters only: Module.to(dtype) would also cast the complex RoPE table to real
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model.train()


class PeerStep:
    """One forward + loss of the torchtitan model on `(ids, labels)`: mean loss over the tokens."""

    def __init__(self, m, seq_length: int, attention: str, mtp_depths: int, device: str, dtype: torch.dtype):
        tt = import_torchtitan()
        self.config = build_config(m, seq_length, attention, mtp_depths)
        self.model = build_model(self.config, device, dtype)
        self.attention, self.mtp_depths = attention, mtp_depths
        self.cross_entropy = tt["cross_entropy_loss"]
        self.mtp_loss = tt["mtp"].MTPLoss(tt["mtp"].MTPLoss.Config(mtp_scale=m.mtp_loss_scaling_factor or 0.0)) \
            if mtp_depths else None

    def __call__(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
        masks = self.model.get_attention_masks(pos) if self.attention == "flex" else None
        out = self.model(ids, pos, masks)
        if self.mtp_loss is not None:
            loss, _ = self.mtp_loss(out, labels, positions=pos)
        else:
            loss = self.cross_entropy(out, labels)
        return loss / labels.numel()  # torchtitan's losses are sums, normalised by the token count

    def parameters(self):
        return self.model.parameters()

    def own_flops_per_token(self, seq_length: int) -> float:
        """torchtitan's `get_nparams_and_flops`: 6 x active params + 6 L H (qk + v) S (its convention)."""
        return float(self.config.get_nparams_and_flops(self.model, seq_length)[1])


def flops_per_token(m, seq_length: int, mtp_depths: int) -> Dict[str, float]:
    """Training FLOPs per token of the peer by our formula (`pretrain.training.flops`): our config
    with no indexer and `mtp_depths` depths, i.e. the matrix work torchtitan's model does."""
    from pretrain.training.flops import training_flops_per_token

    peer = dataclasses.replace(m, mtp_num_layers=mtp_depths or None, dsa_sparse_attention=False)
    return training_flops_per_token(peer, seq_length, dsa_sparse=False, dsa_indexer=False)


def differences() -> List[str]:
    return list(DIFFERENCES)
