"""Core attention over `torch.nn.functional.scaled_dot_product_attention`.

softmax(Q K^T * scale + mask) V for one layer's heads, with Q/K head dim allowed to differ from
V's (MLA: qk = qk_head_dim + qk_pos_emb_head_dim, v = v_head_dim) and K/V allowed to carry fewer
heads than Q (GQA). On GPU, SDPA dispatches to cuDNN / flash kernels; on CPU to its math kernel.
It needs no Transformer Engine, unlike megatron-core 0.16.1's MLA path.

DSA layers use `pretrain.model.dsa.DSACoreAttention`, which builds on this class for
their dense attention. `model.window_size` makes it sliding-window attention
(`pretrain.model.sliding_window`).

Packed documents arrive as a document layout in the `attention_mask` argument (`pretrain.model.documents`:
O(S) segment starts, never an S x S mask) and are attended by `pretrain.model.document_attention` (one
FlashAttention varlen call, or one SDPA call per document piece): no query sees another document's keys.
A megatron bool / float mask [b|1, 1, s, s] is still taken (True = masked) for callers that build one; the
data pipeline never does.

Context parallelism (`parallel.context_parallel`): the queries are this rank's tokens, K and V are
all-gathered over the CP group into global order, and attention is causal in global positions (with
packed documents: within each query's document, through the same document pieces). Without
documents no mask tensor is built (`attend_cp_causal`): the rank's two query chunks, at global
rows [k c, (k + 1) c), each attend to keys [0, (k + 1) c) with the causal diagonal aligned to the
last key. `model.cp_attention: bottom_right` sends each chunk as one bottom-right causal
SDPA call (`torch.nn.attention.bias.causal_lower_right`), which SDPA runs only on its flash and
memory-efficient kernels, 1.55-1.72x an even split of one causal cuDNN call (docs/long_context.md).
`merged` (the default: 1.33x the training step of bottom_right at CP = 2, 32K, 2 x H200) sends each chunk as a non-causal block over keys [0, k c) and a plain causal square over its
own keys, merged by their log-sum-exps (`pretrain.model.blockwise_attention`: cuDNN on CUDA, the
kernels of a single causal call); where no kernel returns the log-sum-exp (fp32 on CUDA, attention
dropout, a sliding window) it falls back to the bottom-right calls, said once in the log. An explicit [s / cp, s] mask
(at 128K and CP = 2, 8 GB per layer) leaves SDPA only its kernels that read a mask, which skip no
block (CP = 2 at 32K trained at 0.31 of one GPU that way: docs/parallelism.md).
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from parallel.context_parallel import (
    causal_visibility,
    cp_size_and_rank,
    gather_sequence,
    local_positions,
)
from pretrain.model.blockwise_attention import Rows, blockwise_attention, bottom_right_rows, choose_kernel
from pretrain.model.document_attention import document_attention
from pretrain.model.documents import (
    AttentionPlan, attention_plan, is_document_layout, layout_assignment, query_blocks,
)
from pretrain.model.sliding_window import combine, sliding_window_mask
from pretrain.notices import say_once

_log = logging.getLogger(__name__)


# cuDNN first on GPU: on Hopper it is the fastest SDPA kernel at MLA's head dims (qk 256, v 256).
GPU_BACKENDS = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


class SDPACoreAttention(MegatronModule):
    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        self.cp_group = cp_group_of(pg_collection) if config.context_parallel_size > 1 else None
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        k_channels = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else k_channels**-0.5
        self.window_size = getattr(config, "window_size", None)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias=None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        # query [sq, b, np, hk], key [sk, b, ng, hk], value [sk, b, ng, hv] -> [sq, b, np * hv]
        if packed_seq_params is not None:
            raise NotImplementedError(
                "packed (thd) sequences are not supported by SDPACoreAttention; documents reach it as the "
                "batch's document layout in attention_mask (pretrain.model.documents)"
            )
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        cp_size, cp_rank = cp_size_and_rank(self.cp_group)
        # the batch's CP chunks (`parallel.cp_chunk_assignment`), carried by its document layout; None: zigzag
        assignment = layout_assignment(attention_mask, cp_size) if is_document_layout(attention_mask) else None
        if cp_size > 1:
            key, value = (gather_sequence(t, 0, self.cp_group, assignment) for t in (key, value))
        if is_document_layout(attention_mask):
            plan = attention_plan(attention_mask, query_blocks(query.shape[0], cp_size, cp_rank, key.shape[0],
                                                               assignment))
            if plan.positions_reset and type(self) is SDPACoreAttention:
                # megatron's MLA / GQA rotated q and k by window positions before this (config check_documents)
                raise ValueError("per-document positions (data.reset_position_ids=true) reach RoPE only in the latent "
                                 "MLA layer (DSA, or MLA under context parallelism); set data.reset_position_ids=false")
            if plan.isolated:
                return self.attend_documents(query, key, value, plan)
            attention_mask = None  # positions only (applied by the RoPE before this): causal attention
        if cp_size > 1:
            if attention_mask is None and self.window_size is None:
                return self.attend_cp_causal(query, key, value, cp_size, cp_rank, assignment)
            visible = causal_visibility(local_positions(query.shape[0], cp_size, cp_rank, query.device, assignment),
                                        key.shape[0])
            attention_mask = ~visible if attention_mask is None else attention_mask | ~visible
        return self.attend(query, key, value, attention_mask, mask_type)

    def attend_cp_causal(self, query, key, value, cp_size: int, cp_rank: int, assignment=None) -> torch.Tensor:
        """Causal attention of this CP rank's queries (its two chunks, `parallel.context_parallel`, or its chunks of
        a chunk `assignment`) to the whole sequence's keys in global order: per run of adjacent chunks a non-causal
        block over the keys before it and a causal square over its own, merged by log-sum-exp (`attend_blocks`);
        else one bottom-right causal call per run."""
        runs = query_blocks(query.shape[0], cp_size, cp_rank, assignment=assignment)
        rows = [bottom_right_rows(l0, l0 + n, 0, g0 + n) for l0, g0, n in runs]
        out = self.attend_blocks(query, key, value, rows, "context-parallel attention")
        if out is not None:
            return out
        outs = []
        for l0, g0, n in runs:  # rows l0 .. l0 + n - 1 sit at global g0 .. g0 + n - 1: keys 0 .. g0 + n - 1
            outs.append(self.attend(query[l0:l0 + n], key[:g0 + n], value[:g0 + n], None, lower_right=True))
        return torch.cat(outs, dim=0)

    def attend_blocks(self, query, key, value, rows: Sequence[Rows], what: str) -> Optional[torch.Tensor]:
        """query [s, b, np, hk], key / value [t, b, ng, *] -> [s, b, np * hv] through
        `pretrain.model.blockwise_attention` (query rows against key blocks, merged by log-sum-exp), or None where
        no kernel returns the log-sum-exp here (said once: the caller takes bottom-right causal SDPA calls)."""
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        dropout_p = self.dropout_p if self.training else 0.0
        kernel, why = choose_kernel(q, k, v, dropout_p)
        if getattr(self.config, "cp_attention", "merged") != "merged":
            kernel, why = None, "model.cp_attention=bottom_right"
        elif self.window_size is not None:
            kernel, why = None, "sliding window"
        if kernel is None:
            say_once(_log, "%s: bottom-right causal SDPA calls, the slower flash / memory-efficient kernels (%s)", what,
                     why)
            return None
        say_once(_log, "%s: a non-causal block and a causal square per query chunk, merged by log-sum-exp (%s)",
                 what, kernel.name)
        out = blockwise_attention(q, k, v, rows, self.softmax_scale, kernel)
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    def attend_documents(self, query, key, value, plan: AttentionPlan) -> torch.Tensor:
        """Causal attention within documents (`pretrain.model.document_attention`): query [s, b, np, hk] at the
        plan's global positions, key / value [t, b, ng, *] in global order -> [s, b, np * hv]; no mask tensor."""

        def piece(q, k, v, lower_right: bool, mask=None):
            if lower_right:  # a document continued from an earlier context-parallel chunk
                rows = (bottom_right_rows(0, q.shape[0], 0, k.shape[0]),)
                out = self.attend_blocks(q, k, v, rows, "document attention under context parallelism")
                if out is not None:
                    return out
            return self.attend(q, k, v, mask, AttnMaskType.causal, lower_right=lower_right)

        return document_attention(query, key, value, plan, self.softmax_scale, piece, window=self.window_size,
                                  dropout_p=self.dropout_p if self.training else 0.0)

    def attend(self, query, key, value, attention_mask, mask_type=None, lower_right: bool = False) -> torch.Tensor:
        """query [sq, b, np, hk], key [sk, b, ng, hk], value [sk, b, ng, hv], mask True = masked -> [sq, b, np * hv].
        `lower_right`: causal with query i seeing keys <= i + sk - sq (no mask tensor; where `attend_blocks` cannot)."""
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        attn_mask = None
        is_causal = False
        if lower_right:
            attn_mask = causal_lower_right(q.shape[2], k.shape[2])
        elif attention_mask is not None:
            # megatron convention: True marks a masked-out position
            attn_mask = ~attention_mask
        elif mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal):
            is_causal = q.shape[2] > 1 or k.shape[2] == 1
        if self.window_size is not None:  # the window is causal too (right = 0), so it replaces is_causal
            window = sliding_window_mask(q.shape[2], k.shape[2], self.window_size, q.device)
            attn_mask, is_causal = combine(window, attention_mask), False
        backends = GPU_BACKENDS if q.is_cuda else [SDPBackend.MATH]
        with sdpa_kernel(backends, set_priority=True):
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=attn_mask,
                dropout_p=self.dropout_p if self.training else 0.0,
                is_causal=is_causal,
                scale=self.softmax_scale,
                enable_gqa=k.shape[1] != q.shape[1],
            )
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


def cp_group_of(pg_collection):
    """The context-parallel group from megatron's process-group collection (or its parallel state)."""
    group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if group is None:
        from megatron.core import parallel_state as ps

        group = ps.get_context_parallel_group()
    return group
