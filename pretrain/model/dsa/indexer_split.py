"""The lightning indexer's query rows split across tensor-parallel ranks (docs/dsa.md, "Tensor and context
parallelism").

Tensor parallelism splits the attention heads, but the indexer has one set of index heads shared by all of them:
replicated, every TP rank would score all s query rows against the keys, select the same top-k and form the same
indexer KL. Instead, TP rank r of R takes 1/R of the rows, scores and selects only those, and the selections are
all-gathered (each rank's sparse attention runs its own heads over every row):

    rows(r) = piece r  and  piece 2R - 1 - r     of the s rows cut into 2R equal pieces    (s % 2R == 0)

The pieces pair an early and a late block, so under causal attention every rank scores the same number of
(query, key) pairs (block i of s/2R rows sees ~(i + 1/2) s/2R keys; i + (2R - 1 - i) is the same for every r).
The sequence shard that sequence parallelism gives rank r (rows r s/R .. (r+1) s/R) would not: its last rank
would score (2R - 1)/R^2 of the pairs, 3/4 at R = 2. The indexer reads the gathered sequence either way (with
sequence parallelism, the layer's inputs x and qr are all-gathered, as before); q_I and w are projected for the
rank's rows only, k_I for every key.

The KL is a mean over all b s rows: a rank forms the sum over its rows divided by b s, and the sums add up over
the TP group (`share`: n / s, the rank's fraction). Its target needs every rank's heads at the rank's rows: each
rank sums its own heads' probabilities over all rows (the attention's own work, split by heads) and a
reduce-scatter (`reduce`) hands each rank the sum at its rows, half the bytes of the all-reduce that the
replicated indexer needed. The indexer's parameters stay replicated: their gradient from one rank's rows is a
partial sum, all-reduced over the TP group once per layer and micro-batch with the loss (`sum_over_ranks`), so
every rank holds the whole gradient as before (no `sequence_parallel` tag, which megatron's
`finalize_model_grads` honours only under sequence parallelism).

Context parallelism (`parallel.context_parallel`) already splits the rows: a CP rank's queries are its chunks of
the sequence (two by the zigzag split, or the batch's chunks assigned by work, `parallel.cp_chunk_assignment`, each
rank's in increasing order), scored against the all-gathered keys, and its KL covers those rows only. Under TP x CP
the split above cuts the CP rank's s local rows again (their global positions increase along the rows, so the
paired pieces still balance).

If s is not a multiple of 2R the indexer stays replicated (said once in the log).
"""

from __future__ import annotations

import logging
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from pretrain.model.notices import say_once

log = logging.getLogger(__name__)


def _tp_size_rank(group):
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


class RowSplit:
    """Rank `rank`'s share of `s` query rows (see the module docstring) and the collectives over `group`."""

    def __init__(self, s: int, size: int, rank: int, group, device):
        self.s, self.size, self.rank, self.group = s, size, rank, group
        self.piece = s // (2 * size)
        self.n = 2 * self.piece
        self.share = self.n / s
        self._device = device
        self.rows = self.rows_of(rank)

    @staticmethod
    def create(s: int, group, device) -> Optional["RowSplit"]:
        """The split of `s` rows over the TP group `group`, or None when there is none (one rank, or s not a
        multiple of 2 x TP: the indexer then scores every row, said once in the log)."""
        size, rank = _tp_size_rank(group)
        if size == 1:
            return None
        if s % (2 * size):
            say_once(log, f"DSA indexer: {s} query rows per rank are not a multiple of 2 x TP = {2 * size}, so every "
                          "TP rank scores all rows (replicated); a sequence length per CP rank divisible by 2 x TP "
                          "splits them", level=logging.WARNING)
            return None
        return RowSplit(s, size, rank, group, device)

    def bounds(self, rank: int):
        """The two [r0, r1) row ranges of `rank`, early piece first."""
        p = self.piece
        late = 2 * self.size - 1 - rank
        return (rank * p, (rank + 1) * p), (late * p, (late + 1) * p)

    def rows_of(self, rank: int) -> torch.Tensor:
        """`rank`'s rows (int64, ascending)."""
        (a0, a1), (b0, b1) = self.bounds(rank)
        return torch.cat([torch.arange(a0, a1, device=self._device), torch.arange(b0, b1, device=self._device)])

    def take(self, t: torch.Tensor, dim: int, fn: Optional[Callable] = None) -> torch.Tensor:
        """This rank's rows of `t` (`dim` runs over the s rows): its two pieces, concatenated; given `fn`, the
        concatenation of fn(piece) (a projection reads the pieces in place, no copy of its input)."""
        (a0, a1), (b0, b1) = self.bounds(self.rank)
        pieces = (t.narrow(dim, a0, a1 - a0), t.narrow(dim, b0, b1 - b0))
        return torch.cat([p if fn is None else fn(p) for p in pieces], dim=dim)

    def gather(self, mine: torch.Tensor) -> torch.Tensor:
        """Every rank's rows, in order: mine [b, n, ...] -> [b, s, ...] (all-gather, then the pieces put back)."""
        b, rest = mine.shape[0], mine.shape[2:]
        # as bytes: NCCL and gloo gather no int16 (the packed selections, `indexer.pack_indices`)
        raw = mine.contiguous().view(torch.uint8)
        out = raw.new_empty((self.size * b,) + tuple(raw.shape[1:]))
        dist.all_gather_into_tensor(out, raw, group=self.group)
        out = out.view(mine.dtype).view(self.size, b, 2, self.piece, *rest).transpose(0, 1)  # [b, R, 2, piece, ...]
        early, late = out[:, :, 0], out[:, :, 1].flip(1)  # piece r of rank r; piece 2R-1-r of rank r, reversed
        return torch.cat([early, late], dim=1).reshape(b, self.s, *rest)

    def reduce(self, full: torch.Tensor) -> torch.Tensor:
        """[b, s, ...] partial sums on every rank -> this rank's rows [b, n, ...] summed over the group: two
        reduce-scatters, the early pieces in rank order, the late ones in reverse."""
        p, size = self.piece, self.size
        halves = []
        for order in (range(size), range(2 * size - 1, size - 1, -1)):
            out = full.new_empty((full.shape[0], p) + tuple(full.shape[2:]))
            if order[0] == 0 and full.shape[0] == 1 and full.is_contiguous():  # the early half, in rank order
                dist.reduce_scatter_tensor(out.view(-1), full.narrow(1, 0, size * p).reshape(-1), group=self.group)
            else:
                parts = [full.narrow(1, i * p, p).contiguous() for i in order]  # views when b = 1
                dist.reduce_scatter(out, parts, group=self.group)
            halves.append(out)
        return torch.cat(halves, dim=1)

    def sum_over_ranks(self, tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Partial sums over this rank's rows (the indexer weights' gradients, the loss, the recall) -> summed
        over the group, in one all-reduce of their concatenation (fp32)."""
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        dist.all_reduce(flat, group=self.group)
        out, i = [], 0
        for t in tensors:
            out.append(flat[i:i + t.numel()].view(t.shape).to(t.dtype))
            i += t.numel()
        return out

    def rope(self, rope: Callable, t: torch.Tensor) -> torch.Tensor:
        """RoPE of t [n, b, heads, d] (this rank's rows) by the rows' own positions: `rope(t, rows=)` (the latent
        layer's, `pretrain.model.latent_attention`) rotates a subset of its s rows."""
        return rope(t, rows=self.rows)


__all__ = ["RowSplit"]
