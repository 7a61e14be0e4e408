"""The lightning indexer's training loss (DeepSeek-V3.2 section 2.1; GLM-5 report, DSA training).

Target: the main attention's probabilities summed over all heads (every TP rank's heads) and
L1-normalized, p[t, :] = sum_h P_h[t, :] / sum_{h, s} P_h[t, s]. Loss, averaged over query tokens:

    L_I = mean_t KL( p[t, S] || softmax(I[t, S]) )

- dense KL (`dsa_indexer_use_sparse_loss=false`, the warm-up): S = every visible key of t; the
  attention is dense (`indexer_kl_dense` with `dense_target`).
- sparse KL (`dsa_indexer_use_sparse_loss=true`): S = S_t, the indexer's selected keys, and p is
  renormalized over S_t (`indexer_kl_sparse`). Its target is the sparse attention's own softmax
  (`sparse_target`, the joint stage) or, with dense attention, the dense probabilities at S_t
  (`dense_target_selected`). Dense KL under sparse attention is refused by the config check: the
  sparse path never forms the probabilities outside S_t.

The target is computed without gradient and the indexer reads detached inputs, so L_I trains only
the indexer and the LM loss never reaches it. The gradient of `coeff * L_I` is attached to the
attention output by `IndexerLossAutoScaler` and scaled by 1 / (number of micro-batches), as
megatron scales its other auxiliary losses (megatron-core 0.16.1's DSA omits that division: the
workaround is `pretrain.compat.dsa`).

Memory is linear in the sequence length: `indexer_kl` forms index scores and targets for `chunk`
query rows at a time and differentiates each chunk right away (the per-chunk gradients of q_I,
k_I and w are what backward returns), so no [S, T] block lives beyond one chunk. Given the
indexer's weights, the gradient goes on through the indexer's projection in forward too, and only
the weights' gradients wait for backward (`_IndexerKL`).
Top-k recall, the share of p[t, :] on t's selected keys, is measured in dense mode.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from pretrain.compat.dsa import IndexerLossAutoScaler
from pretrain.model.dsa.indexer import (
    VisibleKeys, gather_keys, index_scores, index_scores_at, select_topk, unpack_indices, upcast,
)


def kl_sum(p: torch.Tensor, logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """sum over rows of KL(p || softmax(logits)); p is 0 and logits -inf where not valid."""
    logq = torch.where(valid, torch.log_softmax(logits, dim=-1), 0.0)
    return torch.where(valid, torch.xlogy(p, p) - p * logq, 0.0).sum()


def sum_over_tp(probs_sum: torch.Tensor, tp_group) -> torch.Tensor:
    """Head-summed probabilities [b, c, n] of this rank's heads -> summed over every TP rank's heads (in place)."""
    if tp_group is not None and dist.is_initialized() and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(probs_sum, group=tp_group)
    return probs_sum


def normalized_rows(p: torch.Tensor) -> torch.Tensor:
    """Target rows L1-normalized along the last dim; a row summing to 0 stays 0 (an empty target)."""
    total = p.sum(-1, keepdim=True)
    return torch.where(total > 0, p / torch.where(total > 0, total, 1.0), 0.0)


def normalize_heads(probs_sum: torch.Tensor, tp_group) -> torch.Tensor:
    """Head-summed probabilities [b, c, n] -> summed over TP ranks' heads too, L1-normalized."""
    return normalized_rows(sum_over_tp(probs_sum, tp_group))


def split_target(split, keys: VisibleKeys, head_sums: Callable) -> Callable:
    """A target over the TP rank's rows of `split` (`indexer_split.RowSplit`): `head_sums(rank, rows, visible)`
    gives this rank's heads' probabilities summed over heads at the query rows `rows` (int64) of `rank`, whose
    visible keys are `visible`; for each block of rows every rank forms them at every rank's rows and a
    reduce-scatter sums them over the TP group at each rank's own rows, which are then L1-normalized."""
    ranks = [split.rows_of(j) for j in range(split.size)]
    keys_of = [keys.subset(r) for r in ranks]

    def rows(r0: int, r1: int, _mine) -> torch.Tensor:
        parts = [head_sums(j, ranks[j][r0:r1], keys_of[j].rows(r0, r1)).contiguous() for j in range(split.size)]
        out = torch.empty_like(parts[split.rank])
        dist.reduce_scatter(out, parts, group=split.group)
        return normalized_rows(out)

    return rows


