"""Checks that span config sections: model shapes vs parallel sizes, sequence vs model/parallel,
LR schedule vs training length, optimizer settings that need a parallel layout, and (given a world size) the
whole parallel layout.

Rules follow megatron-core's own asserts (TransformerConfig, ModelParallelConfig, parallel_state).
"""

from __future__ import annotations

import logging

from pretrain.config.errors import require
from pretrain.config.pipeline_layout import LAYOUT_KEY, microbatch_group_ok, stage_entries
from pretrain.config.schema import (
    CP_WORK_CHUNKS_PER_RANK, DataConfig, LoggingConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainConfig,
)
from pretrain.notices import say_once

_log = logging.getLogger(__name__)


def check_model_parallel(m: ModelConfig, p: ParallelConfig) -> None:
    tp, etp, ep = p.tensor_model_parallel_size, p.expert_tensor_parallel_size, p.expert_model_parallel_size

    def divisible(key: str, value: int, by: int, by_key: str) -> None:
        require(
            value % by == 0,
            f"{key} ({value}) must be divisible by {by_key} ({by}); change one of them",
        )

    divisible("model.num_attention_heads", m.num_attention_heads, tp, "parallel.tensor_model_parallel_size")
    if not m.multi_latent_attention and m.num_query_groups is not None:
        divisible("model.num_query_groups", m.num_query_groups, tp, "parallel.tensor_model_parallel_size")
    divisible("model.vocab_size", m.vocab_size, tp, "parallel.tensor_model_parallel_size")
    divisible("model.ffn_hidden_size", m.ffn_hidden_size, tp, "parallel.tensor_model_parallel_size")
    check_moe_overlap(m, p)
    if m.num_moe_experts is None:
        require(ep == 1, "parallel.expert_model_parallel_size > 1 needs an MoE model: set model.num_moe_experts, "
                          "or set parallel.expert_model_parallel_size=1")
    else:
        divisible("model.moe_ffn_hidden_size", m.moe_ffn_hidden_size, etp, "parallel.expert_tensor_parallel_size")
        if m.moe_shared_expert_intermediate_size is not None:  # the shared expert is a TP-sharded dense MLP
            divisible("model.moe_shared_expert_intermediate_size", m.moe_shared_expert_intermediate_size, tp,
                      "parallel.tensor_model_parallel_size")
        divisible("model.num_moe_experts", m.num_moe_experts, ep, "parallel.expert_model_parallel_size")
        require(  # pretrain/model/ep_dispatch.py: the per-rank dispatch runs over the EP group alone
            m.moe_token_dispatcher_type != "alltoall_dedup" or etp == 1,
            f"model.moe_token_dispatcher_type=alltoall_dedup needs parallel.expert_tensor_parallel_size=1 (got {etp}); "
            "use moe_token_dispatcher_type=alltoall with expert tensor parallelism",
        )
        # megatron's MoELayer refuses to train with TP > 1 unless the sequence is split across TP
        require(
            tp == 1 or p.sequence_parallel,
            "an MoE model with parallel.tensor_model_parallel_size > 1 needs "
            "parallel.sequence_parallel=true (megatron-core's MoE layer trains only that way)",
        )
    require(
        m.output_loss_backend != "liger" or tp == 1,
        "model.output_loss_backend=liger runs at parallel.tensor_model_parallel_size=1 only (Liger's kernel is not "
        "vocab-parallel); use output_loss_backend=chunked with model.output_chunk_size under TP",
    )
    check_pipeline_layout(m, p)


