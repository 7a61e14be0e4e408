"""Host memory per node of a layout: what each GPU's processes hold in host RAM, times the GPUs of a node.

Per GPU (bytes), on the pipeline rank that needs the most:

    process              PROCESS_BYTES, the trainer's own resident memory (glm5-proxy on one H200: 2.18-2.27 GiB
                         before its first save; data workers not counted)
    checkpoint_staging   W x PINNED_ROUNDING: a save copies the tensors the rank writes (W) to pinned host memory,
                         which PyTorch's caching host allocator rounds up to a power of two and keeps for the next
                         save: in the trainer (synchronous, `checkpoint.pinned_staging: true`) or in the writer
                         process (asynchronous). With `pinned_staging: false`, W in pageable memory during the save,
                         freed after it. W is the rank's weights (2 bytes an element), main weights (4) and optimizer
                         state (4 for Muon's matrices, 8 for AdamW) over the ranks that write the same replica:
                         megatron's fully parallel save spreads replicated tensors over the data-parallel ranks, and
                         ZeRO-2 owners write their own share, so W = per-replica bytes / DP x CP for dense
                         parameters, / the expert-data-parallel size for routed experts.
    activation_offload   the saved activations that wait in host memory at the peak of the schedule
                         (`activations.offloaded_bytes`) x PINNED_ROUNDING: pinned buffers from the same allocator.

PINNED_ROUNDING = 1.3 is measured: a synchronous save kept 1.275 x W on glm5-proxy (27.78 GiB for W = 21.79 GiB on
one H200; 13.90 GiB per rank on two) and 1.33 x on a 48-expert glm5-tiny (2.04 GB for 1.54 GB written); sizes spread
evenly in log scale would give 1 / ln 2 = 1.44, at most 2. The offload term is the activation model's bytes with the
same rounding, not measured on a host. A layout fits when GPUs per node x the largest rank's total stays under
(1 - headroom) x `Cluster.host_memory_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple

from pretrain.layout.activations import ranks_offloaded_bytes
from pretrain.layout.memo import Memo
from pretrain.layout.memory import ParamShard, format_terms, rank_parameters, replica_groups, state_terms
from pretrain.layout.types import GiB, Layout, ModelDims, Workload

PINNED_ROUNDING = 1.3
PROCESS_BYTES = 2.2 * GiB


@dataclass
class HostEstimate:
    """Host bytes per GPU by term on pipeline rank `rank`; `per_node` for `gpus_per_node` GPUs like it."""

    terms: Dict[str, float]
    rank: int
    gpus_per_node: int

    @property
    def per_gpu(self) -> float:
        return sum(self.terms.values())

    @property
    def per_node(self) -> float:
        return self.per_gpu * self.gpus_per_node

    def format(self) -> str:
        return format_terms(self.terms)


def written_bytes(shards: List[ParamShard], layout: Layout, bf16: bool = True) -> float:
    """W: the checkpoint bytes one rank writes (module docstring): one replica's weights, main weights and optimizer
    state (`state_terms` without ZeRO-2's sharding), each group's over the ranks that share it."""
    whole = replace(layout, zero="ddp")
    total = 0.0
    for group, ranks in replica_groups(layout).items():
        terms = state_terms([s for s in shards if s.group == group], whole, bf16)
        total += (terms["weights"] + terms["main_weights"] + terms["optimizer_state"]) / ranks
    return total


def host_estimate(dims: ModelDims, layout: Layout, work: Workload, gpus_per_node: int, a: int = 2,
                  trainable: str = "all", saves: bool = False, pinned_staging: bool = True) -> HostEstimate:
    """Host bytes per GPU on the pipeline rank that needs the most (module docstring). `saves`: the run saves
    checkpoints; `pinned_staging`: `checkpoint.pinned_staging` (asynchronous saves stage pinned in any case)."""
    best: Optional[Tuple[float, Dict[str, float], int]] = None  # (per GPU, terms, rank)
    ranks = tuple(range(layout.pp)) if layout.pipeline_layout else tuple(sorted({0, layout.pp - 1}))
    written = ranks_written_bytes(dims, layout, ranks, trainable, a == 2) if saves else ()
    offloaded = ranks_offloaded_bytes(dims, layout, work, ranks, a) if layout.activation_offload else ()
    for i, rank in enumerate(ranks):
        terms = {"process": PROCESS_BYTES}
        if saves:
            terms["checkpoint_staging"] = written[i] * (PINNED_ROUNDING if pinned_staging else 1.0)
        if layout.activation_offload:
            terms["activation_offload"] = offloaded[i] * PINNED_ROUNDING
        per_gpu = sum(terms.values())  # HostEstimate.per_gpu
        if best is None or per_gpu > best[0]:
            best = (per_gpu, terms, rank)
    return HostEstimate(best[1], best[2], min(gpus_per_node, layout.gpus))


_WRITTEN = Memo()  # a layout's ranks' written bytes, by the fields they read
_RANK_WRITTEN = Memo()  # one rank's, by its shards and the fields written_bytes reads


def ranks_written_bytes(dims: ModelDims, layout: Layout, ranks: Tuple[int, ...], trainable: str = "all",
                        bf16: bool = True) -> Tuple[float, ...]:
    """`written_bytes` of each of `ranks`, remembered by the fields they read (`pretrain.layout.memo`): the split
    and the optimizer, not ZeRO or its reduce mode (a replica is written whole) nor anything of the activations."""
    groups = replica_groups(layout)  # CP and DP enter only as the replica groups
    fields = (groups["dense"], groups["expert"], layout.optimizer, bf16)

    def rank(r: int) -> float:
        shards = rank_parameters(dims, layout, r, trainable)
        return _RANK_WRITTEN.get((tuple(shards), fields), lambda: written_bytes(shards, layout, bf16))

    key = (dims, trainable, ranks, layout.pp, layout.vpp, layout.pipeline_layout, layout.tp, layout.ep, layout.etp,
           fields)
    return _WRITTEN.get(key, lambda: tuple(rank(r) for r in ranks))


def host_refusal(host: HostEstimate, capacity: float, headroom: float) -> Optional[str]:
    """'host memory: ...' when a node's GPUs need more than (1 - headroom) x `capacity`, else None."""
    bound = (1 - headroom) * capacity
    if host.per_node > bound:
        return (f"host memory: {host.per_node / GiB:.0f} GiB per node ({host.gpus_per_node} GPUs x "
                f"{host.per_gpu / GiB:.1f}: {host.format()}) over {bound / GiB:.0f} GiB ({1 - headroom:.0%} of "
                f"{capacity / GiB:.0f}) on pipeline rank {host.rank}")
    return None
