"""A balanced `parallel.pipeline_model_parallel_layout` from a cost model (docs/parallelism.md, pipeline section).

    python -m pretrain.tools.pipeline_split --config configs/models/glm5-proxy.yaml --pp 2 --vpp 2 [overrides]

prints the layout, the overrides to paste, and each stage's share of the work next to megatron's even split.
Megatron-LM takes the layout as an explicit string (`--pipeline-model-parallel-layout`); so does this project:
the tool prints one, the config keeps it, and a resumed run never moves layers because a cost estimate changed.

Cost of each entry, per token, in training FLOPs (forward + backward, `pretrain.training.flops`):

    t  one decoder layer, dense or MoE FFN, DSA as the config trains it       layer_training_flops
    L  the output head h x V and its cross-entropy, once for the main prediction and once per MTP depth
       (megatron computes every MTP depth's logits and loss in the post-process stage, the one holding L)
    m  one MTP depth: eh_proj and the MTP layer (the last layer's spec); its head runs with L
    E  the embedding

The embedding's look-up and the cross-entropy over V are memory-bound, not matrix work; they count as
bytes x `flop_per_byte` (default 989.4 TFLOP/s / 3.35 TB/s, an H100 SXM's bf16 peak over its memory
bandwidth): E moves 14 h bytes per token (the bf16 row read and written, its gradient read and added into
fp32), each cross-entropy 16 V (fp32 logits written and read, their gradient written and read).

The split: the entries in model order (E, t_0 .. t_{n-1}, the MTP depths as one block, L) cut into
PP x VPP consecutive non-empty stages. Without virtual stages, the minimax split (exact dynamic program) of the
estimated step m x (the busiest rank's work) + (p - 1) x (the slowest stage's). With them, the split and
megatron's `microbatch_group_size_per_vp_stage` whose schedule, simulated op by op in megatron's interleaved order
(`pretrain.layout.pipeline_schedule`), is shortest: unequal virtual stages make the interleaved schedule wait where
the closed form does not see it (glm5-proxy, PP=2 x VPP=2 on 2 x H200: 0.88 of one GPU against 0.86 for the closed
form's layout, docs/parallelism.md). `--closed-form` prints the closed form's choice (`balanced_layout`, what the
layout planner's search uses; the closed form's search itself is `pretrain.tools.split_search`). With untied
embeddings the MTP block may end a stage of its own before the last, which then holds L alone (GLM-5's placement);
a stage may start only at a layer whose DSA indexer is "full" (`model.dsa_indexer_types`).
"""

from __future__ import annotations

import argparse
import itertools
from functools import lru_cache
from typing import List, NamedTuple, Optional, Sequence, Tuple

from pretrain.config.pipeline_layout import format_layout, stage_entries
from pretrain.config.schema import GLM5Config
from pretrain.layout.pipeline_schedule import best_split, even_sizes, forward_shares, quick_split, simulated_step
# the closed-form split (`pretrain.tools.split_search`), this tool's API too: tests and benchmarks import it from here
from pretrain.tools.split_search import balanced_split, interleaved_split, step_time
from pretrain.training.flops import (
    layer_training_flops,
    mtp_eh_proj_training_flops,
    output_head_training_flops,
)

H100_FLOP_PER_BYTE = 989.4e12 / 3.35e12


def entry_costs(cfg: GLM5Config, flop_per_byte: float = H100_FLOP_PER_BYTE,
                gpu: Optional[str] = None) -> Tuple[List[str], List[float]]:
    """The model's entries in order (E, t.., one "m"*D block, L) and their training cost per token: FLOPs, or with
    `gpu` ("h100", "h200") the layout planner's calibrated seconds (`calibrated_costs`)."""
    from pretrain.config import moe_layer_pattern

    if gpu:
        return calibrated_costs(cfg, gpu)
    m = cfg.model
    dsa = m.experimental_attention_variant == "dsa"
    kwargs = dict(dsa_sparse=dsa and m.dsa_sparse_attention, dsa_indexer=dsa and m.dsa_indexer_loss_coeff > 0)
    seq = cfg.data.seq_length
    pattern = moe_layer_pattern(m)
    cross_entropy = 16 * m.vocab_size * flop_per_byte
    head = output_head_training_flops(m) + cross_entropy
    entries = ["E"] + ["t"] * m.num_layers
    costs = [14 * m.hidden_size * flop_per_byte]
    costs += [layer_training_flops(m, seq, bool(is_moe), **kwargs) for is_moe in pattern]
    depths = m.mtp_num_layers or 0
    if depths:
        depth = mtp_eh_proj_training_flops(m) + layer_training_flops(m, seq, bool(pattern[-1]), **kwargs)
        entries.append("m" * depths)
        costs.append(depths * depth)
    # GPTModel._postprocess runs the MTP block where "m" is, then every head (main and each depth's) where L is;
    # measured on 2 x H200 (glm5-proxy, PP=2): the first rank, holding m*3, ran no output-layer kernel at all.
    return entries + ["L"], costs + [(1 + depths) * head]


