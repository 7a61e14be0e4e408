"""Config checks: field types, one function per section, then the checks that span sections (cross_checks.py).

Each check raises `ConfigError` at the first problem, with a message that names the key(s) and says
what to change. A field's allowed values are its type in `schema.py` (`Literal[...]`), checked by
`types.check_types` only; the functions here hold the rules between values. Section checks come
first so cross-section checks can divide by sizes safely.
Rules mirror megatron-core's own asserts (TransformerConfig / ModelParallelConfig / parallel_state)
so mistakes surface at load time instead of deep inside model construction on a cluster.
"""

from __future__ import annotations

import importlib.util

from typing import Any, Iterable, Optional

from pretrain.config.cross_checks import (
    check_context_parallel,
    check_documents,
    check_model_parallel,
    check_muon_pipeline_balance,
    check_profile_ranks,
    check_schedule,
    check_sequence,
    check_trainable,
    check_world_size,
)
from pretrain.config.errors import require, show
from pretrain.config.moe_pattern import moe_layer_pattern
from pretrain.config.nccl_options import check_nccl_options
from pretrain.config.schema import (
    SECTIONS,
    CheckpointConfig,
    DataConfig,
    GLM5Config,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    TrainConfig,
)
from pretrain.config.types import check_types

def validate_config(cfg: GLM5Config, world_size: Optional[int] = None) -> None:
    """Raise ConfigError if `cfg` is inconsistent; with `world_size`, also check the parallel layout."""
    for section in SECTIONS:
        check_types(section, getattr(cfg, section))
    check_model(cfg.model)
    check_parallel(cfg.parallel)
    check_optimizer(cfg.optimizer)
    check_data(cfg.data)
    check_train(cfg.train)
    check_checkpoint(cfg.checkpoint)
    check_logging(cfg.logging)
    check_model_parallel(cfg.model, cfg.parallel)
    check_sequence(cfg.model, cfg.data, cfg.parallel)
    check_context_parallel(cfg.model, cfg.data, cfg.parallel)
    check_documents(cfg.model, cfg.data, cfg.parallel)
    check_schedule(cfg.optimizer, cfg.train)
    check_muon_pipeline_balance(cfg.optimizer, cfg.parallel)
    check_trainable(cfg.model, cfg.train)
    if world_size is not None:
        check_world_size(cfg.parallel, cfg.train, world_size)
        check_profile_ranks(cfg.logging, world_size)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _at_least(obj: Any, section: str, names: Iterable[str], low: float, optional: bool = False) -> None:
    for name in names:
        value = getattr(obj, name)
        if optional and value is None:
            continue
        require(value >= low, f"{section}.{name} is {value}; it must be >= {low}" + (" (or null)" if optional else ""))


def _positive(obj: Any, section: str, *names: str, optional: bool = False) -> None:
    for name in names:
        value = getattr(obj, name)
        if optional and value is None:
            continue
        require(value > 0, f"{section}.{name} is {value}; it must be > 0" + (" (or null)" if optional else ""))