def _dense_head_sums(query, key, scale: float, rows, visible) -> torch.Tensor:
    """sum_h softmax of dense attention at the query rows `rows` (slice or int64 index) -> [b, c, T]."""
    q = query[:, rows] if isinstance(rows, slice) else query.index_select(1, rows)
    scores = torch.einsum("bchd,bthd->bhct", upcast(q), upcast(key)) * scale
    return scores.masked_fill(~visible[:, None], float("-inf")).softmax(-1).sum(1)


def dense_target(query: torch.Tensor, key: torch.Tensor, scale: float, tp_group=None, split=None,
                 keys: Optional[VisibleKeys] = None) -> Callable:
    """Target rows of dense attention: query [b, s, h, d], key [b, T, h, d] (detached). With `split` the rows
    are the TP rank's (`split_target`; `keys`: the visible keys of all s rows)."""
    if split is not None:
        return split_target(split, keys, lambda j, rows, visible: _dense_head_sums(query, key, scale, rows, visible))

    def rows(r0: int, r1: int, visible: torch.Tensor) -> torch.Tensor:
        return normalize_heads(_dense_head_sums(query, key, scale, slice(r0, r1), visible), tp_group)

    return rows


def sparse_target(q_absorbed: torch.Tensor, kv: torch.Tensor, scale: float, tp_group=None) -> Callable:
    """Target rows of sparse absorbed attention: q [b, s, h, D], kv [b, T, D] (detached)."""

    def rows(r0: int, r1: int, indices: torch.Tensor) -> torch.Tensor:
        sel = upcast(gather_keys(kv, indices))
        scores = torch.einsum("bchd,bckd->bchk", upcast(q_absorbed[:, r0:r1]), sel) * scale
        probs = scores.masked_fill((indices < 0)[:, :, None], float("-inf")).softmax(-1)
        return normalize_heads(probs.sum(2), tp_group)

    return rows


def dense_target_selected(query: torch.Tensor, key: torch.Tensor, scale: float, keys: VisibleKeys,
                          tp_group=None, split=None, indices: Optional[torch.Tensor] = None) -> Callable:
    """Sparse-KL target rows of dense attention: the head-summed dense probabilities at the selected
    keys, renormalized over them. query [b, s, h, d], key [b, T, h, d] (detached). With `split` the rows
    are the TP rank's (`split_target`), and `indices` [b, s, K] every rank's selection."""

    def at_selected(rows, visible, idx):
        probs = _dense_head_sums(query, key, scale, rows, visible)
        at = probs.expand(idx.shape[0], -1, -1).gather(-1, idx.clamp(min=0).long())
        return at.masked_fill(idx < 0, 0.0)

    if split is not None:
        return split_target(split, keys, lambda j, rows, visible: at_selected(rows, visible,
                                                                             indices.index_select(1, rows)))

    def rows(r0: int, r1: int, idx: torch.Tensor) -> torch.Tensor:
        return normalize_heads(at_selected(slice(r0, r1), keys.rows(r0, r1), idx), tp_group)

    return rows


def grads_through(through, params, grads) -> tuple:
    """Gradients of `params` given `grads` of the tensors `through` that were computed from them."""
    out = torch.autograd.grad(through, params, grads, allow_unused=True)
    return tuple(torch.zeros_like(p) if g is None else g for p, g in zip(params, out))


