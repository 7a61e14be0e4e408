"""What one micro-batch of one decoder layer keeps for backward on one GPU, by named term (docs/layout.md).

Counted from what the code saves (`pretrain.training.saved_activations.SavedTensors` on the layers of
`pretrain.model`; tests/test_layout_memory.py checks the sum against a count on CPU). With t tokens of the
micro-batch on this rank (micro_batch x seq / CP), T key tokens (micro_batch x seq: context parallelism
gathers the keys), n = t / TP under sequence parallelism (t without), h heads per rank = heads / TP and
a bytes per activation element (2 in bf16), in elements unless marked bytes:

    residual_norms   (6 H + 2) n              input and pre-MLP norms: input, normalized, output, 1/rms
    q_latent         (3 q_lora + 1) n         q down-projection, its norm (input, normalized, output)
    kv_latent        (2 c + r + 1) n + c' T   kv down-projection and norm, the latent keys c' = c (+ r under CP)
    core_attention   h d_qk (t + T) + h (d_qk_nope + d_v) T + h d_v t + 4 h t bytes   q, k, v storage, out, lse
    rope_tables      16 r (seq / CP) bytes    cos / sin of the query and key rotations
    dense_mlp        5 F / TP t               fc1 out (2F), SwiGLU's two halves' products, fc2 input
    router           (13 E + 12 k + 8) n bytes   fp32 scores, probabilities, top-k and their indices
    routed_experts   k n ETP (H + 3 F_e / ETP) + 12 k n ETP bytes   tokens this rank's experts receive (balanced)
    shared_expert    5 F_s / TP t
    dsa_sparse       h (d_qk + r + c) t + 4 h t bytes + K i t bytes   q, rope query, latent output, lse, top-k
                     (i = 2 bytes up to 65,535 keys, else 4; the indexer is replicated over TP)
    dsa_indexer      P_I                      the indexer KL's weight gradients, formed in forward (dense
                                              warm-up; sparse attention forms them in backward)

Recompute: "selective" (recompute_modules [core_attn, moe]) keeps of the core only its inputs (the q
up-projection, the roped q and k: h (d_qk + r) t + r T) and output (h d_v t) and of the MoE layer (router, routed
and shared experts) nothing beyond its input; sparse DSA keeps its
top-k and drops the latent output. "full" keeps each layer's input (H n) and rebuilds one layer at a time in
backward (`working_set`).

Per pipeline rank (`activation_terms`, what `pretrain.layout.memory` adds to a rank's state): its layers' bytes
times the micro-batch chunks in flight at the schedule's peak (`in_flight_chunks`), two layers' worth under
activation offloading, a layer's backward working set or the output loss's logits, and the heads on the MTP and loss
ranks. A search sizes tens of thousands of layouts: a layer's bytes are remembered by the fields `layer_terms`
reads, a rank's offloaded bytes by those of `activation_fields` (`pretrain.layout.memo`).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Dict, Tuple

from pretrain.layout.memo import Memo
from pretrain.layout.pipeline_plan import pipeline_plan
from pretrain.layout.types import Layout, ModelDims, Workload


def _tokens(layout: Layout, work: Workload):
    t = layout.micro_batch_size * work.seq_length // layout.cp
    keys = layout.micro_batch_size * work.seq_length
    n = t // layout.tp if layout.sequence_parallel and layout.tp > 1 else t
    return t, keys, n


def attention_terms(dims: ModelDims, layout: Layout, work: Workload, dsa: bool, a: int) -> Dict[str, float]:
    """Saved bytes of the attention half of one layer, no recompute (`dsa`: this layer has an indexer)."""
    t, keys, n = _tokens(layout, work)
    h = dims.heads // layout.tp
    c, r = dims.kv_lora_rank, dims.qk_pos_emb_head_dim
    latent_keys = (c + r) if layout.cp > 1 else c
    out = {
        "residual_norms": (6 * dims.hidden + 2) * n * a,
        "q_latent": (3 * (dims.q_lora_rank or 0) + (1 if dims.q_lora_rank else 0)) * n * a,
        "kv_latent": ((2 * c + r + 1) * n + latent_keys * keys) * a,
        "rope_tables": 16 * r * (work.seq_length // layout.cp),
    }
    if dsa and dims.dsa_sparse_attention:
        index_bytes = 2 if keys <= 65535 else 4
        # q_nope, roped q, latent output, its up-projection (linear_proj's input), lse, top-k; the keys as one
        # [latent ; rope] storage (in place of kv_latent's latent keys)
        out["dsa_sparse"] = ((h * (dims.qk_head + c + dims.v_head_dim) * t + r * keys) * a + 4 * h * t
                             + dims.dsa_indexer_topk * index_bytes * t)
    else:
        out["core_attention"] = (h * dims.qk_head * (t + keys) + h * (dims.qk_head_dim + dims.v_head_dim) * keys
                                 + h * dims.v_head_dim * t) * a + 4 * h * t
    if dsa and dims.dsa_indexer_loss and not dims.dsa_sparse_attention:  # sparse: recomputed in backward
        # the KL's weight gradients, formed in forward (`indexer_loss.apply_kl`), wait for backward
        out["dsa_indexer"] = dims.indexer_params * a
    return out


def ffn_terms(dims: ModelDims, layout: Layout, work: Workload, moe: bool, a: int) -> Dict[str, float]:
    """Saved bytes of the FFN half of one layer, no recompute."""
    t, _, n = _tokens(layout, work)
    if not moe:
        return {"dense_mlp": 5 * dims.ffn_hidden // layout.tp * t * a}
    received = dims.topk * n * layout.etp  # balanced routing: k tokens' worth per local token
    out = {
        "router": (13 * dims.num_experts + 12 * dims.topk + 8) * n,
        "routed_experts": received * (dims.hidden + 3 * dims.expert_ffn_hidden // layout.etp) * a + 12 * received,
    }
    if dims.shared_expert_ffn_hidden:
        out["shared_expert"] = 5 * dims.shared_expert_ffn_hidden // layout.tp * t * a
    return out


def layer_terms(dims: ModelDims, layout: Layout, work: Workload, layer: int, a: int = 2,
                recompute: str = "none") -> Dict[str, float]:
    """Saved bytes of decoder layer `layer` (0-based; `dims.num_layers` is the MTP layer) for one micro-batch."""
    mtp = layer >= dims.num_layers
    moe = dims.mtp_layer_is_moe if mtp else bool(dims.moe_pattern[layer])
    dsa = bool(dims.indexer_params) if mtp else dims.dsa_layers[layer]
    if recompute == "full":
        _, _, n = _tokens(layout, work)
        return {"layer_input": dims.hidden * n * a}
    terms = {**attention_terms(dims, layout, work, dsa, a), **ffn_terms(dims, layout, work, moe, a)}
    if recompute == "selective":
        t, keys, _ = _tokens(layout, work)
        h, r = dims.heads // layout.tp, dims.qk_pos_emb_head_dim
        if "core_attention" in terms:  # the checkpoint's inputs (q up-projection, roped q and k) and output
            terms["core_attention"] = (h * (dims.qk_head + r + dims.v_head_dim) * t + r * keys) * a
            terms.pop("dsa_indexer", None)  # a dense DSA core is checkpointed whole, its indexer KL with it
        if "dsa_sparse" in terms:  # keeps q, the rope query and the top-k; reruns the sparse forward
            terms["dsa_sparse"] -= h * dims.kv_lora_rank * t * a + 4 * h * t
        for name in ("router", "routed_experts", "shared_expert"):  # the MoE checkpoint covers the shared expert
            terms.pop(name, None)
    return terms


def working_set(dims: ModelDims, layout: Layout, work: Workload, a: int = 2) -> Dict[str, float]:
    """Transient bytes while one layer runs its backward: under full recompute its rebuilt activations,
    plus the gradients of its largest tensors and the MoE dispatch's buffers (send and receive with EP,
    the routed rows' gradient without) (a model, not a count: the larger of a dense and an MoE layer)."""
    t, keys, n = _tokens(layout, work)
    h = dims.heads // layout.tp
    layers = [i for i in range(dims.num_layers)]
    rebuilt = 0.0
    if layout.recompute == "full":
        rebuilt = max(sum(layer_terms(dims, layout, work, i, a).values()) for i in {layers[0], layers[-1]})
    grads = 4 * dims.hidden * n * a + h * dims.qk_head * (t + 2 * keys) * a  # residual grads, dq dk dv
    dispatch = 0.0
    if dims.num_experts:
        # with EP: the all-to-all's send and receive buffers of the routed rows; with every expert local
        # (EP x ETP = 1) the dispatch gathers in place and its one transient is the rows' gradient (128K profile)
        buffers = 1 if layout.ep * layout.etp == 1 else 2
        dispatch = buffers * dims.topk * n * dims.hidden * a
    return {"recomputed_layer": rebuilt, "layer_gradients": grads, "moe_dispatch_buffers": dispatch}


