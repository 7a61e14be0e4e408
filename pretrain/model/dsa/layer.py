"""GLM-5's DSA layer: MLA whose attention is restricted to the lightning indexer's top-k keys.

GLM-5 report, DSA section; DeepSeek-V3.2 section 2. `DSAMLASelfAttention` is MLA with latent keys
(`pretrain.model.latent_attention.LatentMLASelfAttention`: megatron's MLA projections and parameters, keys and
values kept as the shared 512-dim latent plus the 64-dim rope key), whose core-attention slot is
`DSACoreAttention`, the latent core (`LatentCoreAttention`: up-projection and dense SDPA) plus the indexer. It

- owns the layer's `LightningIndexer` ("full" layers) or reuses the top-k of the previous full layer
  (`dsa_indexer_types` "shared", HF's `indexer_types`),
- attends densely (SDPA on the up-projected keys/values: dense pretraining and the DSA warm-up), or
  sparsely over the top-k keys in absorbed form (`dsa_sparse_attention`, `sparse_core`), through the
  backend it picks once (`pretrain.model.dsa.backend`: Triton kernels or the PyTorch reference), and
- adds the indexer KL loss (`pretrain.model.dsa.indexer_loss`) when `dsa_indexer_loss_coeff > 0`:
  over the selected keys with `dsa_indexer_use_sparse_loss`, else over every visible key. Under
  sparse attention the KL is formed in backward, from the probabilities the attention backward forms
  anyway (`indexer_loss.kl_from_attention_backward`).

Tensor parallelism splits the attention heads and the indexer's query rows (`indexer_split`): each TP rank
scores, selects and trains the indexer on 1/TP of the rows (paired early and late blocks, equal causal work),
the selections are all-gathered for every rank's heads, the KL target sums the heads of all TP ranks at each
rank's rows, and the indexer's replicated weights get their gradient summed over the TP group. With sequence
parallelism the indexer reads the gathered sequence. Documents inside packed sequences come as the
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
key range. The indexer is already local to the CP rank: it scores, selects and trains (the KL over these rows only)
on the rank's own queries against the gathered keys; under TP x CP the TP ranks split those rows again. The
gathers' backward reduce-scatters the gradients. Plain MLA under CP is the latent layer alone
(`pretrain.model.specs`), with no indexer.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from parallel.context_parallel import cp_size_and_rank, gather_sequence
from pretrain.compat.dsa import IndexerLossAutoScaler
from pretrain.model.documents import AttentionPlan, layout_assignment, segment_starts
from pretrain.model.dsa.backend import select_backend
from pretrain.model.dsa.indexer import LightningIndexer, VisibleKeys, default_chunk, pack_indices, unpack_indices
from pretrain.model.dsa.indexer_split import RowSplit
from pretrain.model.dsa.indexer_loss import (
    DSAMetrics, DeferredKL, dense_target, dense_target_selected, indexer_kl_dense, kl_from_attention_backward,
)
from pretrain.model.dsa.sparse_core import sparse_mla_core
from pretrain.model.latent_attention import LatentCoreAttention, LatentMLASelfAttention, bool_mask, group_size


class DSAMLASelfAttention(LatentMLASelfAttention):
    """The DSA layer: MLA with latent keys (`pretrain.model.latent_attention`) whose core attention is
    `DSACoreAttention` (the spec fills the slot); the projections, RoPE and CP gathers are the latent layer's."""


