"""Documents packed into fixed-length sequences, with their boundaries kept.

megatron-core's `GPTDataset` packs: it shuffles the documents (the document index), lays them end
to end, each ending in EOD, and cuts the stream into windows of `seq_length + 1` tokens (the sample
index; a window overlaps the next by one token so inputs and labels both have `seq_length`).
A window therefore holds the tail of one document, some whole documents and the head of another.
Nothing is padded or dropped except the stream's last partial window.

This module turns one window into what the model needs, given the EOD positions in the inputs
`x[0..s)`. A document starts at 0 and after every EOD, so with `e_1 < e_2 < ...` the EOD positions,

    cu_seqlens = [0, e_1 + 1, e_2 + 1, ..., s]            (segment offsets; EOD at s-1 adds nothing)
    doc(i)     = #{k : e_k < i}                             (segment of token i)
    pos(i)     = i - cu_seqlens[doc(i)]                     (reset_position_ids)
    masked(i, j) = j > i  or  doc(i) != doc(j)              (reset_attention_mask: block-diagonal causal)

Attention sees documents through `cu_seqlens` alone: O(s) per sample, at any length. The training step turns a
batch's offsets and position ids into the model's document layout (`pretrain.model.documents`: each token's
document start and position origin, O(s)), and every attention path (dense, DSA top-k and sparse attention,
context parallelism) isolates documents from it without a mask tensor. megatron's dense [1, s, s] bool mask
(`create_attention_mask`) is not built: it costs s^2 bytes per sample (16 GiB at 128K) and more in temporaries;
`block_causal_mask` writes it out for tests that compare against megatron's `_get_ltor_masks_and_position_ids`.

Without `reset_attention_mask` a window is one attention segment, so `cu_seqlens` always describes
what attention may see: per-document segments when documents are isolated, whole windows when not.
A batch flattens them megatron's THD way: offsets into the [b * s] token stream (`PackedSeqParams`).
"""

from __future__ import annotations

from typing import Dict, List

import torch


def segment_offsets(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """cu_seqlens of one window: 0, one past every EOD in `tokens` (except at the end), len(tokens)."""
    s = tokens.numel()
    starts = (tokens == eod).nonzero().flatten() + 1
    starts = starts[starts < s]
    zero, end = starts.new_zeros(1), starts.new_full((1,), s)
    return torch.cat([zero, starts, end]).to(torch.int32)


def segment_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """doc(i): how many EODs come strictly before token i."""
    is_eod = (tokens == eod).long()
    return torch.cumsum(is_eod, 0) - is_eod


def reset_positions(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """Position ids that restart at 0 after every EOD."""
    cu = segment_offsets(tokens, eod).long()
    return torch.arange(tokens.numel()) - cu[segment_ids(tokens, eod)]


def block_causal_mask(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[1, s, s] bool, True = masked: causal within a document, nothing across documents (megatron's dense
    mask, for tests; the data pipeline never builds it)."""
    doc = segment_ids(tokens, eod)
    s = tokens.numel()
    future = torch.ones(s, s, dtype=torch.bool).triu_(1)
    return (future | (doc[:, None] != doc[None, :])).unsqueeze(0)


def pack_sample(
    text: torch.Tensor,
    eod: int,
    pad: int,
    reset_position_ids: bool,
    reset_attention_mask: bool,
    eod_mask_loss: bool,
    create_attention_mask: bool = False,
) -> Dict[str, torch.Tensor]:
    """One window of s + 1 token ids -> tokens, labels, loss_mask, position_ids, cu_seqlens (all O(s)).

    Same semantics as megatron's `GPTDataset.__getitem__`: `eod_mask_loss` zeroes the loss where the
    *input* is EOD (the prediction that would cross into the next document), padding (`pad`, only
    in a short final window) carries no loss and is mapped to token 0 so the embedding can read it.
    """
    if create_attention_mask:
        raise ValueError("data.create_attention_mask=true: the dense [s, s] document mask is not built (documents "
                         "reach attention as cu_seqlens, O(s)); set data.create_attention_mask=false")
    text = text.long()
    tokens, labels = text[:-1].clone(), text[1:].clone()
    s = tokens.numel()
    loss_mask = torch.ones(s, dtype=torch.float)
    if eod_mask_loss:
        loss_mask[tokens == eod] = 0.0
    loss_mask[labels == pad] = 0.0
    sample = {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": reset_positions(tokens, eod) if reset_position_ids else torch.arange(s),
        "cu_seqlens": (
            segment_offsets(tokens, eod) if reset_attention_mask else torch.tensor([0, s], dtype=torch.int32)
        ),
    }
    tokens[tokens == pad] = 0
    labels[labels == pad] = 0
    return sample


def collate_batch(samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Stack samples; concatenate their segments into batch-wide THD offsets plus `max_seqlen`."""
    batch = {key: torch.stack([torch.as_tensor(x[key]) for x in samples]) for key in samples[0] if key != "cu_seqlens"}
    s = samples[0]["tokens"].numel()
    offsets = [x["cu_seqlens"][:-1] + i * s for i, x in enumerate(samples)]
    cu = torch.cat(offsets + [torch.tensor([len(samples) * s], dtype=torch.int32)]).to(torch.int32)
    batch["cu_seqlens"] = cu
    batch["max_seqlen"] = torch.tensor(int((cu[1:] - cu[:-1]).max()), dtype=torch.int32)
    return batch


def packed_seq_params(batch: Dict[str, torch.Tensor]):
    """megatron-core `PackedSeqParams` (THD) for a collated batch's document segments."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu, max_seqlen = batch["cu_seqlens"], int(batch["max_seqlen"])
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
    )
