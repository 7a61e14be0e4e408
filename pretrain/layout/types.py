"""The planner's vocabulary: what the model is (`ModelDims`), what the machines are (`Cluster`), how the
work is split (`Layout`), what one step processes (`Workload`) and what it costs in time (`StepTime`); where a
layout puts the model over the pipeline ranks is `pretrain.layout.pipeline_plan`.

All are frozen dataclasses, so a layout can key a dict and a search can share dims between candidates.
The memory model (`pretrain.layout.memory`) and the search (`pretrain.layout.search`) consume them;
the time model provides one function and one loader, with these signatures (docs/layout.md):

    pretrain.layout.timing.step_time(dims: ModelDims, layout: Layout, work: Workload,
                                     cluster: Cluster, calib) -> StepTime
        Seconds of one optimizer step of `work.global_batch_size` sequences of `work.seq_length`
        tokens under `layout` on `cluster`, broken down by component (`StepTime`'s fields), with
        tokens/s per GPU and MFU. `calib` is whatever `load_calibration` returned for
        `cluster.gpu_kind`. Pure arithmetic on CPU (the search calls it for thousands of layouts).

    pretrain.layout.timing.load_calibration(gpu_kind: str) -> calib
        The calibration table measured on that GPU kind ("h100" or "h200", `Cluster.gpu_kind`);
        raises a one-line error naming the GPU kind when none is committed.

Sizes count elements; memory counts bytes; bandwidths are bytes/s in one direction per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Dict, List, Literal, Optional, Tuple

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class ModelDims:
    """A GLM-5 model's shapes and per-piece parameter counts (whole model, no parallelism).

    Per-piece counts are elements of one layer's piece (one expert for `expert_params`); the
    memory model scales them by how the layout splits each piece. They equal the tensors the builder
    creates (tests/test_layout_memory.py counts the meta-device model).
    """

    num_layers: int
    moe_pattern: Tuple[int, ...]  # per decoder layer: 1 MoE FFN, 0 dense FFN
    hidden: int
    heads: int
    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_head_dim: int  # no-rope part
    qk_pos_emb_head_dim: int  # rope part
    v_head_dim: int
    ffn_hidden: int  # dense SwiGLU intermediate
    num_experts: int  # 0: dense model
    topk: int
    expert_ffn_hidden: int
    shared_expert_ffn_hidden: int  # 0: no shared expert
    vocab: int
    tied_embeddings: bool
    mtp_depths: int  # prediction depths run per step (0: no MTP)
    mtp_layers: int  # distinct MTP layers holding parameters (1 when the depths share one)
    mtp_layer_is_moe: bool
    dsa_layers: Tuple[bool, ...]  # per decoder layer: has its own DSA indexer
    dsa_indexer_heads: int
    dsa_indexer_head_dim: int
    dsa_indexer_topk: int
    dsa_sparse_attention: bool  # attention reads only the indexer's top-k keys
    dsa_indexer_loss: bool  # the indexer is trained (KL to the main attention) this stage
    dsa_sparse_loss: bool  # the KL runs over the top-k keys only
    # --- parameter counts, elements ---
    attention_params: int  # MLA projections + latent norms, one layer
    indexer_params: int  # one DSA indexer (0: none)
    layer_norm_params: int  # input + pre-MLP norms, one layer
    dense_mlp_params: int  # one dense SwiGLU FFN
    expert_params: int  # ONE routed expert (fc1 gate+up and fc2)
    shared_expert_params: int  # the shared expert of one MoE layer
    router_params: int  # router weight + correction bias of one MoE layer
    embedding_params: int
    output_params: int  # 0 when tied
    final_norm_params: int
    mtp_extra_params: int  # per MTP layer: enorm, hnorm, eh_proj, final norm (its decoder layer apart)

    @property
    def moe_layers(self) -> int:
        return sum(self.moe_pattern)

    @property
    def dense_layers(self) -> int:
        return self.num_layers - self.moe_layers

    @property
    def qk_head(self) -> int:
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    def layer_params(self, layer: int) -> int:
        """Parameters of decoder layer `layer` (0-based), all experts included."""
        ffn = self.moe_ffn_params if self.moe_pattern[layer] else self.dense_mlp_params
        idx = self.indexer_params if self.dsa_layers[layer] else 0
        return self.attention_params + idx + self.layer_norm_params + ffn

    @property
    def moe_ffn_params(self) -> int:
        return self.num_experts * self.expert_params + self.shared_expert_params + self.router_params

    @property
    def mtp_layer_params(self) -> int:
        """One MTP layer: its decoder layer (with its own indexer when DSA) plus the MTP extras."""
        ffn = self.moe_ffn_params if self.mtp_layer_is_moe else self.dense_mlp_params
        # the MTP layer always has its own indexer under DSA (indexer_params is 0 without DSA)
        return self.attention_params + self.indexer_params + self.layer_norm_params + ffn + self.mtp_extra_params

    @cached_property  # frozen: computed once per dims (the time model asks for it per layout)
    def total_params(self) -> int:
        """Every parameter (and router bias) of the model, MTP included."""
        trunk = sum(self.layer_params(i) for i in range(self.num_layers))
        return (trunk + self.embedding_params + self.output_params + self.final_norm_params
                + self.mtp_layers * self.mtp_layer_params)

    @classmethod
    def from_config(cls, cfg) -> "ModelDims":
        """Dims of `cfg.model` (a GLM5Config); the training section decides the stage's DSA mode."""
        from pretrain.config.moe_pattern import moe_layer_pattern

        m = cfg.model
        h, heads = m.hidden_size, m.num_attention_heads
        qk = m.qk_head_dim + m.qk_pos_emb_head_dim
        if not m.multi_latent_attention:
            raise ValueError("model.multi_latent_attention=false: the layout planner models MLA (GLM-5) only")
        if m.q_lora_rank:
            q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * heads * qk  # down, norm, up
        else:
            q = h * heads * qk
        kv = h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + m.kv_lora_rank + m.kv_lora_rank * heads * (
            m.qk_head_dim + m.v_head_dim)
        attention = q + kv + heads * m.v_head_dim * h
        pattern = tuple(moe_layer_pattern(m))
        dsa = m.experimental_attention_variant == "dsa"
        types = m.dsa_indexer_types or ["full"] * m.num_layers
        dsa_layers = tuple(dsa and t == "full" for t in types)
        ih, idim = m.dsa_indexer_n_heads, m.dsa_indexer_head_dim
        q_in = m.q_lora_rank or h
        indexer = (q_in * ih * idim + h * idim + 2 * idim + h * ih) if dsa else 0  # wq_b, wk, k_norm(w, b), weights
        # no MoE layer anywhere (e.g. a cut of GLM-5's dense first layers; MTP's layer follows the last one): a
        # dense model, with no experts to place, no expert parallelism to search and no dispatch buffers
        experts = (m.num_moe_experts or 0) if any(pattern) else 0
        e_ffn = m.moe_ffn_hidden_size or 0
        shared = (m.moe_shared_expert_intermediate_size or 0) if experts else 0
        depths = m.mtp_num_layers or 0
        return cls(
            num_layers=m.num_layers, moe_pattern=pattern, hidden=h, heads=heads,
            q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_head_dim=m.qk_head_dim,
            qk_pos_emb_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim, ffn_hidden=m.ffn_hidden_size,
            num_experts=experts, topk=m.moe_router_topk if experts else 0, expert_ffn_hidden=e_ffn,
            shared_expert_ffn_hidden=shared, vocab=m.vocab_size, tied_embeddings=m.share_embeddings_and_output_weights,
            mtp_depths=depths, mtp_layers=(1 if m.mtp_use_repeated_layer else depths) if depths else 0,
            mtp_layer_is_moe=bool(pattern[-1]), dsa_layers=dsa_layers,
            dsa_indexer_heads=ih if dsa else 0, dsa_indexer_head_dim=idim if dsa else 0,
            dsa_indexer_topk=m.dsa_indexer_topk if dsa else 0,
            dsa_sparse_attention=dsa and m.dsa_sparse_attention,
            dsa_indexer_loss=dsa and m.dsa_indexer_loss_coeff > 0, dsa_sparse_loss=dsa and m.dsa_indexer_use_sparse_loss,
            attention_params=attention, indexer_params=indexer, layer_norm_params=2 * h,
            dense_mlp_params=3 * h * m.ffn_hidden_size, expert_params=3 * h * e_ffn,
            shared_expert_params=3 * h * shared, router_params=(experts * h + experts) if experts else 0,
            embedding_params=m.vocab_size * h, output_params=0 if m.share_embeddings_and_output_weights else m.vocab_size * h,
            final_norm_params=h, mtp_extra_params=(2 * h + 2 * h * h + h) if depths else 0,
        )