def check_moe_overlap(m: ModelConfig, p: ParallelConfig) -> None:
    """The all-to-all overlaps of pretrain/model/moe_overlap.py run on the per-rank EP dispatch only."""
    ep = p.expert_model_parallel_size
    require(m.moe_overlap_chunks >= 1, f"model.moe_overlap_chunks must be >= 1 (got {m.moe_overlap_chunks}); 1 is off")
    for key, on in (("moe_shared_expert_overlap", m.moe_shared_expert_overlap),
                    ("moe_overlap_chunks", m.moe_overlap_chunks > 1)):
        if not on:
            continue
        require(m.moe_token_dispatcher_type == "alltoall_dedup" and ep > 1,
                f"model.{key} overlaps the all-to-all of model.moe_token_dispatcher_type=alltoall_dedup with "
                f"parallel.expert_model_parallel_size > 1 (got {m.moe_token_dispatcher_type}, EP={ep}); "
                "set both or turn it off")
        recomputed = sorted(set(m.recompute_modules or []) & {"moe", "shared_experts"})
        require(not recomputed and m.recompute_granularity != "full",
                f"model.{key} cannot run with model.recompute_granularity={m.recompute_granularity} / "
                f"model.recompute_modules {recomputed} (the MoE layer would re-run around its in-flight "
                "all-to-alls); drop one of them")
    require(not m.moe_shared_expert_overlap or m.moe_shared_expert_intermediate_size is not None,
            "model.moe_shared_expert_overlap needs a shared expert (model.moe_shared_expert_intermediate_size)")
    require(not p.overlap_moe_expert_parallel_comm,
            "parallel.overlap_moe_expert_parallel_comm (megatron-core's combined 1F1B) is not supported: its schedule "
            "plan schedules one node per MTP layer module (ours applies one layer mtp_num_layers times) and our forward "
            "step has no schedule-plan mode (docs/parallelism.md); use model.moe_shared_expert_overlap or "
            "model.moe_overlap_chunks")


def check_pipeline_layout(m: ModelConfig, p: ParallelConfig) -> None:
    """Layers per (virtual) pipeline stage (`pretrain.config.pipeline_layout` resolves and checks the keys),
    where MTP may sit, and DSA's shared indexers against the stage boundaries."""
    stages = stage_entries(m, p)
    if m.mtp_num_layers and "m" not in stages[-1]:  # GLM-5's placement: MTP on the stage before the loss
        require(not m.share_embeddings_and_output_weights,
                f"{LAYOUT_KEY} puts MTP before the last stage, which needs untied embeddings: set "
                "model.share_embeddings_and_output_weights=false or move the m entries to the last stage")
    if m.experimental_attention_variant == "dsa" and m.dsa_indexer_types and len(stages) > 1:
        starts, layer = [], 0
        for entries in stages:
            if "t" in entries:
                starts.append(layer)
            layer += entries.count("t")
        firsts = [i for i in starts if m.dsa_indexer_types[i] != "full"]
        require(
            not firsts,
            f"model.dsa_indexer_types: layers {firsts} start a pipeline stage but are 'shared' (top-k indices do "
            "not cross stages); make the first layer of every stage 'full'",
        )


def check_sequence(m: ModelConfig, d: DataConfig, p: ParallelConfig) -> None:
    require(
        d.seq_length <= m.max_position_embeddings,
        f"data.seq_length ({d.seq_length}) exceeds model.max_position_embeddings ({m.max_position_embeddings}); "
        "shorten the sequence or raise max_position_embeddings",
    )
    if p.sequence_parallel:
        require(
            d.seq_length % p.tensor_model_parallel_size == 0,
            f"data.seq_length ({d.seq_length}) must be divisible by parallel.tensor_model_parallel_size "
            f"({p.tensor_model_parallel_size}) with parallel.sequence_parallel=true",
        )


