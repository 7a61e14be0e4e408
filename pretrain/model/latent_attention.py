"""MLA with latent keys: the layer hands its core attention the shared latent, not per-head keys and values.

Multi-head latent attention (DeepSeek-V2 section 2.1; GLM-5 report, architecture) projects each token to a latent
c = RMSNorm(W_DKV x) (`kv_lora_rank` numbers) and one rope key k_R = RoPE(W_KR x) shared by all heads; head i's key
and value are up-projections of the latent:

    k_i = [W_UK_i c ; k_R],    v_i = W_UV_i c,    o_i = softmax(q_i k_i^T / sqrt(d_qk)) v_i

`LatentMLASelfAttention` computes MLA's projections as megatron-core's `MLASelfAttention` does (same parameters,
same state-dict keys, same TP / SP layout) but hands the core attention c and k_R with the up-projection weight
W_UKV instead of the up-projected keys and values. That is what context parallelism gathers (each CP rank
all-gathers c and k_R, 576 numbers per token at GLM-5's shapes, in global order, where megatron's MLA gathers
nothing), and what DSA selects and attends over in absorbed form (`pretrain.model.dsa`, whose `DSAMLASelfAttention`
and `DSACoreAttention` extend the two classes here with the lightning indexer).

`LatentCoreAttention`, the spec's core-attention slot, up-projects the (gathered) latent and attends densely:
causal in the queries' global positions under CP, per document when the batch's document layout isolates them
(`pretrain.model.documents`), or under a caller's megatron bool mask. RoPE rotates by the position within the
document where positions restart; THD packing (`packed_seq_params.cu_seqlens_q`, b = 1) becomes a layout.
The gathers' backward reduce-scatters the gradients (`parallel.context_parallel`).
"""

from __future__ import annotations

import importlib.util
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from parallel.context_parallel import causal_visibility, cp_size_and_rank, gather_sequence, local_positions
from pretrain.model.core_attention import SDPACoreAttention
from pretrain.model.documents import (
    AttentionPlan, attention_plan, is_document_layout, layout_assignment, query_blocks, rope_positions,
)
from pretrain.model.notices import warn_once


def group_size(group) -> int:
    """A process group's size (1 for None)."""
    return group.size() if group is not None else 1