class _IndexerKL(torch.autograd.Function):
    """Forward computes the loss and, chunk by chunk, its gradient; backward scales that gradient.

    `inputs` are q, k, w, or, with `through` = (q, k, w) still attached to their projection graph,
    the indexer's weights: forward then also carries the gradient through that graph at once and
    keeps only the weights' gradients (their size, not the sequence's), so nothing per token waits
    for backward, neither the [s, H_I, d_I] query gradient nor what the projection saved. The loss
    is linear in its scale: scaling the kept gradients in backward equals backpropagating it."""

    @staticmethod
    def forward(ctx, plan, through, split, *inputs):
        if through is None:
            loss, grads, recall = plan(*inputs)
        else:
            loss, grads, recall = plan(*(t.detach() for t in through))
            grads = grads_through(through, inputs, grads)
        if split is not None:  # this TP rank's rows: its part of the mean, summed over the ranks
            loss, recall, *grads = sum_split(split, (loss, recall, *grads))
        ctx.save_for_backward(*grads)
        ctx.mark_non_differentiable(recall)
        return loss, recall

    @staticmethod
    def backward(ctx, grad_loss, _grad_recall):
        return (None, None, None, *(g * grad_loss for g in ctx.saved_tensors))


def sum_split(split, partials) -> list:
    """Losses or gradients over one TP rank's rows, each a mean over them -> the mean over every rank's rows
    (times the rank's share of the rows, then summed over the TP group; `indexer_split`)."""
    return split.sum_over_ranks([t * split.share for t in partials])


def apply_kl(q, k, w, plan, params=(), split=None):
    """(loss, recall) of `plan(q, k, w) -> (loss, (dq, dk, dw), recall)`, its gradient computed in forward
    (`_IndexerKL`); given the indexer's weights `params`, it goes on through (q, k, w)'s graph at once.
    `split` (`indexer_split.RowSplit`): q and w hold the TP rank's query rows only; the loss, the recall and the
    weights' gradients are summed over the TP group (it needs `params`)."""
    params = tuple(params)
    if params:
        return _IndexerKL.apply(plan, (q, k, w), split, *params)
    if split is not None:
        raise ValueError("an indexer loss over a TP rank's rows needs the indexer's weights (params) to sum "
                         "their gradients over the ranks")
    return _IndexerKL.apply(plan, None, None, q, k, w)


def _run_chunks(q, k, w, chunk: int, rows_fn) -> Tuple[torch.Tensor, tuple, torch.Tensor]:
    b, s = q.shape[0], q.shape[1]
    n = b * s
    acc = upcast(q).dtype
    # dq and dw are written once per row block: kept in their own dtype (no [s, H_I, d_I] fp32 copy); dk sums
    # over the blocks in fp32
    dq, dw = torch.empty_like(q), torch.empty_like(w)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    total = torch.zeros((), dtype=acc, device=q.device)
    recall = torch.zeros((), dtype=acc, device=q.device)
    for r0 in range(0, s, chunk):
        r1 = min(s, r0 + chunk)
        with torch.enable_grad():
            qc = q[:, r0:r1].detach().requires_grad_()
            wc = w[:, r0:r1].detach().requires_grad_()
            kc = k.detach().requires_grad_()
            loss_c, recall_c = rows_fn(r0, r1, qc, kc, wc)
            gq, gk, gw = torch.autograd.grad(loss_c, (qc, kc, wc))
        dq[:, r0:r1], dw[:, r0:r1] = (gq.to(acc) / n).to(q.dtype), (gw.to(acc) / n).to(w.dtype)
        dk += gk
        total += loss_c.detach()
        recall += recall_c
    return total / n, (dq, (dk / n).to(k.dtype), dw), recall / n


def indexer_kl_dense(q, k, w, keys: VisibleKeys, target: Callable, topk: int, chunk: int, params=(), split=None):
    """Dense-mode loss: q [b, s, H_I, d_I], k [b, T, d_I], w [b, s, H_I] -> (mean KL, top-k recall).
    `params`: the indexer's weights, for the gradient to reach them from forward (`_IndexerKL`); `split`: q, w,
    `keys` and `target` cover the TP rank's rows (`apply_kl`)."""

    def rows(r0, r1, qc, kc, wc):
        visible = keys.rows(r0, r1).expand(qc.shape[0], -1, -1)
        logits = index_scores(qc, kc, wc, visible)
        p = target(r0, r1, visible)
        idx = select_topk(logits.detach(), topk)
        recall = (p.gather(-1, idx.clamp(min=0)) * (idx >= 0)).sum()
        return kl_sum(p, logits, visible), recall

    return apply_kl(q, k, w, lambda q_, k_, w_: _run_chunks(q_, k_, w_, chunk, rows), params, split)