@dataclass(frozen=True)
class Cluster:
    """The machines: `gpus` GPUs of one kind, `gpus_per_node` per node joined by NVLink, nodes by InfiniBand."""

    name: str
    gpus: int
    gpus_per_node: int
    gpu_kind: str  # key of the calibration table: "h100" | "h200"
    memory_bytes: int  # per GPU, as the driver reports it (the planner keeps headroom below it)
    peak_bf16_flops: float  # dense (no sparsity) bf16 tensor-core FLOP/s per GPU
    intra_node_bw: float  # bytes/s per GPU per direction inside a node (NVLink)
    inter_node_bw: float  # bytes/s per GPU per direction between nodes (one NIC per GPU)
    host_memory_bytes: int = 2048 * GiB  # per node: what its GPUs' processes may pin (checkpoint staging, offload)

    def with_gpus(self, gpus: int) -> "Cluster":
        return Cluster(**{**{f.name: getattr(self, f.name) for f in fields(self)}, "gpus": gpus})


# Assumptions behind the presets (nominal datasheet figures; the calibration benchmark measures what
# collectives actually reach, and the time model uses its numbers where it has them):
# - H100 SXM 80 GB: nvidia-smi reports 81,559 MiB; 989 TFLOP/s dense bf16 (NVIDIA datasheet).
# - H200 SXM 141 GB: nvidia-smi reports 143,771 MiB; 989 TFLOP/s dense bf16 (same tensor cores as the H100).
# - NVLink 4 through NVSwitch: 900 GB/s bidirectional per GPU = 450 GB/s per direction; NCCL's bus
#   bandwidth on 8 GPUs reaches ~80% of it, so treat 450e9 as an upper bound.
# - InfiniBand: one NIC per GPU; NDR 400 Gb/s = 50 GB/s per GPU per direction, XDR 800 Gb/s = 100 GB/s.
# - Host memory: 2 TiB per 8-GPU node (DGX H100 and DGX H200: 2 TB of DDR5).
_H100_MEM = 81_559 * MiB
_H200_MEM = 143_771 * MiB
_PEAK = 989e12
_NVLINK = 450e9