class DSACoreAttention(LatentCoreAttention):
    """The core-attention slot of a DSA layer (see the module docstring): the latent core plus the indexer."""

    def __init__(self, config, layer_number: int, attn_mask_type, **kwargs):
        super().__init__(config, layer_number, attn_mask_type, **kwargs)
        types = getattr(config, "dsa_indexer_types", None)
        # Decoder layers 1..num_layers follow dsa_indexer_types; the MTP layer always has its own.
        self.index_type = types[layer_number - 1] if types and layer_number <= config.num_layers else "full"
        self.indexer = LightningIndexer(config) if self.index_type == "full" else None
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
        attention_mask = bool_mask(attention_mask)
        segment_ids = segment_starts(layout) if documents is not None else None  # equal within a document
        # the batch's CP chunks (`parallel.cp_chunk_assignment`; None: the zigzag split): the indexer keys' gather
        assignment = layout_assignment(layout, cp_size_and_rank(self.cp_group)[0])
        keys = VisibleKeys(s, t, q_nope.device, attention_mask=attention_mask, segment_ids=segment_ids,
                           query_positions=query_positions)
        coeff = cfg.dsa_indexer_loss_coeff or 0.0
        train_indexer = coeff > 0 and self.indexer is not None and torch.is_grad_enabled()
        # Under TP with model.dsa_indexer_tp_split this rank's indexer scores and trains on its share of the query
        # rows only (`indexer_split`); otherwise every TP rank scores every row (replicated).
        split = (RowSplit.create(s, self.tp_group, q_nope.device)
                 if self.indexer is not None and getattr(cfg, "dsa_indexer_tp_split", False) else None)
        my_keys = keys if split is None else keys.subset(split.rows)
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
                    indices, lse = backend.topk(*self._index_inputs(x, qr, rope, split, assignment), cfg.dsa_indexer_topk,
                                                my_keys, chunk, with_lse=True)
                kept = pack_indices(indices, t)  # what backward keeps: one storage for every function here
                if split is not None:  # every rank's rows (in the kept form: int16 up to 65,535 keys)
                    kept = split.gather(kept)
                    indices = unpack_indices(kept)
                # kept past the forward only for the 'shared' layers that read it ([b, s, topk] per layer)
                self.last_indices = (indices, kept) if self.shared_by_others else None
                if train_indexer:  # the KL and its gradient come in backward, from the attention's own P
                    spec = DeferredKL(project=lambda x_, qr_: self._index_inputs(x_, qr_, rope, split, assignment),
                                      plan=lambda idx, target, lse_, **kw: backend.sparse_kl_plan(
                                          idx, target, sparse_chunk, lse=lse_, **kw),
                                      coeff=coeff, layer=self.layer_number, tp_group=self.tp_group, split=split)
                    channel = kl_from_attention_backward(spec, x, qr, kept, self._indexer_weights(), lse)
            else:
                indices, kept = self._shared_indices(b, s)
            out, _ = sparse_mla_core(q_nope, q_pe, latent, k_pe, kv_up_weight, indices, backend, self.softmax_scale,
                                     sparse_chunk, recompute=recompute_attention, kl_channel=channel,
                                     kept_indices=kept)
            return out

        indexed = self._index_inputs(x, qr, rope, split, assignment) if train_indexer else None
        out, query, key = self.attend_latent(q_nope, q_pe, latent, k_pe, kv_up_weight, attention_mask, documents,
                                             query_positions, assignment)
        if train_indexer:
            query, key = query.detach().transpose(0, 1), key.detach().transpose(0, 1)
            if sparse_loss:  # KL over the indexer's selection, target = dense attention renormalized on it
                backend = self._backend(q_nope.device)
                with torch.no_grad():
                    indices, lse = backend.topk(*indexed, cfg.dsa_indexer_topk, my_keys, chunk, with_lse=True)
                    every = split.gather(indices) if split is not None else None  # the target's other rows
                target = dense_target_selected(query, key, self.softmax_scale, keys, self.tp_group, split, every)
                loss, _ = backend.sparse_kl(*indexed, indices, target, sparse_chunk, max_rows=chunk,
                                            params=self._indexer_weights(), lse=lse, split=split)
            else:
                target = dense_target(query, key, self.softmax_scale, self.tp_group, split, keys)
                loss, recall = indexer_kl_dense(*indexed, my_keys, target, cfg.dsa_indexer_topk, chunk,
                                                params=self._indexer_weights(), split=split)
                DSAMetrics.record("topk_recall", self.layer_number, recall)
            out = self._attach(out, loss, coeff)
        return out

    def own_recompute(self, layer_recompute: bool) -> Optional[bool]:
        """Sparse attention recomputes inside its core (`sparse_core`, keeping the top-k) under the layer's
        `core_attn` recompute or `dsa_sparse_recompute_attention`; dense DSA layers are checkpointed whole."""
        if not self.config.dsa_sparse_attention:
            return None
        return layer_recompute or bool(self.config.dsa_sparse_recompute_attention)

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

    def _index_inputs(self, x, qr, rope, split: Optional[RowSplit] = None, assignment=None):
        """The indexer's q_I, k_I, w from detached inputs over the full sequence (q_I and w at the TP rank's rows
        only, given `split`); under CP the keys of every rank, gathered in the chunk `assignment` (None: zigzag)."""
        x, qr = x.detach(), qr.detach()
        if self.config.sequence_parallel and group_size(self.tp_group) > 1:
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=self.tp_group)
            qr = gather_from_sequence_parallel_region(qr, tensor_parallel_output_grad=False, group=self.tp_group)
        q, k, w = self.indexer.project(x, qr, rope, split)
        # Context parallelism: every rank's indexer keys [b, t, d_I] (this rank's queries score all of them).
        return q, gather_sequence(k, 1, self.cp_group, assignment), w

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