def calibrated_costs(cfg: GLM5Config, gpu: str) -> Tuple[List[str], List[float]]:
    """`entry_costs` in seconds per micro-batch from the layout planner's time model calibrated on `gpu`
    (`pretrain.layout.timing.entry_seconds`): the measured speed of each part, where FLOPs alone weigh the output
    head 2.2x too heavy against a decoder layer (glm5-proxy on H200: a head 84 ms, a layer 136 ms per step of
    8 x 16K tokens, against 1.5 : 1 in FLOPs)."""
    from pretrain.config import moe_layer_pattern
    from pretrain.layout.from_config import layout_of
    from pretrain.layout.timing import entry_seconds, load_calibration
    from pretrain.layout.types import ModelDims, cluster_preset

    p = cfg.parallel
    world = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size * max(
        1, p.expert_model_parallel_size)
    layout, work = layout_of(cfg, world)
    sec = entry_seconds(ModelDims.from_config(cfg), layout, work, cluster_preset(f"{gpu}-nvl-ib400", world),
                        load_calibration(gpu))
    entries = ["E"] + ["t"] * cfg.model.num_layers
    costs = [sec["E"]] + [sec["t_moe"] if is_moe else sec["t_dense"] for is_moe in moe_layer_pattern(cfg.model)]
    depths = cfg.model.mtp_num_layers or 0
    if depths:
        entries.append("m" * depths)
        costs.append(depths * sec["m"])
    return entries + ["L"], costs + [sec["L"]]


def simulated_split(costs: Sequence[float], shares: Sequence[float], pp: int, vpp: int, microbatches: int,
                    can_start: Optional[Sequence[bool]] = None) -> Tuple[List[int], int, float]:
    """`pipeline_schedule.best_split` from `interleaved_split`'s split: (stage sizes, micro-batch group, simulated
    step)."""
    start = interleaved_split(costs, pp, vpp, microbatches, can_start)
    return best_split(costs, shares, pp, vpp, microbatches, start, can_start)


def split_inputs(cfg: GLM5Config, flop_per_byte: float = H100_FLOP_PER_BYTE, gpu: Optional[str] = None
                 ) -> Tuple[List[str], List[float], List[bool]]:
    """(entries, their costs per token, whether a stage may start at each) as the split sees them: with tied
    embeddings the MTP block stays with the loss; a stage starts only at a "full" DSA indexer."""
    m = cfg.model
    entries, costs = entry_costs(cfg, flop_per_byte, gpu)
    if m.share_embeddings_and_output_weights and m.mtp_num_layers:  # MTP stays with the loss
        entries, costs = entries[:-2] + [entries[-2] + "L"], costs[:-2] + [costs[-2] + costs[-1]]
    types = m.dsa_indexer_types if m.experimental_attention_variant == "dsa" else None
    can_start = [e != "t" or types is None or types[i - 1] == "full" for i, e in enumerate(entries)]
    return entries, costs, can_start


@lru_cache(maxsize=2048)
def _cached_split(costs: Tuple[float, ...], pp: int, vpp: int, microbatches: int,
                  can_start: Tuple[bool, ...], minimax: bool) -> Tuple[int, ...]:
    """`interleaved_split` (or, `minimax`, `balanced_split` over PP x VPP stages), remembered: the layout search asks
    for the same split of the same model many times."""
    if minimax:
        return tuple(balanced_split(costs, pp * vpp, can_start))
    return tuple(interleaved_split(costs, pp, vpp, microbatches, can_start))


