"""Typed configuration sections: every rule that a single field carries sits on the field.

Every section is a dataclass. Field names equal megatron-core `TransformerConfig` /
`MLATransformerConfig` / `ModelParallelConfig` / `OptimizerConfig` field names (or Megatron-LM
argument names) wherever such a field exists, so users can read the megatron docs for them.

Conventions, read by `pretrain.config.field_docs` and the loader:
* a field's allowed values are its type: `Literal[...]` lists the choices (the loader's error names
  them), `Optional[...]` allows null;
* the string literal right under a field is its one-line docstring (an attribute docstring, as
  Sphinx reads them); "Ours:" marks fields megatron-core has no name for.

Defaults describe the tiny CPU model; the shipped YAML files set every GLM-5 value explicitly.
Rules that relate fields live in `pretrain.config.validation` (one function per section) and
`cross_checks` (rules that span sections).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Literal, Optional, Union


@dataclass
class ModelConfig:
    # --- trunk -----------------------------------------------------------------------------
    num_layers: int = 2
    """Decoder layers (GLM-5: 78)."""
    hidden_size: int = 64
    """Model width (GLM-5: 6144)."""
    ffn_hidden_size: int = 128
    """Dense SwiGLU intermediate size (GLM-5: 12288)."""
    num_attention_heads: int = 4
    """Attention heads (GLM-5: 64)."""
    vocab_size: int = 512
    """Exact vocabulary size (GLM-5: 154880); must divide by TP."""
    max_position_embeddings: int = 4096
    """Longest sequence the model is built for."""
    share_embeddings_and_output_weights: bool = False
    """Tie the input embedding and the output layer (GLM-5 unties them)."""
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    """Norm of every layer."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of the layer norms."""
    init_method_std: float = 0.02
    """Std of the normal weight initialization."""
    add_bias_linear: bool = False
    """Biases in the linear layers."""
    hidden_dropout: float = 0.0
    """Dropout after attention and MLP."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    # --- attention -------------------------------------------------------------------------
    multi_latent_attention: bool = True
    """MLA; false selects GQA (num_query_groups, kv_channels)."""
    q_lora_rank: Optional[int] = 32
    """MLA query latent rank (GLM-5: 2048); null: no query compression."""
    kv_lora_rank: int = 16
    """MLA key/value latent rank (GLM-5: 512)."""
    qk_head_dim: int = 24
    """No-rope part of the q/k head (GLM-5: 192)."""
    qk_pos_emb_head_dim: int = 8
    """Rope part of the q/k head (GLM-5: 64)."""
    v_head_dim: int = 32
    """Value head dim (GLM-5: 256, "MLA-256")."""
    latent_layernorm_epsilon: float = 1e-6
    """Ours: epsilon of the q/kv latent RMSNorms."""
    num_query_groups: Optional[int] = None
    """GQA only: key/value heads."""
    kv_channels: Optional[int] = None
    """GQA only: head dim."""
    window_size: Optional[List[int]] = None
    """Sliding-window attention [left, 0]: a query sees itself and the `left` keys before it; null: full causal."""
    rope_type: Literal["rope", "yarn"] = "rope"
    """Rotary embedding kind; GLM-5 uses plain rope."""
    rotary_base: float = 1_000_000.0
    """Rope theta."""
    rotary_scaling_factor: float = 1.0
    """Yarn only: context extension factor."""
    original_max_position_embeddings: int = 4096
    """Yarn only: the pre-extension context length."""
    beta_fast: float = 32.0
    """Yarn only."""
    beta_slow: float = 1.0
    """Yarn only."""
    mscale: float = 1.0
    """Yarn only."""
    mscale_all_dim: float = 0.0
    """Yarn only."""
    # --- MoE -------------------------------------------------------------------------------
    num_moe_experts: Optional[int] = 8
    """Routed experts (GLM-5: 256); null: a dense model."""
    moe_layer_freq: Union[int, List[int], str] = "[0]*1+[1]*1"
    """1 = every layer MoE; a list of 0/1 per layer; or Megatron-LM's string form "[0]*3+[1]*75"."""
    moe_ffn_hidden_size: Optional[int] = 32
    """Routed expert intermediate size (GLM-5: 2048)."""
    moe_shared_expert_intermediate_size: Optional[int] = 32
    """Intermediate size of the one shared expert; null: none."""
    moe_router_topk: int = 2
    """Experts per token (GLM-5: 8)."""
    moe_router_score_function: Literal["sigmoid", "softmax"] = "sigmoid"
    """Router score function."""
    moe_router_enable_expert_bias: bool = True
    """Loss-free balancing: a correction bias moved by the balancing rule."""
    moe_router_bias_update_rate: float = 1e-3
    """Step of the correction bias update."""
    moe_router_topk_scaling_factor: Optional[float] = 2.5
    """Scale of the top-k weights (HF: routed_scaling_factor)."""
    moe_router_num_groups: Optional[int] = None
    """Group-limited routing: expert groups (with moe_router_group_topk)."""
    moe_router_group_topk: Optional[int] = None
    """Group-limited routing: groups a token may use."""
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"] = (
        "seq_aux_loss"
    )
    """Auxiliary balancing loss."""
    moe_aux_loss_coeff: float = 1e-4
    """Weight of the auxiliary balancing loss."""
    moe_router_dtype: Optional[Literal["fp32", "fp64"]] = "fp32"
    """Router computation dtype; null: the model's."""
    moe_token_dispatcher_type: Literal["auto", "allgather", "alltoall", "alltoall_dedup"] = "auto"
    """"auto": alltoall on GPU, allgather on CPU; "alltoall_dedup" (ours, EP > 1): a token sent once per expert rank."""
    moe_router_force_load_balancing: bool = False
    """Benchmarks only: random router logits (balanced load, untrained routing); never for training runs."""
    moe_shared_expert_overlap: bool = False
    """The shared expert runs while the dispatch all-to-all is in flight (alltoall_dedup, EP > 1; docs/parallelism.md)."""
    moe_overlap_chunks: int = 1
    """Ours: split each micro-batch's tokens after routing; one chunk's all-to-all runs under another's experts (1: off)."""
    moe_grouped_gemm: bool = True
    """torch._grouped_mm experts; false: megatron's SequentialMLP (a loop over experts)."""
    # --- MTP -------------------------------------------------------------------------------
    mtp_num_layers: Optional[int] = 3
    """Multi-token prediction depths (null or 0: no MTP)."""
    mtp_use_repeated_layer: bool = True
    """Ours: one MTP layer's parameters shared by all depths."""
    mtp_loss_scaling_factor: float = 0.3
    """Weight of the MTP losses (split over the depths)."""
    # --- DSA (the indexer weights exist whenever the variant is "dsa") ---------------------
    experimental_attention_variant: Optional[Literal["dsa"]] = "dsa"
    """"dsa": DeepSeek Sparse Attention's indexer on MLA; null: plain attention."""
    dsa_indexer_n_heads: int = 4
    """Indexer heads (GLM-5: 32)."""
    dsa_indexer_head_dim: int = 16
    """Indexer head dim (GLM-5: 128)."""
    dsa_indexer_topk: int = 2048
    """Keys each query selects."""
    dsa_indexer_loss_coeff: float = 0.0
    """> 0 trains the indexer (KL to the main attention)."""
    dsa_indexer_use_sparse_loss: bool = False
    """KL over the indexer's selected top-k keys (true) or over every visible key (false; dense attention only)."""
    dsa_sparse_attention: bool = False
    """Ours: attend only to the indexer's top-k keys."""
    dsa_indexer_types: Optional[List[Literal["full", "shared"]]] = None
    """Ours: per decoder layer "full" (own indexer) or "shared" (previous full layer's top-k); null: all full."""
    dsa_indexer_hadamard: bool = False
    """Ours: DeepSeek's FP8-oriented Hadamard rotation (GLM-5: off)."""
    dsa_chunk_size: Optional[int] = None
    """Ours: query rows per chunk of the reference path; null: auto."""
    dsa_sparse_recompute_attention: bool = False
    """Ours: sparse layers rerun the sparse forward in backward instead of keeping its h x 512 output (top-k kept)."""
    dsa_kernel_backend: Literal["auto", "triton", "reference"] = "auto"
    """Ours: "auto" (Triton kernels on GPU, the PyTorch reference on CPU), "triton" or "reference"."""
    dsa_key_partition_mib: Optional[float] = None
    """Ours: Triton sparse backward's key partitions, MiB of kv + fp32 dkv rows; 0: one pass; null: measured default."""
    dsa_indexer_fp8: bool = False
    """Ours: top-k ranks keys by FP8 (e4m3, per-row scales) index scores (DeepSeek-V3.2); the indexer loss: bf16."""
    dsa_indexer_tp_split: bool = False
    """Ours, TP > 1: each TP rank scores, selects and trains the indexer on 1/TP of the query rows (not yet GPU-run)."""
    deterministic_mode: bool = False
    """Bitwise-reproducible kernels (DSA backward without atomics)."""
    # --- long-context memory (GLM-5 report: recompute, activation offloading, chunked output) -
    recompute_granularity: Optional[Literal["full", "selective"]] = None
    """Activation recompute: "full" re-runs whole layers in backward, "selective" only recompute_modules; null: off."""
    recompute_method: Optional[Literal["uniform", "block"]] = None
    """With full: "uniform" (units of recompute_num_layers layers) or "block" (the first recompute_num_layers per stage)."""
    recompute_num_layers: Optional[int] = None
    """With full: layers per recompute unit (uniform) or layers recomputed on each stage (block)."""
    recompute_modules: Optional[List[Literal["core_attn", "mlp", "moe", "shared_experts", "layernorm"]]] = None
    """With selective: the submodules recomputed in backward; null: ["core_attn"] (megatron's default)."""
    activation_offload: bool = False
    """Ours: each layer's saved activations wait in pinned host memory between forward and backward."""
    activation_offload_backend: Literal["torch", "deepspeed"] = "torch"
    """Ours: "torch" (saved-tensor hooks, any recompute) or "deepspeed" (checkpoint_in_cpu; needs recompute full)."""
    cp_attention: Literal["bottom_right", "merged"] = "merged"
    """Ours, CP > 1: "merged" (each query chunk as a block + causal square, by lse) or bottom-right causal SDPA calls."""
    output_loss_backend: Literal["unfused", "chunked", "liger"] = "unfused"
    """Ours: output layer + loss: "unfused" (full logits), "chunked" (sequence chunks, any TP) or "liger" (TP = 1)."""
    output_chunk_size: Optional[int] = None
    """Ours: tokens per chunk of output_loss_backend "chunked" (required there); null: unchunked."""
    output_grad_weight_fp32: bool = True
    """Ours: "chunked" sums the output weight's gradient over chunks in fp32 (4 V H bytes) or, false, in its dtype."""
    # --- implementation --------------------------------------------------------------------
    transformer_impl: Literal["local", "transformer_engine"] = "local"
    """Linears and norms: "local" (torch-native, tested) or "transformer_engine" (untested here)."""
    bf16: bool = False
    """bf16 mixed precision (needs a GPU)."""
    params_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the model's weights (bfloat16 needs bf16: true; main weights stay fp32)."""


