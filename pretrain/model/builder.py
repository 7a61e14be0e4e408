"""From our typed config to a megatron-core `TransformerConfig` and a built `GLM5Model`.

`transformer_config` (and so `build_model`) calls `pretrain.compat.install()`: building a model is
where a library user who skips our entry points meets megatron-core, and the patches must be in
before its modules are built. `install()` is idempotent, so after an entry point's call this is free.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import MLATransformerConfig

from pretrain import compat
from pretrain.config import moe_layer_pattern
from pretrain.config.schema import GLM5Config, ModelConfig, ParallelConfig
from pretrain.model import specs
from pretrain.model.ep_dispatch import megatron_dispatcher_fields
from pretrain.model.glm5_model import GLM5Model
from pretrain.notices import say_once

_log = logging.getLogger(__name__)


@dataclass
class GLM5TransformerConfig(MLATransformerConfig):
    """megatron-core's MLA config plus the GLM-5 fields it has no name for."""

    latent_layernorm_epsilon: float = 1e-6
    mtp_use_repeated_layer: bool = True
    dsa_sparse_attention: bool = False
    dsa_indexer_types: Optional[List[str]] = None
    dsa_indexer_hadamard: bool = False
    dsa_chunk_size: Optional[int] = None
    dsa_sparse_recompute_attention: bool = False
    dsa_kernel_backend: str = "auto"
    dsa_key_partition_mib: Optional[float] = None
    dsa_indexer_fp8: bool = False
    dsa_indexer_tp_split: bool = False
    activation_offload: bool = False
    cp_attention: str = "merged"
    output_loss_backend: str = "unfused"
    output_chunk_size: Optional[int] = None
    output_grad_weight_fp32: bool = True
    moe_alltoall_dedup: bool = False
    moe_overlap_chunks: int = 1

    def __post_init__(self):
        with compat.dsa_config_check_without_cp(self):  # our DSA layer supports CP; megatron's asserts
            super().__post_init__()


# ModelConfig keys that are not TransformerConfig fields (consumed by the builder itself).
_BUILDER_KEYS = {
    "vocab_size",
    "max_position_embeddings",
    "share_embeddings_and_output_weights",
    "moe_layer_freq",
    "moe_token_dispatcher_type",
    "params_dtype",
    "transformer_impl",
    "activation_offload_backend",
}


def pipeline_p2p_fields(parallel: ParallelConfig) -> dict:
    """megatron-core's pipeline send/receive fields, as megatron-LM sets them.

    `overlap_p2p_comm` (default true) applies to the interleaved schedule (virtual stages): sends and receives are
    separate requests overlapping compute. megatron-core's non-interleaved 1F1B cannot overlap them; it batches
    each transfer, and a batched transfer ends in a device synchronize, so the host cannot queue ahead (measured:
    PP=2 x VPP=2 on 2 x H200 keeps 0.75 of one GPU batched, 0.86 overlapped; docs/parallelism.md)."""
    interleaved = parallel.virtual_pipeline_model_parallel_size is not None
    overlap = parallel.overlap_p2p_comm and interleaved
    if parallel.overlap_p2p_comm and not interleaved and parallel.pipeline_model_parallel_size > 1:
        say_once(_log, "parallel.overlap_p2p_comm applies to the interleaved schedule only: without "
                 "parallel.virtual_pipeline_model_parallel_size, 1F1B batches each send/receive and synchronizes the "
                 "device after it (set virtual stages to overlap them)")
    return {"overlap_p2p_comm": overlap, "batch_p2p_comm": not overlap}