def check_context_parallel(m: ModelConfig, d: DataConfig, p: ParallelConfig) -> None:
    """Context parallelism (`parallel.context_parallel`): 2 x cp equal chunks per sequence, and an
    attention whose keys the layer all-gathers (MLA with a query latent, DSA, GQA)."""
    check_cp_chunks(m, d, p)
    cp = p.context_parallel_size
    if cp == 1:
        return
    require(
        d.seq_length % (2 * cp) == 0,
        f"data.seq_length ({d.seq_length}) must be divisible by 2 x parallel.context_parallel_size (2 x {cp}: "
        "each CP rank holds two equal chunks); change the sequence length or the CP size",
    )
    require(
        not p.sequence_parallel or (d.seq_length // cp) % p.tensor_model_parallel_size == 0,
        f"data.seq_length / parallel.context_parallel_size ({d.seq_length} / {cp}) must be divisible by "
        f"parallel.tensor_model_parallel_size ({p.tensor_model_parallel_size}) with parallel.sequence_parallel=true",
    )
    require(
        not m.multi_latent_attention or m.q_lora_rank is not None,
        "parallel.context_parallel_size > 1 with MLA needs model.q_lora_rank (the latent attention layer that "
        "gathers keys over CP projects queries through the query latent); set q_lora_rank or context_parallel_size=1",
    )
    require(
        m.window_size is None,
        "model.window_size (sliding-window attention) is not implemented with parallel.context_parallel_size > 1; "
        "set one of them back (window_size=null or context_parallel_size=1)",
    )


def check_cp_chunks(m: ModelConfig, d: DataConfig, p: ParallelConfig) -> None:
    """`parallel.cp_chunk_assignment` / `parallel.cp_chunks_per_rank` (`parallel.cp_load_balance`): the work
    assignment cuts every sequence into cp x chunks-per-rank equal chunks and rotates queries and keys by their global
    positions in the latent MLA layer (GQA takes megatron's RoPE table of the zigzag split)."""
    cp, per, work = p.context_parallel_size, p.cp_chunks_per_rank, p.cp_chunk_assignment == "work"
    require(per is None or per >= 1, f"parallel.cp_chunks_per_rank ({per}) must be at least 1, or null")
    require(work or per in (None, 2),
            f"parallel.cp_chunks_per_rank={per} needs parallel.cp_chunk_assignment=work (the zigzag split holds 2 "
            "chunks per rank); set cp_chunks_per_rank to null or set cp_chunk_assignment=work")
    if not work:
        return
    if cp == 1:
        say_once(_log, "parallel.cp_chunk_assignment=work does nothing with parallel.context_parallel_size=1 (one rank "
                 "holds the whole sequence)")
        return
    n = cp * (per or CP_WORK_CHUNKS_PER_RANK)
    require(d.seq_length % n == 0,
            f"data.seq_length ({d.seq_length}) must be divisible by parallel.context_parallel_size x "
            f"parallel.cp_chunks_per_rank ({n}) with parallel.cp_chunk_assignment=work; change one of them")
    require(m.multi_latent_attention,
            "parallel.cp_chunk_assignment=work needs MLA (model.multi_latent_attention=true): GQA's RoPE comes from "
            "megatron's table of the zigzag split; set cp_chunk_assignment=zigzag")
    if not d.reset_attention_mask:
        say_once(_log, "parallel.cp_chunk_assignment=work without data.reset_attention_mask: documents attend to "
                 "each other, one causal window per sequence, which the zigzag split already balances; batches keep it")


def check_documents(m: ModelConfig, d: DataConfig, p: ParallelConfig) -> None:
    """Per-document RoPE positions (`pretrain.model.documents`) are applied by the latent MLA layer (DSA, or MLA
    under context parallelism); megatron's MLA and GQA attention rotate by the window position."""
    latent = m.multi_latent_attention and (m.experimental_attention_variant == "dsa" or p.context_parallel_size > 1)
    require(
        not d.reset_position_ids or latent,
        "data.reset_position_ids=true restarts RoPE per document only in the latent MLA layer "
        "(model.experimental_attention_variant=dsa, or parallel.context_parallel_size > 1); set it to false here",
    )


def check_trainable(m: ModelConfig, t: TrainConfig) -> None:
    if t.trainable_params != "dsa_indexer":
        return
    require(
        m.experimental_attention_variant == "dsa" and m.dsa_indexer_loss_coeff > 0,
        "train.trainable_params='dsa_indexer' trains only the indexer, which learns only from its KL loss: set "
        "model.experimental_attention_variant=dsa and model.dsa_indexer_loss_coeff > 0",
    )


def check_schedule(o: OptimizerConfig, t: TrainConfig) -> None:
    decay_iters = o.lr_decay_iters if o.lr_decay_iters is not None else t.train_iters
    require(
        o.lr_warmup_iters < decay_iters,
        f"optimizer.lr_warmup_iters ({o.lr_warmup_iters}) must be < the decay length ({decay_iters}, "
        "optimizer.lr_decay_iters or train.train_iters); shorten the warm-up",
    )


def check_profile_ranks(lg: LoggingConfig, world_size: int) -> None:
    beyond = [r for r in lg.profile_ranks if r >= world_size]
    require(not beyond or lg.profile_step_start is None,
            f"logging.profile_ranks names ranks {beyond} of a world of {world_size} (ranks 0 .. {world_size - 1}); "
            "list ranks that exist")


def check_world_size(p: ParallelConfig, t: TrainConfig, world_size: int) -> None:
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size
    require(world_size >= 1, f"world size is {world_size}; it must be >= 1")
    require(cp <= world_size, f"parallel.context_parallel_size ({cp}) is larger than the world size ({world_size}); "
                              "lower the CP size or launch more ranks")
    model_parallel = tp * pp * cp
    require(
        world_size % model_parallel == 0,
        f"world size {world_size} is not divisible by parallel.tensor_model_parallel_size x "
        f"pipeline_model_parallel_size x context_parallel_size ({tp} x {pp} x {cp} = {model_parallel}); "
        "change the parallel sizes or the number of GPUs",
    )
    dp = world_size // model_parallel
    # megatron-core parallel_state: the expert grid EP x ETP tiles each pipeline stage's ranks.
    require(
        (world_size // pp) % (ep * etp) == 0,
        f"parallel.expert_model_parallel_size x expert_tensor_parallel_size ({ep} x {etp} = {ep * etp}) must divide "
        f"world size / pipeline_model_parallel_size ({world_size} / {pp} = {world_size // pp}); lower the expert "
        "parallel size",
    )
    step = t.micro_batch_size * dp
    require(
        t.global_batch_size % step == 0,
        f"train.global_batch_size ({t.global_batch_size}) must be divisible by train.micro_batch_size x data-parallel "
        f"size ({t.micro_batch_size} x {dp} = {step}; data-parallel size = world size {world_size} / "
        f"{model_parallel}); set train.global_batch_size to a multiple of {step}",
    )
    # megatron's interleaved schedule runs micro-batches in groups of PP per virtual stage
    vpp = p.virtual_pipeline_model_parallel_size
    require(
        vpp is None or t.global_batch_size % (step * pp) == 0,
        f"parallel.virtual_pipeline_model_parallel_size needs micro-batches per step (train.global_batch_size / "
        f"(train.micro_batch_size x data-parallel size) = {t.global_batch_size} / {step}) divisible by "
        f"parallel.pipeline_model_parallel_size ({pp}); set train.global_batch_size to a multiple of {step * pp}",
    )
    group = p.microbatch_group_size_per_vp_stage
    if group is not None and vpp is not None:  # megatron's schedule raises on these at the first step
        microbatches = t.global_batch_size // step
        require(microbatch_group_ok(pp, group, microbatches),
                f"parallel.microbatch_group_size_per_vp_stage ({group}) must be between "
                f"parallel.pipeline_model_parallel_size ({pp}) and the micro-batches per step ({microbatches}), with "
                f"micro-batches % group 0 or >= {pp} (megatron-core's interleaved schedule)")


def check_muon_pipeline_balance(o: OptimizerConfig, p: ParallelConfig) -> None:
    # Read only by Muon's replicated (DDP) step over several pipeline ranks (pretrain/optim/muon_pipeline.py).
    require(
        not o.muon_pipeline_balance
        or (o.optimizer == "muon" and not o.use_distributed_optimizer and p.pipeline_model_parallel_size > 1),
        "optimizer.muon_pipeline_balance=true shares Muon's Newton-Schulz work between pipeline ranks: it needs "
        "optimizer.optimizer=muon, optimizer.use_distributed_optimizer=false (ZeRO-2 already spreads it over data "
        f"parallelism) and parallel.pipeline_model_parallel_size > 1; got optimizer={o.optimizer}, "
        f"use_distributed_optimizer={o.use_distributed_optimizer}, "
        f"pipeline_model_parallel_size={p.pipeline_model_parallel_size}",
    )
