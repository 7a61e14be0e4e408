"""megatron-core ModuleSpecs for the GLM-5 decoder (GLM-5 report, architecture).

One decoder layer is

    h = x + Attn(RMSNorm(x));   y = h + FFN(RMSNorm(h))

with Attn = MLA (or GQA for the ablation) and FFN = dense SwiGLU for the first layers and
MoE (routed grouped-GEMM experts + one shared expert) after them. `model.transformer_impl` picks
the backend that fills the slots: "local" (the default: torch-native parallel linears and norms,
always available, the one this project tests) or "transformer_engine" (TE linears and norms; an
explicit choice, untested here, which says so once in the log). Core attention is ours in both
(SDPA, which also holds the DSA indexer), so neither backend needs TE's attention.
"""

from __future__ import annotations

import functools
import warnings
from typing import List, Optional, Tuple

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.multi_latent_attention import (
    MLASelfAttention,
    MLASelfAttentionSubmodules,
)
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlockSubmodules,
    get_mtp_layer_spec_for_backend,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from pretrain.compat import SequenceParallelTorchNorm, te_available
from pretrain.model.core_attention import SDPACoreAttention
from pretrain.model.dsa import DSACoreAttention, DSAMLASelfAttention
from pretrain.model.latent_attention import LatentCoreAttention, LatentMLASelfAttention
from pretrain.model.experts import GroupedGemmExperts
from pretrain.model.moe_layer import GLM5MoELayer
from pretrain.model.mtp import ChunkAssignedMTPLayer


class _TorchBackend(LocalSpecProvider):
    """megatron's local provider, with torch's RMSNorm/LayerNorm (no apex) that also work with
    sequence parallelism."""

    is_te = False

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        return SequenceParallelTorchNorm

    def linear(self) -> type:
        # Down-projections to the MLA latents: the local backend column-splits and gathers.
        return self.column_parallel_linear()


def _te_backend():
    from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

    class _TEBackend(TESpecProvider):
        is_te = True

    return _TEBackend()


def resolve_backend(transformer_impl: str):
    """`model.transformer_impl` ("local" or "transformer_engine", checked by the config) -> a spec provider."""
    if transformer_impl != "transformer_engine":
        return _TorchBackend()
    if not te_available():
        raise RuntimeError(
            "model.transformer_impl=transformer_engine, but transformer_engine.pytorch does "
            "not import here; install Transformer Engine or set model.transformer_impl=local"
        )
    _warn_te_untested()
    return _te_backend()


@functools.lru_cache(maxsize=None)
def _warn_te_untested() -> None:
    warnings.warn(
        "model.transformer_impl=transformer_engine: the Transformer Engine backend is not tested in this project "
        "(its tests and golden runs use local); compare a short run against transformer_impl=local",
        UserWarning,
        stacklevel=3,
    )


def latent_norm(norm_cls: type) -> type:
    """The q/kv latent RMSNorms: MLA builds them with the layer eps; GLM-5 uses its own."""

    class LatentNorm:
        def __new__(cls, config, hidden_size: int, eps: Optional[float] = None, **kwargs):
            return norm_cls(config=config, hidden_size=hidden_size, eps=config.latent_layernorm_epsilon)

    LatentNorm.__name__ = f"Latent{norm_cls.__name__}"
    return LatentNorm


def mla_classes(config) -> Tuple[type, type]:
    """(self-attention, core attention) of an MLA layer: DSA's (the latent layer plus the lightning indexer);
    under context parallelism the latent layer (`pretrain.model.latent_attention`: the layer all-gathers the
    latent over CP, not the up-projected K/V); else megatron's MLA with SDPA."""
    if getattr(config, "experimental_attention_variant", None) == "dsa":
        return DSAMLASelfAttention, DSACoreAttention
    if config.context_parallel_size > 1:
        return LatentMLASelfAttention, LatentCoreAttention
    return MLASelfAttention, SDPACoreAttention


def _attention_spec(config, backend) -> ModuleSpec:
    if config.multi_latent_attention:
        norm = latent_norm(backend.layer_norm(rms_norm=True))
        attention, core = mla_classes(config)
        return ModuleSpec(
            module=attention,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=MLASelfAttentionSubmodules(
                linear_q_proj=backend.column_parallel_linear(),
                linear_q_down_proj=backend.linear(),
                linear_q_up_proj=backend.column_parallel_linear(),
                linear_kv_down_proj=backend.linear(),
                linear_kv_up_proj=backend.column_parallel_linear(),
                core_attention=core,
                linear_proj=backend.row_parallel_linear(),
                q_layernorm=norm if config.q_lora_rank is not None else IdentityOp,
                kv_layernorm=norm,
            ),
        )
    return ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=backend.column_parallel_linear(),
            core_attention=SDPACoreAttention,
            linear_proj=backend.row_parallel_linear(),
            q_layernorm=IdentityOp,
            k_layernorm=IdentityOp,
        ),
    )


def _mlp_spec(config, backend, moe: bool) -> ModuleSpec:
    dense = MLPSubmodules(
        linear_fc1=backend.column_parallel_linear(), linear_fc2=backend.row_parallel_linear()
    )
    if not moe:
        return ModuleSpec(module=MLP, submodules=dense)
    if config.moe_grouped_gemm:
        experts = ModuleSpec(module=GroupedGemmExperts)
    else:
        experts = ModuleSpec(module=SequentialMLP, submodules=dense)
    shared = (
        ModuleSpec(module=SharedExpertMLP, submodules=dense)
        if config.moe_shared_expert_intermediate_size
        else None
    )
    return ModuleSpec(
        module=GLM5MoELayer,
        submodules=MoESubmodules(experts=experts, shared_experts=shared),
        metainfo={"fuse_pre_mlp_layernorm": False},
    )


def layer_spec(config, backend, moe: bool) -> ModuleSpec:
    norm = backend.layer_norm(rms_norm=config.normalization == "RMSNorm")
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=_attention_spec(config, backend),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=_mlp_spec(config, backend, moe),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def decoder_layer_specs(config, backend, moe_pattern: List[int]) -> List[ModuleSpec]:
    dense, moe = layer_spec(config, backend, False), layer_spec(config, backend, True)
    return [moe if is_moe else dense for is_moe in moe_pattern]


def decoder_block_spec(config, backend, moe_pattern: List[int], vp_stage=None) -> TransformerBlockSubmodules:
    """The layers this pipeline stage builds, and the final norm."""
    specs = decoder_layer_specs(config, backend, moe_pattern)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(
        layer_specs=specs[offset : offset + count],
        layer_norm=backend.layer_norm(rms_norm=config.normalization == "RMSNorm"),
    )


def mtp_block_spec(config, backend, moe_pattern: List[int]) -> Optional[MultiTokenPredictionBlockSubmodules]:
    """MTP on the last pipeline stage: one layer shared by all depths, or one layer per depth.

    The MTP transformer layer has the spec of the last decoder layer (MoE in GLM-5).
    """
    if not config.mtp_num_layers:
        return None
    mtp_layer = get_mtp_layer_spec_for_backend(
        transformer_layer_spec=layer_spec(config, backend, bool(moe_pattern[-1])), backend=backend
    )
    mtp_layer.module = ChunkAssignedMTPLayer  # megatron's layer, its shift over the batch's CP chunks
    n_layers = 1 if config.mtp_use_repeated_layer else config.mtp_num_layers
    return MultiTokenPredictionBlockSubmodules(layer_specs=[mtp_layer] * n_layers)
