"""Enumerate the layouts of a GPU count, refuse the ones that cannot run, rank the rest (docs/layout.md).

For W GPUs: TP in {1, 2, 4, 8} within a node, CP, PP dividing W / (TP CP), DP = W / (TP CP PP), VPP, EP dividing
the experts with EP x ETP dividing TP CP DP, micro-batch, ZeRO-2's gradient reduce (per micro-batch or per step,
`SearchOptions.zero2_grad_reduce`), recompute and offload. Cheap arithmetic refuses first,
with a reason (the rules of `pretrain.config.cross_checks`, which the best candidates then pass through for real):

    heads % TP, vocab % TP, ffn % TP, PP VPP stages over the model's entries, layers % (PP VPP) unless the
    stages are uneven, experts % EP, expert width % ETP,
    TP CP DP % (EP ETP), seq % (2 CP), global batch % (micro-batch x DP), micro-batches % PP with VPP,
    bubble (PP - 1) / (VPP m) over the bound, memory (`memory.estimate`) + runtime reserve over
    (1 - headroom) x GPU memory, host memory per node (`host_memory.host_estimate`: checkpoint staging, offloaded
    activations) over (1 - headroom) x the node's.

A PP x VPP that does not divide the layers gets uneven stages, `pretrain.tools.pipeline_split`'s balanced split
at the layout's micro-batches (`uneven_layout`, carried as `Layout.pipeline_layout`). Within one parallel split
the recompute options are tried from the fastest (none) to the leanest (full + offload) and the first that fits is
kept (a split whose state alone exceeds the bound gets the leanest's refusal: `memory.state_floor`). Survivors are
ranked by the time model's tokens/s per GPU (`pretrain.layout.timing.step_time`, the textbook bubble); the best
pipelined ones are then re-split, re-fitted and re-timed with megatron's schedule simulated, and refused over the
bound by that schedule (`pretrain.layout.rescore`); the best are built as configs and validated (`validate_config`).
"""

from __future__ import annotations

import itertools
from functools import lru_cache
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import yaml

from pretrain.layout.from_config import configured_layout, layout_of  # also this module's API (__all__)
from pretrain.layout.host_memory import HostEstimate, host_estimate, host_refusal
from pretrain.layout.memo import Memo
from pretrain.layout.memory import RUNTIME_RESERVE_BYTES, MemoryEstimate, estimate, state_floor
from pretrain.layout.rescore import rescore, scheduled
from pretrain.layout.types import Cluster, Layout, ModelDims, StepTime, Workload

# recompute options from the fastest to the leanest
RECOMPUTE_ORDER: Tuple[Tuple[str, bool], ...] = (("none", False), ("selective", False), ("selective", True),
                                                 ("full", False), ("full", True))
StepFn = Callable[[ModelDims, Layout, Workload, Cluster], StepTime]


@dataclass
class SearchOptions:
    headroom: float = 0.10  # keep this fraction of GPU memory free
    bubble_bound: float = 0.10  # refuse a pipeline idle more than this fraction of the ideal step
    optimizer: str = "muon"
    zero: Tuple[str, ...] = ("zero2",)
    micro_batches: Tuple[int, ...] = (1, 2, 4)
    max_vpp: int = 8
    min_tokens_per_cp_rank: int = 4096  # CP splits long sequences only
    output_chunk_size: int = 4096
    trainable: str = "all"
    saves: bool = False  # checkpoints saved: a save's expert copies may peak above the step (memory.save_copies_terms)
    pinned_staging: bool = True  # checkpoint.pinned_staging: a save's host staging is kept (host_memory)
    # optimizer.zero2_grad_reduce values tried for Muon's ZeRO-2 (its gradient memory and traffic): a layout dimension
    zero2_grad_reduce: Tuple[str, ...] = ("microbatch", "step")
    validate_top: int = 10  # candidates built as configs and validated, best first
    # the second pass (pretrain.layout.rescore): at most this many pipelined layouts re-split and re-timed with the
    # schedule simulated, best first; 0: the textbook bubble only
    schedule_rescore: int = 400
    # (entries, cost per token, may a stage start there) of the model, `pretrain.tools.pipeline_split.split_inputs`
    # of the config at the workload's sequence length (`pipeline_costs`): a PP x VPP that does not divide the
    # layers gets the balanced uneven stages; None: such splits are refused
    pipeline_costs: Optional[Tuple[Tuple[str, ...], Tuple[float, ...], Tuple[bool, ...]]] = None

    def __post_init__(self):
        if isinstance(self.zero2_grad_reduce, str):  # one mode, pinned
            self.zero2_grad_reduce = (self.zero2_grad_reduce,)