# Chunks per CP rank of `parallel.cp_chunk_assignment: work` when `parallel.cp_chunks_per_rank` is null: on packed
# stdlib windows (32K-128K, CP 2-8) 8 per rank leave at most 0.6% imbalance of dense attention work, 2 per rank up
# to 60% (docs/long_context.md).
CP_WORK_CHUNKS_PER_RANK = 8


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    """TP: ranks that split every layer's weights."""
    pipeline_model_parallel_size: int = 1
    """PP: pipeline stages."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Interleaved stages per PP rank; null: none."""
    pipeline_model_parallel_layout: Optional[str] = None
    """Layers per (virtual) stage, megatron's string: "Et*3|(tt|)*2,tmmm|L"; null: an even split (docs/parallelism.md)."""
    num_layers_in_first_pipeline_stage: Optional[int] = None
    """Decoder layers on the first PP rank (uneven split; null: an even share)."""
    num_layers_in_last_pipeline_stage: Optional[int] = None
    """Decoder layers on the last PP rank (uneven split; null: an even share)."""
    account_for_embedding_in_pipeline_split: bool = False
    """Count the embedding as one decoder layer when splitting layers over stages."""
    account_for_loss_in_pipeline_split: bool = False
    """Count the output layer and loss as one decoder layer when splitting layers over stages."""
    context_parallel_size: int = 1
    """CP: ranks that split each sequence (2 x CP chunks); attention all-gathers the latent KV / indexer keys."""
    cp_chunk_assignment: Literal["zigzag", "work"] = "zigzag"
    """CP chunks per rank: zigzag (2, megatron's split) or work (balanced per batch over packed documents)."""
    cp_chunks_per_rank: Optional[int] = None
    """Chunks each CP rank holds; null: 2 (zigzag) or 8 (work); with work, S divisible by CP x this."""
    expert_model_parallel_size: int = 1
    """EP: ranks that split the routed experts."""
    expert_tensor_parallel_size: int = 1
    """ETP: TP size inside each expert."""
    sequence_parallel: bool = False
    """Split norms/dropout activations along the sequence over TP (needed by MoE with TP > 1)."""
    overlap_grad_reduce: bool = True
    """megatron DDP: all-reduce gradient buckets while the backward pass still runs (DP > 1)."""
    microbatch_group_size_per_vp_stage: Optional[int] = None
    """Interleaved PP: micro-batches run through one virtual stage before the next (megatron's); null: PP."""
    overlap_p2p_comm: bool = True
    """Interleaved PP: sends/receives overlap compute, not a batch that syncs the device (megatron-LM's default)."""
    deallocate_pipeline_outputs: bool = True
    """PP: free a stage's output once sent (megatron-LM sets it): less activation memory per micro-batch in flight."""
    overlap_moe_expert_parallel_comm: bool = False
    """megatron-core's combined 1F1B (EP all-to-all under another micro-batch); refused: docs/parallelism.md says why."""
    grad_reduce_in_fp32: bool = True
    """megatron DDP: reduce gradients in fp32; false: in the weights' dtype (accumulation stays fp32, ZeRO-2 too)."""
    bucket_size: Optional[int] = None
    """Elements per gradient-reduce bucket (megatron DDP and ZeRO-2); null: megatron's max(40M, 1M x DP), ZeRO-2's 40M."""
    distributed_timeout_minutes: int = 30
    """Timeout of every process group's collectives (megatron-core's default); a rank waiting longer raises."""
    nccl_communicator_config_path: Optional[str] = None
    """megatron-core's NCCL options per process group, a YAML file (group -> max_ctas, min_ctas, ...); null: NCCL's."""