def _fraction(obj: Any, section: str, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        require(0.0 <= value < 1.0, f"{section}.{name} is {value}; it must be in [0, 1)")


# ---------------------------------------------------------------------------------------------
# per-section checks
# ---------------------------------------------------------------------------------------------


def check_model(m: ModelConfig) -> None:
    _positive(m, "model", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size")
    _positive(m, "model", "max_position_embeddings", "layernorm_epsilon", "latent_layernorm_epsilon", "init_method_std")
    _fraction(m, "model", "hidden_dropout", "attention_dropout")
    _positive(m, "model", "rotary_base", "rotary_scaling_factor")
    _check_attention(m)
    _check_dsa(m)
    _check_moe(m)
    _check_memory(m)
    require(
        m.mtp_num_layers is None or m.mtp_num_layers >= 0,
        f"model.mtp_num_layers is {m.mtp_num_layers}; use null or 0 for no MTP, or the number of depths (GLM-5: 3)",
    )
    _at_least(m, "model", ["mtp_loss_scaling_factor"], 0)


def _check_window(m: ModelConfig) -> None:
    if m.window_size is None:
        return
    require(
        len(m.window_size) == 2 and m.window_size[0] >= 1 and m.window_size[1] == 0,
        f"model.window_size is {m.window_size}; write [left, 0] with left >= 1 (a causal window of left + 1 keys)",
    )
    require(
        m.experimental_attention_variant is None,
        "model.window_size needs model.experimental_attention_variant=null (DSA layers choose their keys by top-k)",
    )


def _check_attention(m: ModelConfig) -> None:
    _check_window(m)
    if m.multi_latent_attention:
        _positive(m, "model", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
        _positive(m, "model", "q_lora_rank", optional=True)
        require(
            m.qk_pos_emb_head_dim % 2 == 0,
            f"model.qk_pos_emb_head_dim is {m.qk_pos_emb_head_dim}; RoPE rotates pairs of dims, so it must be even "
            "(GLM-5: 64)",
        )
        return
    # GQA / MHA: megatron-core derives the head size from kv_channels.
    require(
        m.kv_channels is not None and m.kv_channels > 0,
        f"model.kv_channels is {show(m.kv_channels)}; model.multi_latent_attention=false (GQA) needs the head dim in "
        "model.kv_channels, e.g. 128",
    )
    if m.num_query_groups is not None:
        _positive(m, "model", "num_query_groups")
        require(
            m.num_attention_heads % m.num_query_groups == 0,
            f"model.num_query_groups ({m.num_query_groups}) must divide model.num_attention_heads "
            f"({m.num_attention_heads}); pick a divisor of the head count",
        )


def _check_dsa(m: ModelConfig) -> None:
    if m.experimental_attention_variant != "dsa":
        return
    require(
        m.multi_latent_attention and m.q_lora_rank is not None,
        "model.experimental_attention_variant='dsa' needs model.multi_latent_attention=true with model.q_lora_rank "
        "set (the indexer reads the MLA query latent); set experimental_attention_variant=null otherwise",
    )
    _positive(m, "model", "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk")
    require(
        m.dsa_indexer_head_dim >= m.qk_pos_emb_head_dim,
        f"model.dsa_indexer_head_dim ({m.dsa_indexer_head_dim}) must be >= model.qk_pos_emb_head_dim "
        f"({m.qk_pos_emb_head_dim}): RoPE is applied to the first qk_pos_emb_head_dim dims of the index head",
    )
    _at_least(m, "model", ["dsa_indexer_loss_coeff"], 0)
    _positive(m, "model", "dsa_chunk_size", optional=True)
    require(
        not (m.dsa_sparse_attention and (m.dsa_indexer_loss_coeff or 0) > 0) or m.dsa_indexer_use_sparse_loss,
        "model.dsa_sparse_attention=true trains the indexer only with model.dsa_indexer_use_sparse_loss=true (the "
        "dense KL needs attention probabilities over every key, which sparse attention never forms)",
    )
    require(
        not m.dsa_sparse_attention or m.attention_dropout == 0,
        f"model.attention_dropout={m.attention_dropout} is not supported with model.dsa_sparse_attention=true "
        "(the sparse attention has no dropout); set attention_dropout=0",
    )
    require(
        m.dsa_key_partition_mib is None or m.dsa_key_partition_mib == 0
        or (m.dsa_key_partition_mib > 0 and m.dsa_sparse_attention and not m.deterministic_mode),
        f"model.dsa_key_partition_mib={m.dsa_key_partition_mib} needs a value > 0 (0: one pass, null: the measured "
        "default), model.dsa_sparse_attention=true and model.deterministic_mode=false (it splits the sparse attention "
        "backward's atomic key-gradient passes)",
    )
    require(
        not m.dsa_indexer_fp8 or m.dsa_sparse_attention
        or (m.dsa_indexer_use_sparse_loss and (m.dsa_indexer_loss_coeff or 0) > 0),
        "model.dsa_indexer_fp8=true changes the top-k selection, which runs only with model.dsa_sparse_attention=true "
        "or a sparse indexer loss (model.dsa_indexer_use_sparse_loss=true, model.dsa_indexer_loss_coeff > 0)",
    )
    require(
        not m.dsa_sparse_recompute_attention or m.dsa_sparse_attention,
        "model.dsa_sparse_recompute_attention=true recomputes the sparse attention; it needs "
        "model.dsa_sparse_attention=true",
    )
    require(
        not m.dsa_indexer_hadamard or m.dsa_indexer_head_dim & (m.dsa_indexer_head_dim - 1) == 0,
        f"model.dsa_indexer_hadamard=true needs a power-of-two model.dsa_indexer_head_dim, got {m.dsa_indexer_head_dim}",
    )
    types = m.dsa_indexer_types
    if types is not None:
        require(
            len(types) == m.num_layers,
            f"model.dsa_indexer_types must list 'full' or 'shared' for each of the {m.num_layers} layers, got {types}",
        )
        require(
            types[0] == "full",
            "model.dsa_indexer_types[0] must be 'full': a 'shared' layer reuses the top-k of the previous full layer",
        )


def _check_memory(m: ModelConfig) -> None:
    full = m.recompute_granularity == "full"
    require(
        full == (m.recompute_method is not None) and full == (m.recompute_num_layers is not None),
        "model.recompute_granularity=full needs model.recompute_method and model.recompute_num_layers (and only "
        f"full takes them); got granularity={m.recompute_granularity}, method={m.recompute_method}, "
        f"num_layers={m.recompute_num_layers}",
    )
    _positive(m, "model", "recompute_num_layers", optional=True)
    require(
        m.recompute_modules is None or m.recompute_granularity == "selective",
        "model.recompute_modules needs model.recompute_granularity=selective",
    )
    require(
        # selective core_attn is fine: sparse layers keep their top-k for backward (pretrain.model.dsa.sparse_core)
        # and dense layers' shared cores read none
        not (m.recompute_granularity == "full" and m.experimental_attention_variant == "dsa" and m.dsa_indexer_types
             and "shared" in m.dsa_indexer_types),
        "model.recompute_granularity=full with 'shared' model.dsa_indexer_types is not supported (a recomputed "
        "shared layer would read another micro-batch's top-k); use all-'full' indexers, selective or no recompute",
    )
    deepspeed = m.activation_offload_backend == "deepspeed"
    require(
        not deepspeed or (m.activation_offload and m.recompute_granularity == "full"),
        "model.activation_offload_backend=deepspeed offloads the inputs of full-recompute units: it needs "
        f"model.activation_offload=true and model.recompute_granularity=full (got {m.activation_offload}, "
        f"{m.recompute_granularity})",
    )
    require(
        not deepspeed or importlib.util.find_spec("deepspeed") is not None,
        "model.activation_offload_backend=deepspeed needs DeepSpeed: pip install -e '.[deepspeed]' (or use torch)",
    )
    require(
        not deepspeed or (m.hidden_dropout == 0 and m.attention_dropout == 0),
        "model.activation_offload_backend=deepspeed restores DeepSpeed's RNG tracker, not megatron's: set "
        "model.hidden_dropout and model.attention_dropout to 0, or use the torch backend",
    )
    require(
        m.output_loss_backend != "liger" or importlib.util.find_spec("liger_kernel") is not None,
        "model.output_loss_backend=liger needs Liger kernels: pip install -e '.[liger]' (or use chunked)",
    )
    _positive(m, "model", "output_chunk_size", optional=True)
    require(
        m.output_grad_weight_fp32 or m.output_loss_backend == "chunked",
        "model.output_grad_weight_fp32=false is read only by model.output_loss_backend=chunked, got "
        f"output_loss_backend={m.output_loss_backend}",
    )
    require(
        (m.output_loss_backend == "chunked") == (m.output_chunk_size is not None),
        "model.output_loss_backend=chunked needs model.output_chunk_size (tokens per chunk), which only chunked reads; "
        f"got output_loss_backend={m.output_loss_backend}, output_chunk_size={m.output_chunk_size}",
    )


def _check_moe(m: ModelConfig) -> None:
    if m.num_moe_experts is None:
        return
    _positive(m, "model", "num_moe_experts", "moe_router_topk")
    require(
        m.moe_ffn_hidden_size is not None and m.moe_ffn_hidden_size > 0,
        f"model.moe_ffn_hidden_size is {show(m.moe_ffn_hidden_size)}; an MoE model (model.num_moe_experts set) needs the "
        "expert intermediate size (GLM-5: 2048), or set model.num_moe_experts=null for a dense model",
    )
    _positive(m, "model", "moe_shared_expert_intermediate_size", "moe_router_topk_scaling_factor", optional=True)
    require(
        m.moe_router_topk <= m.num_moe_experts,
        f"model.moe_router_topk ({m.moe_router_topk}) must be <= model.num_moe_experts ({m.num_moe_experts})",
    )
    _at_least(m, "model", ["moe_router_bias_update_rate", "moe_aux_loss_coeff"], 0)
    if m.moe_router_num_groups is not None or m.moe_router_group_topk is not None:
        g, k = m.moe_router_num_groups, m.moe_router_group_topk
        require(
            g is not None and k is not None and g > 0 and 0 < k <= g and m.num_moe_experts % g == 0,
            f"model.moe_router_num_groups ({show(g)}) and model.moe_router_group_topk ({show(k)}) must be set together, with "
            f"num_groups dividing num_moe_experts ({m.num_moe_experts}) and 0 < group_topk <= num_groups; "
            "set both to null to disable group-limited routing",
        )
    moe_layer_pattern(m)  # raises on a bad moe_layer_freq (syntax, length != num_layers, non-0/1 entries)


def check_parallel(p: ParallelConfig) -> None:
    _positive(p, "parallel", "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
              "expert_model_parallel_size", "expert_tensor_parallel_size", "distributed_timeout_minutes")
    _positive(p, "parallel", "bucket_size", optional=True)
    check_nccl_options(p.nccl_communicator_config_path)
    _positive(p, "parallel", "microbatch_group_size_per_vp_stage", optional=True)
    require(p.microbatch_group_size_per_vp_stage is None or p.virtual_pipeline_model_parallel_size is not None,
            "parallel.microbatch_group_size_per_vp_stage orders the interleaved schedule and needs "
            "parallel.virtual_pipeline_model_parallel_size; set it to null")
    if p.virtual_pipeline_model_parallel_size is not None:
        _positive(p, "parallel", "virtual_pipeline_model_parallel_size")
        require(
            p.pipeline_model_parallel_size > 1,
            "parallel.virtual_pipeline_model_parallel_size needs parallel.pipeline_model_parallel_size > 1; "
            "set it to null",
        )
    require(
        not p.sequence_parallel or p.tensor_model_parallel_size > 1,
        "parallel.sequence_parallel=true requires parallel.tensor_model_parallel_size > 1; "
        "set parallel.sequence_parallel=false",
    )
    # EP > 1 with TP > 1 and no sequence parallelism is allowed: megatron-core only warns, and
    # sequence parallelism needs TE or apex norms, which the torch-native backend does not have.


def check_optimizer(o: OptimizerConfig) -> None:
    _at_least(o, "optimizer", ["lr", "min_lr", "weight_decay", "clip_grad", "lr_warmup_init", "lr_warmup_iters"], 0)
    require(o.min_lr <= o.lr, f"optimizer.min_lr ({o.min_lr}) must be <= optimizer.lr ({o.lr})")
    _fraction(o, "optimizer", "adam_beta1", "adam_beta2", "muon_momentum")
    _positive(o, "optimizer", "adam_eps", "muon_num_ns_steps", "muon_scale_rms")
    _positive(o, "optimizer", "lr_decay_iters", optional=True)
    # Read only by Muon's ZeRO-2 (pretrain/optim/zero2_*.py): anywhere else the key would be silently ignored.
    require(
        o.zero2_grad_reduce == "microbatch" or (o.optimizer == "muon" and o.use_distributed_optimizer),
        f"optimizer.zero2_grad_reduce={o.zero2_grad_reduce!r} applies to Muon's ZeRO-2 only; set optimizer.optimizer=muon "
        "and optimizer.use_distributed_optimizer=true, or leave it at \"microbatch\"",
    )
    require(
        o.zero2_reduce_transport == "nccl"
        or (o.optimizer == "muon" and o.use_distributed_optimizer and o.zero2_grad_reduce != "microbatch_scatter"),
        f"optimizer.zero2_reduce_transport={o.zero2_reduce_transport!r} applies to Muon's ZeRO-2 with "
        "optimizer.zero2_grad_reduce microbatch or step; set optimizer.optimizer=muon, "
        "optimizer.use_distributed_optimizer=true, or leave it at \"nccl\"",
    )


def check_data(d: DataConfig) -> None:
    _positive(d, "data", "seq_length")
    require(
        not d.create_attention_mask,
        "data.create_attention_mask=true asks for megatron's dense [s, s] mask, which is not built (documents reach "
        "attention as cu_seqlens, O(s), with data.reset_attention_mask=true); set data.create_attention_mask=false",
    )
    _at_least(d, "data", ["num_workers"], 0)
    _at_least(d, "data", ["num_dataset_builder_threads"], 1)
    try:
        parts = [float(s) for s in d.split.replace("/", ",").split(",")]
    except ValueError:
        parts = []
    require(
        0 < len(parts) <= 3 and all(x >= 0 for x in parts) and sum(parts) > 0,
        f"data.split is {d.split!r}; give up to three non-negative train,valid,test weights, e.g. \"969,30,1\"",
    )
    # Megatron blend: either ["prefix", ...] or ["weight", "prefix", "weight", "prefix", ...].
    if len(d.data_path) > 1 and _is_number(d.data_path[0]):
        weights = d.data_path[0::2]
        require(
            len(d.data_path) % 2 == 0 and all(_is_number(w) and float(w) >= 0 for w in weights),
            f"data.data_path {d.data_path} looks like a weighted blend but is not \"weight, prefix\" pairs; "
            "write [\"0.7\", \"prefix_a\", \"0.3\", \"prefix_b\"] or only prefixes",
        )
    _check_min_document_length(d)


def _check_min_document_length(d: DataConfig) -> None:
    lengths = d.min_document_length
    if not lengths:
        return
    require(
        all(n >= 0 for n in lengths),
        f"data.min_document_length {lengths} has a negative entry; use 0 for no filter on that blend entry",
    )
    weighted = len(d.data_path) > 1 and _is_number(d.data_path[0])
    entries = len(d.data_path) // 2 if weighted else len(d.data_path)
    require(
        len(lengths) == entries,
        f"data.min_document_length has {len(lengths)} entries but data.data_path has {entries} blend entries; "
        "give one minimum length per entry (0 = no filter), or [] for none",
    )


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def check_train(t: TrainConfig) -> None:
    _positive(t, "train", "micro_batch_size", "global_batch_size", "train_iters", "max_consecutive_nan_steps")
    _positive(t, "train", "eval_interval", optional=True)
    _at_least(t, "train", ["eval_iters"], 0)
    require(
        t.global_batch_size % t.micro_batch_size == 0,
        f"train.global_batch_size ({t.global_batch_size}) must be a multiple of train.micro_batch_size "
        f"({t.micro_batch_size}); set train.global_batch_size to a multiple of {t.micro_batch_size}",
    )
    from pretrain.exit_signals import EXIT_SIGNAL_CHOICES  # the one list of signals a run can stop on

    unknown = [s for s in t.exit_signals if s not in EXIT_SIGNAL_CHOICES]
    require(not unknown, f"train.exit_signals has {unknown}; use signal names among {', '.join(EXIT_SIGNAL_CHOICES)}, "
                         "or [] to let signals end the run without a checkpoint")


def check_checkpoint(c: CheckpointConfig) -> None:
    _positive(c, "checkpoint", "save_interval", optional=True)
    _positive(c, "checkpoint", "keep_last")
    require(
        not c.pretrained_optimizer or bool(c.pretrained),
        "checkpoint.pretrained_optimizer=true needs checkpoint.pretrained (the checkpoint whose optimizer state "
        "to take); set checkpoint.pretrained or checkpoint.pretrained_optimizer=false",
    )
    require(
        c.pinned_staging or not c.async_save,
        "checkpoint.pinned_staging=false applies to synchronous saves; with checkpoint.async_save=true the writer "
        "process stages in pinned memory it keeps. Set checkpoint.pinned_staging=true or checkpoint.async_save=false",
    )


def check_logging(lg: LoggingConfig) -> None:
    _positive(lg, "logging", "log_interval")
    start, end = lg.profile_step_start, lg.profile_step_end
    if start is not None or end is not None:
        require(
            start is not None and end is not None and 0 <= start < end,
            f"logging.profile_step_start ({show(start)}) and logging.profile_step_end ({show(end)}) must be set together "
            "with 0 <= start < end; set both to null to disable profiling",
        )
    require(
        bool(lg.profile_ranks) and all(isinstance(r, int) and r >= 0 for r in lg.profile_ranks),
        f"logging.profile_ranks ({show(lg.profile_ranks)}) must list one or more global ranks >= 0, e.g. [0]",
    )
    require(
        not lg.profile_memory or start is not None,
        "logging.profile_memory records allocations over the profile window: set logging.profile_step_start and "
        "logging.profile_step_end too",
    )
