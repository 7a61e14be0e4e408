"""Packed documents in O(S) memory: which keys a query may see, and where RoPE counts its position from.

A packed window of S tokens holds several documents (`data_pipeline.packing`). With `reset_attention_mask` a
query at global position g sees the keys

    visible(g, j) = start(g) <= j <= g,       start(g) = the first position of g's document,

(documents are contiguous, so "same document and causal" is one key range); with `reset_position_ids` RoPE
rotates it by pos(g) = g - origin(g), origin(g) its document's first position. Both are O(S) per sequence.
The model receives them as one int32 tensor, the *document layout*, over the whole (global) sequence:

    layout[b, 0, g] = start(g)      (0 everywhere when documents may attend to each other)
    layout[b, 1, g] = g - position_ids[b, g]     (0 everywhere when positions run 0 .. S-1)

RoPE depends only on the distance between a query and a key, so within isolated documents restarted positions
change nothing but rounding; they change the result where documents see each other (`reset_position_ids` without
`reset_attention_mask`), which is what tests/test_hf_parity.py checks against transformers.

With a context-parallel chunk assignment (`parallel.cp_chunk_assignment: work`, `parallel.cp_load_balance`) the
layout has a third row: layout[b, 2, :n] = the n chunk ids rank by rank (each rank's in increasing order), -1 after
(`with_assignment`; read back by `layout_assignment`, the same for every row b). Carried in the tensor, it survives
activation checkpointing (which detaches its inputs) and reaches every layer and stage that gets the layout.

It travels in megatron's `attention_mask` argument (a tensor there, so megatron's activation checkpointing
keeps it), from `pretrain.training.step` to every attention layer; a [b, 2, S] int32 tensor is never one of
megatron's masks (those are bool or float [b|1, 1, s, s]). Under context parallelism it is not split: each rank
keeps all S entries (the keys are global), and its queries' global positions come from
`parallel.context_parallel.local_positions`.

`AttentionPlan` turns a layout and the queries' global positions into *pieces*: a run of consecutive query rows
of one document and the key range they attend to, [start(document), last query + 1). Every piece is causal
attention aligned to its last key (bottom-right); when it starts at its document's first position it is plain
causal (square). The plan is computed on the host once per layout (one device-to-host copy of the segment
starts, cached on the tensor for the other layers and for recompute), so its cost is O(S) per micro-batch.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

Piece = Tuple[int, int, int, int]  # local query rows [q0, q1), global keys [k0, k1); k1 - k0 >= q1 - q0


def document_layout(cu_seqlens: Optional[torch.Tensor], position_ids: Optional[torch.Tensor], batch: int,
                    seq: int) -> Optional[torch.Tensor]:
    """The layout [b, 2, S] of a collated batch, or None when it holds nothing a causal model would not assume.

    `cu_seqlens`: `packing.collate_batch`'s offsets into the flattened [b * S] stream (attention segments);
    `position_ids` [b, S]. Host tensors: O(b S) work, no S x S intermediate."""
    starts = torch.zeros(batch, seq, dtype=torch.int32)
    if cu_seqlens is not None and cu_seqlens.numel() > batch + 1:
        cu = cu_seqlens.to(torch.int64).cpu()
        flat = torch.arange(batch * seq)
        seg = torch.bucketize(flat, cu[1:-1], right=True)  # segment of every token of the stream
        starts = (cu[seg] - (flat // seq) * seq).view(batch, seq).to(torch.int32)
    origins = torch.zeros(batch, seq, dtype=torch.int32)
    if position_ids is not None:
        origins = (torch.arange(seq) - position_ids.to(torch.int64).cpu()).to(torch.int32).view(batch, seq)
    if not bool(starts.any()) and not bool(origins.any()):
        return None
    return torch.stack([starts, origins], dim=1)


def is_document_layout(mask) -> bool:
    """Whether an `attention_mask` argument is a document layout (else: None or one of megatron's masks)."""
    return torch.is_tensor(mask) and mask.dtype == torch.int32 and mask.dim() == 3 and mask.shape[1] in (2, 3)


def with_assignment(layout: torch.Tensor, assignment) -> torch.Tensor:
    """`layout` [b, 2, S] with a context-parallel chunk `assignment` (per rank its chunk ids) as its third row."""
    ids = [k for chunks in assignment for k in chunks]
    row = torch.full((layout.shape[0], 1, layout.shape[-1]), -1, dtype=layout.dtype, device=layout.device)
    row[:, 0, :len(ids)] = torch.tensor(ids, dtype=layout.dtype)
    return torch.cat([layout[:, :2], row], dim=1)


def host_layout(layout: torch.Tensor) -> torch.Tensor:
    """The layout as int64 on the host: one device-to-host copy per layout tensor (cached on it)."""
    host = getattr(layout, "_host_copy", None)
    if host is None:
        host = layout.detach().to("cpu", torch.int64)
        layout._host_copy = host
    return host


def layout_assignment(layout: Optional[torch.Tensor], cp_size: int):
    """The chunk assignment a layout carries (`with_assignment`) for `cp_size` ranks, or None: the zigzag split."""
    if cp_size == 1 or layout is None or not is_document_layout(layout) or layout.shape[1] < 3:
        return None
    row = host_layout(layout)[0, 2]
    ids = row[row >= 0].tolist()
    if len(ids) % cp_size or sorted(ids) != list(range(len(ids))):
        raise ValueError(f"the document layout's chunk assignment ({len(ids)} chunk ids) does not share its chunks "
                         f"equally over {cp_size} context-parallel ranks")
    per = len(ids) // cp_size
    return tuple(tuple(ids[r * per:(r + 1) * per]) for r in range(cp_size))


def query_blocks(s: int, cp_size: int = 1, cp_rank: int = 0, t: Optional[int] = None,
                 assignment=None) -> Tuple[Tuple[int, int, int]]:
    """(first local row, first global position, rows) of each contiguous run of a rank's `s` queries: the last s
    of t keys without context parallelism, the rank's two chunks with it (`parallel.context_parallel`), or its
    chunks of a chunk `assignment` (`parallel.cp_load_balance`)."""
    if cp_size == 1:
        return ((0, (t if t is not None else s) - s, s),)
    if assignment is not None:
        from parallel.context_parallel import query_runs

        return query_runs(s, cp_size, cp_rank, assignment)
    from parallel.context_parallel import chunk_ids

    c = s // 2
    first, second = chunk_ids(cp_size, cp_rank)
    return ((0, first * c, c), (c, second * c, c))


@dataclass
class AttentionPlan:
    """Host-side description of one layout for one set of query blocks (see the module docstring)."""

    pieces: List[List[Piece]]  # per batch row
    isolated: bool  # documents do not attend to each other
    positions_reset: bool  # some position differs from its global index
    max_q: int
    max_k: int


def _document_bounds(starts: torch.Tensor) -> torch.Tensor:
    """starts [S] (non-decreasing) -> the documents' boundaries [0, ..., S]."""
    s = starts.numel()
    cut = (starts[1:] != starts[:-1]).nonzero().flatten() + 1
    return torch.cat([torch.zeros(1, dtype=torch.int64), cut, torch.full((1,), s, dtype=torch.int64)])


def attention_plan(layout: torch.Tensor, blocks: Sequence[Tuple[int, int, int]]) -> AttentionPlan:
    """The pieces of `layout` [b, 2, S] for query `blocks` (`query_blocks`), cached on the layout tensor."""
    key = tuple(blocks)
    cache = getattr(layout, "_document_plans", None)
    if cache is None:
        cache = {}
        layout._document_plans = cache
    if key in cache:
        return cache[key]
    host = host_layout(layout)
    pieces, max_q, max_k = [], 1, 1
    for row in host:
        bounds = _document_bounds(row[0]).tolist()
        row_pieces: List[Piece] = []
        for l0, g0, n in blocks:
            g1 = g0 + n
            # documents [d0, d1) meeting [g0, g1): from the one holding g0 to the one holding g1 - 1
            i = bisect.bisect_right(bounds, g0) - 1
            while i < len(bounds) - 1 and bounds[i] < g1:
                d0, d1 = bounds[i], bounds[i + 1]
                q0, q1 = max(g0, d0), min(g1, d1)
                row_pieces.append((l0 + q0 - g0, l0 + q1 - g0, d0, q1))
                max_q, max_k = max(max_q, q1 - q0), max(max_k, q1 - d0)
                i += 1
        pieces.append(row_pieces)
    plan = AttentionPlan(pieces=pieces, isolated=bool(host[:, 0].any()), positions_reset=bool(host[:, 1].any()),
                         max_q=max_q, max_k=max_k)
    cache[key] = plan
    return plan


def rope_positions(layout: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
    """pos(g) = g - origin(g) of the queries at global positions `query_positions` [s] -> int64 [b, s]."""
    g = query_positions.to(layout.device, torch.int64)
    return g[None, :] - layout[:, 1, g].to(torch.int64)


def segment_starts(layout: torch.Tensor) -> torch.Tensor:
    """start(j) of every key [b, S] (int64): equal for keys of one document (`dsa.indexer.VisibleKeys`)."""
    return layout[:, 0].to(torch.int64)


__all__ = [
    "AttentionPlan",
    "attention_plan",
    "document_layout",
    "host_layout",
    "is_document_layout",
    "layout_assignment",
    "query_blocks",
    "rope_positions",
    "segment_starts",
    "with_assignment",
]