def balanced_stages(entries: Sequence[str], costs: Sequence[float], pp: int, vpp: int, microbatches: int,
                    can_start: Optional[Sequence[bool]] = None) -> List[List[str]]:
    """The balanced stages (lists of entry letters) of `split_inputs`' entries over PP x VPP stages."""
    can = tuple(can_start or [True] * len(costs))
    return _stages(entries, list(_cached_split(tuple(costs), pp, vpp, microbatches, can, False)))


def scheduled_stages(entries: Sequence[str], costs: Sequence[float], pp: int, vpp: int, microbatches: int,
                     can_start: Optional[Sequence[bool]] = None, fused_loss: bool = True
                     ) -> Tuple[Optional[List[List[str]]], int, float]:
    """(stages, micro-batch group, simulated step) for the layout planner's search: of megatron's even split (then
    stages None), the closed-form balanced split (`interleaved_split`) and the split with the smallest largest stage
    (`balanced_split`), the one whose interleaved schedule simulates shortest (`pipeline_schedule.quick_split`)."""
    can_start = list(can_start or [True] * len(costs))
    shares = forward_shares(entries, fused_loss)
    key = (tuple(costs), pp, vpp, microbatches, tuple(can_start))
    candidates = [list(_cached_split(*key, False)), list(_cached_split(*key, True))]
    even = even_sizes(len(costs), pp * vpp)
    if even is not None and all(can_start[i] for i in itertools.accumulate(even[:-1])):
        candidates.insert(0, even)
    sizes, group, step = quick_split(costs, shares, pp, vpp, microbatches, candidates)
    return (None if sizes == even else _stages(entries, sizes)), group, step


def balanced_layout(cfg: GLM5Config, flop_per_byte: float = H100_FLOP_PER_BYTE,
                    microbatches: Optional[int] = None, gpu: Optional[str] = None) -> List[List[str]]:
    """The balanced stages (lists of entry letters) for the config's PP x VPP, by the closed-form estimate
    (`step_time`; what the layout planner's search uses)."""
    p = cfg.parallel
    entries, costs, can_start = split_inputs(cfg, flop_per_byte, gpu)
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1
    return balanced_stages(entries, costs, pp, vpp, _microbatches(cfg, microbatches), can_start)


def scheduled_layout(cfg: GLM5Config, flop_per_byte: float = H100_FLOP_PER_BYTE, microbatches: Optional[int] = None,
                     gpu: Optional[str] = None) -> Tuple[List[List[str]], Optional[int], float]:
    """(stages, micro-batch group per virtual stage or None, simulated step / ideal) for the config's PP x VPP:
    with virtual stages the split and megatron's `microbatch_group_size_per_vp_stage` that give the shortest
    simulated interleaved schedule (`simulated_split`); without, `balanced_layout`'s."""
    p = cfg.parallel
    entries, costs, can_start = split_inputs(cfg, flop_per_byte, gpu)
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1
    m_count = _microbatches(cfg, microbatches)
    ideal = m_count * sum(costs) / pp
    if vpp == 1:
        sizes = interleaved_split(costs, pp, 1, m_count, can_start)
        return _stages(entries, sizes), None, step_time(sizes, costs, pp, m_count) / ideal
    shares = forward_shares(entries, cfg.model.output_loss_backend in ("chunked", "liger"))
    sizes, group, step = simulated_split(costs, shares, pp, vpp, m_count, can_start)
    return _stages(entries, sizes), group, step / ideal


def _stages(entries: Sequence[str], sizes: Sequence[int]) -> List[List[str]]:
    """Stages as lists of entry letters, from stage sizes in entries."""
    out, start = [], 0
    for size in sizes:
        out.append([letter for e in entries[start:start + size] for letter in e])
        start += size
    return out


