"""The time model's collectives (`pretrain.layout.timing`, docs/layout.md): a group's bandwidth by where its ranks
sit, a ring collective's time, and the rows an expert-parallel all-to-all sends off the rank.

A group's bandwidth is NVLink's when its ranks share a node and InfiniBand's otherwise, with megatron's rank order
tp-cp-ep-dp-pp (a group of size n and stride s stays inside a node when n x s <= gpus_per_node), each scaled by the
calibrated bus-bandwidth fraction.
"""

from __future__ import annotations

import math
from typing import Tuple

from pretrain.layout.calibration import Calibration
from pretrain.layout.types import Cluster, ModelDims

__all__ = ["group_bw", "offrank_rows", "ring"]


def group_bw(cluster: Cluster, calib: Calibration, size: int, stride: int) -> Tuple[float, bool]:
    """(bus bandwidth, inside one node) of a group of `size` ranks `stride` apart (megatron's rank order)."""
    intra = size * stride <= cluster.gpus_per_node
    if intra:
        return cluster.intra_node_bw * calib["collective.busbw_fraction_intra"], True
    return cluster.inter_node_bw * calib["collective.busbw_fraction_inter"], False


def ring(nbytes: float, n: int, bw: float, latency: float, allreduce: bool = False) -> float:
    """Ring all-gather / reduce-scatter (all-reduce: twice) of `nbytes` (the whole tensor) over n ranks."""
    if n <= 1:
        return 0.0
    return (2 if allreduce else 1) * nbytes * (n - 1) / n / bw + latency


def offrank_rows(tokens: float, dims: ModelDims, ep: int, dispatcher: str) -> float:
    """Rows a rank sends to other EP ranks per all-to-all, uniform routing."""
    if ep <= 1 or not dims.num_experts:
        return 0.0
    k, e = dims.topk, dims.num_experts
    if dispatcher == "alltoall_dedup":
        local = e // ep
        p_none = math.comb(e - local, k) / math.comb(e, k) if e - local >= k else 0.0
        return tokens * (ep - 1) * (1 - p_none)
    return tokens * k * (ep - 1) / ep