def transformer_config(model: ModelConfig, parallel: ParallelConfig) -> GLM5TransformerConfig:
    """Map our sections onto megatron's config (field names are shared where they exist)."""
    compat.install()
    fields = {f.name for f in dataclasses.fields(GLM5TransformerConfig)}
    kwargs = {k: v for k, v in dataclasses.asdict(model).items() if k not in _BUILDER_KEYS}
    unknown = set(kwargs) - fields
    assert not unknown, f"ModelConfig keys without a TransformerConfig field: {sorted(unknown)}"
    # ParallelConfig also holds DDP settings (overlap_grad_reduce) that the trainer consumes
    kwargs.update({k: v for k, v in dataclasses.asdict(parallel).items() if k in fields})
    kwargs.update(pipeline_p2p_fields(parallel))
    pattern = moe_layer_pattern(model)
    backend = specs.resolve_backend(model.transformer_impl)
    if model.num_moe_experts is None:
        for key in [k for k in kwargs if k.startswith("moe_")]:
            kwargs.pop(key)
    else:
        kwargs["moe_layer_freq"] = pattern
        kwargs.update(megatron_dispatcher_fields(compat.token_dispatcher_for_device(model.moe_token_dispatcher_type)))
    if not model.mtp_num_layers:
        kwargs["mtp_num_layers"] = None
    if model.window_size is not None:
        kwargs["window_size"] = tuple(model.window_size)  # megatron's type
    if model.experimental_attention_variant is None:
        for key in [k for k in kwargs if k.startswith("dsa_")]:
            kwargs.pop(key)
    if not model.multi_latent_attention:
        # GQA: rope is applied by GPTModel; MLA-only fields keep their (unused) defaults.
        kwargs["multi_latent_attention"] = False
    return GLM5TransformerConfig(
        **kwargs,
        transformer_impl="transformer_engine" if backend.is_te else "local",
        gated_linear_unit=True,
        activation_func=F.silu,
        bias_activation_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        params_dtype=getattr(torch, model.params_dtype),
        pipeline_dtype=torch.bfloat16 if model.bf16 else torch.float32,
        use_cpu_initialization=not torch.cuda.is_available(),
        moe_permute_fusion=False,
        moe_router_fusion=False,
    )


def build_model(
    cfg: GLM5Config,
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    vp_stage: Optional[int] = None,
) -> GLM5Model:
    """Build this rank's part of the model. megatron parallel state must be initialized."""
    from megatron.core import parallel_state as ps

    model_cfg = cfg.model
    tcfg = transformer_config(model_cfg, cfg.parallel)
    backend = specs.resolve_backend(model_cfg.transformer_impl)
    pattern = moe_layer_pattern(model_cfg)
    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    mtp_spec = specs.mtp_block_spec(tcfg, backend, pattern) if _holds_mtp(tcfg, post_process, vp_stage) else None
    model = GLM5Model(
        config=tcfg,
        transformer_layer_spec=specs.decoder_block_spec(tcfg, backend, pattern, vp_stage=vp_stage),
        vocab_size=model_cfg.vocab_size,
        max_sequence_length=model_cfg.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=model_cfg.share_embeddings_and_output_weights,
        position_embedding_type="none" if model_cfg.multi_latent_attention else "rope",
        rotary_base=int(model_cfg.rotary_base),
        mtp_block_spec=mtp_spec,
        vp_stage=vp_stage,
    )
    # Torch-native norms are created on the CPU; megatron's parallel layers are already on the GPU.
    if torch.cuda.is_available() and not any(p.is_meta for p in model.parameters()):
        model.cuda(torch.cuda.current_device())
    if model_cfg.activation_offload:
        _enable_activation_offload(model, model_cfg.activation_offload_backend)
    return model


def build_model_chunks(cfg: GLM5Config) -> List[GLM5Model]:
    """This rank's model chunks: one, or one per virtual pipeline stage. An MTP chunk placed on the
    first pipeline rank (`parallel.pipeline_model_parallel_layout`, PP=2) gets the first chunk's embedding
    values (`pretrain.compat.tie_local_embedding_copies`)."""
    vpp = cfg.parallel.virtual_pipeline_model_parallel_size
    chunks = [build_model(cfg, vp_stage=i) for i in range(vpp)] if vpp else [build_model(cfg)]
    compat.tie_local_embedding_copies(chunks)
    return chunks


def _holds_mtp(tcfg: GLM5TransformerConfig, post_process: bool, vp_stage: Optional[int]) -> bool:
    """MTP sits with the loss, unless the layout puts its "m" entries on the stage before."""
    if not tcfg.mtp_num_layers:
        return False
    if tcfg.pipeline_model_parallel_layout is None:
        return post_process
    from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank

    return mtp_on_this_rank(tcfg, ignore_virtual=False, vp_stage=vp_stage)


def _enable_activation_offload(model: GLM5Model, backend: str) -> None:
    """GLM-5's activation offloading: every transformer layer (decoder and MTP) of this chunk."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from parallel.activation_offload import enable_torch_offload

    if backend == "deepspeed":
        from parallel.deepspeed_offload import enable_deepspeed_offload

        enable_deepspeed_offload(model)
        return

    enable_torch_offload(model, [m for m in model.modules() if isinstance(m, TransformerLayer)])