def _microbatches(cfg: GLM5Config, microbatches: Optional[int]) -> int:
    return microbatches or max(1, cfg.train.global_batch_size // cfg.train.micro_batch_size)


class ScheduleEstimate(NamedTuple):
    busiest: float  # the busiest rank's work / an ideal pipeline's step
    simulated: float  # the simulated schedule / the ideal step
    textbook: float  # busiest x (1 + (PP - 1) / (VPP m)): what the layout planner's bubble term assumes
    microbatches: int  # per pipeline per step
    ideal_s: float  # the ideal step: every entry's cost x micro-batches / PP


def simulated_schedule(cfg: GLM5Config, world_size: int, gpu: Optional[str] = None) -> Optional[ScheduleEstimate]:
    """The config's own stages on `world_size` GPUs, run in megatron's schedule (`pipeline_schedule.simulate`), the
    entries weighed by the planner's calibration for `gpu` (FLOPs without one); None without pipeline stages."""
    from pretrain.layout.pipeline_schedule import simulate

    p = cfg.parallel
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1
    if pp == 1:
        return None
    entries, costs, _ = split_inputs(cfg, gpu=gpu)
    shares = forward_shares(entries, cfg.model.output_loss_backend in ("chunked", "liger"))
    dp = max(world_size // (p.tensor_model_parallel_size * pp * p.context_parallel_size), 1)
    m = max(cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp), 1)
    letters = []  # per entry letter: (cost, forward share); an "m"*D entry spans D letters
    for e, c, f in zip(entries, costs, shares):
        letters += [(c / len(e), f)] * len(e)
    fwd, bwd, i = [], [], 0
    for stage in stage_entries(cfg.model, p):
        chunk = letters[i:i + len(stage)]
        i += len(stage)
        fwd.append(sum(c * f for c, f in chunk))
        bwd.append(sum(c * (1 - f) for c, f in chunk))
    group = (p.microbatch_group_size_per_vp_stage or pp) if vpp > 1 else None
    sim = simulate(fwd, bwd, pp, m, group=group)
    ideal = sum(costs) * m / pp
    busiest = max(sim.busy) / ideal
    return ScheduleEstimate(busiest, sim.step / ideal, busiest * (1 + (pp - 1) / (vpp * m)), m, ideal)


def stage_costs(cfg: GLM5Config, stages: List[List[str]], flop_per_byte: float = H100_FLOP_PER_BYTE,
                gpu: Optional[str] = None) -> List[float]:
    """Each stage's cost (the entries' costs, in model order)."""
    entries, costs = entry_costs(cfg, flop_per_byte, gpu)
    per_letter = []
    for e, c in zip(entries, costs):
        per_letter += [c / len(e)] * len(e)
    out, start = [], 0
    for stage in stages:
        out.append(sum(per_letter[start:start + len(stage)]))
        start += len(stage)
    return out


def report(cfg: GLM5Config, flop_per_byte: float = H100_FLOP_PER_BYTE, microbatches: Optional[int] = None,
           gpu: Optional[str] = None, closed_form: bool = False) -> str:
    """The table the CLI prints; its last line, `overrides: ...`, is the chosen layout (the simulated schedule's
    best, or with `closed_form` the closed-form balance) to paste."""
    import dataclasses

    p = cfg.parallel
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1
    m_count = _microbatches(cfg, microbatches)
    layout, group, _ = scheduled_layout(cfg, flop_per_byte, m_count, gpu)
    even_cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(p, pipeline_model_parallel_layout=None))
    rows = [("balanced", layout, group)]
    if vpp > 1:
        rows.append(("closed-form balance (the planner's)", balanced_layout(cfg, flop_per_byte, m_count, gpu), pp))
    try:
        rows.append(("even (no layout)", stage_entries(even_cfg.model, even_cfg.parallel), pp))
    except ValueError as e:  # ConfigError: the even split does not exist at these sizes
        rows.append(("even (no layout)", str(e), pp))
    unit, scale = ("ms per micro-batch", 1e-3) if gpu else ("GFLOPs per token", 1e9)
    lines = [f"PP={pp} x VPP={vpp}, {m_count} micro-batches per step; cost in " + (
        f"{unit}, the layout planner's {gpu} calibration" if gpu else f"training {unit} (FLOP per byte {flop_per_byte:.0f})")]
    entries = split_inputs(cfg, flop_per_byte, gpu)[0]
    shares = forward_shares(entries, cfg.model.output_loss_backend in ("chunked", "liger"))
    for name, stages, g in rows:
        if isinstance(stages, str):
            lines.append(f"{name}: not possible: {stages}")
            continue
        costs = stage_costs(cfg, stages, flop_per_byte, gpu)
        ideal = sum(costs) / len(costs)
        ranks = [sum(costs[i] for i in range(r, len(costs), pp)) for r in range(pp)]
        lines.append(f"{name}: {format_layout(stages)}" + (f", {g} micro-batches per virtual stage in turn"
                                                           if vpp > 1 else ""))
        lines.append("  stages: " + "  ".join(f"{c / scale:.2f}" for c in costs)
                     + f"   slowest / mean = {max(costs) / ideal:.3f}")
        # the step against an ideal pipeline (every rank's share equal, no bubble)
        estimate = (m_count * max(ranks) + (pp - 1) * max(costs)) / (m_count * sum(costs) / pp)
        line = "  per pipeline rank: " + "  ".join(f"{c / scale:.2f}" for c in ranks) + \
               f"   estimated step / ideal = {estimate:.3f}"
        if vpp > 1:
            sizes = _entry_sizes(entries, stages)
            sim = simulated_step(sizes, split_inputs(cfg, flop_per_byte, gpu)[1], shares, pp, m_count, g)
            line += f", simulated schedule / ideal = {sim / (m_count * sum(costs) / pp):.3f}"
        lines.append(line)
    if closed_form and vpp > 1:
        layout, group = rows[1][1], pp
    vpp_key = f" parallel.virtual_pipeline_model_parallel_size={vpp}" if vpp > 1 else ""
    group_key = f" parallel.microbatch_group_size_per_vp_stage={group}" if group and group != pp else ""
    lines.append(f"overrides: parallel.pipeline_model_parallel_layout='{format_layout(layout)}'{vpp_key}{group_key}")
    return "\n".join(lines)


