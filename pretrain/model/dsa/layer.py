"""GLM-5's DSA layer: MLA whose attention is restricted to the lightning indexer's top-k keys.

GLM-5 report, DSA section; DeepSeek-V3.2 section 2. `DSAMLASelfAttention` computes MLA's
projections as megatron-core's `MLASelfAttention` does (same parameters, same TP / SP layout) but
keeps keys and values as the shared 512-dim latent plus the 64-dim rope key, and hands them with
the key/value up-projection to `DSACoreAttention`, the attention spec's core-attention slot, which

- owns the layer's `LightningIndexer` ("full" layers) or reuses the top-k of the previous full layer
  (`dsa_indexer_types` "shared", HF's `indexer_types`),
- attends densely (SDPA on the up-projected keys/values: dense pretraining and the DSA warm-up), or
  sparsely over the top-k keys in absorbed form (`dsa_sparse_attention`, `sparse_core`), through the
  backend it picks once (`pretrain.model.dsa.backend`: Triton kernels or the PyTorch reference), and
- adds the indexer KL loss (`pretrain.model.dsa.indexer_loss`) when `dsa_indexer_loss_coeff > 0`:
  over the selected keys with `dsa_indexer_use_sparse_loss`, else over every visible key. Under
  sparse attention the KL is formed in backward, from the probabilities the attention backward forms
  anyway (`indexer_loss.kl_from_attention_backward`).

Tensor parallelism splits the attention heads; the indexer is replicated (every TP rank computes the
same top-k and the same indexer gradient; the KL target sums the heads of all TP ranks). With
sequence parallelism the indexer reads the gathered sequence. Documents inside packed sequences come as the
batch's document layout (`pretrain.model.documents`: O(S) segment starts and position origins, in the
`attention_mask` argument) or as `packed_seq_params.cu_seqlens_q` (THD, b = 1, turned into a layout): the
indexer scores and selects only keys of the query's document (rows with fewer visible keys than K pad with -1),
so the sparse attention and the indexer KL never reach another document; dense attention runs per document
(`pretrain.model.document_attention`); RoPE (MLA's and the indexer's) rotates by the position within the
document when positions restart (`data.reset_position_ids`). A megatron bool mask is still taken.

Selective recompute of the core attention (`recompute_modules: [core_attn]`): dense layers
checkpoint the whole core (megatron's rule); sparse layers keep their top-k and recompute only the
sparse attention's forward in backward (`sparse_core`), so the indexer is never run twice.

Context parallelism (`parallel.context_parallel`): each CP rank holds 2 chunks of the sequence; the
layer all-gathers the normalized latent and the roped rope key (576 numbers per token at GLM-5's
shapes) and the core attention the indexer keys (128), in global order, and the rank's queries
attend to all keys under the causal mask of their global positions: dense, or top-k over the global
key range. The gathers' backward reduce-scatters the gradients. The same classes carry plain MLA
(no `dsa` variant: no indexer) under CP, where megatron's MLA would gather nothing.
"""

from __future__ import annotations

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

from parallel.context_parallel import cp_size_and_rank, gather_sequence, local_positions
from pretrain.compat.dsa import IndexerLossAutoScaler
from pretrain.model.core_attention import SDPACoreAttention
from pretrain.model.documents import (
    AttentionPlan, attention_plan, is_document_layout, query_blocks, rope_positions, segment_starts,
)
from pretrain.model.dsa.backend import select_backend
from pretrain.model.dsa.kernels import triton_available
from pretrain.model.dsa.indexer import (
    LightningIndexer, VisibleKeys, default_chunk, pack_indices, segment_ids_from_cu_seqlens,
)
from pretrain.model.dsa.indexer_loss import (
    DSAMetrics, DeferredKL, dense_target, dense_target_selected, indexer_kl_dense, kl_from_attention_backward,
)
from pretrain.model.dsa.sparse_core import sparse_mla_core
from pretrain.model.notices import warn_once


def _tp_size(group) -> int:
    return group.size() if group is not None else 1