@dataclass
class Candidate:
    layout: Layout
    memory: MemoryEstimate
    step: Optional[StepTime] = None
    host: Optional[HostEstimate] = None

    @property
    def tokens_per_s(self) -> float:
        return self.step.tokens_per_s_per_gpu * self.layout.gpus if self.step else 0.0


@dataclass
class SearchResult:
    ranked: List[Candidate]
    refused: Counter = field(default_factory=Counter)  # reason kind -> layouts refused for it
    examples: Dict[str, str] = field(default_factory=dict)  # reason kind -> one full reason
    considered: int = 0


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def refusal(dims: ModelDims, layout: Layout, work: Workload) -> Optional[str]:
    """The first arithmetic rule `layout` breaks, as 'kind: detail', or None (cheap: no memory, no config)."""
    tp, pp, vpp, ep, etp, cp, dp = layout.tp, layout.pp, layout.vpp, layout.ep, layout.etp, layout.cp, layout.dp
    # in order, each reason formatted only when its rule is broken (the search asks this of every layout)
    if dims.heads % tp:
        return f"heads % tp: {dims.heads} heads over TP {tp}"
    if dims.vocab % tp:
        return f"vocab % tp: vocab {dims.vocab} over TP {tp}"
    if dims.ffn_hidden % tp or dims.shared_expert_ffn_hidden % tp:
        return f"ffn % tp: FFN widths {dims.ffn_hidden}/{dims.shared_expert_ffn_hidden} over TP {tp}"
    if pp * vpp > dims.num_layers + 2:
        return f"stages > entries: PP {pp} x VPP {vpp} stages for {dims.num_layers} layers, the embedding and the loss"
    if dims.num_layers % (pp * vpp) and layout.pipeline_layout is None:
        return (f"layers % (pp*vpp): {dims.num_layers} layers over PP {pp} x VPP {vpp} (uneven stages need the "
                "model's stage costs, SearchOptions.pipeline_costs)")
    if vpp != 1 and pp <= 1:
        return f"vpp without pp: VPP {vpp} needs PP > 1"
    if ep != 1 and dims.num_experts % ep:
        return f"experts % ep: {dims.num_experts} experts over EP {ep}"
    if etp != 1 and dims.expert_ffn_hidden % etp:
        return f"expert width % etp: expert width {dims.expert_ffn_hidden} over ETP {etp}"
    if (tp * cp * dp) % (ep * etp):
        return f"ep*etp vs tp*cp*dp: EP {ep} x ETP {etp} must divide TP x CP x DP"
    if tp != 1 and not layout.sequence_parallel and dims.num_experts:
        return "moe needs sp: TP > 1 with MoE needs SP"
    if work.seq_length % (2 * cp):
        return f"seq % (2*cp): seq {work.seq_length} over 2 x CP {cp}"
    if layout.sequence_parallel and (work.seq_length // cp) % tp:
        return f"seq/cp % tp: seq / CP {work.seq_length // cp} over TP {tp}"
    if work.global_batch_size % (layout.micro_batch_size * dp):
        return (f"global batch % (mbs*dp): global batch {work.global_batch_size} over micro-batch "
                f"{layout.micro_batch_size} x DP {dp}")
    if vpp != 1 and layout.num_microbatches % pp:
        return (f"micro-batches % pp with vpp: {layout.num_microbatches} micro-batches over PP {pp} "
                "(interleaved schedule)")
    return None


def memory_refusal(mem: MemoryEstimate, capacity: float, headroom: float) -> Optional[str]:
    bound = (1 - headroom) * capacity
    if mem.needed > bound:
        return (f"memory: {mem.needed / 2**30:.1f} GiB needed (peak {mem.total / 2**30:.1f} + reserve) over "
                f"{bound / 2**30:.1f} GiB ({1 - headroom:.0%} of {capacity / 2**30:.1f}) on pipeline rank {mem.rank}")
    return None


def bubble_refusal(layout: Layout, bound: float) -> Optional[str]:
    if layout.pp > 1 and layout.bubble > bound:
        return (f"bubble: (PP - 1) / (VPP x m) = {layout.pp - 1} / ({layout.vpp} x {layout.num_microbatches}) "
                f"= {layout.bubble:.0%} over {bound:.0%}")
    return None


def simulated_bubble_refusal(layout: Layout, step: StepTime, bound: float) -> Optional[str]:
    """The refusal of a pipeline whose schedule, simulated with its own virtual stages (`StepTime.bubble_fraction`),
    idles more than `bound` of its busiest rank's work; None within it."""
    if layout.pp > 1 and step.bubble_fraction > bound:
        return (f"bubble (simulated schedule): {step.bubble_fraction:.0%} of the busiest rank's work at PP {layout.pp} "
                f"x VPP {layout.vpp}, m {layout.num_microbatches}, over {bound:.0%}")
    return None


def pipeline_costs(cfg, work: Workload, gpu: Optional[str] = None
                   ) -> Tuple[Tuple[str, ...], Tuple[float, ...], Tuple[bool, ...]]:
    """`SearchOptions.pipeline_costs` of `cfg` at the workload's sequence length (docs/parallelism.md's cost model):
    with `gpu` ("h100", "h200") each entry weighed by this package's time model calibrated on it, else by FLOPs."""
    import dataclasses

    from pretrain.tools.pipeline_split import split_inputs

    at_seq = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_length=work.seq_length))
    entries, costs, can_start = split_inputs(at_seq, gpu=gpu)
    return tuple(entries), tuple(costs), tuple(can_start)


