"""Float64 references of the DSA lightning indexer (visibility, index scores, top-k), shared by the DSA op tests."""

from __future__ import annotations

import itertools
import math

import torch

from pretrain.model.dsa.indexer import VisibleKeys, segment_ids_from_cu_seqlens

F64 = torch.float64
NEG_INF = float("-inf")


def docs_from_lengths(lengths):
    """Document id of every position of a packed stream of documents with these lengths."""
    out = []
    for i, n in enumerate(lengths):
        out += [i] * n
    return out


def naive_visible(b, S, T, docs=None):
    """bool [b, S, T]: query row t sits at absolute position t + T - S; it sees key s iff
    s <= that position and (when documents are given) both are in the same document."""
    vis = torch.zeros(b, S, T, dtype=torch.bool)
    for bi in range(b):
        for t in range(S):
            pos = t + T - S
            for s in range(T):
                ok = s <= pos
                if docs is not None:
                    ok = ok and docs[bi][s] == docs[bi][pos]
                vis[bi, t, s] = ok
    return vis


def naive_index_scores(q, k, w, vis):
    """Python loops: I[b,t,s] = sum_j w[b,t,j] * max(0, sum_e q[b,t,j,e] k[b,s,e] / sqrt(d)), -inf if invisible."""
    b, S, H, d = q.shape
    T = k.shape[1]
    ql, kl, wl, vl = q.tolist(), k.tolist(), w.tolist(), vis.tolist()
    inv = 1.0 / math.sqrt(d)
    out = []
    for bi in range(b):
        rows = []
        for t in range(S):
            row = []
            for s in range(T):
                if not vl[bi][t][s]:
                    row.append(NEG_INF)
                    continue
                total = 0.0
                for j in range(H):
                    dot = 0.0
                    for e in range(d):
                        dot += ql[bi][t][j][e] * kl[bi][s][e]
                    total += wl[bi][t][j] * max(dot * inv, 0.0)
                row.append(total)
            rows.append(row)
        out.append(rows)
    return torch.tensor(out, dtype=F64)


def ref_topk(scores, topk):
    """The documented selection by a naive sort of each row of the [b, S, T] matrix: the k largest
    finite scores, ties to the lower key index, listed in ascending key order, -1 padded."""
    k = min(topk, scores.shape[-1])
    out = []
    for row in scores.reshape(-1, scores.shape[-1]).tolist():
        finite = [i for i, v in enumerate(row) if v != NEG_INF]
        chosen = sorted(sorted(finite, key=lambda i: (-row[i], i))[:k])
        out.append(chosen + [-1] * (k - len(chosen)))
    return torch.tensor(out, dtype=torch.long).view(*scores.shape[:-1], k)


def visibility_case(mode, b, S, T):
    """(VisibleKeys, naive visibility [b, S, T]) for one visibility mode."""
    if mode == "causal":
        return VisibleKeys(S, T, "cpu"), naive_visible(b, S, T)
    assert S == T
    if mode in ("mask", "mask_nocausal", "mask_shared"):
        lengths = [[4, 1, 6, S - 11], [S - 7, 7]]
        docs = [docs_from_lengths(lengths[0 if mode == "mask_shared" else bi % 2]) for bi in range(b)]
        mb = 1 if mode == "mask_shared" else b  # [1, 1, s, s]: one mask broadcast over the batch
        mask = torch.zeros(mb, 1, S, S, dtype=torch.bool)
        for bi, t, s in itertools.product(range(mb), range(S), range(S)):
            same = docs[bi][t] == docs[bi][s]
            mask[bi, 0, t, s] = not same if mode == "mask_nocausal" else not (same and s <= t)
        return VisibleKeys(S, T, "cpu", attention_mask=mask), naive_visible(b, S, T, docs)
    if mode == "segments":
        lengths = [3, 1, 2, S - 6]
        cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)
        seg = segment_ids_from_cu_seqlens(cu, S)
        docs = docs_from_lengths(lengths)
        assert seg.shape == (1, S)
        return VisibleKeys(S, T, "cpu", segment_ids=seg), naive_visible(b, S, T, [docs] * b)
    raise ValueError(mode)