@dataclass
class OptimizerConfig:
    optimizer: Literal["adam", "muon"] = "adam"
    """"adam" (AdamW, decoupled decay) or "muon"."""
    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: float = 3e-5
    """Learning rate at the end of the decay."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0: none."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over DP (megatron's for AdamW; ZeRO-2, pretrain/optim/zero2_*.py, with muon)."""
    zero2_grad_reduce: Literal["microbatch", "step", "microbatch_scatter"] = "microbatch"
    """Ours, Muon ZeRO-2: per micro-batch to owners, once per step (full grads), or per micro-batch scattered."""
    zero2_reduce_transport: Literal["nccl", "copy_engine"] = "nccl"
    """Ours, Muon ZeRO-2: who moves the reduces' bytes: NCCL, or the GPUs' copy engines (DP inside one node)."""
    muon_momentum: float = 0.95
    """Muon momentum (GLM-4.5 settings, kept by GLM-5)."""
    muon_use_nesterov: bool = True
    """Nesterov momentum in Muon."""
    muon_num_ns_steps: int = 5
    """Newton-Schulz iterations."""
    muon_scale_rms: float = 0.2
    """Ours: update RMS target, x 0.2 * sqrt(max(m, n))."""
    muon_split: bool = True
    """Ours: per-head orthogonalization of MLA up-projections."""
    muon_split_glu: bool = False
    """Ours: true orthogonalizes a SwiGLU fc1's gate and up apart (fewer FLOPs, trained worse); false: whole."""
    muon_ns_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Ours: Newton-Schulz precision."""
    muon_pipeline_balance: bool = False
    """Ours: PP > 1: a pipeline rank with more Newton-Schulz work sends some blocks to one with less (no ZeRO-2)."""
    muon_router: Literal["adamw", "muon"] = "adamw"
    """Ours: optimizer of the MoE router gate (embeddings, output layer, norms, biases always take AdamW)."""
    muon_indexer: Literal["adamw", "muon"] = "muon"
    """Ours: optimizer of the DSA indexer's projections."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "cosine"
    """LR schedule after warm-up (Megatron-LM argument names from here on)."""
    lr_warmup_iters: int = 0
    """Linear warm-up steps."""
    lr_decay_iters: Optional[int] = None
    """Decay length; null: train.train_iters."""
    lr_warmup_init: float = 0.0
    """Learning rate at step 0 of the warm-up."""