# ------------------------------------------------------------------------------------------ per pipeline rank
_LAYERS = Memo()  # layer_terms by the fields it reads
_OFFLOADED = Memo()  # a layout's ranks' offloaded bytes by activation_fields


def in_flight_chunks(layout: Layout, rank: int) -> int:
    """Micro-batch model chunks whose activations rank `rank` holds at the peak of the schedule."""
    m = layout.num_microbatches
    if layout.vpp == 1:
        return min(layout.pp - rank, m)
    group = layout.microbatch_group or layout.pp  # megatron's microbatch_group_size_per_vp_stage: its warm-up
    return min(2 * (layout.pp - rank - 1) + (layout.vpp - 1) * group + 1, m * layout.vpp)


@lru_cache(maxsize=4096)
def _layer_kinds(dims: ModelDims, pp: int, vpp: int, pipeline_layout, rank: int) -> Tuple[Tuple[int, int], ...]:
    """(a layer of the kind, count) per layer kind (MoE, DSA) of the rank: a kind's layers keep equal bytes."""
    plan = pipeline_plan(dims, Layout(pp=pp, vpp=vpp, pipeline_layout=pipeline_layout))
    first = {}
    for i in plan.layers[rank]:
        first.setdefault((dims.moe_pattern[i], dims.dsa_layers[i]), i)
    return tuple((first[kind], n) for kind, n in plan.kinds[rank])


