"""Where a model sits over the pipeline ranks (`pipeline_plan`): every virtual stage's entries (megatron's layout
letters), the decoder layers per rank and per virtual stage, the ranks of the embedding, MTP, loss and final norm,
and the kinds of layer each rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, Optional, Tuple

from pretrain.layout.types import Layout, ModelDims


def pipeline_stages(dims: ModelDims, layout: Layout) -> Tuple[str, ...]:
    """The entries of every virtual stage (megatron's letters: E embedding, t decoder layer, m MTP depth, L output
    layer and loss; stage i = vpp_rank x PP + pp_rank): `layout.pipeline_layout` parsed, or the even split."""
    return pipeline_plan(dims, layout).stages


@dataclass(frozen=True)
class PipelinePlan:
    """Where the model sits over the pipeline ranks (`pipeline_plan`); a rank is -1 where nothing holds the piece."""

    stages: Tuple[str, ...]  # entries per virtual stage
    layers: Tuple[Tuple[int, ...], ...]  # decoder layers per pipeline rank, its virtual stages' in order
    stage_layers: Tuple[Tuple[int, ...], ...]  # decoder layers per virtual stage
    embedding_rank: int
    mtp_rank: int
    loss_rank: int
    norm_rank: int  # the decoder's final norm: with its last layer
    kinds: Tuple[Tuple[Tuple[Tuple[int, bool], int], ...], ...]  # per rank: ((MoE, DSA), count) of its layers

    def special(self, rank: int) -> bool:
        """Whether the rank holds more than decoder layers (embedding, MTP, loss or the final norm)."""
        return rank in (self.embedding_rank, self.mtp_rank, self.loss_rank, self.norm_rank)


def pipeline_plan(dims: ModelDims, layout: Layout) -> PipelinePlan:
    return _plan(dims, layout.pp, layout.vpp, layout.pipeline_layout)


@lru_cache(maxsize=4096)
def _plan(dims: ModelDims, pp: int, vpp: int, pipeline_layout: Optional[str]) -> PipelinePlan:
    if pipeline_layout:
        from pretrain.config.pipeline_layout import parse_layout

        stages = ["".join(s) for s in parse_layout(pipeline_layout)]
    else:
        n = pp * vpp
        if dims.num_layers % n:
            raise ValueError(f"{dims.num_layers} layers over PP {pp} x VPP {vpp} do not split evenly; "
                             "give the layout's pipeline_layout")
        stages = ["t" * (dims.num_layers // n) for _ in range(n)]
        stages[0] = "E" + stages[0]
        stages[-1] += "m" * dims.mtp_depths + "L"
    stage_layers, first = [], 0
    for stage in stages:
        stage_layers.append(tuple(range(first, first + stage.count("t"))))
        first += stage.count("t")
    layers = tuple(tuple(i for v in range(r, len(stages), pp) for i in stage_layers[v]) for r in range(pp))

    def rank_of(letter: str) -> int:
        return next((i % pp for i, s in enumerate(stages) if letter in s), -1)

    norm = next((r for r in range(pp) if dims.num_layers - 1 in layers[r]), -1)
    kinds = []
    for rank_layers in layers:
        count: Dict[Tuple[int, bool], int] = {}
        for i in rank_layers:
            key = (dims.moe_pattern[i], dims.dsa_layers[i])
            count[key] = count.get(key, 0) + 1
        kinds.append(tuple(sorted(count.items())))
    return PipelinePlan(tuple(stages), layers, tuple(stage_layers), rank_of("E"), rank_of("m"), rank_of("L"), norm,
                        tuple(kinds))