CLUSTERS: Dict[str, Cluster] = {
    "h100-nvl-ib400": Cluster("h100-nvl-ib400", 8, 8, "h100", _H100_MEM, _PEAK, _NVLINK, 50e9),
    "h200-nvl-ib400": Cluster("h200-nvl-ib400", 8, 8, "h200", _H200_MEM, _PEAK, _NVLINK, 50e9),
    "h100-nvl-ib800": Cluster("h100-nvl-ib800", 8, 8, "h100", _H100_MEM, _PEAK, _NVLINK, 100e9),
    "h200-nvl-ib800": Cluster("h200-nvl-ib800", 8, 8, "h200", _H200_MEM, _PEAK, _NVLINK, 100e9),
}


def cluster_preset(name: str, gpus: int) -> Cluster:
    """The preset `name` sized to `gpus` GPUs; one-line error naming the presets otherwise."""
    if name not in CLUSTERS:
        raise ValueError(f"--cluster {name!r} is not a preset; choose one of {', '.join(sorted(CLUSTERS))}")
    return CLUSTERS[name].with_gpus(gpus)


Recompute = Literal["none", "selective", "full"]


REDUCE_SUFFIX = {"microbatch": "", "step": "-step", "microbatch_scatter": "-scatter"}  # Layout.short's zero2 label