def _entry_sizes(entries: Sequence[str], stages: List[List[str]]) -> List[int]:
    """Entries per stage, for stages given as letters (an "m"*D entry spans D letters)."""
    letters = [len(e) for e in entries]
    sizes, i = [], 0
    for stage in stages:
        n, count = 0, 0
        while count < len(stage):
            count += letters[i]
            i += 1
            n += 1
        sizes.append(n)
    return sizes


def main(argv=None) -> None:
    import dataclasses

    from pretrain.config import load_config

    parser = argparse.ArgumentParser(description="A balanced pipeline layout for a config's PP x VPP")
    parser.add_argument("--config", required=True)
    parser.add_argument("--pp", type=int, help="pipeline ranks (default: the config's)")
    parser.add_argument("--vpp", type=int, help="virtual stages per rank (default: the config's)")
    parser.add_argument("--microbatches", type=int,
                        help="micro-batches per step per pipeline (default: global / micro batch size, DP=1)")
    parser.add_argument("--flop-per-byte", type=float, default=H100_FLOP_PER_BYTE,
                        help="the GPU's bf16 peak over its memory bandwidth (memory-bound entries' weight)")
    parser.add_argument("--gpu", choices=("h100", "h200"),
                        help="weigh the entries by the layout planner's time model calibrated on this GPU kind "
                             "(measured speeds) instead of FLOPs")
    parser.add_argument("--closed-form", action="store_true",
                        help="emit the closed-form balance (the layout planner's estimate, micro-batch groups of PP) "
                             "instead of the split and group with the shortest simulated schedule")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    # loaded without pipeline stages: the config's own split may not exist at these sizes (what the tool is for)
    flat = ["parallel.pipeline_model_parallel_size=1", "parallel.virtual_pipeline_model_parallel_size=null",
            "parallel.pipeline_model_parallel_layout=null"]
    wanted = load_config(args.config, args.overrides).parallel if args.pp is None or args.vpp is None else None
    cfg = load_config(args.config, list(args.overrides) + flat)
    pp = args.pp or wanted.pipeline_model_parallel_size
    vpp = args.vpp if args.vpp is not None else wanted.virtual_pipeline_model_parallel_size
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(
        cfg.parallel, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None))
    print(report(cfg, args.flop_per_byte, args.microbatches, args.gpu, closed_form=args.closed_form))
    stages = (balanced_layout if args.closed_form else lambda *a: scheduled_layout(*a)[0])(
        cfg, args.flop_per_byte, args.microbatches, args.gpu)
    stage_entries(cfg.model, dataclasses.replace(cfg.parallel, pipeline_model_parallel_layout=format_layout(stages)))


if __name__ == "__main__":
    main()
