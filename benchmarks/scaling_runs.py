"""The runs of benchmarks/scaling.py: each layout, its overrides, its micro-batches and the 1-GPU run it is compared
with. Every run trains the config for `--iters` steps with the same work per data-parallel rank as its 1-GPU
baseline: M micro-batches per step per data-parallel rank (per pipeline for PP). Runs (N = the GPUs used; layouts
that use fewer than N model-parallel ranks fill the rest with data parallelism):

    gpu1                   1 GPU, M = 8                     (the baseline of every 4K run)
    ddp_m8, ddp_m32        DP = N, megatron DDP, M = 8 / 32
    zero2_m8, zero2_m32    DP = N, ZeRO-2 (optimizer.use_distributed_optimizer), M = 8 / 32
    zero2_scatter_m32      zero2_m32 with optimizer.zero2_grad_reduce=microbatch_scatter (one reduce-scatter per
                           bucket per micro-batch instead of a reduce to each owner)
    zero2_bf16_m32         zero2_m32 with parallel.grad_reduce_in_fp32=false: each micro-batch's reduce in bf16 (half
                           the traffic; the owner still accumulates in fp32)
    zero2_step_m32         zero2_m32 with optimizer.zero2_grad_reduce=step (one reduce per step, a full gradient buffer)
    zero2_b160_m32         zero2_m32 with parallel.bucket_size=160000000: a quarter of the reduces, each 4x longer
    zero2_ce_m8, zero2_ce_m32   zero2_m8 / zero2_m32 with optimizer.zero2_reduce_transport=copy_engine: the reduces'
                           bytes on the GPUs' copy engines, not NCCL's kernels beside the backward
    zero2_ce_bf16_m32      zero2_ce_m32 with the reduce in bf16 (parallel.grad_reduce_in_fp32=false)
    ddp_ctas4_m32,         ddp_m32 / zero2_m32 with parallel.nccl_communicator_config_path=
    zero2_ctas4_m32        configs/nccl/dp_reduce_4ctas.yaml: the data-parallel groups' NCCL kernels take at most 4
                           thread blocks (SMs) beside the backward
    ep_a2a                 EP = N x DP = N, megatron's alltoall dispatcher
    ep                     EP = N x DP = N, alltoall_dedup (one row per token and destination rank)
    ep_shared, ep_chunks   ep + model.moe_shared_expert_overlap / + model.moe_overlap_chunks=2
    ep_overlap             ep + both overlaps
    gpu1_bal, ep_bal, ep_overlap_bal   forced router balance (benchmarks only): communication without imbalance
    pp2                    PP = 2 x VPP = 2 with pipeline_split's layout and micro-batch group (the shortest simulated
                           schedule, stages weighed by the planner's calibration for the GPU kind), x DP = N / 2; the
                           config's pipeline settings
                           (megatron-LM's: parallel.overlap_p2p_comm and deallocate_pipeline_outputs true)
    pp2_batched            pp2 with megatron-core's defaults instead: each send/receive batched, ending in a device
                           synchronize (overlap_p2p_comm=false), outputs kept (deallocate_pipeline_outputs=false)
    pp2_chunked            pp2 with the chunked output loss (output_loss_backend=chunked, 4096-token chunks), not
                           Liger's, whose forward reads its mask count on the host (`.item()`) once per head per
                           micro-batch: the last stage's host then waits for its device, which waits for the other stage
    pp2_muon_balance       pp2_chunked with optimizer.muon_pipeline_balance=true: the busier pipeline rank sends part of
                           its Newton-Schulz blocks to the other
    pp2_closed             pp2_chunked with pipeline_split's closed-form balance (--closed-form: the busiest rank and
                           the slowest stage, micro-batch groups of PP), what pp2_chunked ran before the simulated
                           schedule
    tp2                    TP = 2 + SP x DP = N / 2 (chunked output loss: Liger is not vocab-parallel)
    gpu1_32k, cp2_32k      32K sequences, 2 micro-batches, full recompute: 1 GPU and CP = 2 x DP = N / 2 with
                           model.cp_attention=bottom_right (one bottom-right causal SDPA call per query chunk)
    cp2_32k_merged         cp2_32k with model.cp_attention=merged (block + causal square, lse-merged: the default)
    cp2_32k_zero2          cp2_32k_merged with ZeRO-2, which shards the optimizer over DP x CP: each CP rank
                           updates half the weights (one GPU's Muon step is not split by CP otherwise)
    gpu1_32k_docs, cp2_32k_docs, cp2_32k_docs_work
                           packed documents isolated (data.reset_attention_mask, own positions); the last with
                           chunks assigned by work (parallel.cp_chunk_assignment=work); merged attention in all
    gpu1_32k_dsa, cp2_32k_dsa                  DSA sparse (indexer top-k + sparse KL) at 32K
    width                  GLM-5's own layer dims (configs/scaling/glm5-width.yaml: one dense + one MoE layer),
                           EP = N x DP = N, Muon + ZeRO-2; fits no single GPU, so MFU is its measure
    width_tp2              (4 GPUs) width with TP = 2 + SP x EP = N / 2 (expert TP 1, experts of full width)
    width_128k             configs/scaling/glm5-width-128k.yaml (two dense layers of GLM-5's width, 128K windows
                           of isolated documents, DSA sparse), CP = N, mock windows
    gpu1_128k, cp2_128k, gpu1_128k_docs, cp2_128k_docs, cp2_128k_docs_work
                           the same at 128K with DSA sparse, 1 micro-batch per step, full recompute, Liger loss;
                           on 4 GPUs also cp4_128k and cp4_128k_docs_work (CP = 4)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

DEFAULT_CONFIG = "configs/models/glm5-proxy.yaml"
WIDTH = "configs/scaling/glm5-width.yaml"
COPY_ENGINE = "optimizer.zero2_reduce_transport=copy_engine"
FEW_CTAS = "parallel.nccl_communicator_config_path=configs/nccl/dp_reduce_4ctas.yaml"
WIDTH_128K = "configs/scaling/glm5-width-128k.yaml"
GROUPS = {
    "baseline": ["gpu1"],
    "dp": ["ddp_m8", "ddp_m32", "zero2_m8", "zero2_m32", "zero2_scatter_m32", "zero2_bf16_m32", "zero2_step_m32",
           "zero2_b160_m32", "ddp_ctas4_m32", "zero2_ctas4_m32", "zero2_ce_m8", "zero2_ce_m32", "zero2_ce_bf16_m32"],
    "dispatch": ["ep_a2a", "ep", "ep_overlap"],  # group names never equal a run's: `--only ep` is the run
    "overlaps": ["ep", "ep_shared", "ep_chunks", "ep_overlap"],
    "balance": ["gpu1_bal", "ep_bal", "ep_overlap_bal"],
    "pp": ["pp2", "pp2_batched", "pp2_chunked", "pp2_muon_balance", "pp2_closed"],
    "tp": ["tp2"],
    "cp": ["gpu1_32k", "cp2_32k", "cp2_32k_merged", "cp2_32k_zero2", "gpu1_32k_docs", "cp2_32k_docs",
           "cp2_32k_docs_work", "gpu1_32k_dsa", "cp2_32k_dsa"],
    "glm5_width": ["width", "width_128k", "width_tp2"],
    "cp_long": ["gpu1_128k", "cp2_128k", "gpu1_128k_docs", "cp2_128k_docs", "cp2_128k_docs_work", "cp4_128k",
                "cp4_128k_docs_work"],
}
DEDUP = ["model.moe_token_dispatcher_type=alltoall_dedup"]
OVERLAP = ["model.moe_shared_expert_overlap=true", "model.moe_overlap_chunks=2"]
BALANCED = ["model.moe_router_force_load_balancing=true"]
ZERO2 = ["optimizer.use_distributed_optimizer=true"]
TP2 = ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true", "model.output_loss_backend=chunked",
       "model.output_chunk_size=4096"]
FULL_RECOMPUTE = ["model.recompute_granularity=full", "model.recompute_method=uniform", "model.recompute_num_layers=1"]
LONG = ["data.seq_length=32768", "train.micro_batch_size=1"] + FULL_RECOMPUTE
DSA_SPARSE = ["model.dsa_sparse_attention=true", "model.dsa_indexer_loss_coeff=1e-3",
              "model.dsa_indexer_use_sparse_loss=true"]
LONG_128K = ["data.seq_length=131072", "train.micro_batch_size=1", "model.output_loss_backend=liger"] + FULL_RECOMPUTE \
    + DSA_SPARSE
DOCS = ["data.reset_attention_mask=true", "data.reset_position_ids=true"]
BALANCED_CP = ["model.cp_attention=merged", "parallel.cp_chunk_assignment=work"]


@dataclass
class Run:
    name: str
    gpus: int
    microbatches: int  # per data-parallel rank (per pipeline) per step
    dp: int
    baseline: str
    overrides: List[str] = field(default_factory=list)
    profile: str = ""  # "a2a" (EP) or "allgather" (CP): the collective whose share of the step is reported
    config: Optional[str] = None  # another config than --config (the GLM-5-width slices)


def plan_runs(n: int, micro_batch: int, pp_layout: List[str], pp_closed: Optional[List[str]] = None
              ) -> Dict[str, Run]:
    """Every run for a host of n GPUs, by name (module docstring)."""
    half = n // 2
    ep = [f"parallel.expert_model_parallel_size={n}"]
    cp2 = ["parallel.context_parallel_size=2"]
    runs = [
        Run("gpu1", 1, 8, 1, "gpu1"),
        Run("ddp_m8", n, 8, n, "gpu1"),
        Run("ddp_m32", n, 32, n, "gpu1"),
        Run("zero2_m8", n, 8, n, "gpu1", ZERO2),
        Run("zero2_m32", n, 32, n, "gpu1", ZERO2),
        Run("zero2_scatter_m32", n, 32, n, "gpu1", ZERO2 + ["optimizer.zero2_grad_reduce=microbatch_scatter"]),
        Run("zero2_bf16_m32", n, 32, n, "gpu1", ZERO2 + ["parallel.grad_reduce_in_fp32=false"]),
        Run("zero2_step_m32", n, 32, n, "gpu1", ZERO2 + ["optimizer.zero2_grad_reduce=step"]),
        Run("zero2_b160_m32", n, 32, n, "gpu1", ZERO2 + ["parallel.bucket_size=160000000"]),
        Run("zero2_ce_m8", n, 8, n, "gpu1", ZERO2 + [COPY_ENGINE]),
        Run("zero2_ce_m32", n, 32, n, "gpu1", ZERO2 + [COPY_ENGINE]),
        Run("zero2_ce_bf16_m32", n, 32, n, "gpu1", ZERO2 + [COPY_ENGINE, "parallel.grad_reduce_in_fp32=false"]),
        Run("ddp_ctas4_m32", n, 32, n, "gpu1", [FEW_CTAS]),
        Run("zero2_ctas4_m32", n, 32, n, "gpu1", ZERO2 + [FEW_CTAS]),
        Run("ep_a2a", n, 8, n, "gpu1", ep + ["model.moe_token_dispatcher_type=alltoall"], "a2a"),
        Run("ep", n, 8, n, "gpu1", ep + DEDUP, "a2a"),
        Run("ep_shared", n, 8, n, "gpu1", ep + DEDUP + OVERLAP[:1], "a2a"),
        Run("ep_chunks", n, 8, n, "gpu1", ep + DEDUP + OVERLAP[1:], "a2a"),
        Run("ep_overlap", n, 8, n, "gpu1", ep + DEDUP + OVERLAP, "a2a"),
        Run("gpu1_bal", 1, 8, 1, "gpu1_bal", BALANCED),
        Run("ep_bal", n, 8, n, "gpu1_bal", ep + DEDUP + BALANCED, "a2a"),
        Run("ep_overlap_bal", n, 8, n, "gpu1_bal", ep + DEDUP + OVERLAP + BALANCED, "a2a"),
        Run("pp2", n, 8, half, "gpu1", ["parallel.pipeline_model_parallel_size=2"] + pp_layout),
        Run("pp2_batched", n, 8, half, "gpu1", ["parallel.pipeline_model_parallel_size=2"] + pp_layout
            + ["parallel.overlap_p2p_comm=false", "parallel.deallocate_pipeline_outputs=false"]),
        Run("pp2_chunked", n, 8, half, "gpu1", ["parallel.pipeline_model_parallel_size=2"] + pp_layout
            + ["model.output_loss_backend=chunked", "model.output_chunk_size=4096"]),
        Run("pp2_muon_balance", n, 8, half, "gpu1", ["parallel.pipeline_model_parallel_size=2"] + pp_layout
            + ["model.output_loss_backend=chunked", "model.output_chunk_size=4096",
               "optimizer.muon_pipeline_balance=true"]),
        Run("pp2_closed", n, 8, half, "gpu1", ["parallel.pipeline_model_parallel_size=2"] + (pp_closed or pp_layout)
            + ["model.output_loss_backend=chunked", "model.output_chunk_size=4096"]),
        Run("tp2", n, 8, half, "gpu1", TP2),
        Run("gpu1_32k", 1, 2, 1, "gpu1_32k", LONG),
        Run("cp2_32k", n, 2, half, "gpu1_32k", LONG + cp2 + ["model.cp_attention=bottom_right"], "allgather"),
        Run("cp2_32k_merged", n, 2, half, "gpu1_32k", LONG + cp2 + BALANCED_CP[:1], "allgather"),
        Run("cp2_32k_zero2", n, 2, half, "gpu1_32k", LONG + cp2 + BALANCED_CP[:1] + ZERO2, "allgather"),
        Run("gpu1_32k_docs", 1, 2, 1, "gpu1_32k_docs", LONG + DOCS),
        Run("cp2_32k_docs", n, 2, half, "gpu1_32k_docs", LONG + DOCS + cp2, "allgather"),
        Run("cp2_32k_docs_work", n, 2, half, "gpu1_32k_docs", LONG + DOCS + cp2 + BALANCED_CP, "allgather"),
        Run("gpu1_32k_dsa", 1, 2, 1, "gpu1_32k_dsa", LONG + DSA_SPARSE),
        Run("cp2_32k_dsa", n, 2, half, "gpu1_32k_dsa", LONG + DSA_SPARSE + cp2, "allgather"),
        Run("gpu1_128k", 1, 1, 1, "gpu1_128k", LONG_128K),
        Run("cp2_128k", n, 1, half, "gpu1_128k", LONG_128K + cp2, "allgather"),
        Run("gpu1_128k_docs", 1, 1, 1, "gpu1_128k_docs", LONG_128K + DOCS),
        Run("cp2_128k_docs", n, 1, half, "gpu1_128k_docs", LONG_128K + DOCS + cp2, "allgather"),
        Run("cp2_128k_docs_work", n, 1, half, "gpu1_128k_docs", LONG_128K + DOCS + cp2 + BALANCED_CP, "allgather"),
    ]
    # GLM-5's own width (configs/scaling): no 1-GPU baseline fits one GPU, so MFU is their measure (baseline "")
    runs += [Run("width", n, 8, n, "", [f"parallel.expert_model_parallel_size={n}"], "a2a", WIDTH),
             Run("width_128k", n, 2, 1, "", [f"parallel.context_parallel_size={n}", "data.mock=true",
                                              "data.data_path=[]", "data.tokenizer=null"],  # mock windows: no corpus
                 "allgather", WIDTH_128K)]
    if n >= 4:  # GLM-5's width with TP=2 x EP=n/2 (expert TP follows TP): the issue's TP-at-width question
        runs.append(Run("width_tp2", n, 8, n // 2, "", ["parallel.tensor_model_parallel_size=2",
                                                        "parallel.sequence_parallel=true",
                                                        f"parallel.expert_model_parallel_size={n // 2}"], "a2a", WIDTH))
        cp4 = ["parallel.context_parallel_size=4"]
        runs += [Run("cp4_128k", n, 1, n // 4, "gpu1_128k", LONG_128K + cp4, "allgather"),
                 Run("cp4_128k_docs_work", n, 1, n // 4, "gpu1_128k_docs", LONG_128K + DOCS + cp4 + BALANCED_CP,
                     "allgather")]
    for run in runs:
        mbs = 1 if "train.micro_batch_size=1" in run.overrides else \
            config_micro_batch(run.config) if run.config else micro_batch
        run.overrides = [f"train.global_batch_size={mbs * run.microbatches * run.dp}"] + run.overrides
    return {run.name: run for run in runs}


def config_micro_batch(config: str) -> int:
    """A run's own config's micro-batch size (the GLM-5-width configs set theirs)."""
    from pretrain.config import load_config

    return load_config(config).train.micro_batch_size


def select(runs: Dict[str, Run], only: Optional[str]) -> List[Run]:
    """The runs `--only` names (run names or groups), with the baselines they are compared with, in plan order."""
    if not only:
        return list(runs.values())
    wanted = set()
    for word in only.split(","):
        word = word.strip()
        if word in GROUPS:
            wanted.update(name for name in GROUPS[word] if name in runs)  # cp4 runs need 4 GPUs
        elif word in runs:
            wanted.add(word)
        else:
            raise SystemExit(f"--only: unknown run or group {word!r}; runs: {', '.join(runs)}; "
                             f"groups: {', '.join(GROUPS)}")
    wanted.update(runs[name].baseline for name in list(wanted) if runs[name].baseline)
    return [run for name, run in runs.items() if name in wanted]