@dataclass(frozen=True)
class Layout:
    """One way to split training over `tp * pp * cp * dp` GPUs.

    `ep` experts groups and `etp` expert-TP are carved out of the same GPUs (megatron-core's expert
    grid: ep * etp divides tp * cp * dp). `vpp` is 1 without interleaving. `zero` is what
    `optimizer.use_distributed_optimizer` turns on: ZeRO-2 for Muon (gradients, state and main weights
    1/dp, `pretrain.optim.zero2_grads`), megatron's distributed optimizer for AdamW (state and main
    weights 1/dp, the gradient buffer full-size). `recompute`: "selective" recomputes the core
    attention and the MoE layer (`recompute_modules: [core_attn, moe]`, GLM-5's fine-grained recompute), "full"
    reruns every layer (uniform, one layer per unit).
    """

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    dp: int = 1
    micro_batch_size: int = 1
    num_microbatches: int = 1  # per pipeline per step: global_batch / (micro_batch_size * dp)
    sequence_parallel: bool = False
    recompute: Recompute = "none"
    activation_offload: bool = False
    optimizer: Literal["muon", "adam"] = "muon"
    zero: Literal["ddp", "zero2"] = "zero2"
    # optimizer.zero2_grad_reduce under Muon's ZeRO-2: "microbatch" reduces to the owners every micro-batch (1/dp of
    # the gradients kept), "step" once per step (a full-size gradient buffer); "microbatch_scatter" is timed and
    # sized as "microbatch"
    zero2_grad_reduce: Literal["microbatch", "step", "microbatch_scatter"] = "microbatch"
    output_loss_backend: Literal["unfused", "chunked", "liger"] = "chunked"
    output_chunk_size: int = 4096  # tokens per chunk with "chunked"
    # megatron's `parallel.pipeline_model_parallel_layout` (e.g. "Et*20|t*20|t*19|t*19m*3L") when the stages are
    # uneven; None: num_layers / (pp * vpp) decoder layers per virtual stage (`pipeline_plan.pipeline_stages`)
    pipeline_layout: Optional[str] = None
    # megatron's `parallel.microbatch_group_size_per_vp_stage` (interleaved schedule: micro-batches through a virtual
    # stage before the next; more in flight on each rank); None: PP, megatron's default
    microbatch_group: Optional[int] = None

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def bubble(self) -> float:
        """Pipeline bubble as a fraction of the ideal step: (pp - 1) / (vpp * m) (megatron interleaved 1F1B)."""
        return (self.pp - 1) / (self.vpp * self.num_microbatches)

    def overrides(self) -> List[str]:
        """The dotted config overrides (`section.key=value`) that select this layout."""
        recompute = {"none": ["model.recompute_granularity=null", "model.recompute_method=null",
                              "model.recompute_num_layers=null", "model.recompute_modules=null"],
                     "selective": ["model.recompute_granularity=selective", "model.recompute_method=null",
                                   "model.recompute_num_layers=null", "model.recompute_modules=[core_attn,moe]"],
                     "full": ["model.recompute_granularity=full", "model.recompute_method=uniform",
                              "model.recompute_num_layers=1", "model.recompute_modules=null"]}[self.recompute]
        out = [
            f"parallel.tensor_model_parallel_size={self.tp}",
            f"parallel.pipeline_model_parallel_size={self.pp}",
            f"parallel.virtual_pipeline_model_parallel_size={self.vpp if self.vpp > 1 else 'null'}",
            # quoted: the layout's | and * must survive a shell; YAML drops the quotes
            f"parallel.pipeline_model_parallel_layout={repr(self.pipeline_layout) if self.pipeline_layout else 'null'}",
            "parallel.num_layers_in_first_pipeline_stage=null", "parallel.num_layers_in_last_pipeline_stage=null",
            "parallel.account_for_embedding_in_pipeline_split=false",
            "parallel.account_for_loss_in_pipeline_split=false",
            f"parallel.context_parallel_size={self.cp}",
            f"parallel.expert_model_parallel_size={self.ep}",
            f"parallel.expert_tensor_parallel_size={self.etp}",
            f"parallel.sequence_parallel={str(self.sequence_parallel).lower()}",
            f"train.micro_batch_size={self.micro_batch_size}",
            *recompute,
            f"model.activation_offload={str(self.activation_offload).lower()}",
            f"optimizer.optimizer={self.optimizer}",
            f"optimizer.use_distributed_optimizer={str(self.zero == 'zero2').lower()}",
            f"optimizer.zero2_grad_reduce={self.zero2_grad_reduce}",
            f"model.output_loss_backend={self.output_loss_backend}",
        ]
        if self.output_loss_backend == "chunked":
            out.append(f"model.output_chunk_size={self.output_chunk_size}")
        if self.microbatch_group is not None:
            out.append(f"parallel.microbatch_group_size_per_vp_stage={self.microbatch_group}")
        return out

    def short(self) -> str:
        """One-line name, e.g. `tp8 pp6 vpp2 ep32 etp1 cp1 dp32 mbs1 m64 sel zero2`."""
        rc = {"none": "norc", "selective": "sel", "full": "full"}[self.recompute]
        return (f"tp{self.tp} pp{self.pp} vpp{self.vpp} ep{self.ep} etp{self.etp} cp{self.cp} dp{self.dp} "
                f"mbs{self.micro_batch_size} m{self.num_microbatches} {rc}{' off' if self.activation_offload else ''}"
                f" {self.optimizer}/{self.zero}{REDUCE_SUFFIX[self.zero2_grad_reduce]} {self.output_loss_backend}"
                + (f" group {self.microbatch_group}" if self.microbatch_group else "")
                + (f" layout {self.pipeline_layout}" if self.pipeline_layout else ""))


