"""Peak memory per GPU of a layout: a named breakdown of what one pipeline rank holds (docs/layout.md).

State, per parameter element p on this rank (bf16 training, `model.bf16: true`):

    weights          2 p                 the bf16 model copy (megatron's Float16Module casts every parameter)
    main_weights     4 p / d             fp32 main copy; d = 1 under DDP, the data-parallel size under `zero2`
    gradients        4 p                 fp32 accumulation buffer (DDP; megatron's distributed optimizer for AdamW)
                     4 p / d + buckets   ZeRO-2 for Muon: owners keep their share, 2 reduce buckets in flight
    optimizer_state  8 p / d             AdamW: 2 fp32 moments; Muon: 4 p / d (momentum) on its matrices,
                                         AdamW on embeddings, output layer, norms and the router

Dense parameters are sharded over DP x CP, expert parameters over the expert-data-parallel group
(TP x CP x DP / (EP x ETP)); ZeRO-2 owns whole parameters, so the owner of a tensor larger than a rank's 1/d
share holds all of it (`zero2_ownership_slack`: the largest tensor beyond the share, at TP = 1 the embedding). Parameter shards: attention, dense and shared-expert
FFNs and the MTP projection / TP; latent norms, the DSA indexer and the router replicated over TP; routed
experts: E / EP experts of width F_e / ETP; embedding and output layer vocab-parallel (/ TP) on the first
and last stage; with MTP, its layers and a copy of the embedding on its stage (the last, or the one before an
output-only last stage); the final norm with the last decoder layer. Stages: even (L / (PP VPP) layers each)
or as `Layout.pipeline_layout` places them (`pipeline_plan.pipeline_plan`).

Activations (`pretrain.layout.activations`): one micro-batch's saved tensors per layer, times the micro-batches
in flight on the rank: 1F1B keeps min(PP - r, m) on pipeline rank r; megatron's interleaved schedule keeps
min(2 (PP - r - 1) + (VPP - 1) G + 1, m VPP) model chunks (G: `Layout.microbatch_group`, PP by default; the
rank's layers / VPP each), which on the first
rank of even stages is L (1 + (PP - 1) / (PP VPP)) layers' worth. Activation offloading leaves two layers' worth on the GPU (the one
running, the one prefetched). The MTP rank adds its depths, the last rank the final norm and the output loss (unfused:
fp32 softmax [t, V / TP] per head kept; chunked: the fp32 weight-gradient accumulator; liger: a bf16 weight
gradient). Transient on top: one layer's backward working set, or on the last rank the output loss's logits
(all of them unfused, a chunk's otherwise) if larger. Outside the allocator: a runtime reserve (CUDA context,
NCCL buffers, fragmentation), an assumption added only where a layout is checked against the GPU's memory.

Checkpoint saves (`checkpoint.save`, synchronous or asynchronous) peak between steps at `checkpoint_save_copies`
on top of the state: megatron-core saves grouped routed experts in a transposed per-expert layout
(`GroupedMLP.sharded_state_dict`'s factory ends in `.contiguous()`), so a save copies on the GPU every routed-expert
weight of the rank and, through the same factory, its main weight and optimizer state, as the rank holds them
(ZeRO-2 owners their share): (2 + 4 + 4) bytes per expert element with bf16 and Muon (8 for AdamW's moments). The
copies live until the tensors are staged to host memory, also in an asynchronous save (`pretrain.compat` frees
them once staged), while the step's activations are freed: the estimate is the larger of the step's peak and
the save's (glm5-proxy on one H200: 16.875 GiB of copies predicted and measured, under a 60.5 GiB step peak; data
parallelism > 1 not measured).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Dict, List, Optional, Tuple

# the per-rank activations, this module's API too (tests import them from here)
from pretrain.layout.activations import (activation_fields, activation_terms, head_terms, in_flight_chunks,
                                         offloaded_bytes, saved_activations)
from pretrain.layout.memo import Memo
from pretrain.layout.pipeline_plan import pipeline_plan
from pretrain.layout.types import GiB, Layout, ModelDims, Workload

ZERO2_BUCKET_ELEMENTS = 40_000_000  # pretrain.optim.zero2_grads.DEFAULT_BUCKET_ELEMENTS (megatron's DDP bucket)
ZERO2_BUCKETS_IN_FLIGHT = 2
# Outside PyTorch's allocator: CUDA context, NCCL communicators' channel buffers, cuBLAS workspaces.
# An assumption, to be measured (torch.cuda.mem_get_info against max_memory_reserved on a run).
RUNTIME_RESERVE_BYTES = 2 * GiB


@dataclass(frozen=True)
class ParamShard:
    """Elements of one kind of parameter on one rank: optimizer family ("muon" | "adamw") and the group its
    gradients reduce over ("dense": DP x CP, "expert": expert data parallel)."""

    elements: int
    optimizer: str
    group: str
    largest: int  # the largest single tensor among them (ZeRO-2 owns whole tensors)


@dataclass
class MemoryEstimate:
    """Bytes per GPU by named term on the pipeline rank with the highest total (`rank`). `total` is what
    PyTorch's allocator peaks at (`torch.cuda.max_memory_allocated`, what runs record); `reserve` what the
    GPU loses besides (`RUNTIME_RESERVE_BYTES`): a layout fits when total + reserve stays under the bound."""

    terms: Dict[str, float]
    rank: int
    layers: Tuple[int, ...] = field(default=())
    reserve: float = float(RUNTIME_RESERVE_BYTES)

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    @property
    def needed(self) -> float:
        """Bytes the GPU must have: the allocator's peak plus the runtime reserve."""
        return self.total + self.reserve

    def format(self) -> str:
        return format_terms(self.terms)