class DSAMLASelfAttention(MLASelfAttention):
    """MLA self-attention whose core attention sees the latent keys (training and evaluation)."""

    def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                attention_bias=None, packed_seq_params=None, position_ids=None, sequence_len_offset=None,
                *, inference_params=None):
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("DSA attention has no KV-cache inference path; run full sequences")
        cfg, tp = self.config, self.pg_collection.tp
        tp_size = _tp_size(tp)
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
        if cp_size > 1:  # every rank's latent keys, in global order: one all-gather of c + d_rope per token
            keys = gather_sequence(torch.cat([latent, k_pe[:, :, 0]], dim=-1), 0, self.pg_collection.cp)
            latent, k_pe = keys[..., :cfg.kv_lora_rank], keys[..., cfg.kv_lora_rank:].unsqueeze(2)
            positions = local_positions(s, cp_size, cp_rank, q.device)
        documents = None  # the plan of isolated documents (None: causal over the whole window)
        if layout is not None:
            plan = attention_plan(layout, query_blocks(s, cp_size, cp_rank))
            documents = plan if plan.isolated else None

        recompute = self.checkpoint_core_attention and self.training  # recompute_modules: core_attn
        # Sparse layers recompute only the attention, inside their core (`sparse_core`): a checkpoint of
        # the whole core would repeat the indexer's top-k and keep its inputs besides.
        sparse = getattr(cfg, "experimental_attention_variant", None) == "dsa" and cfg.dsa_sparse_attention

        def core(q_nope, q_pe, latent, k_pe, weight, x, qr):
            return self.core_attention(q_nope, q_pe, latent, k_pe, weight, x=x, qr=qr, attention_mask=attention_mask,
                                       documents=documents, layout=layout, rope=rope, query_positions=positions,
                                       recompute_attention=sparse and (recompute or cfg.dsa_sparse_recompute_attention))

        inputs = (q_nope, q_pe, latent, k_pe, self.linear_kv_up_proj.weight, hidden_states, q_c)
        if recompute and not sparse:
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
            starts = cu.long()[segment_ids_from_cu_seqlens(cu, s)].to(torch.int32)  # [1, s]
            layout = torch.stack([starts, starts], dim=1)
        positions = None
        if layout is not None and attention_plan(layout, query_blocks(s, cp_size, cp_rank)).positions_reset:
            query_positions = local_positions(s, cp_size, cp_rank, device)
            positions = rope_positions(layout, query_positions)  # [b, s], each < the global length
        # megatron's rotary modules return this CP rank's positions unless asked for the whole table (packed_seq)
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
        if freqs.is_cuda and triton_available():
            if cfg.rotary_interleaved:
                warn_once("model.rotary_interleaved=true: MLA's RoPE runs megatron-core's unfused formula (the "
                          "fused kernel takes the non-interleaved rotation GLM-5 uses)", stacklevel=2)
            elif freqs.shape[1] != 1:
                warn_once("documents with per-sample RoPE positions (micro-batch > 1): MLA's RoPE runs megatron-core's "
                          "unfused formula (the fused kernel takes one position per token row)", stacklevel=2)
            else:
                from pretrain.model.rope import mla_rope

                fused = mla_rope(freqs, mscale)

        def rope(t: torch.Tensor) -> torch.Tensor:
            if fused is not None:
                return fused(t)
            return apply_rotary_pos_emb(t, freqs, config=cfg, mscale=mscale, cp_group=cp)

        return rope, layout


