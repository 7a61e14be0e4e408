"""Context parallelism (CP): one sequence split over the ranks of a CP group.

Layout (megatron-core's load-balanced causal split, `get_batch_on_this_cp_rank`): a sequence of S
tokens is cut into 2 * cp chunks of c = S / (2 * cp) tokens, and CP rank r holds chunks r and
2cp - 1 - r, in that order:

    local index i  ->  global position  g(i) = r * c + i                    (i <  c)
                                         g(i) = (2cp - 1 - r) * c + i - c   (i >= c)

Under a causal mask the work of chunk k grows with k, so pairing chunk r with chunk 2cp - 1 - r
gives every rank the same number of (query, key) pairs. Positions stay global: RoPE rotates token
i by g(i) (megatron's `RotaryEmbedding` selects the same chunks when given the full length; with
`data.reset_position_ids`, by its position within its document), a query at g(i) sees the keys at
positions <= g(i) in its own document, and the labels, loss mask and position ids are split like the
tokens. Packed documents travel as the batch's document layout (`pretrain.model.documents`: O(S) segment
starts and position origins over the whole sequence), which is not split: every rank keeps all S entries.

Chunk assignments (`parallel.cp_load_balance`): with packed documents the zigzag pairs no longer hold equal work
(measured on packed real documents: docs/long_context.md). `split_sequence`, `local_positions`,
`gather_sequence`, `split_batch` and `pretrain.model.documents.query_blocks` take an optional `assignment`, each
rank's chunk ids of n equal chunks (n a multiple of cp, as many per rank, each rank's in increasing order), in place
of the zigzag split; positions stay global, so attention, RoPE by position and the loss are unchanged by it.
Training chooses it with `parallel.cp_chunk_assignment: work`: the step computes each micro-batch's assignment from
its document starts and carries it in the document layout (`pretrain.model.documents.with_assignment`), where every
consumer reads it (the split, RoPE positions, the gathers, attention pieces, the DSA indexer's keys and
`roll_sequence`, MTP's shift of tokens and labels).

Attention (MLA, DSA, GQA) all-gathers what is small per token over the CP group, never the
queries: MLA's compressed latent and rope key (kv_lora_rank + qk_pos_emb_head_dim = 576 numbers per
token at GLM-5's shapes, after the latent norm and the rope), the DSA indexer keys (128), GQA's
K/V heads. `gather_sequence` returns them in global order (rank j's block holds chunks j and
2cp - 1 - j, which are put back in place), so each rank attends its own queries to all S keys in
global positions: dense attention without documents per query chunk (chunk k sees keys [0, (k + 1) c), diagonal
aligned to the last key; no mask tensor: `SDPACoreAttention.attend_cp_causal`, a non-causal block over [0, k c)
and a causal square merged by log-sum-exp, `pretrain.model.blockwise_attention`), with documents as causal pieces
per (query chunk, document)
(`pretrain.model.document_attention`: no mask tensor), sparse DSA through its selected key positions
(top-k only within each query's document). The gather's backward sums the gathered tensor's
gradient over the CP group and hands each rank the rows of its own tokens (a reduce-scatter):

    d L / d x_j = sum_r  d L_r / d gather(x)[rows of rank j]

Memory per rank: O(S / cp) for everything but the gathered keys, O(S * 576) for those; traffic per
layer: one all-gather forward and one reduce-scatter backward of S * 576 numbers (plus S * 128 for
the indexer), independent of the number of heads.

Loss: each CP rank holds S / cp tokens, so token means are formed from sums and counts reduced over
the CP group (`global_token_count`), not by averaging the ranks' means.

Source: megatron-core's `get_batch_on_this_cp_rank` and `get_pos_emb_on_this_cp_rank` (the
layout); the all-gather of the latent KV for MLA/DSA follows Megatron-LM's DSA context
parallelism (PR #6058) rather than ring attention, which breaks for MLA (K and V head dims differ).
"""

from __future__ import annotations

import logging
from typing import Dict, Optional

import torch
import torch.distributed as dist

from pretrain.notices import say_once

_log = logging.getLogger(__name__)