def format_terms(terms: Dict[str, float]) -> str:
    """Terms in GiB, largest first, those under 0.05 GiB left out."""
    rows = sorted(terms.items(), key=lambda kv: -kv[1])
    return "  ".join(f"{k} {v / GiB:.1f}" for k, v in rows if v >= 0.05 * GiB)


def replica_groups(layout: Layout) -> Dict[str, int]:
    """Ranks holding the same parameters, by gradient group: "dense" over DP x CP, "expert" over the
    expert-data-parallel ranks (TP x CP x DP / (EP x ETP)); ZeRO-2 shards over them, a fully parallel save
    splits the writing over them."""
    return {"dense": layout.dp * layout.cp, "expert": layout.tp * layout.cp * layout.dp // (layout.ep * layout.etp)}


def rank_layers(dims: ModelDims, layout: Layout, rank: int) -> List[int]:
    """Decoder layers of pipeline rank `rank`, its virtual stages' in order (`pipeline_plan.pipeline_stages`: even,
    chunk j holds layers ((j PP + rank) c, ..., + c), c = L / (PP VPP); or as `layout.pipeline_layout` places them)."""
    return list(pipeline_plan(dims, layout).layers[rank])


def rank_parameters(dims: ModelDims, layout: Layout, rank: int, trainable: str = "all") -> List[ParamShard]:
    """Parameter shards on pipeline rank `rank` (TP/EP/ETP split, see the module docstring), one per
    (optimizer, group); `trainable` "dsa_indexer" (the DSA warm-up) marks all but the indexers "frozen"."""
    plan = pipeline_plan(dims, layout)
    holds = (rank == plan.embedding_rank, rank == plan.mtp_rank, rank == plan.loss_rank, rank == plan.norm_rank)
    return list(_rank_parameters(dims, layout.tp, layout.ep, layout.etp, plan.kinds[rank], holds, trainable))


@lru_cache(maxsize=4096)
def _rank_parameters(dims: ModelDims, tp: int, ep: int, etp: int, kinds: Tuple[Tuple[Tuple[int, bool], int], ...],
                     holds: Tuple[bool, bool, bool, bool], trainable: str) -> Tuple[ParamShard, ...]:
    """The shards of a rank with `kinds` ((MoE, DSA), count) of decoder layers holding (embedding, MTP, loss,
    final norm) as `holds` says."""
    layout = Layout(tp=tp, ep=ep, etp=etp)
    h = dims.hidden
    latent_norms = (dims.q_lora_rank or 0) + dims.kv_lora_rank
    idx_norm = 2 * dims.dsa_indexer_head_dim if dims.indexer_params else 0
    out: List[ParamShard] = []

    def add(n: int, opt: str, group: str = "dense", largest: Optional[int] = None) -> None:
        if n:
            out.append(ParamShard(n, opt if trainable == "all" else "frozen", group, largest or n))

    def layer(moe: bool, dsa: bool) -> None:
        add((dims.attention_params - latent_norms) // tp, "muon", largest=dims.kv_lora_rank * dims.heads
            * (dims.qk_head_dim + dims.v_head_dim) // tp)
        add(latent_norms + dims.layer_norm_params, "adamw", largest=h)
        if dsa:
            idx = ParamShard(dims.indexer_params - idx_norm, "muon", "dense", (dims.q_lora_rank or h)
                             * dims.dsa_indexer_heads * dims.dsa_indexer_head_dim)
            out.append(idx)
            out.append(ParamShard(idx_norm, "adamw", "dense", idx_norm))
        if moe:
            add(dims.num_experts // layout.ep * dims.expert_params // layout.etp, "muon", "expert",
                largest=2 * h * dims.expert_ffn_hidden * dims.num_experts // layout.ep // layout.etp)
            add(dims.shared_expert_params // tp, "muon")
            add(dims.router_params, "adamw")
        else:
            add(dims.dense_mlp_params // tp, "muon", largest=2 * h * dims.ffn_hidden // tp)

    for (moe, dsa), n in kinds:  # a kind's layers hold the same shards: one layer's, n times the elements
        start = len(out)
        layer(bool(moe), dsa)
        out[start:] = [ParamShard(p.elements * n, p.optimizer, p.group, p.largest) for p in out[start:]]
    embedding, mtp, loss, norm = holds
    # MTP embeds the shifted tokens on its rank: a copy of the embedding lives there (gradients summed with
    # the first rank's, megatron's shared-embedding all-reduce), optimizer state included
    if embedding or mtp:
        add(dims.embedding_params // tp, "adamw")
    if loss:  # MTP's heads too run on the last stage (megatron builds output_layer there only)
        add(dims.output_params // tp, "adamw")
    if norm:  # the decoder's final norm follows its last layer
        add(dims.final_norm_params, "adamw")
    if mtp:
        for _ in range(dims.mtp_layers):
            layer(dims.mtp_layer_is_moe, bool(dims.indexer_params))
            add(2 * h * h // tp, "muon")  # eh_proj
            add(dims.mtp_extra_params - 2 * h * h, "adamw")
    merged: Dict[Tuple[str, str], Tuple[int, int]] = {}  # (elements, largest tensor) in order of first appearance
    for p in out:
        q = merged.get((p.optimizer, p.group))
        merged[(p.optimizer, p.group)] = (p.elements, p.largest) if q is None else (
            q[0] + p.elements, max(q[1], p.largest))
    return tuple(ParamShard(n, opt, group, largest) for (opt, group), (n, largest) in merged.items())


def optimizer_state_bytes(shard: ParamShard, layout: Layout) -> int:
    """Optimizer state bytes per element of `shard`: AdamW's two fp32 moments, Muon's one momentum, none frozen."""
    if shard.optimizer == "frozen":
        return 0
    return 8 if (layout.optimizer == "adam" or shard.optimizer == "adamw") else 4


def state_terms(shards: List[ParamShard], layout: Layout, bf16: bool = True) -> Dict[str, float]:
    """Weights, main weights, gradients and optimizer state in bytes (see the module docstring).
    `layout.zero2_grad_reduce` "step" keeps a full-size gradient buffer under ZeRO-2."""
    groups = replica_groups(layout)
    zero = layout.zero == "zero2"
    muon_zero2 = zero and layout.optimizer == "muon"
    sharded_grads = muon_zero2 and layout.zero2_grad_reduce != "step"
    terms = {"weights": 0.0, "main_weights": 0.0, "gradients": 0.0, "optimizer_state": 0.0}
    owned = {g: 0.0 for g in groups}
    largest = {g: 0 for g in groups}
    for s in shards:
        terms["weights"] += (2 if bf16 else 4) * s.elements
        if s.optimizer == "frozen":
            continue
        d = groups[s.group] if zero else 1
        owned[s.group] += s.elements / d
        largest[s.group] = max(largest[s.group], s.largest)
        if bf16:
            terms["main_weights"] += 4 * s.elements / d
        terms["gradients"] += 4 * s.elements / (d if sharded_grads else 1)
        terms["optimizer_state"] += optimizer_state_bytes(s, layout) * s.elements / d
    if muon_zero2:
        # whole-tensor ownership: a rank owning a tensor larger than its 1/d share holds all of it (main weight,
        # gradient, state: the AdamW worst case)
        slack = sum(max(0.0, largest[g] - owned[g]) for g in groups if groups[g] > 1)
        terms["zero2_ownership_slack"] = slack * ((4 if bf16 else 0) + (4 if sharded_grads else 0) + 8)
        if sharded_grads:  # reduce buckets in flight besides the owned share
            terms["gradient_buckets"] = 4.0 * ZERO2_BUCKET_ELEMENTS * ZERO2_BUCKETS_IN_FLIGHT
    return terms


def save_copies_terms(shards: List[ParamShard], layout: Layout, bf16: bool = True) -> Dict[str, float]:
    """The copies a checkpoint save makes on the GPU while it stages (module docstring): the rank's routed experts'
    weights, main weights and optimizer state, sharded as the rank holds them."""
    experts = state_terms([s for s in shards if s.group == "expert"], layout, bf16)
    return {"checkpoint_save_copies": experts["weights"] + experts["main_weights"] + experts["optimizer_state"]}


_ACTIVATIONS = Memo()  # a layout's compared ranks' activation terms, by activation_fields
_STATES = Memo()  # a split's compared ranks with their state (rank_states)
_RANK_STATES = Memo()  # one rank's state and a save's copies, by its shards and the fields they read


def rank_activations(dims: ModelDims, layout: Layout, work: Workload, a: int = 2) -> Tuple[Dict[str, float], ...]:
    """`activation_terms` of each rank `compared_ranks` lists, in its order, remembered by the fields they read
    (`activation_fields`; shared: not to be changed)."""
    return _ACTIVATIONS.get((dims, work, a, activation_fields(layout)), lambda: tuple(
        activation_terms(dims, layout, work, r, a) for r in compared_ranks(dims, layout)))


def estimate(dims: ModelDims, layout: Layout, work: Workload, a: int = 2, trainable: str = "all",
             saves: bool = False) -> MemoryEstimate:
    """Peak bytes per GPU over the pipeline ranks (with even stages the first and the last hold the most), by term.
    `a`: bytes per activation (2: bf16 training; 4: fp32 on CPU, no main-weight copy); `trainable`
    (`train.trainable_params`) as in the config (ZeRO-2's reduce mode is the layout's); `saves`:
    the run saves checkpoints (`checkpoint.save`), whose copies may peak above the step (`save_copies_terms`)."""
    best: Optional[Tuple[float, Dict[str, float], int, Tuple[int, ...]]] = None  # (total, terms, rank, layers)
    states = rank_states(dims, layout, trainable, a == 2)
    for (rank, layers, state, copies), act in zip(states, rank_activations(dims, layout, work, a)):
        terms = {**state, **act}
        total = sum(terms.values())
        if saves:  # between steps: the state and the save's copies, no activations
            at_save = {**state, **copies}
            if sum(at_save.values()) > total:
                terms, total = at_save, sum(at_save.values())
        if best is None or total > best[0]:
            best = (total, terms, rank, layers)
    return MemoryEstimate(best[1], best[2], best[3])


def rank_states(dims: ModelDims, layout: Layout, trainable: str = "all", bf16: bool = True
                ) -> Tuple[Tuple[int, Tuple[int, ...], Dict[str, float], Dict[str, float]], ...]:
    """(rank, its decoder layers, its `state_terms`, a save's copies (`save_copies_terms`)) of each pipeline rank
    `estimate` compares, remembered by the fields they read (the same for every recompute setting, micro-batch and
    activation layout of a split; shared: not to be changed)."""
    # CP and DP enter only as the replica groups: the CP x DP splits of a TP x PP share their state
    groups = replica_groups(layout)
    key = (dims, trainable, bf16, layout.pp, layout.vpp, layout.pipeline_layout, layout.tp, layout.ep, layout.etp,
           groups["dense"], groups["expert"], layout.zero, layout.optimizer, layout.zero2_grad_reduce)
    return _STATES.get(key, lambda: _rank_states(dims, layout, trainable, bf16))


def state_floor(dims: ModelDims, layout: Layout, trainable: str = "all", bf16: bool = True) -> float:
    """A lower bound of `estimate(...).total` under every recompute, offload and micro-batch setting of the split:
    its ranks' largest state (a rank's activations, or a save's copies, only add bytes to its state)."""
    return max(sum(state.values()) for _, _, state, _ in rank_states(dims, layout, trainable, bf16))


def compared_ranks(dims: ModelDims, layout: Layout) -> Tuple[int, ...]:
    """The pipeline ranks `estimate` compares. Even stages: the first rank holds the most in flight, the last the
    heads; uneven: any rank may peak (a rank of decoder layers only whose layers match an earlier such rank's, kind
    by kind, is its twin with fewer in flight: skipped; twins only, since ZeRO-2's ownership slack makes bytes not
    monotone in the layers held)."""
    plan = pipeline_plan(dims, layout)
    ranks, seen = [], set()
    for r in range(layout.pp) if layout.pipeline_layout else sorted({0, layout.pp - 1}):
        if plan.special(r):
            ranks.append(r)
        elif plan.kinds[r] not in seen:
            ranks.append(r)
            seen.add(plan.kinds[r])
    return tuple(ranks)


def _rank_states(dims: ModelDims, layout: Layout, trainable: str, bf16: bool):
    groups = replica_groups(layout)
    fields = (groups["dense"], groups["expert"], layout.zero, layout.optimizer, layout.zero2_grad_reduce, bf16)
    out = []
    for rank in compared_ranks(dims, layout):
        shards = rank_parameters(dims, layout, rank, trainable)
        # a rank's state reads only its shards and `fields`: the ranks of other splits with its shards share it
        state, copies = _RANK_STATES.get((tuple(shards), fields), lambda: (
            state_terms(shards, layout, bf16), save_copies_terms(shards, layout, bf16)))
        out.append((rank, tuple(rank_layers(dims, layout, rank)), state, copies))
    return tuple(out)