@dataclass(frozen=True)
class Workload:
    """What one optimizer step processes: `global_batch_size` sequences of `seq_length` tokens;
    `documents`: packed documents reach attention as cu_seqlens (per-document causal attention)."""

    seq_length: int
    global_batch_size: int
    documents: bool = False

    @property
    def tokens_per_step(self) -> int:
        return self.seq_length * self.global_batch_size


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step by component (filled by `pretrain.layout.timing.step_time`).

    `total` is the step's wall time: the components that do not overlap summed (communication
    fields hold only their EXPOSED part). `tokens_per_s_per_gpu` = tokens per step / total / GPUs;
    `mfu` = model FLOPs per step / total / GPUs / the GPU's dense bf16 peak.
    """

    compute_fwd: float
    compute_bwd: float
    recompute: float
    tp_comm: float
    cp_comm: float
    ep_a2a: float
    pp_bubble: float
    dp_comm_exposed: float
    optimizer: float
    total: float
    tokens_per_s_per_gpu: float
    mfu: float
    host: float = 0.0  # the host's kernel launches and gaps not hidden behind GPU work (additive, like the above)
    # the pipeline's idle time over the busiest rank's work, a fraction: the schedule simulated in megatron's order
    # (timing.step_time's default) or the textbook (PP - 1) / (VPP m); 0 without a pipeline. Not additive.
    bubble_fraction: float = 0.0
    notes: Tuple[str, ...] = field(default=())  # assumptions taken for this layout (e.g. a missing calibration point)

    def components(self) -> Dict[str, float]:
        """{name: seconds} of the additive components (everything but total and the rates)."""
        skip = {"total", "tokens_per_s_per_gpu", "mfu", "notes", "bubble_fraction"}
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