def saved_activations(dims: ModelDims, layout: Layout, work: Workload, rank: int, a: int = 2
                      ) -> Tuple[Dict[str, float], float]:
    """(the in-flight micro-batches' saved tensors on pipeline rank `rank` by term, what stays on the GPU of them
    under activation offloading: two layers' worth, the one running and the one prefetched)."""
    kinds = _layer_kinds(dims, layout.pp, layout.vpp, layout.pipeline_layout, rank)
    # every field layer_terms reads (through _tokens, ffn_terms): the shared terms are read only
    fields = (dims, work, a, layout.recompute, layout.tp, layout.cp, layout.sequence_parallel,
              layout.micro_batch_size, layout.etp)
    per_kind = [(_LAYERS.get((fields, first), lambda: layer_terms(dims, layout, work, first, a, layout.recompute)), n)
                for first, n in kinds]
    chunks = in_flight_chunks(layout, rank)
    # chunks in flight x the rank's mean layers per chunk (its layers / VPP), at its mean per-layer bytes
    scale = chunks / layout.vpp
    out: Dict[str, float] = {}
    for terms, n in per_kind:
        for k, v in terms.items():
            out[k] = out.get(k, 0.0) + v * n * scale
    resident = 2 * max((sum(t.values()) for t, _ in per_kind), default=0.0)  # a rank may hold no layer
    return out, min(sum(out.values()), resident)


def activation_fields(layout: Layout) -> Tuple:
    """Every field of `layout` the activation terms read (`saved_activations`, `working_set`, `head_terms`, the
    pipeline plan): not DP, the optimizer or ZeRO, and EP only as whether every expert is local (the dispatch
    buffers), so the layouts of a search that differ only there share their activations (`pretrain.layout.memo`)."""
    return (layout.pp, layout.vpp, layout.pipeline_layout, layout.microbatch_group, layout.num_microbatches,
            layout.tp, layout.cp, layout.sequence_parallel, layout.micro_batch_size, layout.etp,
            layout.ep * layout.etp == 1, layout.recompute, layout.activation_offload, layout.output_loss_backend,
            layout.output_chunk_size)


