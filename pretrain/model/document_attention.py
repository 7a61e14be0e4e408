"""Dense causal attention isolated per document, without a mask tensor (`pretrain.model.documents`).

For each piece of a plan (`documents.AttentionPlan`: query rows [q0, q1) of one document at global positions
[k1 - (q1 - q0), k1), its keys [k0, k1)),

    out[i] = softmax_j( q_i . k_j * scale ) v_j   over  k0 <= j <= k1 - (q1 - q0) + (i - q0)

that is causal attention aligned to the last key (bottom-right). No query sees a key of another document, and
nothing of size S x S (or [s / cp, S] under context parallelism) is ever formed. Two exact implementations:

- "varlen": one call of `torch.nn.attention.varlen.varlen_attn` (FlashAttention-2 varlen, CUDA, bf16 / fp16)
  over all pieces: queries packed as they lie (a view at micro-batch 1), keys as they lie when the pieces tile
  them (no context parallelism), else gathered per piece (O(S d) copy). FlashAttention's causal mask with
  fewer queries than keys is bottom-right aligned, which is what a piece needs; its causal block skipping and
  the absence of a mask keep the cost at the pieces' FLOPs, sum over pieces of (q1 - q0)(k1 - k0) - (q1 - q0)^2 / 2,
  below a whole-window causal call's. Taken on CUDA for bf16 / fp16 with equal query/key and value head dims
  <= 256, no dropout, no sliding window and no deterministic mode.
- "split": one `scaled_dot_product_attention` call per piece: plain causal (cuDNN on Hopper) when the piece
  starts at its document's start. A piece that continues a document from an earlier context-parallel chunk (at
  most one per chunk: the document holding the chunk's first row) is bottom-right causal; it goes as a non-causal
  block over its document's keys before the chunk, [k0, k1 - (q1 - q0)), and a causal square over its own rows,
  merged by log-sum-exp (`pretrain.model.blockwise_attention`, through the caller's `attend`). That block holds
  only keys of the query's document, contiguous, so it needs no mask and attends no pair it does not use: the
  cheapest exact form (a block over the whole chunk prefix would need a document mask, which leaves SDPA its
  slowest kernels and attends every other document's keys for nothing). Where no kernel returns the log-sum-exp,
  the piece is one bottom-right causal call (`causal_lower_right`: flash or memory-efficient), said once. Runs of short documents (each under `SHORT` tokens) go
  as one call of at most `GROUP` tokens with a small block-diagonal causal mask ([GROUP, GROUP] at most), so a
  window of many tiny documents does not cost a launch each. Exact on every device and dtype; the CPU tests run it.

The choice ("varlen" where it applies, else "split") is logged once per process. Candidates not taken: SDPA on
nested jagged tensors reaches the same flash varlen kernel but only for square (top-left) causal segments, so
context-parallel pieces would need a mask; FlexAttention's document block mask needs torch.compile per shape;
cuDNN's THD path needs `nvidia-cudnn-frontend` and its 92 MB dependency.
"""

from __future__ import annotations

import inspect
import logging
from typing import Callable, Optional

import torch

from pretrain.model.documents import AttentionPlan
from pretrain.notices import say_once

_log = logging.getLogger(__name__)


def _say_once(method: str, why: str) -> None:
    say_once(_log, "document attention: %s (%s)", method, why)


def _varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def choose_method(query: torch.Tensor, value: torch.Tensor, window, dropout_p: float) -> str:
    """"varlen" where `varlen_attn` can run these tensors (see the module docstring), else "split"."""
    d, dv = query.shape[-1], value.shape[-1]
    if not query.is_cuda:
        return "split"
    reason = None
    if _varlen() is None:
        reason = "torch.nn.attention.varlen is missing in this torch"
    elif query.dtype not in (torch.bfloat16, torch.float16):
        reason = f"varlen needs bf16 / fp16, got {query.dtype}"
    elif d != dv or d > 256 or d % 8:
        reason = f"varlen needs equal query/value head dims <= 256, got {d} and {dv}"
    elif window is not None or dropout_p > 0:
        reason = "varlen is not used with a sliding window or attention dropout"
    elif torch.are_deterministic_algorithms_enabled():
        reason = "deterministic mode: FlashAttention's backward is not"
    if reason is None:
        _say_once("varlen", "one FlashAttention-2 varlen call per layer")
        return "varlen"
    _say_once("split", f"one SDPA call per document piece; {reason}")
    return "split"


SHORT, GROUP = 512, 2048  # "split": documents under SHORT tokens are attended together, up to GROUP tokens a call


def _groups(pieces):
    """Consecutive pieces in calls: a run of square pieces (whole documents from their start) of one query chunk,
    each under SHORT tokens and GROUP in all, or one piece alone."""
    group = []
    for piece in pieces:
        q0, q1, k0, k1 = piece
        short = k1 - k0 == q1 - q0 and q1 - q0 < SHORT
        if group and short and k0 == group[-1][3] and q1 - group[0][0] <= GROUP:  # keys contiguous (one chunk)
            group.append(piece)
            continue
        if group:
            yield group
        group = [piece]
        if not short:
            yield group
            group = []
    if group:
        yield group