def _scores_at_reference(qc, kc, wc, idx):
    return index_scores_at(qc, gather_keys(kc, idx), wc).masked_fill(idx < 0, float("-inf"))


def sparse_kl_plan(indices: torch.Tensor, target: Callable, chunk: int,
                   scores_at: Callable = _scores_at_reference, normalize: bool = False,
                   grad_scale: float = 1.0) -> Callable:
    """The sparse-mode loss over the selected keys `indices` [b, s, K] as a plan for `apply_kl`:
    (q, k, w) -> (mean KL, its gradients, recall = 1). `scores_at(q_rows, k, w_rows, idx_rows)` gives the
    index scores at the selected keys (-inf on empty slots): the reference gathers keys, the Triton
    backend (`backend.TritonBackend`) does not. `normalize`: the target rows are raw head sums, normalized
    here (`normalized_rows`); `grad_scale`: a factor on the gradients only (the loss keeps its value)."""

    def rows(r0, r1, qc, kc, wc):
        idx = indices[:, r0:r1]
        valid = idx >= 0
        logits = scores_at(qc, kc, wc, idx)
        p = target(r0, r1, idx)
        p = normalized_rows(p) if normalize else p
        return kl_sum(p, logits, valid), p.sum()

    def plan(q, k, w):
        loss, grads, recall = _run_chunks(q, k, w, chunk, rows)
        if grad_scale != 1.0:
            grads = tuple(g.mul_(grad_scale) for g in grads)
        return loss, grads, recall

    return plan


def indexer_kl_sparse(q, k, w, indices: torch.Tensor, target: Callable, chunk: int,
                      scores_at: Callable = _scores_at_reference, params=(), split=None):
    """Sparse-mode loss (`sparse_kl_plan`) -> (mean KL, recall = 1); `params`, `split`: as `indexer_kl_dense`'s."""
    return apply_kl(q, k, w, sparse_kl_plan(indices, target, chunk, scores_at), params, split)


@dataclasses.dataclass
class DeferredKL:
    """What `kl_from_attention_backward` needs in backward: `project(x, qr)` -> (q_I, k_I, w) attached to
    the indexer's weights, `plan(indices, target, lse, normalize=, grad_scale=)` -> a plan for `apply_kl` (lse: the
    selection's, or None; the other two as `sparse_kl_plan`'s),
    the loss coefficient, the layer's metrics slot and the TP group whose heads the target sums; `split`
    (`indexer_split.RowSplit`): `project` gives the TP rank's query rows and the loss covers those (the
    indices are every rank's, the lse the rank's)."""

    project: Callable
    plan: Callable
    coeff: float
    layer: int
    tp_group: object = None
    split: object = None


def target_rows(p: torch.Tensor) -> Callable:
    """A target callable over the rows of a whole [b, s, K] target tensor."""
    return lambda r0, r1, _idx: p[:, r0:r1]


class _KLFromAttentionBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec: DeferredKL, x, qr, indices, lse, *params):
        ctx.spec, ctx.params = spec, params
        ctx.save_for_backward(x, qr, indices, lse)
        # stride 0: the channel costs 4 bytes; its gradient (the head sums) is a full [b, s, K] tensor
        return torch.zeros(1, dtype=torch.float32, device=indices.device).expand(indices.shape)

    @staticmethod
    def backward(ctx, head_sums):
        if head_sums is None:
            raise RuntimeError("the sparse indexer loss got no target: pass its channel to sparse_mla_core")
        x, qr, indices, lse = ctx.saved_tensors
        indices = unpack_indices(indices)
        spec, split = ctx.spec, ctx.spec.split
        if split is None:
            p = sum_over_tp(head_sums.float().contiguous(), spec.tp_group)  # ours alone: summed in place
        else:  # every rank's heads at this rank's rows
            p, indices = split.reduce(head_sums.float()), split.take(indices, 1)
        with torch.enable_grad():
            through = spec.project(x, qr)
        scale = IndexerLossAutoScaler.main_loss_backward_scale
        scale = spec.coeff * (1.0 if scale is None else scale)
        # the plan normalizes the head sums and scales the gradients as it forms them (no passes of their own)
        plan = spec.plan(indices, target_rows(p), lse, normalize=True, grad_scale=scale)
        loss, grads, _ = plan(*(t.detach() for t in through))
        del p, plan  # the [b, s, K] target goes before the projection's backward allocates
        grads = grads_through(through, ctx.params, grads)
        if split is not None:
            loss, *grads = sum_split(split, (loss, *grads))
        DSAMetrics.record("indexer_loss", spec.layer, loss)
        return (None, None, None, None, None, *grads)