def offloaded_bytes(dims: ModelDims, layout: Layout, work: Workload, rank: int, a: int = 2) -> float:
    """Saved activations pipeline rank `rank` keeps in host memory at the peak of the schedule (0 without
    `activation_offload`)."""
    if not layout.activation_offload:
        return 0.0
    saved, resident = saved_activations(dims, layout, work, rank, a)
    return sum(saved.values()) - resident


def ranks_offloaded_bytes(dims: ModelDims, layout: Layout, work: Workload, ranks: Tuple[int, ...], a: int = 2
                          ) -> Tuple[float, ...]:
    """`offloaded_bytes` of each of `ranks`, remembered by the fields they read (`activation_fields`)."""
    return _OFFLOADED.get((dims, work, a, ranks, activation_fields(layout)),
                          lambda: tuple(offloaded_bytes(dims, layout, work, r, a) for r in ranks))


def activation_terms(dims: ModelDims, layout: Layout, work: Workload, rank: int, a: int = 2) -> Dict[str, float]:
    """Activation bytes on pipeline rank `rank`: the in-flight micro-batches' saved tensors, by term."""
    out, resident = saved_activations(dims, layout, work, rank, a)
    if layout.activation_offload:  # saved tensors wait in host memory; two layers' worth stay
        out = {"offload_resident": resident}
    # transients: a layer's backward working set, or (last rank) the output loss's logits, whichever is larger:
    # the loss runs before the first backward, so the two do not coexist
    transient = working_set(dims, layout, work, a)
    plan = pipeline_plan(dims, layout)
    loss_rank, mtp_rank = plan.loss_rank, plan.mtp_rank
    if rank in (loss_rank, mtp_rank):
        head = head_terms(dims, layout, work, a)
        logits = {"output_logits_transient": head.pop("output_logits_transient")}
        if rank != mtp_rank:  # MTP placed on the rank before (its stage ends before an L-only last stage)
            head.pop("mtp", None)
        if rank != loss_rank:  # the MTP rank: its depths (their heads' logits are the transient)
            head, logits = {"mtp": head["mtp"]}, {}  # the heads' logits and loss run on the last stage
        out.update(head)
        if sum(logits.values()) > sum(transient.values()):
            transient = logits
    out.update(transient)
    return out


def head_terms(dims: ModelDims, layout: Layout, work: Workload, a: int = 2) -> Dict[str, float]:
    """The last rank's final norm, MTP depths and output loss for one micro-batch (bytes)."""
    t = layout.micro_batch_size * work.seq_length // layout.cp
    n = t // layout.tp if layout.sequence_parallel and layout.tp > 1 else t
    h, heads = dims.hidden, 1 + dims.mtp_depths
    v = dims.vocab // layout.tp
    # the final norm, the output layer's input (every head's hidden states in one storage), and per head the
    # loss's target indices and mask (int64, bool) and, for the MTP depths, their shifted labels and mask (int64, fp32)
    out = {"final_norm": (2 * h + 1) * n * a + heads * h * n * a, "loss_inputs": (heads * 9 + dims.mtp_depths * 12) * t}
    if dims.mtp_depths:
        rc = layout.recompute
        mtp_layer = sum(layer_terms(dims, layout, work, dims.num_layers, a, rc).values())
        # per depth: its layer, plus enorm / hnorm / eh_proj input / final norm (full recompute: the checkpoint's
        # second input, the shifted embedding) and the shifted ids
        extra = (8 * h + 3) * n * a if rc != "full" else h * n * a
        out["mtp"] = dims.mtp_depths * (mtp_layer + extra + 8 * t)
    if layout.output_loss_backend == "unfused":
        out["output_logits_saved"] = heads * 4 * v * t  # the fp32 softmax each head's loss keeps for backward
        out["output_logits_transient"] = (a + 4) * v * t  # one head's logits and their fp32 cast
    else:
        chunk = min(layout.output_chunk_size, t)
        out["output_logits_transient"] = (a + 8) * v * chunk  # a chunk's logits, fp32 softmax and its gradient
        # chunked: the weight gradient summed over chunks in fp32 (output_grad_weight_fp32, the default);
        # liger: formed in forward in the weights' dtype
        out["output_weight_grad"] = (4.0 if layout.output_loss_backend == "chunked" else a) * v * h
    return out