def uneven_layout(dims: ModelDims, pp: int, vpp: int, m: int, opts: SearchOptions) -> Optional[str]:
    """The balanced `parallel.pipeline_model_parallel_layout` of PP x VPP stages at m micro-batches when the layers
    do not split evenly (`pretrain.tools.pipeline_split.balanced_stages`); None where the even split holds or the
    split cannot be made (the arithmetic refusal then says why)."""
    if pp == 1 or dims.num_layers % (pp * vpp) == 0 or opts.pipeline_costs is None:
        return None
    if pp * vpp > len(opts.pipeline_costs[0]):
        return None
    return _uneven_layout(opts.pipeline_costs, pp, vpp, m if vpp > 1 else 1)


@lru_cache(maxsize=1024)
def _uneven_layout(costs: Tuple[Tuple[str, ...], Tuple[float, ...], Tuple[bool, ...]], pp: int, vpp: int,
                   m: int) -> Optional[str]:
    from pretrain.config.pipeline_layout import format_layout
    from pretrain.tools.pipeline_split import balanced_stages

    entries, cost, can_start = costs
    try:
        return format_layout(balanced_stages(list(entries), list(cost), pp, vpp, m, list(can_start)))
    except ValueError:  # no split meets the DSA stage-start constraints
        return None


def splits(dims: ModelDims, work: Workload, cluster: Cluster, opts: SearchOptions) -> Iterator[Layout]:
    """Every parallel split of `cluster.gpus` (recompute left at none) the search considers; a PP x VPP that does
    not divide the layers carries the balanced uneven stages (`uneven_layout`)."""
    w = cluster.gpus
    tps = [t for t in (1, 2, 4, 8) if t <= cluster.gpus_per_node and w % t == 0]
    for tp in tps:
        cps = [c for c in _divisors(w // tp) if work.seq_length // c >= opts.min_tokens_per_cp_rank or c == 1]
        for cp in cps:
            for pp in _divisors(w // (tp * cp)):
                dp = w // (tp * cp * pp)
                vpps = [v for v in range(1, opts.max_vpp + 1) if pp > 1 or v == 1]
                eps = [e for e in _divisors(dims.num_experts)] if dims.num_experts else [1]
                etps = [e for e in (1, 2, 4, 8) if e <= tp * cp * dp] if dims.num_experts else [1]
                for vpp, ep, etp, mbs, zero in itertools.product(vpps, eps, etps, opts.micro_batches, opts.zero):
                    if mbs > 1 and work.seq_length > 8192:
                        continue  # long sequences: one per micro-batch
                    m = max(work.global_batch_size // (mbs * dp), 1)
                    uneven = uneven_layout(dims, pp, vpp, m, opts)
                    # the reduce mode matters to Muon's ZeRO-2 only (the config validator refuses it elsewhere)
                    modes = opts.zero2_grad_reduce if zero == "zero2" and opts.optimizer == "muon" else ("microbatch",)
                    for mode in modes:
                        yield Layout(pipeline_layout=uneven, tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, cp=cp, dp=dp,
                                     micro_batch_size=mbs, num_microbatches=m, sequence_parallel=tp > 1,
                                     optimizer=opts.optimizer, zero=zero, zero2_grad_reduce=mode,
                                     output_loss_backend="chunked", output_chunk_size=opts.output_chunk_size)


def fitting(dims: ModelDims, layout: Layout, work: Workload, cluster: Cluster,
            opts: SearchOptions) -> Tuple[Optional[Candidate], Optional[str], float]:
    """(the fastest recompute/offload setting of `layout` that fits, None, bytes it needs), or
    (None, the leanest setting's refusal, the bytes that one needs)."""
    reason, needed = None, 0.0
    # where the split's state alone exceeds the bound (beyond rounding) every setting is refused: size the leanest only
    floor = state_floor(dims, layout, opts.trainable) + RUNTIME_RESERVE_BYTES
    hopeless = floor > (1 - opts.headroom) * cluster.memory_bytes * (1 + 1e-9)
    for recompute, offload in RECOMPUTE_ORDER[-1:] if hopeless else RECOMPUTE_ORDER:
        lay = replace(layout, recompute=recompute, activation_offload=offload)
        mem = estimate(dims, lay, work, trainable=opts.trainable, saves=opts.saves)
        reason, needed = memory_refusal(mem, cluster.memory_bytes, opts.headroom), mem.needed
        if reason is None:
            host = host_estimate(dims, lay, work, cluster.gpus_per_node, trainable=opts.trainable, saves=opts.saves,
                                 pinned_staging=opts.pinned_staging)
            reason = host_refusal(host, cluster.host_memory_bytes, opts.headroom)
            if reason is None:
                return Candidate(lay, mem, host=host), None, needed
    return None, reason, needed


def default_step_fn(cluster: Cluster, schedule: str = "simulated") -> StepFn:
    """The time model with the calibration of the cluster's GPU kind (each layout's own ZeRO-2 reduce mode; the
    pipeline `schedule`, timing.step_time's); a one-line error when it is missing."""
    try:
        from pretrain.layout import timing
    except ImportError as e:
        raise RuntimeError(f"the layout planner's time model (pretrain.layout.timing) is not available: {e}") from e
    calib = timing.load_calibration(cluster.gpu_kind)
    # the layouts' selective recompute is recompute_modules [core_attn, moe] (Layout.overrides)
    variant = {"selective_modules": ("core_attn", "moe")}
    memo = Memo()  # the stage model's times, shared by the layouts this function times (timing.step_time)
    return lambda dims, layout, work, cl: timing.step_time(dims, layout, work, cl, calib, variant=variant,
                                                           schedule=schedule, memo=memo)


def search(dims: ModelDims, work: Workload, cluster: Cluster, opts: Optional[SearchOptions] = None,
           step_fn: Optional[StepFn] = None, validate: Optional[Callable[[Layout], Optional[str]]] = None
           ) -> SearchResult:
    """Every split of the cluster, refused with a reason or ranked by tokens/s (module docstring).
    `validate(layout)` returns the config validator's refusal of a layout (None: accepted). With the default time
    model the best pipelined layouts are re-split and re-timed with the schedule simulated (`rescore`); a given
    `step_fn` times every layout alone."""
    opts = opts or SearchOptions()
    retime_fn = default_step_fn(cluster) if step_fn is None and opts.schedule_rescore else None
    step_fn = step_fn or default_step_fn(cluster, "textbook")
    result = SearchResult(ranked=[])

    closest = {}  # memory refusals: the example shown is the nearest miss

    def refuse(reason: str, needed: float = 0.0) -> None:
        kind = reason.split(":", 1)[0]
        result.refused[kind] += 1
        if kind not in result.examples or (needed and needed < closest.get(kind, float("inf"))):
            result.examples[kind] = reason
            closest[kind] = needed or closest.get(kind, 0.0)

    for layout in splits(dims, work, cluster, opts):
        result.considered += 1
        reason = refusal(dims, layout, work) or bubble_refusal(layout, opts.bubble_bound)
        if reason:
            refuse(reason)
            continue
        cand, reason, needed = fitting(dims, layout, work, cluster, opts)
        if cand is None:
            refuse(reason, needed)
            continue
        cand.step = step_fn(dims, cand.layout, work, cluster)
        result.ranked.append(cand)
    result.ranked.sort(key=lambda c: -c.step.tokens_per_s_per_gpu)
    if retime_fn is not None:
        def retime(layout: Layout) -> Tuple[Optional[Candidate], Optional[str]]:
            lay = scheduled(layout, opts.pipeline_costs)
            cand, reason, _ = fitting(dims, lay, work, cluster, opts)
            if cand is None:
                return None, reason
            cand.step = retime_fn(dims, cand.layout, work, cluster)
            reason = simulated_bubble_refusal(cand.layout, cand.step, opts.bubble_bound)
            return (None, reason) if reason else (cand, None)

        result.ranked, refusals = rescore(result.ranked, retime, lambda c: c.step.tokens_per_s_per_gpu,
                                          need=max(opts.validate_top, 1), limit=opts.schedule_rescore)
        for reason in refusals:
            refuse(reason)
    if validate is not None:
        kept, checked = [], 0
        for cand in result.ranked:
            if checked < opts.validate_top:
                checked += 1
                reason = validate(cand.layout)
                if reason:
                    refuse(f"config: {reason}")
                    continue
            kept.append(cand)
        result.ranked = kept
    return result


def config_validator(cfg, work: Workload) -> Callable[[Layout], Optional[str]]:
    """validate(layout): `cfg` with the layout's overrides, checked by `validate_config` at the layout's world size."""
    from pretrain.config import ConfigError, config_from_dict, config_to_dict, validate_config

    base = config_to_dict(cfg)

    def validate(layout: Layout) -> Optional[str]:
        data = {k: dict(v) for k, v in base.items()}
        for item in layout.overrides() + [f"data.seq_length={work.seq_length}",
                                          f"train.global_batch_size={work.global_batch_size}"]:
            key, _, value = item.partition("=")
            section, name = key.split(".")
            data[section][name] = yaml.safe_load(value)
        try:
            validate_config(config_from_dict(data, source="layout planner"), world_size=layout.gpus)
        except ConfigError as e:
            return str(e).splitlines()[0]
        return None

    return validate


def stage_memory(cfg, layout: Layout, work: Workload) -> MemoryEstimate:
    """The memory model's estimate of a resolved config run under `layout` (`layout_of`)."""
    return estimate(ModelDims.from_config(cfg), layout, work, a=2 if cfg.model.bf16 else 4,
                    trainable=cfg.train.trainable_params, saves=saves_checkpoints(cfg))


def stage_host_memory(cfg, layout: Layout, work: Workload, gpus_per_node: int) -> HostEstimate:
    """The host-memory model's estimate of a resolved config run under `layout`, per GPU and per node."""
    return host_estimate(ModelDims.from_config(cfg), layout, work, gpus_per_node, a=2 if cfg.model.bf16 else 4,
                         trainable=cfg.train.trainable_params, saves=saves_checkpoints(cfg),
                         pinned_staging=cfg.checkpoint.pinned_staging)


def saves_checkpoints(cfg) -> bool:
    """Whether the config's run saves checkpoints (a `checkpoint.save` directory), synchronously or not."""
    return bool(cfg.checkpoint.save)


def stage_step(cfg, layout: Layout, work: Workload, cluster: Cluster) -> StepTime:
    """The time model's step of a resolved config under `layout` on `cluster` (the config's recompute modules and
    ZeRO-2 reduce, the cluster's GPU-kind calibration)."""
    from pretrain.layout import timing

    variant = {"selective_modules": tuple(cfg.model.recompute_modules or ("core_attn", "moe"))}
    return timing.step_time(ModelDims.from_config(cfg), layout, work, cluster,
                            timing.load_calibration(cluster.gpu_kind), variant=variant)


def check_stage(cfg, world_size: int, cluster: str = "h100-nvl-ib400", headroom: float = 0.10,
                bubble_bound: float = 0.10) -> Optional[str]:
    """One line saying why a stage's config cannot run well on `world_size` GPUs of `cluster` (memory over
    (1 - headroom) of the GPU or of the node's host memory, pipeline bubble over `bubble_bound` by the textbook
    formula or by megatron's schedule simulated with the stage's virtual stages, a divisibility rule), or None."""
    from pretrain.layout.types import cluster_preset

    gpus = cluster_preset(cluster, world_size)
    layout, work = layout_of(cfg, world_size)
    dims = ModelDims.from_config(cfg)
    p = cfg.parallel
    model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    reason = (f"world size % (tp*pp*cp): {world_size} GPUs over TP x PP x CP = {model_parallel}"
              if world_size % model_parallel else None)  # layout_of's DP rounds down: the rest would idle
    reason = reason or refusal(dims, layout, work) or bubble_refusal(layout, bubble_bound)
    if reason is None:
        reason = memory_refusal(stage_memory(cfg, layout, work), gpus.memory_bytes, headroom) or host_refusal(
            stage_host_memory(cfg, layout, work, gpus.gpus_per_node), gpus.host_memory_bytes, headroom)
    if reason is None and layout.pp > 1:  # megatron's schedule with the stage's own virtual stages
        reason = simulated_bubble_refusal(layout, stage_step(cfg, layout, work, gpus), bubble_bound)
    return f"{layout.short()} on {world_size} x {gpus.gpu_kind}: {reason}" if reason else None


__all__: Sequence[str] = ["Candidate", "SearchOptions", "SearchResult", "check_stage", "config_validator",
                          "configured_layout", "layout_of", "pipeline_costs", "refusal", "saves_checkpoints", "search",
                          "simulated_bubble_refusal", "splits", "stage_host_memory", "stage_memory", "stage_step",
                          "uneven_layout"]
