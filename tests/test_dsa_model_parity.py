"""DSA in the whole model against transformers' GlmMoeDsaForCausalLM: sparse logits, packed documents, index sharing."""

# transformers runs in the sparse regime (index_topk below the sequence length): whole-model logits,
# single-document logits of packed batches, THD-packed attention layers and the indexer's top-k
# selection. fp32 on CPU. Tolerances are relative max-abs errors (max|out - ref| / max|ref|).

from __future__ import annotations

import pytest
import torch

from pretrain.convert import load_hf_model
from tests.dsa_helpers import (  # noqa: F401  (clean_dsa_globals: an autouse fixture)
    NO_TIE_INDEX_HEADS,
    TOL,
    clean_dsa_globals,
    document_mask,
    hf_checkpoint,
    is_indexer,
    positions,
    relative_error,
    tokens,
)

# ================================================================================================
# 1. logits parity with transformers in the sparse regime
# ================================================================================================

SPARSE_CASES = [
    # seed, layers, dense-first layers, batch, seq, index_topk, indexer_types, chunk override
    # (32 index heads: no ties at the top-k boundary. transformers selects with torch.topk, whose choice
    # among tied keys is unspecified; ours takes the lowest key indices, tested in test_dsa_ops_indexer.py.)
    (10, 3, 1, 2, 24, 6, None, None),
    # every layer MoE; top-k and sparse attention in row chunks of 7
    (11, 2, 0, 1, 33, 5, None, 7),
    (12, 3, 1, 2, 40, 8, ["full", "shared", "full"], None),
    (13, 3, 2, 1, 20, 7, ["full", "shared", "shared"], 6),
]


@pytest.mark.parametrize("seed,layers,dense,batch,seq,topk,types,chunk", SPARSE_CASES)
def test_sparse_logits_match_transformers(tmp_path, seed, layers, dense, batch, seq, topk, types, chunk):
    kw = {"indexer_types": types} if types else {}
    hf = hf_checkpoint(tmp_path, seed, layers=layers, dense=dense, index_topk=topk,
                       index_n_heads=NO_TIE_INDEX_HEADS, **kw)
    assert topk < seq
    ids = tokens(seed, batch, seq)
    with torch.no_grad():
        ref = hf(ids).logits
    overrides = {"dsa_chunk_size": chunk} if chunk else {}
    cfg, model = load_hf_model(str(tmp_path), mtp_num_layers=None, **overrides)
    assert cfg.model.dsa_sparse_attention and cfg.model.dsa_indexer_topk == topk
    assert cfg.model.dsa_indexer_types == types
    with torch.no_grad():
        out = model(ids, positions(batch, seq), None)
    assert out.shape == ref.shape
    assert relative_error(out, ref) <= TOL

    # Sensitivity: the same weights with dense attention are far from the sparse reference, so the
    # comparison above really exercises the sparse path.
    _, dense_model = load_hf_model(str(tmp_path), mtp_num_layers=None, dsa_sparse_attention=False)
    with torch.no_grad():
        dense_out = dense_model(ids, positions(batch, seq), None)
    assert relative_error(dense_out, ref) > 1e-3


# ================================================================================================
# 2. packed sequences: documents by a dense mask, and THD packing at the attention module
# ================================================================================================


def test_dense_document_mask_gives_each_document_its_own_logits(tmp_path):
    """Sparse mode, packed documents under a dense document mask: every document's logits equal
    transformers' logits of that document alone (later documents sit at RoPE offsets; rope scores
    depend only on position differences). Without the mask later documents differ."""
    topk = 5
    hf = hf_checkpoint(tmp_path, 41, layers=3, dense=1, index_topk=topk, indexer_types=["full", "shared", "full"],
                       index_n_heads=NO_TIE_INDEX_HEADS)
    lengths = [[9, 7, 12], [6, 14, 8]]
    seq = sum(lengths[0])
    ids = tokens(41, len(lengths), seq)
    _, model = load_hf_model(str(tmp_path), mtp_num_layers=None)
    mask = document_mask(lengths)
    with torch.no_grad():
        packed = model(ids, positions(*ids.shape), mask)
        unmasked = model(ids, positions(*ids.shape), None)
    later_diffs = []
    for row, row_lengths in enumerate(lengths):
        start = 0
        for n in row_lengths:
            assert n > topk  # the documents themselves are sparse
            with torch.no_grad():
                ref = hf(ids[row : row + 1, start : start + n]).logits[0]
            assert relative_error(packed[row, start : start + n], ref) <= TOL, (row, start)
            if start > 0:
                later_diffs.append(relative_error(unmasked[row, start : start + n], ref))
            start += n
    assert min(later_diffs) > 1e-3, later_diffs


