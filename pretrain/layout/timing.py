"""Time of one training step of a layout, from FLOPs and a calibration measured on the GPU kind (issue 45).

Per micro-batch, on the slowest pipeline stage's rank (T = micro_batch_size x seq tokens per pipeline):

    G   = sum over op classes c of  F_c x T_c / rate_c          compute, F_c from pretrain.training.flops
          + per-token overheads (norms/RoPE/residuals, router, permutes, embedding: seconds per element, measured
            in a profiled step) + gradient accumulation (per parameter) + recompute (the recomputed classes'
            forward share) + offload + exposed TP/CP/EP communication
    t_mb = max(G, H) + Y                                         H: the host's kernel launches for the rank's layers,
                                                                 Y: host gaps per micro-batch (both per layer, from
                                                                 micro-batch 1 against 4 on one GPU)
    step = pipeline + p2p + exposed DP gradient reduce + optimizer step
    p2p  = m x 2 vpp x (activation bytes / bw + latency + `p2p.overhead_s_per_transfer`, fitted to a measured
           pipeline: the transfers not hidden, host stalls and the tied-embedding reduce the schedule does not see)
    pipeline = megatron's (interleaved) 1F1B schedule of m micro-batches simulated with each virtual stage's time
               (`pretrain.layout.schedule_term`; with equal stages m x t_mb + (pp - 1) / vpp x t_mb), or, with
               schedule="textbook", m x t_mb(slowest stage) + (pp - 1) / vpp x mean stage t_mb

T_c is the tokens a rank computes for class c: T / (tp x cp) for GEMMs split by TP (experts too, since EP x ETP
is carved out of the same ranks), T / cp for the DSA indexer (replicated under TP). rate_c is the achieved model
FLOP/s of that class on the GPU kind: attention from a table over (seq, heads per rank), the others constants
from a profiled glm5-proxy step; a GEMM whose rows per call fall below `gemm.small_m_knee_rows` runs
proportionally slower (an assumption). Communication (ring formulas; `bw` per GPU per direction):

    all-gather / reduce-scatter of B bytes over n ranks: B (n - 1) / n / bw + latency; all-reduce twice that
    TP + SP: 4 collectives of T/cp x hidden bf16 per layer forward and 4 backward (backward partly hidden)
    CP: all-gather of the 576-wide latent (+ indexer keys) per layer, reduce-scatter of its gradient
    EP: 4 all-to-alls per MoE layer (dispatch, combine, forward and backward) of the rows sent off-rank:
        alltoall T_r x topk x (ep - 1) / ep; alltoall_dedup T_r x (ep - 1) x (1 - C(E - E/ep, k) / C(E, k))
    ETP: the dispatcher's all-gather of the received rows over the expert-TP group and the reduce-scatter of the
        experts' output (forward and backward): 4 ring collectives of etp x T_r x topk rows per MoE layer
    DP: DDP all-reduce (ZeRO-2: reduce-scatter per micro-batch + bf16 all-gather of parameters) of the rank's
        gradients; exposed beyond `dp.overlap_fraction_of_backward` of the overlapping backward. ZeRO-2's
        per-micro-batch reduce shows at least `dp.zero2_microbatch_reduce_shown` x its ring time in every
        micro-batch (fitted: on 2 x H200 it cost more than its ring time although the backward was long enough
        to hide it; NCCL's kernels share the SMs and memory bandwidth with the backward).

A group's bandwidth is NVLink's when its ranks share a node and InfiniBand's otherwise, with megatron's rank
order tp-cp-ep-dp-pp (a group of size n and stride s stays inside a node when n x s <= gpus_per_node;
`pretrain.layout.collectives`).
MFU = pretrain.training.flops' FLOPs of the step / time / GPUs / flops.peak_flops(device): the trainer's MFU.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from pretrain.layout.calibration import Calibration, load_calibration
from pretrain.layout.collectives import group_bw, offrank_rows, ring
from pretrain.layout.memo import Memo
from pretrain.layout.schedule_term import simulated_pipeline
from pretrain.layout.pipeline_plan import pipeline_plan
from pretrain.layout.types import Cluster, Layout, ModelDims, StepTime, Workload
from pretrain.layout.flop_terms import flops_per_token, newton_schulz_flops, per_layer_flops
from pretrain.training.flops import peak_flops

__all__ = ["step_time", "load_calibration", "flops_per_token", "newton_schulz_flops", "offrank_rows"]

BF16, FP32 = 2, 4
LATENT_WIDTH = 576  # MLA's gathered key/value latent: kv_lora 512 + rope 64 (GLM-5, glm5-proxy)
DEFAULT_VARIANT = {"ep_dispatcher": "alltoall", "cp_attention": "merged", "selective_modules": ("core_attn", "moe"),
                   "dsa_kernels": "current"}


def _indexer_s_per_token(calib: Calibration, seq: int, notes: List[str]) -> float:
    """DSA index scores + top-k + sparse KL, seconds per query token at `seq` (GLM-5's 32 indexer heads): linear in
    seq (each query scores its seq / 2 causal keys), least squares over the measured points, extrapolated."""
    pts = [(p["seq"], p["s_per_token"]) for p in calib["dsa.indexer_topk_kl"]]
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    slope = sum((x - mx) * (y - my) for x, y in pts) / max(sum((x - mx) ** 2 for x, _ in pts), 1e-30)
    if not min(x for x, _ in pts) <= seq <= max(x for x, _ in pts):
        notes.append(f"dsa.indexer_topk_kl extrapolated linearly in seq to {seq}")
    return max(my + slope * (seq - mx), 0.0)


# ------------------------------------------------------------------------------------------------ one stage
def _stage_time(dims, layout: Layout, work: Workload, cluster: Cluster, calib: Calibration, variant: Mapping,
                layers: float, moe_layers: float, mtp: int, first: bool, last: bool,
                notes: List[str]) -> Dict[str, float]:
    """Seconds per micro-batch (forward + backward) of one pipeline stage's rank, by component."""
    S, tp, cp, ep = work.seq_length, layout.tp, layout.cp, layout.ep
    T = layout.micro_batch_size * S
    t_rank = T / (tp * cp)  # tokens of the split GEMMs / sequence-parallel elementwise work
    t_elem = t_rank if (layout.sequence_parallel or tp == 1) else T / cp
    layer_f, head_f, _ = per_layer_flops(dims, S)
    knee = calib["gemm.small_m_knee_rows"]
    share = calib["recompute.forward_share"]
    slot = layers + mtp  # decoder layers run on this rank per micro-batch (MTP depths included)
    moe_slots = moe_layers + (mtp if dims.mtp_layer_is_moe else 0)
    dense_slots = slot - moe_slots

    def small_m(rows: float) -> float:
        return min(1.0, rows / knee)

    parts: Dict[str, float] = {}
    gemm_m = small_m(t_rank)
    parts["attention_proj"] = slot * layer_f["attention_proj"] * t_rank / (calib["rate.attention_proj"] * gemm_m)
    heads = dims.heads / tp
    if dims.dsa_sparse_attention:
        rate, note = calib.lookup("dsa.sparse_attention", "flops_per_s", S, heads=heads)
        parts["attention_core"] = slot * layer_f["attention_sparse"] * t_rank / rate
    else:
        # cuDNN's rate barely depends on heads per rank (H200, 32K: 372 TFLOP/s at 64 heads, 397 at 16): by seq only
        rate, note = calib.lookup("attention.dense", "flops_per_s", S)
        core = slot * layer_f["attention_core"] * t_rank / rate
        if work.documents:
            ratio, n2 = calib.lookup("documents.attention_ratio", "value", S)
            core *= min(1.0, ratio)
            notes.append(n2) if n2 else None
        parts["attention_core"] = core
    notes.append(note) if note else None
    if cp > 1:
        table = {"mask": "cp.mask_over_ideal", "chunks": "cp.chunks_over_ideal"}.get(variant["cp_attention"],
                                                                                   "cp.merged_over_ideal")
        factor, n3 = calib.lookup(table, "value", S, cp=cp)
        parts["attention_core"] *= factor
        notes.append(n3) if n3 else None
    if dims.dsa_indexer_loss or dims.dsa_sparse_attention:
        # replicated under TP (every TP rank scores all its sequence's queries)
        parts["dsa_indexer"] = slot * _indexer_s_per_token(calib, S, notes) * (T / cp) * dims.dsa_indexer_heads / 32
    if dims.dsa_sparse_attention and variant.get("dsa_kernels") == "2026-11-24":
        # the DSA core as profiled in the model on 2026-11-24 (before the kernel work of 11-25..27): today's
        # estimate scaled by that profile's time at 16K, 16 heads over today's estimate there
        k = dims.dsa_indexer_topk
        keys = lambda s: s / 2 if s <= k else k * (1 - k / (2 * s))  # flops.sparse_keys_per_query
        per_key = 3 * 16 * (2 * (dims.kv_lora_rank + dims.qk_pos_emb_head_dim) + 2 * dims.kv_lora_rank)
        now16 = per_key * keys(16384) / calib.lookup("dsa.sparse_attention", "flops_per_s", 16384, heads=16)[0]
        now16 += _indexer_s_per_token(calib, 16384, []) * dims.dsa_indexer_heads / 32
        factor = calib["dsa.core_s_per_token_layer_2026_11_24"] / now16
        parts["attention_core"] *= factor
        parts["dsa_indexer"] *= factor
    if moe_slots:
        # a rank's experts see the rows of its EP group, gathered over its ETP group (each ETP rank runs every row
        # through its 1/etp of the expert's width): ep x etp ranks' t_rank x topk rows over the experts
        rows_per_expert = t_rank * dims.topk * ep * layout.etp / dims.num_experts
        parts["routed_experts"] = moe_slots * layer_f["routed_experts"] * t_rank / (
            calib["rate.routed_experts"] * small_m(rows_per_expert))
        parts["shared_expert"] = moe_slots * layer_f["shared_expert"] * t_rank / (calib["rate.shared_expert"] * gemm_m)
        parts["router"] = moe_slots * t_elem * dims.num_experts * calib["overhead.router_s_per_token_layer_expert"]
        parts["dispatch"] = moe_slots * t_elem * dims.topk * dims.hidden * calib["overhead.dispatch_s_per_row_hidden"]
    if dense_slots:
        parts["dense_mlp"] = dense_slots * layer_f["dense_mlp"] * t_rank / (calib["rate.dense_mlp"] * gemm_m)
    parts["glue"] = slot * t_elem * dims.hidden * calib["overhead.glue_s_per_token_layer_hidden"]
    embeds = (1 if first else 0) + mtp  # MTP embeds the shifted tokens on its rank
    parts["embedding"] = embeds * t_elem * dims.hidden * calib["overhead.embedding_s_per_token_hidden"]
    if last:
        backend = layout.output_loss_backend
        rate, _ = calib.lookup("output_loss", "flops_per_s", None, hidden=dims.hidden)
        pts = [p for p in calib["output_loss"] if p["backend"] == backend]
        if pts:
            best = min(pts, key=lambda p: abs(math.log(p["hidden"] * p["vocab"]) - math.log(dims.hidden * dims.vocab)))
            rate = best["flops_per_s"]
        parts["output_head"] = (1 + dims.mtp_depths) * head_f["output_head"] * t_rank / rate  # MTP's heads too
    if mtp:
        parts["mtp_eh_proj"] = mtp * head_f["mtp_eh_proj"] * t_rank / calib["rate.mtp_eh_proj"]

    fwd = sum(t * share.get(k, share["attention_proj"]) for k, t in parts.items() if k not in ("output_head",))
    fwd += parts.get("output_head", 0.0) * 0.97  # the fused loss computes its gradient in the forward (profile)
    total_compute = sum(parts.values())
    recompute = 0.0
    layer_parts = ("attention_proj", "attention_core", "dsa_indexer", "routed_experts", "shared_expert", "router",
                   "dispatch", "dense_mlp", "glue")
    if layout.recompute == "full":
        recompute = sum(parts.get(k, 0.0) * share.get(k, share["attention_proj"]) for k in layer_parts)
    elif layout.recompute == "selective":
        mods = set(variant["selective_modules"])
        keys = (["attention_core"] if "core_attn" in mods else []) + (
            ["routed_experts", "router", "dispatch"] if "moe" in mods else [])
        recompute = sum(parts.get(k, 0.0) * share.get(k, share["attention_proj"]) for k in keys)
    offload = 0.0
    if layout.activation_offload and layout.recompute != "full":  # with full recompute: one input per layer,
        # measured free (long_context_h100: 7,006 vs 7,026 tokens/s at 32K)
        frac = calib["offload.time_fraction"]["dsa" if dims.dsa_sparse_attention else "dense"]
        offload = frac * (total_compute + recompute)

    # --- communication exposed inside the micro-batch
    lat = calib["collective.latency_s"]
    comm_tp = comm_cp = comm_ep = tp_serial = 0.0
    if tp > 1:
        bw, _ = group_bw(cluster, calib, tp, 1)
        act = T / cp * dims.hidden * BF16
        one = ring(act, tp, bw, lat, allreduce=not layout.sequence_parallel)
        n_fwd = 4 if layout.sequence_parallel else 2
        comm_tp = (slot + 1) * n_fwd * one * (1 + (1 - calib["tp.exposed_fraction_backward"]))
        # what TP=2 costs beyond its collectives' volume, on the GPU's critical path (fitted, calibration entry)
        tp_serial = slot * calib["tp.overhead_s_per_layer_microbatch"] * (tp - 1)
        if tp > 2:
            notes.append(f"tp.overhead_s_per_layer_microbatch fitted at TP=2, scaled by tp - 1 to TP={tp}")
        comm_tp += tp_serial
    if cp > 1:
        bw, _ = group_bw(cluster, calib, cp, tp)
        indexer_on = dims.dsa_indexer_loss or dims.dsa_sparse_attention
        width = LATENT_WIDTH + (dims.dsa_indexer_head_dim if indexer_on else 0)
        gathered = layout.micro_batch_size * S * width * BF16
        comm_cp = slot * 2 * ring(gathered, cp, bw, lat)
    if ep > 1 and moe_slots:
        rows = offrank_rows(t_rank, dims, ep, variant["ep_dispatcher"])
        intra = ep * layout.etp <= cluster.gpus_per_node
        bw = calib["a2a.intra_node_bytes_per_s"] if intra else cluster.inter_node_bw * calib["a2a.inter_node_fraction"]
        comm_ep = moe_slots * 4 * (rows * dims.hidden * BF16 / bw + lat)
        if ep > 2:
            notes.append(f"all-to-all bandwidth measured at EP=2, used at EP={ep}")
    if layout.etp > 1 and moe_slots:
        # megatron's alltoall dispatcher all-gathers the received rows over the expert-TP group after the
        # all-to-all and reduce-scatters the experts' output before the combine (forward; the reverse backward):
        # 4 ring collectives of etp x the t_rank x topk rows a rank receives at balanced routing, per MoE layer;
        # the ETP group is the innermost of the expert grid (stride 1)
        bw, _ = group_bw(cluster, calib, layout.etp, 1)
        gathered = layout.etp * t_rank * dims.topk * dims.hidden * BF16
        comm_ep += moe_slots * 4 * ring(gathered, layout.etp, bw, lat)
    gpu = total_compute + recompute + offload + comm_tp - tp_serial + comm_cp + comm_ep
    host = slot * calib["host.launch_s_per_layer_microbatch"]
    if layout.recompute == "full":  # the recomputed forward launches its kernels again
        host *= 1 + share["glue"]
    if ep > 1 and moe_slots:  # megatron's all-to-all dispatcher: host work per MoE layer (fitted, calibration entry)
        host += moe_slots * calib["ep.host_s_per_moe_layer_microbatch"]
    gaps = slot * calib["host.sync_s_per_layer_microbatch"] + tp_serial
    launch_bound = max(0.0, host - gpu)
    return {"fwd": fwd, "bwd": total_compute - fwd, "recompute": recompute + offload, "tp": comm_tp, "cp": comm_cp,
            "ep": comm_ep, "host": launch_bound + gaps - tp_serial, "total": gpu + launch_bound + gaps,
            "bwd_window": (total_compute - fwd) + recompute}


def entry_seconds(dims: ModelDims, layout: Layout, work: Workload, cluster: Cluster, calib: Calibration,
                  variant: Optional[Mapping] = None) -> Dict[str, float]:
    """Seconds per micro-batch (forward + backward, the layout's recompute) that each pipeline entry adds to its
    rank, from this module's calibrated stage model: "t_dense" and "t_moe" (one decoder layer), "m" (one MTP depth:
    eh_proj, its layer, its embedding), "E" (the embedding), "L" (every output head and loss: megatron computes
    the MTP depths' heads where L is). What `pretrain.tools.pipeline_split --gpu` balances instead of FLOPs."""
    v = dict(DEFAULT_VARIANT, **(variant or {}))
    v["ep_dispatcher"] = getattr(layout, "ep_dispatcher", None) or v["ep_dispatcher"]

    def rank(layers=0, moe=0, mtp=0, first=False, last=False) -> float:
        return _stage_time(dims, layout, work, cluster, calib, v, layers, moe, mtp, first, last, notes=[])["total"]

    empty = rank()
    dense = rank(1) - empty
    moe = rank(1, 1) - empty if dims.num_experts else dense  # a cut with no MoE layer has no expert to time
    return {"t_dense": dense, "t_moe": moe, "m": rank(mtp=1) - empty,
            "E": rank(first=True) - empty, "L": rank(last=True) - empty}


# ------------------------------------------------------------------------------------------------ the step
def _stages(dims: ModelDims, layout: Layout) -> List[Tuple[float, float, int, bool, bool]]:
    """(decoder layers, MoE layers, MTP depths, first, last) per pipeline rank, its virtual stages together
    (`pipeline_plan.pipeline_stages`: even, megatron's default, or `layout.pipeline_layout`): the embedding where E is,
    the MTP depths where m is, the output heads (main and MTP) where L is."""
    plan = pipeline_plan(dims, layout)
    mtp_rank, first, last = plan.mtp_rank, plan.embedding_rank, plan.loss_rank
    out = []
    for r, layers in enumerate(plan.layers):
        out.append((len(layers), sum(dims.moe_pattern[i] for i in layers), dims.mtp_depths if r == mtp_rank else 0,
                    r == first, r == last))
    return out


def _rank_params(dims: ModelDims, layout: Layout) -> Tuple[float, float]:
    """(dense, expert) parameters one rank holds (the slowest stage taken as 1/pp of the model)."""
    moe = dims.moe_layers + (dims.mtp_layers if dims.mtp_layer_is_moe else 0)
    experts = moe * dims.num_experts * dims.expert_params
    dense = dims.total_params - experts
    return dense / (layout.tp * layout.pp), experts / (layout.ep * layout.etp * layout.pp)


def _stage_times(dims: ModelDims, layout: Layout, work: Workload, cluster: Cluster, calib: Calibration, v: Dict,
                 memo: Optional[Memo]) -> Tuple[Callable, List[Dict[str, float]], Tuple[str, ...]]:
    """(the stage model of the layout by a stage's `_stages` tuple, each pipeline rank's time by it, their notes),
    through `memo` where given: keyed by every field `_stage_time` reads, so the layouts of a search that differ
    elsewhere (DP, PP, the micro-batches, ZeRO) share their ranks' times; the times are shared, read only."""
    def run(counts, notes: List[str]) -> Dict[str, float]:
        return _stage_time(dims, layout, work, cluster, calib, v, *counts, notes=notes)

    def ranks() -> Tuple[List[Dict[str, float]], Tuple[str, ...]]:
        notes: List[str] = []
        return [run(st, notes) for st in _stages(dims, layout)], tuple(notes)

    if memo is None:
        return (lambda counts: run(counts, []), *ranks())
    fields = (dims, work, cluster, tuple(v.items()), layout.tp, layout.cp, layout.ep, layout.etp,
              layout.micro_batch_size, layout.sequence_parallel, layout.output_loss_backend, layout.recompute,
              layout.activation_offload)

    def remembered(counts) -> Tuple[Dict[str, float], Tuple[str, ...]]:  # one stage's time and its notes
        def compute():
            notes: List[str] = []
            return run(counts, notes), tuple(notes)
        return memo.get(("stage", fields, tuple(counts)), compute)

    def ranks_remembered() -> Tuple[List[Dict[str, float]], Tuple[str, ...]]:
        timed = [remembered(st) for st in _stages(dims, layout)]
        return [t for t, _ in timed], tuple(n for _, notes in timed for n in notes)

    return (lambda counts: remembered(counts)[0],
            *memo.get(("ranks", fields, layout.pp, layout.vpp, layout.pipeline_layout), ranks_remembered))


def step_time(dims: ModelDims, layout: Layout, work: Workload, cluster: Cluster, calib: Calibration,
              variant: Optional[Mapping] = None, schedule: str = "simulated", memo: Optional[Memo] = None) -> StepTime:
    """Seconds of one optimizer step of `work` under `layout` on `cluster` (module docstring), by component.

    `variant` selects code paths a layout does not name, for predicting runs made on them: ep_dispatcher
    ("alltoall": megatron's, the GPU default; "alltoall_dedup"), cp_attention ("merged": model.cp_attention's default;
    "chunks": its bottom_right; "mask": the explicit CP mask path before 2026-11-27), selective_modules (megatron recompute_modules for "selective"; default
    core_attn + moe as Layout.overrides emits), dsa_kernels. ZeRO-2's reduce mode is the layout's
    (`Layout.zero2_grad_reduce`). `schedule`: "simulated" runs megatron's pipeline schedule with the layout's
    virtual stages (`pretrain.layout.schedule_term`); "textbook" takes (PP - 1) / VPP x the mean rank's micro-batch
    (cheaper: the search's first pass). `memo`: a `pretrain.layout.memo.Memo` kept for one `calib` (the search's
    step function; the variant's values hashable) remembers the stage model's times between calls.
    """
    if schedule not in ("simulated", "textbook"):
        raise ValueError(f"schedule {schedule!r}: simulated or textbook")
    v = dict(DEFAULT_VARIANT, **(variant or {}))
    v["ep_dispatcher"] = getattr(layout, "ep_dispatcher", None) or v["ep_dispatcher"]
    stage, stages, stage_notes = _stage_times(dims, layout, work, cluster, calib, v, memo)
    notes: List[str] = list(stage_notes)
    m = layout.num_microbatches
    crit = max(stages, key=lambda st: st["total"])
    mean = sum(st["total"] for st in stages) / len(stages)
    bubble = (layout.pp - 1) / layout.vpp * mean
    bubble_fraction = layout.bubble if layout.pp > 1 else 0.0
    if layout.pp > 1 and schedule == "simulated":
        sim = simulated_pipeline(dims, layout, stage, [st["total"] for st in stages])
        if sim is None:
            notes.append("micro-batch group refused by megatron: the textbook bubble")
        else:
            bubble = sim.step - m * crit["total"]
            bubble_fraction = bubble / (m * crit["total"])
    if layout.pp > 1:
        bw, _ = group_bw(cluster, calib, layout.pp, layout.tp * layout.cp * layout.dp)
        act = layout.micro_batch_size * work.seq_length / (layout.tp * layout.cp) * dims.hidden * BF16
        p2p = 2 * layout.vpp * (act / bw + calib["collective.latency_s"]) * calib["p2p.exposed_fraction"]
        # what a pipeline rank waits beyond the simulated schedule and the transfers' modeled time (fitted)
        p2p += 2 * layout.vpp * calib["p2p.overhead_s_per_transfer"]
        bubble += m * p2p

    # --- gradients: accumulation per micro-batch, the DP reduce, the optimizer
    dense_p, expert_p = _rank_params(dims, layout)
    params = dense_p + expert_p
    accum = m * params * calib["overhead.grad_accum_s_per_param_microbatch"]
    lat = calib["collective.latency_s"]
    # dense gradients are reduced over DP x CP (CP ranks hold the same weights), expert gradients over the
    # expert-data-parallel group TP x CP x DP / (EP x ETP)
    ddp = layout.dp * layout.cp
    edp = layout.tp * layout.cp * layout.dp // (layout.ep * layout.etp)
    dp_bw, _ = group_bw(cluster, calib, ddp, layout.tp)
    edp_bw, _ = group_bw(cluster, calib, edp, layout.ep * layout.etp)
    gbytes = FP32  # parallel.grad_reduce_in_fp32 (the configs' default)
    window = calib["dp.overlap_fraction_of_backward"] * crit["bwd_window"]
    if layout.zero == "zero2" and layout.optimizer == "muon":
        per_mb = ring(dense_p * gbytes, ddp, dp_bw, lat) + ring(expert_p * gbytes, edp, edp_bw, lat)
        gather = ring(dense_p * BF16, ddp, dp_bw, lat) + ring(expert_p * BF16, edp, edp_bw, lat)
        if layout.zero2_grad_reduce == "step":  # one reduce-scatter after the last micro-batch
            dp_exposed = max(0.0, per_mb - window) + gather
        else:  # every micro-batch; measured to show in the step even where the backward could hide it
            shown = calib["dp.zero2_microbatch_reduce_shown"] * per_mb
            dp_exposed = m * max(0.0, per_mb - window, shown) + gather
        shard_dense, shard_expert = ddp, edp
    else:
        reduce = (ring(dense_p * gbytes, ddp, dp_bw, lat, allreduce=True)
                  + ring(expert_p * gbytes, edp, edp_bw, lat, allreduce=True))
        dp_exposed = max(0.0, reduce - window)
        shard_dense = shard_expert = 1
        if layout.zero == "zero2":  # AdamW: megatron's distributed optimizer gathers the updated bf16 weights
            dp_exposed += ring(dense_p * BF16, ddp, dp_bw, lat) + ring(expert_p * BF16, edp, edp_bw, lat)
            shard_dense, shard_expert = ddp, edp
    owned = dense_p / shard_dense + expert_p / shard_expert
    if layout.optimizer == "muon":
        ns = newton_schulz_flops(dims) * owned / max(dims.total_params, 1)
        optimizer = ns / calib["muon.newton_schulz_flops_per_s"] + owned * calib["muon.other_s_per_param"]
    else:
        optimizer = owned * calib["adamw.s_per_param"]

    fixed = calib["step.fixed_s"]
    total = m * crit["total"] + bubble + accum + dp_exposed + optimizer + fixed
    tokens = work.tokens_per_step
    gpus = layout.gpus
    _, _, flops_tok = per_layer_flops(dims, work.seq_length)
    peak = peak_flops(calib.device_name) or cluster.peak_bf16_flops
    return StepTime(
        compute_fwd=m * crit["fwd"], compute_bwd=m * crit["bwd"] + accum, host=m * crit["host"] + fixed,
        recompute=m * crit["recompute"], tp_comm=m * crit["tp"], cp_comm=m * crit["cp"], ep_a2a=m * crit["ep"],
        pp_bubble=bubble, dp_comm_exposed=dp_exposed, optimizer=optimizer, total=total, bubble_fraction=bubble_fraction,
        tokens_per_s_per_gpu=tokens / total / gpus, mfu=flops_tok * tokens / total / gpus / peak,
        notes=tuple(dict.fromkeys(notes)))