def kl_from_attention_backward(spec: DeferredKL, x: torch.Tensor, qr: torch.Tensor, indices: torch.Tensor,
                               params, lse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The joint stage's sparse KL (sparse attention, `dsa_indexer_use_sparse_loss`), formed in backward.

    Its target p = sum_h P_h / sum is what the sparse attention's backward forms anyway (P = exp(s - lse)
    at every selected key); in forward it would take a second gather of kv and 2 h K (C + R) FLOPs per
    token (docs/dsa.md gives its cost at 32K). So this
    returns `channel` [b, s, K] (zeros, stride 0) for `sparse_core.sparse_mla_core`, whose backward
    hands the head sums back as the channel's gradient; autograd runs this function's backward after
    it: the KL, its gradient into (q_I, k_I, w) and on through the indexer's projection, recomputed from
    its detached inputs x and qr (tensors the layer keeps anyway), into the indexer's weights `params`.
    `indices` may be packed (`indexer.pack_indices`); `lse`: the selection's log sum exp per token (the Triton
    top-k's `with_lse`), kept for the plan (4 bytes a token). The gradient is that of coeff * L_I scaled as
    `IndexerLossAutoScaler` scales it; the loss is recorded for logging (`DSAMetrics`) when backward
    forms it. Same loss and gradient as `indexer_kl_sparse` with `sparse_target`, up to rounding."""
    params = tuple(params)
    if not params:
        raise ValueError("kl_from_attention_backward needs the indexer's trained weights")
    return _KLFromAttentionBackward.apply(spec, x.detach(), qr.detach(), indices, lse, *params)


class DSAMetrics:
    """Per-layer indexer loss and top-k recall of the current step, for logging.

    Layers record into slots 1..num_layers (decoder) and num_layers + 1 (the MTP layer, every
    depth); `collect` sums over pipeline stages, averages over data-parallel ranks and clears.
    """

    values: Dict[str, Dict[int, list]] = {}

    @classmethod
    def record(cls, name: str, layer: int, value: torch.Tensor) -> None:
        # Under activation recompute the forward runs without grad, so the indexer loss is computed (and
        # recorded) once, by the forward recomputed in backward.
        slot = cls.values.setdefault(name, {}).setdefault(layer, [0.0, 0])
        slot[0] = slot[0] + value.detach().float()
        slot[1] += 1

    @classmethod
    def clear(cls) -> None:
        cls.values = {}

    @classmethod
    def collect(cls, num_slots: int, names=("indexer_loss", "topk_recall"), pp_group=None, dp_group=None,
                device=None) -> Dict[str, float]:
        out: Dict[str, float] = {}
        for name in names:
            table = torch.zeros(2, num_slots + 1, dtype=torch.float64, device=device)
            for layer, (total, count) in cls.values.get(name, {}).items():
                table[0, min(layer, num_slots)] += torch.as_tensor(total, dtype=torch.float64).to(table.device)
                table[1, min(layer, num_slots)] += count
            if dist.is_initialized():
                for group in (pp_group, dp_group):
                    if group is not None and dist.get_world_size(group) > 1:
                        dist.all_reduce(table, group=group)
            seen = table[1] > 0
            if not bool(seen.any()):
                continue
            per_layer = table[0][seen] / table[1][seen]
            out[name] = per_layer.mean().item()
            for layer, value in zip(seen.nonzero().flatten().tolist(), per_layer.tolist()):
                label = "mtp" if layer == num_slots else f"layer_{layer:02d}"
                out[f"{name}/{label}"] = value
        cls.clear()
        return out