def _block_causal(group, device) -> torch.Tensor:
    """[1, 1, L, L] bool, True = masked, for a run of whole documents laid end to end (L = their total)."""
    lengths = torch.tensor([q1 - q0 for q0, q1, _, _ in group])
    doc = torch.repeat_interleave(torch.arange(len(group)), lengths).to(device)
    n = doc.numel()
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril_()
    return ~(causal & (doc[:, None] == doc[None, :])).view(1, 1, n, n)


def split_attention(query, key, value, plan: AttentionPlan, attend: Callable) -> torch.Tensor:
    """query [s, b, hq, d], key [t, b, hk, d], value [t, b, hk, dv] -> [s, b, hq * dv] through calls of
    `attend(q, k, v, lower_right, mask)` (`SDPACoreAttention.attend` semantics; mask True = masked): one per
    piece, or one per run of short documents (`_groups`)."""
    rows = []
    for r, pieces in enumerate(plan.pieces):
        parts = []
        for group in _groups(pieces):
            q0, k0, q1, k1 = group[0][0], group[0][2], group[-1][1], group[-1][3]
            mask = _block_causal(group, query.device) if len(group) > 1 else None
            parts.append(attend(query[q0:q1, r:r + 1], key[k0:k1, r:r + 1], value[k0:k1, r:r + 1],
                                k1 - k0 != q1 - q0, mask))
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=0))
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=1)


def _device_offsets(plan: AttentionPlan, t: int, device):
    """(cu_q, cu_k, key rows or None when the pieces tile the keys), cached on the plan per device."""
    cache = plan.__dict__.setdefault("_varlen", {})
    if device in cache:
        return cache[device]
    cu_q, cu_k, starts, tiles = [0], [0], [], True
    for r, pieces in enumerate(plan.pieces):
        end = 0
        for q0, q1, k0, k1 in pieces:
            cu_q.append(cu_q[-1] + q1 - q0)
            cu_k.append(cu_k[-1] + k1 - k0)
            starts.append(r * t + k0)
            tiles = tiles and k0 == end
            end = k1
        tiles = tiles and end == t
    lengths = torch.tensor(cu_k).diff()
    rows = None
    if not tiles:  # row index of every packed key: the piece's first key row + its offset within the piece
        first = torch.tensor(starts, dtype=torch.int64) - torch.tensor(cu_k[:-1], dtype=torch.int64)
        rows = (torch.repeat_interleave(first, lengths) + torch.arange(cu_k[-1])).to(device)
    out = (torch.tensor(cu_q, dtype=torch.int32, device=device), torch.tensor(cu_k, dtype=torch.int32, device=device),
           rows)
    cache[device] = out
    return out


def varlen_attention(query, key, value, plan: AttentionPlan, scale: float) -> torch.Tensor:
    """As `split_attention`, in one `varlen_attn` call (CUDA; `choose_method` says when)."""
    varlen_attn = _varlen()
    s, b, hq, d = query.shape
    t, _, hk, dv = value.shape
    cu_q, cu_k, rows = _device_offsets(plan, t, query.device)
    q = query.transpose(0, 1).reshape(b * s, hq, d)
    k = key.transpose(0, 1).reshape(b * t, hk, d)
    v = value.transpose(0, 1).reshape(b * t, hk, dv)
    if rows is not None:
        k, v = k.index_select(0, rows), v.index_select(0, rows)
    params = inspect.signature(varlen_attn).parameters
    kwargs = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "scale" in params:
        kwargs["scale"] = scale
    elif abs(scale - d ** -0.5) > 1e-12 * scale:
        q = q * (scale * d ** 0.5)
    if hk != hq:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k, v = k.repeat_interleave(hq // hk, dim=1), v.repeat_interleave(hq // hk, dim=1)
    out = varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, plan.max_q, plan.max_k, **kwargs)
    return out.view(b, s, hq * dv).transpose(0, 1).contiguous()


def document_attention(query, key, value, plan: AttentionPlan, scale: float, attend: Callable,
                       window=None, dropout_p: float = 0.0, method: Optional[str] = None) -> torch.Tensor:
    """Document-isolated causal attention of `plan`'s pieces; `method` None: `choose_method`."""
    method = method or choose_method(query, value, window, dropout_p)
    if method == "varlen":
        return varlen_attention(query, key, value, plan, scale)
    if method != "split":
        raise ValueError(f"document attention method must be 'varlen' or 'split', got {method!r}")
    return split_attention(query, key, value, plan, attend)


__all__ = ["choose_method", "document_attention", "split_attention", "varlen_attention"]