def cp_size_and_rank(group: Optional[dist.ProcessGroup]):
    """(size, rank) of a CP group; (1, 0) without one."""
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def chunk_ids(cp_size: int, cp_rank: int):
    """The two global chunks a CP rank holds, in local order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def rank_chunks(cp_size: int, cp_rank: int, assignment=None):
    """(number of chunks, this rank's chunk ids in local order): the zigzag split's two of 2 cp, or an assignment's
    (`parallel.cp_load_balance`: per rank its chunk ids, every rank as many)."""
    if assignment is None:
        return 2 * cp_size, chunk_ids(cp_size, cp_rank)
    if len(assignment) != cp_size:
        raise ValueError(f"a chunk assignment for {len(assignment)} ranks given to a CP group of {cp_size}")
    return sum(len(chunks) for chunks in assignment), tuple(assignment[cp_rank])


def split_sequence(t: torch.Tensor, dim: int, cp_size: int, cp_rank: int, assignment=None) -> torch.Tensor:
    """This rank's part of a tensor whose `dim` is the global sequence: chunks r and 2cp - 1 - r (or the
    `assignment`'s chunks of this rank, `rank_chunks`)."""
    if cp_size == 1:
        return t
    n, mine = rank_chunks(cp_size, cp_rank, assignment)
    length = t.shape[dim]
    if length % n:
        raise ValueError(f"context parallelism: a sequence of {length} tokens cannot be split in {n} equal chunks "
                         f"({cp_size} ranks); make the sequence length a multiple of {n}")
    chunks = t.chunk(n, dim=dim)
    return torch.cat([chunks[k] for k in mine], dim=dim)


def local_positions(local_len: int, cp_size: int, cp_rank: int, device=None, assignment=None) -> torch.Tensor:
    """Global position g(i) of each of this rank's `local_len` tokens (int64 [local_len])."""
    if cp_size == 1:
        return torch.arange(local_len, device=device)
    _, mine = rank_chunks(cp_size, cp_rank, assignment)
    c = local_len // len(mine)
    return torch.cat([torch.arange(k * c, (k + 1) * c, device=device) for k in mine])


def query_runs(local_len: int, cp_size: int, cp_rank: int, assignment=None):
    """(first local row, first global position, rows) of each run of this rank's chunks that are adjacent in the
    sequence (`pretrain.model.documents.query_blocks`)."""
    _, mine = rank_chunks(cp_size, cp_rank, assignment)
    c = local_len // len(mine)
    runs = []
    for i, k in enumerate(mine):
        if runs and runs[-1][1] + runs[-1][2] == k * c:
            runs[-1][2] += c
        else:
            runs.append([i * c, k * c, c])
    return tuple(tuple(run) for run in runs)


# Batch keys split along the sequence, and the dimension that holds it. `attention_mask`
# [b, 1, s, s] keeps every key column: only its query rows are this rank's.
SEQUENCE_DIMS = {"tokens": 1, "labels": 1, "loss_mask": 1, "position_ids": 1, "attention_mask": 2}


def split_batch(batch: Dict[str, torch.Tensor], cp_size: int, cp_rank: int, assignment=None) -> Dict[str, torch.Tensor]:
    """A micro-batch as this CP rank sees it (`SEQUENCE_DIMS`); other entries are kept as they are."""
    if cp_size == 1:
        return batch
    return {k: split_sequence(v, SEQUENCE_DIMS[k], cp_size, cp_rank, assignment)
            if k in SEQUENCE_DIMS and torch.is_tensor(v) else v for k, v in batch.items()}


def _to_global_order(blocks, dim: int, cp_size: int, assignment=None) -> torch.Tensor:
    """Rank-major gathered blocks (block j = rank j's chunks in local order) -> the sequence in global order."""
    n, _ = rank_chunks(cp_size, 0, assignment)
    chunks = [None] * n
    for j, block in enumerate(blocks):
        mine = rank_chunks(cp_size, j, assignment)[1]
        for k, part in zip(mine, block.chunk(len(mine), dim=dim)):
            chunks[k] = part
    return torch.cat(chunks, dim=dim)


def _to_rank_order(full: torch.Tensor, dim: int, cp_size: int, assignment=None) -> torch.Tensor:
    """The inverse: a global-order sequence -> rank-major blocks concatenated along `dim`."""
    n, _ = rank_chunks(cp_size, 0, assignment)
    chunks = full.chunk(n, dim=dim)
    return torch.cat([chunks[k] for j in range(cp_size) for k in rank_chunks(cp_size, j, assignment)[1]], dim=dim)


def _reduce_scatter(grad_rank_major: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum over the group, keep this rank's block (rank-major along `dim`)."""
    size, rank = cp_size_and_rank(group)
    if dist.get_backend(group) == "nccl":
        moved = grad_rank_major.movedim(dim, 0).contiguous()
        out = moved.new_empty((moved.shape[0] // size, *moved.shape[1:]))
        dist.reduce_scatter_tensor(out, moved, group=group)
        return out.movedim(0, dim)
    # gloo has no reduce-scatter: all-reduce the whole gradient and keep this rank's block
    # (cp x the traffic; CPU runs only).
    say_once(_log, "context parallelism on %s: gradients of gathered keys are all-reduced, not reduce-scattered "
             "(cp x the traffic of NCCL's reduce-scatter)", dist.get_backend(group))
    full = grad_rank_major.contiguous()
    dist.all_reduce(full, group=group)
    return full.chunk(size, dim=dim)[rank]


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim: int, group, assignment):
        ctx.dim, ctx.group, ctx.assignment = dim, group, assignment
        size, _ = cp_size_and_rank(group)
        blocks = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(blocks, x.contiguous(), group=group)
        return _to_global_order(blocks, dim, size, assignment)

    @staticmethod
    def backward(ctx, grad):
        size, _ = cp_size_and_rank(ctx.group)
        rank_major = _to_rank_order(grad, ctx.dim, size, ctx.assignment)
        return _reduce_scatter(rank_major, ctx.dim, ctx.group), None, None, None


def gather_sequence(x: torch.Tensor, dim: int, group: Optional[dist.ProcessGroup], assignment=None) -> torch.Tensor:
    """All-gather this rank's tokens (`dim`) over the CP group, in global order; backward reduce-scatters.
    `assignment`: the chunks each rank holds (`rank_chunks`), zigzag when None."""
    if cp_size_and_rank(group)[0] == 1:
        return x
    return _GatherSequence.apply(x, dim, group, assignment)


def roll_sequence(t: torch.Tensor, group: Optional[dist.ProcessGroup], assignment=None):
    """This rank's tokens t [..., s] (last dim: its chunks of the sequence) shifted one token left in the global
    sequence, position g taking g + 1's value and the last position 0 (`torch.roll(-1)` with the wrapped entry
    zeroed, as megatron's MTP `roll_tensor` does), for any chunk `assignment` (zigzag when None) -> (rolled, its
    sum). Each chunk's first token is all-gathered (cp x chunks per rank values per row); no gradient flows."""
    size, rank = cp_size_and_rank(group)
    n, mine = rank_chunks(size, rank, assignment)
    local = t.reshape(*t.shape[:-1], len(mine), t.shape[-1] // len(mine))
    heads = local[..., 0].contiguous()
    blocks = [torch.empty_like(heads) for _ in range(size)]
    dist.all_gather(blocks, heads, group=group)
    first = {k: block[..., i] for j, block in enumerate(blocks) for i, k in enumerate(rank_chunks(size, j, assignment)[1])}
    following = [first[k + 1] if k + 1 < n else torch.zeros_like(heads[..., 0]) for k in mine]
    rolled = torch.cat([local[..., 1:], torch.stack(following, dim=-1).unsqueeze(-1)], dim=-1).reshape(t.shape)
    return rolled, rolled.sum()


def global_token_count(count: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """A token count summed over the CP group (no gradient), for token means over the whole sequence."""
    if cp_size_and_rank(group)[0] == 1:
        return count
    total = count.detach().clone()
    dist.all_reduce(total, group=group)
    return total


def causal_visibility(query_positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[s_q, num_keys] bool, True where key position <= the query's global position."""
    keys = torch.arange(num_keys, device=query_positions.device)
    return keys[None, :] <= query_positions[:, None]


__all__ = [
    "SEQUENCE_DIMS",
    "causal_visibility",
    "chunk_ids",
    "cp_size_and_rank",
    "gather_sequence",
    "global_token_count",
    "local_positions",
    "query_runs",
    "rank_chunks",
    "roll_sequence",
    "split_batch",
    "split_sequence",
]