def _hf_attention(attn, rotary, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' attention layer on one document: hidden [s, h] -> [s, h]."""
    s = hidden.shape[0]
    x = hidden.unsqueeze(0)
    cos_sin = rotary(x, torch.arange(s).unsqueeze(0))
    mask = torch.full((s, s), torch.finfo(x.dtype).min).triu(1)[None, None]
    out, _, _ = attn(x, position_embeddings=cos_sin, attention_mask=mask)
    return out[0]


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_thd_packed_attention_matches_documents_alone(tmp_path, sparse):
    """A DSA attention layer called on a THD-packed stream [t, 1, h] with cu_seqlens gives, per
    document, its output on that document alone (RoPE positions restart per document); in sparse
    mode that is also transformers' attention layer on the document."""
    from megatron.core.packed_seq_params import PackedSeqParams

    topk = 4
    hf = hf_checkpoint(tmp_path, 51, layers=2, dense=1, index_topk=topk, index_n_heads=NO_TIE_INDEX_HEADS)
    _, model = load_hf_model(str(tmp_path), mtp_num_layers=None, dsa_sparse_attention=sparse)
    lengths = [7, 11, 5, 9]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    total = int(cu[-1])
    hidden = torch.randn(total, 1, hf.config.hidden_size, generator=torch.Generator().manual_seed(51))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    for index, layer in enumerate(model.decoder.layers):
        attn = layer.self_attention
        with torch.no_grad():
            packed, _ = attn(hidden, None, packed_seq_params=params)
            whole, _ = attn(hidden, None)
        assert packed.shape == hidden.shape
        later_diffs = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            with torch.no_grad():
                alone, _ = attn(hidden[a:b], None)
                ref = _hf_attention(hf.model.layers[index].self_attn, hf.model.rotary_emb, hidden[a:b, 0])
            assert relative_error(packed[a:b], alone) <= TOL, (index, a)
            if sparse:
                assert relative_error(packed[a:b, 0], ref) <= TOL, (index, a)
            if a > 0:
                later_diffs.append(relative_error(whole[a:b], alone))
        assert min(later_diffs) > 1e-3, later_diffs  # without the packing the documents mix


# ================================================================================================
# 3. index sharing
# ================================================================================================


def test_shared_layer_reuses_the_full_layers_selection(tmp_path, monkeypatch):
    """dsa_indexer_types ["full", "shared"]: the shared layer owns no indexer, points at layer 1's
    core attention, and attends over exactly layer 1's top-k, which is transformers' selection."""
    from pretrain.model.dsa.backend import ReferenceBackend

    topk, seq = 5, 18
    hf = hf_checkpoint(tmp_path, 71, layers=2, dense=1, index_topk=topk, indexer_types=["full", "shared"])
    cfg, model = load_hf_model(str(tmp_path), mtp_num_layers=None)
    assert cfg.model.dsa_indexer_types == ["full", "shared"]
    names = [n for n, _ in model.named_parameters() if is_indexer(n)]
    assert names and all(n.startswith("decoder.layers.0.") for n in names)
    first, second = (layer.self_attention.core_attention for layer in model.decoder.layers)
    assert second.indexer is None and second.index_source is first

    seen = []
    original = ReferenceBackend.attention_forward

    def recording(self, q, kv, indices, *args, **kwargs):
        seen.append(indices.clone())
        return original(self, q, kv, indices, *args, **kwargs)

    monkeypatch.setattr(ReferenceBackend, "attention_forward", recording)
    hf_indices = []
    hf.model.layers[0].self_attn.register_forward_hook(lambda m, a, out: hf_indices.append(out[2]))
    ids = tokens(71, 2, seq)
    with torch.no_grad():
        model(ids, positions(2, seq), None)
        hf(ids)
    assert len(seen) == 2 and torch.equal(seen[0], seen[1])

    def selected(indices: torch.Tensor) -> torch.Tensor:
        """[b, s, K] -> [b, s, s] bool over causal keys (slots of -1 / masked keys dropped)."""
        b, s, _ = indices.shape
        out = torch.zeros(b, s, s + 1, dtype=torch.bool)
        out.scatter_(-1, torch.where(indices < 0, s, indices.long()), True)
        return out[..., :s] & torch.ones(s, s, dtype=torch.bool).tril()

    ours, theirs = selected(seen[0]), selected(hf_indices[0])
    assert torch.equal(ours, theirs)
    assert torch.equal(ours.sum(-1), torch.arange(1, seq + 1).clamp(max=topk).expand(2, -1))