@dataclass
class DataConfig:
    data_path: List[str] = field(default_factory=list)
    """Megatron-style blend: ["0.7", "prefix_a", "0.3", "prefix_b"] or just ["prefix"]."""
    split: str = "969,30,1"
    """Train,valid,test weights."""
    seq_length: int = 128
    """Tokens per sample."""
    tokenizer: Optional[str] = None
    """Path to a Hugging Face tokenizer.json."""
    num_workers: int = 0
    """DataLoader worker processes."""
    num_dataset_builder_threads: int = 1
    """megatron: threads rank 0 builds a blend's per-file sample indices with on a cache miss (others wait)."""
    reset_position_ids: bool = False
    """Restart position ids at every document."""
    reset_attention_mask: bool = False
    """Documents do not attend to each other."""
    eod_mask_loss: bool = False
    """No loss on end-of-document tokens."""
    create_attention_mask: bool = False
    """megatron's dense [b, 1, s, s] mask: refused (true); documents reach attention as cu_seqlens, O(s)."""
    min_document_length: List[int] = field(default_factory=list)
    """Ours: per blend entry, skip documents shorter than this (0: keep all); []: no filter."""
    data_cache_path: Optional[str] = None
    """megatron's dataset index cache; null: <logging.run_dir>/data_cache."""
    mock: bool = False
    """Synthetic tokens, no files needed."""


