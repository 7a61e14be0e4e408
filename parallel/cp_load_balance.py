"""Causal work per context-parallel rank with packed documents, and chunk assignments that balance it.

A sequence of S tokens is cut into n equal chunks (n a multiple of 2 * cp) and every CP rank holds n / cp of them
(`parallel.context_parallel`). Under causal attention isolated per document a query at global position g attends
to the keys start(g) .. g of its own document (`pretrain.model.documents`), so the work of chunk k is

    W_k = sum_{g in chunk k}  (g - start(g) + 1)        query-key pairs (dense attention and the DSA indexer)
    W_k^sparse = sum_{g in chunk k}  min(g - start(g) + 1, topk)      (DSA's sparse attention)

and rank r's work is the sum over its chunks. Every rank waits for the slowest at each layer's all-gather, so a
step's attention costs max_r W_r; the imbalance cost of an assignment is max_r W_r / mean_r W_r - 1.

`zigzag`: the load-balanced split of megatron-core (`get_batch_on_this_cp_rank`), rank r holding chunks r and
2cp - 1 - r of n = 2 cp; exact balance for one document over the whole window (W_k grows linearly in k, pairs sum
to a constant), not for packed documents. `work`: workload-aware assignment, as the GLM-5 report names it for
long-context training (its exact rule is not given; here longest processing time first under equal chunk counts):
chunks in decreasing work, each to the rank with the least work that still has room. It is a permutation of
equal-size chunks, so every rank keeps S / cp tokens and positions stay global.

Training (`parallel.cp_chunk_assignment: work`, docs/long_context.md): `assign` computes the assignment of each
micro-batch on the host from its document starts (the same on every CP rank: the batch and the rule are), balancing
the dense work W_k summed over the micro-batch's rows (dense attention and the DSA indexer, the quadratic terms).
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

Assignment = Tuple[Tuple[int, ...], ...]  # per rank, its chunk ids in increasing order


def token_work(starts: torch.Tensor, topk: int = 0) -> torch.Tensor:
    """Pairs attended by each query: starts [..., S] (each token's document start) -> int64 [..., S]; with `topk`,
    at most topk per query (DSA's sparse attention)."""
    positions = torch.arange(starts.shape[-1], device=starts.device)
    work = positions - starts.to(torch.int64) + 1
    return work.clamp(max=topk) if topk > 0 else work


def chunk_work(starts: torch.Tensor, n_chunks: int, topk: int = 0) -> torch.Tensor:
    """W_k of the module docstring, summed over the batch rows of starts [b, S] (or [S]) -> int64 [n_chunks]."""
    work = token_work(starts, topk).reshape(-1, starts.shape[-1]).sum(0)
    if work.numel() % n_chunks:
        raise ValueError(f"a sequence of {work.numel()} tokens cannot be cut into {n_chunks} equal chunks")
    return work.view(n_chunks, -1).sum(1)


def zigzag(cp: int) -> Assignment:
    """megatron's load-balanced split: rank r holds chunks r and 2cp - 1 - r of 2 cp."""
    return tuple((r, 2 * cp - 1 - r) for r in range(cp))


def balance(work: Sequence[int], cp: int) -> Assignment:
    """`work` per chunk (len a multiple of cp) -> chunks per rank, equal counts, least max work found greedily
    (longest processing time first); ties go to the lower rank and chunk, so every rank computes the same."""
    n = len(work)
    if n % cp:
        raise ValueError(f"{n} chunks cannot be shared equally by {cp} context-parallel ranks")
    per_rank = n // cp
    loads, held = [0] * cp, [[] for _ in range(cp)]
    for chunk in sorted(range(n), key=lambda k: (-int(work[k]), k)):
        rank = min((r for r in range(cp) if len(held[r]) < per_rank), key=lambda r: (loads[r], r))
        held[rank].append(chunk)
        loads[rank] += int(work[chunk])
    return tuple(tuple(sorted(chunks)) for chunks in held)


def assign(starts: torch.Tensor, cp: int, chunks_per_rank: int):
    """The `work` assignment of a micro-batch with document starts [b, S] (host) over `cp` ranks holding
    `chunks_per_rank` chunks each, or None (keep the zigzag split) where its documents are not isolated: one
    causal window, which the zigzag split balances exactly."""
    if cp == 1 or not bool(starts.any()):
        return None
    return balance(chunk_work(starts, cp * chunks_per_rank).tolist(), cp)


def rank_work(work: Sequence[int], assignment: Assignment) -> List[int]:
    """Work per rank of an assignment."""
    return [sum(int(work[k]) for k in chunks) for chunks in assignment]


def imbalance(loads: Sequence[int]) -> float:
    """max / mean - 1 (0 for equal loads)."""
    mean = sum(loads) / len(loads)
    return max(loads) / mean - 1 if mean > 0 else 0.0


__all__ = ["Assignment", "assign", "balance", "chunk_work", "imbalance", "rank_work", "token_work", "zigzag"]