class LatentMLASelfAttention(MLASelfAttention):
    """MLA self-attention whose core attention sees the latent keys (training and evaluation)."""

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                attention_bias=None, packed_seq_params=None, position_ids=None, sequence_len_offset=None,
                *, inference_params=None):
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("latent MLA attention has no KV-cache inference path; run full sequences")
        cfg, tp = self.config, self.pg_collection.tp
        tp_size = group_size(tp)
        sp = cfg.sequence_parallel and tp_size > 1

        # Down projections and latent norms, laid out as megatron's MLA lays them out.
        q_c, _ = self.linear_q_down_proj(hidden_states)
        if q_c.size(-1) != cfg.q_lora_rank:
            q_c = gather_from_tensor_model_parallel_region(q_c, group=tp)
            if cfg.sequence_parallel:
                q_c = scatter_to_sequence_parallel_region(q_c, group=tp)
        q_c = self.q_layernorm(q_c)
        kv, _ = self.linear_kv_down_proj(hidden_states)
        full_seq = not sp
        if kv.size(-1) != cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim:  # column-parallel: [s, b, width / TP]
            kv = gather_from_tensor_model_parallel_region(kv, group=tp)
            full_seq = True
        latent, k_pe = torch.split(kv, [cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim], dim=-1)
        if full_seq and sp:  # the latent norm runs sequence-sharded (its weight is SP-marked)
            latent = scatter_to_sequence_parallel_region(latent, group=tp)
        latent = self.kv_layernorm(latent)
        # The latent and the rope key are shared by this rank's heads: every TP rank's heads add to
        # their gradient (megatron's MLA loses the rope key's share, Megatron-LM #1699).
        if sp:
            latent = gather_from_sequence_parallel_region(latent, group=tp)
        elif tp_size > 1:
            latent = copy_to_tensor_model_parallel_region(latent, group=tp)
        if not full_seq:
            k_pe = gather_from_sequence_parallel_region(k_pe, group=tp)
        elif tp_size > 1:
            k_pe = copy_to_tensor_model_parallel_region(k_pe, group=tp)

        q, _ = self.linear_q_up_proj(q_c)
        s, b = q.shape[0], q.shape[1]
        q = q.view(s, b, self.num_attention_heads_per_partition, self.q_head_dim)
        q_nope, q_pe = torch.split(q, [cfg.qk_head_dim, cfg.qk_pos_emb_head_dim], dim=-1)

        layout = attention_mask if is_document_layout(attention_mask) else None
        if layout is not None:
            attention_mask = None
        rope, layout = self._rope(s, packed_seq_params, q.device, layout)
        q_pe, k_pe = rope(q_pe), rope(k_pe.unsqueeze(2))
        positions = None
        cp_size, cp_rank = cp_size_and_rank(self.pg_collection.cp)
        assignment = layout_assignment(layout, cp_size)  # the batch's CP chunks (None: the zigzag split)
        if cp_size > 1:  # every rank's latent keys, in global order: one all-gather of c + d_rope per token
            keys = gather_sequence(torch.cat([latent, k_pe[:, :, 0]], dim=-1), 0, self.pg_collection.cp, assignment)
            latent, k_pe = keys[..., :cfg.kv_lora_rank], keys[..., cfg.kv_lora_rank:].unsqueeze(2)
            positions = local_positions(s, cp_size, cp_rank, q.device, assignment)
        documents = None  # the plan of isolated documents (None: causal over the whole window)
        if layout is not None:
            plan = attention_plan(layout, query_blocks(s, cp_size, cp_rank, assignment=assignment))
            documents = plan if plan.isolated else None

        recompute = self.checkpoint_core_attention and self.training  # recompute_modules: core_attn
        # A core that recomputes inside itself (DSA's sparse attention, `sparse_core`) is not checkpointed whole:
        # that would repeat the indexer's top-k and keep its inputs besides.
        inside = self.core_attention.own_recompute(recompute)

        def core(q_nope, q_pe, latent, k_pe, weight, x, qr):
            return self.core_attention(q_nope, q_pe, latent, k_pe, weight, x=x, qr=qr, attention_mask=attention_mask,
                                       documents=documents, layout=layout, rope=rope, query_positions=positions,
                                       recompute_attention=bool(inside))

        inputs = (q_nope, q_pe, latent, k_pe, self.linear_kv_up_proj.weight, hidden_states, q_c)
        if recompute and inside is None:
            out = tensor_parallel.checkpoint(core, False, *inputs)
        else:
            out = core(*inputs)
        output, bias = self.linear_proj(out)
        return output, bias

    def _rope(self, s: int, packed_seq_params, device, layout):
        """(rope(t), layout): RoPE over this rank's tokens, by their position within their document where positions
        restart (a document layout's origins; THD packing, whose sequences become the layout)."""
        cfg = self.config
        thd = packed_seq_params is not None and getattr(packed_seq_params, "qkv_format", "thd") == "thd"
        cp_size, cp_rank = cp_size_and_rank(self.pg_collection.cp)
        if thd and cp_size > 1:
            raise NotImplementedError("context parallelism takes packed documents as the batch's document layout "
                                      "(pretrain.model.documents), not as THD cu_seqlens")
        if thd:
            cu = packed_seq_params.cu_seqlens_q.to(device)
            token = torch.arange(s, device=device)  # each token's document start: cu at its segment id
            starts = cu.long()[torch.bucketize(token, cu[1:-1].to(token.dtype), right=True)].to(torch.int32)[None]
            layout = torch.stack([starts, starts], dim=1)
        positions = None
        assignment = layout_assignment(layout, cp_size)
        if layout is not None and attention_plan(layout, query_blocks(s, cp_size, cp_rank,
                                                                      assignment=assignment)).positions_reset:
            query_positions = local_positions(s, cp_size, cp_rank, device, assignment)
            positions = rope_positions(layout, query_positions)  # [b, s], each < the global length
        elif assignment is not None:  # global positions of a chunk assignment: rows of the whole table
            positions = local_positions(s, cp_size, cp_rank, device, assignment)[None]
        # megatron's rotary modules return this CP rank's positions (of the zigzag split) unless asked for the whole
        # table (packed_seq)
        length = s * cp_size
        if cfg.rope_type == "rope":
            freqs, mscale = self.rotary_pos_emb(length, packed_seq=positions is not None), 1.0
        else:
            freqs, mscale = self.rotary_pos_emb(length, packed_seq=positions is not None)
        if positions is None:
            freqs = freqs[:s]
        elif positions.shape[0] == 1:
            freqs = freqs[positions[0]]
        else:  # per-sample positions: [s, b, 1, r], which megatron's formula broadcasts (the fused kernel does not)
            freqs = freqs[positions.t()].view(s, positions.shape[0], 1, freqs.shape[-1])
        cp = self.pg_collection.cp
        # On CUDA one Triton kernel per direction (`pretrain.model.rope`), bitwise megatron's unfused formula,
        # which takes seven passes and recomputes its cos / sin on every call; megatron's own on CPU.
        fused = None
        if freqs.is_cuda and importlib.util.find_spec("triton") is None:
            warn_once("triton is not installed: MLA's RoPE runs megatron-core's unfused formula (seven passes a call, "
                      "its cos / sin recomputed each time); install triton for the fused kernel", stacklevel=2)
        elif freqs.is_cuda:
            if cfg.rotary_interleaved:
                warn_once("model.rotary_interleaved=true: MLA's RoPE runs megatron-core's unfused formula (the "
                          "fused kernel takes the non-interleaved rotation GLM-5 uses)", stacklevel=2)
            elif freqs.shape[1] != 1:
                warn_once("documents with per-sample RoPE positions (micro-batch > 1): MLA's RoPE runs megatron-core's "
                          "unfused formula (the fused kernel takes one position per token row)", stacklevel=2)
            else:
                from pretrain.model.rope import mla_rope

                fused = mla_rope(freqs, mscale)

        def rope(t: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
            """`rows` (int64): t holds only these of the s rows (the DSA indexer's share of them under TP)."""
            if rows is not None:
                f = freqs.index_select(0, rows)
                return mla_rope(f, mscale)(t) if fused is not None else apply_rotary_pos_emb(
                    t, f, config=cfg, mscale=mscale, cp_group=cp)
            if fused is not None:
                return fused(t)
            return apply_rotary_pos_emb(t, freqs, config=cfg, mscale=mscale, cp_group=cp)

        return rope, layout


class LatentCoreAttention(SDPACoreAttention):
    """The latent layer's core-attention slot: the up-projected latent keys, attended densely (SDPA)."""

    def own_recompute(self, layer_recompute: bool) -> Optional[bool]:
        """How this core takes the layer's `core_attn` recompute: None, the layer checkpoints the whole core
        (megatron's rule, dense attention); a bool, the core recomputes inside itself, and whether it does."""
        return None

    def forward(self, q_nope, q_pe, latent, k_pe, kv_up_weight, *, x=None, qr=None, attention_mask=None,
                documents: Optional[AttentionPlan] = None, layout=None, rope=None, query_positions=None,
                recompute_attention: bool = False):
        """q_nope [s, b, h, dn], q_pe [s, b, h, dr] (roped), latent [t, b, c], k_pe [t, b, 1, dr] (roped),
        kv_up_weight [h * (dn + dv), c] -> [s, b, h * dv]. Without context parallelism t = s; with it the
        keys are the whole sequence and `query_positions` [s] the global positions of the queries.
        `documents`: the plan of isolated documents of the document layout `layout` (`pretrain.model.documents`),
        None when documents may attend to each other. `x`, `qr`, `rope`, `recompute_attention`: what the layer
        hands every core (DSA's indexer reads them); dense attention needs none of them."""
        return self.attend_latent(q_nope, q_pe, latent, k_pe, kv_up_weight, bool_mask(attention_mask), documents,
                                  query_positions, layout_assignment(layout, cp_size_and_rank(self.cp_group)[0]))[0]

    def attend_latent(self, q_nope, q_pe, latent, k_pe, kv_up_weight, attention_mask, documents, query_positions,
                      assignment=None):
        """Dense attention over the up-projected latent -> (out [s, b, h * dv], query, key), `attention_mask` a
        bool megatron mask (True = masked) or None; `assignment`: the batch's CP chunks (None: the zigzag split)."""
        s, b, h, dn = q_nope.shape
        t, c, dv = latent.shape[0], latent.shape[-1], self.config.v_head_dim
        k_nope, value = F.linear(latent, kv_up_weight.view(h * (dn + dv), c)).view(t, b, h, dn + dv).split([dn, dv],
                                                                                                            dim=-1)
        query = torch.cat([q_nope, q_pe], dim=-1)
        key = torch.cat([k_nope, k_pe.expand(-1, -1, h, -1)], dim=-1)
        mask = attention_mask
        cp_size, cp_rank = cp_size_and_rank(self.cp_group)
        if documents is not None:  # within each query's document, no mask tensor
            out = self.attend_documents(query, key, value, documents)
        elif mask is None and cp_size > 1:  # causal in global positions, no mask tensor
            out = self.attend_cp_causal(query, key, value, cp_size, cp_rank, assignment)
        else:
            if query_positions is not None:  # a caller's dense mask under CP: its rows AND global causal
                visible = causal_visibility(query_positions.to(query.device), t).unsqueeze(0)
                if mask is not None:
                    visible = visible & ~mask[:, 0, :s, :]
                mask = ~visible.unsqueeze(1)
            out = self.attend(query, key, value, mask, self.attn_mask_type)
        return out, query, key


def bool_mask(attention_mask):
    """A megatron attention mask as bool (True = masked): additive float masks are masked where negative."""
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        return attention_mask < 0
    return attention_mask


__all__ = ["LatentCoreAttention", "LatentMLASelfAttention", "bool_mask", "group_size"]