@dataclass
class TrainConfig:
    micro_batch_size: int = 2
    """Samples per rank per forward/backward."""
    global_batch_size: int = 2
    """Samples per optimizer step over all DP ranks."""
    train_iters: int = 100
    """Optimizer steps."""
    seed: int = 1234
    """Seed of weights, data order and dropout."""
    eval_interval: Optional[int] = None
    """Steps between evaluations; null: none."""
    eval_iters: int = 2
    """Batches per evaluation."""
    max_consecutive_nan_steps: int = 3
    """Ours: stop after this many skipped (non-finite) steps in a row."""
    trainable_params: Literal["all", "dsa_indexer"] = "all"
    """Ours: "all", or "dsa_indexer" (DSA warm-up: every other parameter frozen)."""
    exit_signals: List[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    """Ours: on these signals every rank ends its step, saves a checkpoint and exits with code 75; []: off."""


@dataclass
class CheckpointConfig:
    save: Optional[str] = None
    """Directory to save checkpoints in; null: none."""
    load: Optional[str] = None
    """Directory to resume from."""
    save_interval: Optional[int] = None
    """Steps between saves."""
    keep_last: int = 2
    """Ours: step directories kept."""
    auto_resume: bool = True
    """Ours: resume from save when it holds a checkpoint."""
    pretrained: Optional[str] = None
    """Ours: weights a fresh run starts from (ours or `glm5-convert hf-to-checkpoint` output)."""
    pretrained_optimizer: bool = False
    """Ours: also take optimizer state (moments, Muon momentum) from checkpoint.pretrained; step count and data restart."""
    async_save: bool = False
    """Write checkpoints in the background (megatron-core async save); training blocks only to stage the tensors."""
    pinned_staging: bool = True
    """Ours: sync saves stage in pinned host memory kept for the next (~1.3x the state in RAM); false: pageable, freed."""


@dataclass
class LoggingConfig:
    run_dir: str = "runs/default"
    """Ours: where logs, metrics and the resolved config go."""
    log_interval: int = 1
    """Steps between progress lines."""
    tensorboard_dir: Optional[str] = None
    """TensorBoard event directory; null: none."""
    wandb_project: Optional[str] = None
    """W&B project; null: no W&B."""
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    """W&B mode."""
    profile_step_start: Optional[int] = None
    """First profiled step (with profile_step_end)."""
    profile_step_end: Optional[int] = None
    """Step after the last profiled one."""
    profile_memory: bool = False
    """Ours: the profile window also records CUDA allocations: a memory snapshot and a report of the peak."""
    profile_ranks: List[int] = field(default_factory=lambda: [0])
    """Global ranks that write a profile trace (megatron-LM's --profile-ranks), e.g. both pipeline ends."""


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
