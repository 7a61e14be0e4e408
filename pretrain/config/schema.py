"""Typed configuration sections.

Every section is a dataclass. Field names equal megatron-core `TransformerConfig` /
`MLATransformerConfig` / `ModelParallelConfig` / `OptimizerConfig` field names (or Megatron-LM
argument names) wherever such a field exists, so users can read the megatron docs for them.
Fields that megatron-core has no name for are marked "ours" in their comment.

Defaults describe the tiny CPU model; the shipped YAML files set every GLM-5 value explicitly.
Validation lives in `pretrain.config.validation` (one check function per section, plus cross-section
checks); `pretrain.config.load_config` builds these dataclasses with type checking.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Union


@dataclass
class ModelConfig:
    # --- trunk -----------------------------------------------------------------------------
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 128  # dense SwiGLU intermediate size (GLM-5: 12288)
    num_attention_heads: int = 4
    vocab_size: int = 512  # exact vocabulary (GLM-5: 154880); must divide by TP
    max_position_embeddings: int = 4096
    share_embeddings_and_output_weights: bool = False  # GLM-5 unties them
    normalization: str = "RMSNorm"
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    add_bias_linear: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    # --- attention -------------------------------------------------------------------------
    multi_latent_attention: bool = True  # False selects GQA (num_query_groups, kv_channels)
    q_lora_rank: Optional[int] = 32  # GLM-5: 2048
    kv_lora_rank: int = 16  # GLM-5: 512
    qk_head_dim: int = 24  # no-rope part of the q/k head (GLM-5: 192)
    qk_pos_emb_head_dim: int = 8  # rope part of the q/k head (GLM-5: 64)
    v_head_dim: int = 32  # GLM-5: 256 ("MLA-256")
    latent_layernorm_epsilon: float = 1e-6  # ours: eps of the q/kv latent RMSNorms
    num_query_groups: Optional[int] = None  # GQA only
    kv_channels: Optional[int] = None  # GQA head dim
    rope_type: str = "rope"  # "rope" or "yarn"; GLM-5 uses plain rope
    rotary_base: float = 1_000_000.0
    rotary_scaling_factor: float = 1.0  # yarn only
    original_max_position_embeddings: int = 4096  # yarn only
    beta_fast: float = 32.0  # yarn only
    beta_slow: float = 1.0  # yarn only
    mscale: float = 1.0  # yarn only
    mscale_all_dim: float = 0.0  # yarn only
    # --- MoE -------------------------------------------------------------------------------
    num_moe_experts: Optional[int] = 8  # None: a dense model
    # 1 = every layer MoE; a list of 0/1 per layer; or Megatron-LM's string form "[0]*3+[1]*75"
    moe_layer_freq: Union[int, List[int], str] = "[0]*1+[1]*1"
    moe_ffn_hidden_size: Optional[int] = 32
    moe_shared_expert_intermediate_size: Optional[int] = 32  # one shared expert
    moe_router_topk: int = 2
    moe_router_score_function: str = "sigmoid"
    moe_router_enable_expert_bias: bool = True  # loss-free balancing correction bias
    moe_router_bias_update_rate: float = 1e-3
    moe_router_topk_scaling_factor: Optional[float] = 2.5  # routed_scaling_factor
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_router_load_balancing_type: str = "seq_aux_loss"
    moe_aux_loss_coeff: float = 1e-4
    moe_router_dtype: Optional[str] = "fp32"
    # "auto": alltoall on GPU, allgather on CPU (the alltoall dispatcher needs CUDA streams)
    moe_token_dispatcher_type: str = "auto"
    moe_grouped_gemm: bool = True  # torch._grouped_mm experts; False: megatron SequentialMLP
    # --- MTP -------------------------------------------------------------------------------
    mtp_num_layers: Optional[int] = 3  # prediction depths (None or 0: no MTP)
    mtp_use_repeated_layer: bool = True  # ours: one layer's parameters shared by all depths
    mtp_loss_scaling_factor: float = 0.3
    # --- DSA (the indexer weights exist whenever the variant is "dsa") ---------------------
    experimental_attention_variant: Optional[str] = "dsa"  # "dsa" or None
    dsa_indexer_n_heads: int = 4  # GLM-5: 32
    dsa_indexer_head_dim: int = 16  # GLM-5: 128
    dsa_indexer_topk: int = 2048
    dsa_indexer_loss_coeff: float = 0.0  # > 0 trains the indexer (KL to the main attention)
    dsa_indexer_use_sparse_loss: bool = False  # KL over the selected keys (needs dsa_sparse_attention)
    dsa_sparse_attention: bool = False  # ours: attend only to the indexer's top-k keys
    # ours: per decoder layer "full" (own indexer) or "shared" (previous full layer's top-k); null = all full
    dsa_indexer_types: Optional[List[str]] = None
    dsa_indexer_hadamard: bool = False  # ours: DeepSeek's FP8-oriented Hadamard rotation (GLM-5: off)
    dsa_chunk_size: Optional[int] = None  # ours: query rows per chunk of the reference path; null = auto
    # ours: "auto" (Triton kernels on GPU, the PyTorch reference on CPU), "triton" or "reference"
    dsa_kernel_backend: str = "auto"
    deterministic_mode: bool = False  # bitwise-reproducible kernels (DSA backward without atomics)
    # --- implementation --------------------------------------------------------------------
    transformer_impl: str = "auto"  # "local", "transformer_engine", or "auto" (TE if importable)
    bf16: bool = False
    params_dtype: str = "float32"  # master weights dtype: "float32" or "bfloat16"


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    # megatron DDP: all-reduce gradient buckets while the backward pass still runs (DP > 1)
    overlap_grad_reduce: bool = True
    # megatron DDP field: reduce gradients in fp32 (false: in the parameters' dtype, half the
    # traffic; accumulation stays fp32). Muon's ZeRO-2 honours it too.
    grad_reduce_in_fp32: bool = True


@dataclass
class OptimizerConfig:
    optimizer: str = "adam"  # "adam" (AdamW, decoupled decay) or "muon"
    lr: float = 3e-4
    min_lr: float = 3e-5
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False  # with muon: ZeRO-2 (parallel/zero2.py)
    # ours, Muon's ZeRO-2: "microbatch" reduces each micro-batch's gradients to their owners (1/dp
    # gradient memory, one reduce per micro-batch); "step" accumulates locally and reduces once per
    # step (DDP's traffic; a full gradient buffer during backward; state and main weights sharded)
    zero2_grad_reduce: str = "microbatch"
    # Muon (GLM-4.5 settings, kept by GLM-5)
    muon_momentum: float = 0.95
    muon_use_nesterov: bool = True
    muon_num_ns_steps: int = 5
    muon_scale_rms: float = 0.2  # ours: update RMS target, x 0.2 * sqrt(max(m, n))
    muon_split: bool = True  # ours: per-head orthogonalization of MLA up-projections
    muon_ns_dtype: str = "bfloat16"  # ours: Newton-Schulz precision, "bfloat16" or "float32"
    # ours: where the MoE router gate ([experts, hidden]) and the DSA indexer's projections go,
    # "adamw" or "muon"; embeddings, the output layer, norms and biases always take AdamW, and
    # the routers' correction bias is a buffer moved only by the balancing rule
    muon_router: str = "adamw"
    muon_indexer: str = "muon"
    # LR schedule (Megatron-LM argument names)
    lr_decay_style: str = "cosine"  # "constant", "linear", "cosine"
    lr_warmup_iters: int = 0
    lr_decay_iters: Optional[int] = None  # None: train.train_iters
    lr_warmup_init: float = 0.0


@dataclass
class DataConfig:
    # Megatron-style blend: ["0.7", "prefix_a", "0.3", "prefix_b"] or just ["prefix"]
    data_path: List[str] = field(default_factory=list)
    split: str = "969,30,1"
    seq_length: int = 128
    tokenizer: Optional[str] = None  # path to a Hugging Face tokenizer.json
    num_workers: int = 0
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    # with reset_attention_mask: also the dense bool [b, 1, s, s] document mask (s^2 bytes a sample);
    # false leaves only the batch's cu_seqlens, for attention kernels that take segment offsets
    create_attention_mask: bool = True
    # ours: per blend entry of data_path, skip documents shorter than this many tokens (0 = keep all);
    # [] = no filter. Long-context stages list a corpus twice, filtered and not, to up-sample long documents
    min_document_length: List[int] = field(default_factory=list)
    data_cache_path: Optional[str] = None  # megatron's dataset index cache; null: <logging.run_dir>/data_cache
    mock: bool = False  # synthetic tokens, no files needed


@dataclass
class TrainConfig:
    micro_batch_size: int = 2
    global_batch_size: int = 2
    train_iters: int = 100
    seed: int = 1234
    eval_interval: Optional[int] = None
    eval_iters: int = 2
    max_consecutive_nan_steps: int = 3  # ours: stop after this many skipped steps in a row
    # ours: "all", or "dsa_indexer" (DSA warm-up: every other parameter frozen)
    trainable_params: str = "all"


@dataclass
class CheckpointConfig:
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    keep_last: int = 2  # ours
    auto_resume: bool = True  # ours
    # ours: weights a fresh run starts from (a checkpoint dir of ours, or `glm5-convert hf-to-checkpoint`
    # output); iteration, optimizer and data start over. DSA indexer weights it lacks are initialized fresh
    pretrained: Optional[str] = None


@dataclass
class LoggingConfig:
    run_dir: str = "runs/default"  # ours
    log_interval: int = 1
    tensorboard_dir: Optional[str] = None
    wandb_project: Optional[str] = None
    wandb_mode: str = "offline"  # "offline", "online" or "disabled"
    profile_step_start: Optional[int] = None
    profile_step_end: Optional[int] = None


@dataclass
class GLM5Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "optimizer": OptimizerConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
}

__all__: List[Any] = ["GLM5Config", "SECTIONS", *[c.__name__ for c in SECTIONS.values()]]