class DSACoreAttention(SDPACoreAttention):
    """The core-attention slot of a DSA layer (see the module docstring)."""

    def __init__(self, config, layer_number: int, attn_mask_type, **kwargs):
        super().__init__(config, layer_number, attn_mask_type, **kwargs)
        types = getattr(config, "dsa_indexer_types", None)
        # Decoder layers 1..num_layers follow dsa_indexer_types; the MTP layer always has its own.
        self.index_type = types[layer_number - 1] if types and layer_number <= config.num_layers else "full"
        # Plain MLA under context parallelism uses this slot too (latent keys), without an indexer.
        dsa = getattr(config, "experimental_attention_variant", None) == "dsa"
        self.indexer = LightningIndexer(config) if self.index_type == "full" and dsa else None
        self.__dict__["index_source"] = None  # the full layer a shared layer reads (not a submodule)
        self.last_indices: Optional[torch.Tensor] = None
        self.shared_by_others = False  # set by link_shared_indexers
        self.backend = None  # ReferenceBackend or TritonBackend, set by the first sparse call
        pg_collection = kwargs.get("pg_collection")
        self.tp_group = pg_collection.tp if pg_collection is not None else None

    def forward(self, q_nope, q_pe, latent, k_pe, kv_up_weight, *, x, qr, attention_mask=None,
                documents: Optional[AttentionPlan] = None, layout=None, rope=None, query_positions=None,
                recompute_attention: bool = False):
        """q_nope [s, b, h, dn], q_pe [s, b, h, dr] (roped), latent [t, b, c], k_pe [t, b, 1, dr] (roped),
        kv_up_weight [h * (dn + dv), c] -> [s, b, h * dv]. Without context parallelism t = s; with it the
        keys are the whole sequence and `query_positions` [s] the global positions of the queries.
        `documents`: the plan of isolated documents of the document layout `layout` (`pretrain.model.documents`),
        None when documents may attend to each other.
        `recompute_attention`: sparse attention keeps neither its latent output nor its log-sum-exp and
        runs its forward again in backward (`sparse_core`); the top-k selection is kept."""
        cfg = self.config
        s, b, h, dn = q_nope.shape
        t = latent.shape[0]
        c, dv = latent.shape[-1], cfg.v_head_dim
        w = kv_up_weight.view(h, dn + dv, c)
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            attention_mask = attention_mask < 0
        segment_ids = segment_starts(layout) if documents is not None else None  # equal within a document
        keys = VisibleKeys(s, t, q_nope.device, attention_mask=attention_mask, segment_ids=segment_ids,
                           query_positions=query_positions)
        coeff = cfg.dsa_indexer_loss_coeff or 0.0
        train_indexer = coeff > 0 and self.indexer is not None and torch.is_grad_enabled()
        # Query rows per chunk: row blocks over all keys ([rows, heads, s]: top-k, dense KL) and over the
        # selected keys ([rows, K, 576] gathered: sparse attention and KL) have different widths.
        k_sel = min(cfg.dsa_indexer_topk or t, t)
        chunk = cfg.dsa_chunk_size or default_chunk(max(h, cfg.dsa_indexer_n_heads or 0) * t)
        sparse_chunk = cfg.dsa_chunk_size or default_chunk(k_sel * (c + q_pe.shape[-1] + h))
        sparse, sparse_loss = cfg.dsa_sparse_attention, bool(getattr(cfg, "dsa_indexer_use_sparse_loss", False))
        if train_indexer and sparse and not sparse_loss:  # the config check refuses it first
            raise ValueError("model.dsa_indexer_use_sparse_loss=false (dense KL) cannot train with "
                             "model.dsa_sparse_attention=true: sparse attention has no dense probabilities")
        if sparse:
            backend = self._backend(q_nope.device)
            channel = None
            if self.indexer is not None:
                with torch.no_grad():  # the indexer loss recomputes the projection in backward
                    indices, lse = backend.topk(*self._index_inputs(x, qr, rope), cfg.dsa_indexer_topk, keys, chunk,
                                                with_lse=True)
                kept = pack_indices(indices, t)  # what backward keeps: one storage for every function here
                # kept past the forward only for the 'shared' layers that read it ([b, s, topk] per layer)
                self.last_indices = (indices, kept) if self.shared_by_others else None
                if train_indexer:  # the KL and its gradient come in backward, from the attention's own P
                    spec = DeferredKL(project=lambda x_, qr_: self._index_inputs(x_, qr_, rope),
                                      plan=lambda idx, target, lse_, **kw: backend.sparse_kl_plan(
                                          idx, target, sparse_chunk, lse=lse_, **kw),
                                      coeff=coeff, layer=self.layer_number, tp_group=self.tp_group)
                    channel = kl_from_attention_backward(spec, x, qr, kept, self._indexer_weights(), lse)
            else:
                indices, kept = self._shared_indices(b, s)
            out, _ = sparse_mla_core(q_nope, q_pe, latent, k_pe, kv_up_weight, indices, backend, self.softmax_scale,
                                     sparse_chunk, recompute=recompute_attention, kl_channel=channel,
                                     kept_indices=kept)
            return out

        indexed = self._index_inputs(x, qr, rope) if train_indexer else None
        k_nope, value = F.linear(latent, w.view(h * (dn + dv), c)).view(t, b, h, dn + dv).split([dn, dv], dim=-1)
        query = torch.cat([q_nope, q_pe], dim=-1)
        key = torch.cat([k_nope, k_pe.expand(-1, -1, h, -1)], dim=-1)
        mask = attention_mask
        cp_size, cp_rank = cp_size_and_rank(self.cp_group)
        if documents is not None:  # within each query's document, no mask tensor
            out = self.attend_documents(query, key, value, documents)
        elif mask is None and cp_size > 1:  # causal in global positions, no mask tensor
            out = self.attend_cp_causal(query, key, value, cp_size, cp_rank)
        else:
            if query_positions is not None:
                mask = ~keys.rows(0, s).unsqueeze(1)  # a caller's dense mask under CP: its rows AND global causal
            out = self.attend(query, key, value, mask, self.attn_mask_type)
        if train_indexer:
            query, key = query.detach().transpose(0, 1), key.detach().transpose(0, 1)
            if sparse_loss:  # KL over the indexer's selection, target = dense attention renormalized on it
                backend = self._backend(q_nope.device)
                with torch.no_grad():
                    indices, lse = backend.topk(*indexed, cfg.dsa_indexer_topk, keys, chunk, with_lse=True)
                target = dense_target_selected(query, key, self.softmax_scale, keys, self.tp_group)
                loss, _ = backend.sparse_kl(*indexed, indices, target, sparse_chunk, max_rows=chunk,
                                            params=self._indexer_weights(), lse=lse)
            else:
                target = dense_target(query, key, self.softmax_scale, self.tp_group)
                loss, recall = indexer_kl_dense(*indexed, keys, target, cfg.dsa_indexer_topk, chunk,
                                                params=self._indexer_weights())
                DSAMetrics.record("topk_recall", self.layer_number, recall)
            out = self._attach(out, loss, coeff)
        return out

    def _backend(self, device: torch.device):
        """This layer's sparse-operation backend, chosen on first use (when the device is known)."""
        if self.backend is None:
            cfg = self.config
            mib = getattr(cfg, "dsa_key_partition_mib", None)
            self.backend = select_backend(getattr(cfg, "dsa_kernel_backend", "auto"), device.type,
                                          deterministic=cfg.deterministic_mode,
                                          key_partition_bytes=None if mib is None else int(mib * 2**20),
                                          indexer_fp8=getattr(cfg, "dsa_indexer_fp8", False))
        return self.backend

    def _index_inputs(self, x, qr, rope):
        """The indexer's q_I, k_I, w from detached inputs over the full sequence."""
        x, qr = x.detach(), qr.detach()
        if self.config.sequence_parallel and _tp_size(self.tp_group) > 1:
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=self.tp_group)
            qr = gather_from_sequence_parallel_region(qr, tensor_parallel_output_grad=False, group=self.tp_group)
        q, k, w = self.indexer.project(x, qr, rope)
        # Context parallelism: every rank's indexer keys [b, t, d_I] (this rank's queries score all of them).
        return q, gather_sequence(k, 1, self.cp_group), w

    def _indexer_weights(self):
        """The indexer's trained weights: its loss's gradient reaches them from forward (`indexer_loss`)."""
        return [p for p in self.indexer.parameters() if p.requires_grad]

    def _shared_indices(self, b: int, s: int):
        """The previous full layer's (indices, indices as kept for backward)."""
        source = self.index_source
        shared = source.last_indices if source is not None else None
        if shared is None or shared[0].shape[:2] != (b, s):
            raise RuntimeError(
                f"DSA layer {self.layer_number} is 'shared' but no full indexer layer ran before it on "
                "this pipeline stage; the first layer of every stage must be 'full'"
            )
        return shared

    def _attach(self, out: torch.Tensor, loss: torch.Tensor, coeff: float) -> torch.Tensor:
        DSAMetrics.record("indexer_loss", self.layer_number, loss)
        return IndexerLossAutoScaler.apply(out, loss * coeff)


def link_shared_indexers(module: torch.nn.Module) -> None:
    """Point every 'shared' DSA layer at the nearest full layer before it (module order)."""
    last = None
    for sub in module.modules():
        if isinstance(sub, DSACoreAttention):
            if sub.indexer is not None:
                last = sub
            else:
                sub.__dict__["index_source"] = last
                if last is not None:
                    last.shared_by_others = True
