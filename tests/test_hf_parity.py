"""Logits of our megatron-core GLM-5 against transformers' GlmMoeDsaForCausalLM (fp32, CPU).

index_topk >= sequence length, so the reference's DSA selects every causal key and attention is
dense, which is what our model computes until sparse attention is on.
"""

import pytest
import torch

from pretrain.convert import load_hf_model
from tests.hf_fixtures import write_hf_checkpoint

CASES = [
    # seed, decoder layers, dense-first layers, batch, sequence
    (0, 3, 1, 2, 24),
    (1, 2, 0, 1, 17),  # every layer MoE
    (2, 3, 2, 2, 40),
    (3, 2, 2, 3, 9),  # every layer dense
]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).abs().max() / ref.abs().max()).item()


def reference_and_ours(path, seed: int, batch: int, seq: int, **checkpoint):
    """transformers' logits and ours for the same random checkpoint and tokens."""
    hf = write_hf_checkpoint(str(path), seed, **checkpoint)
    ids = torch.randint(0, hf.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref = hf(ids).logits
    cfg, model = load_hf_model(str(path))
    with torch.no_grad():
        out = model(ids, torch.arange(seq).unsqueeze(0).expand(batch, -1), None)
    return cfg, model, ids, ref, out


@pytest.mark.parametrize("seed,layers,dense,batch,seq", CASES)
def test_logits_match_transformers(tmp_path, seed, layers, dense, batch, seq):
    cfg, _, _, ref, out = reference_and_ours(tmp_path, seed, batch, seq, layers=layers, dense=dense, mtp=False)
    assert cfg.model.num_layers == layers and not cfg.model.mtp_num_layers
    assert out.shape == ref.shape
    assert relative_error(out, ref) <= 1e-5


def test_logits_match_with_mtp_layer_in_checkpoint(tmp_path):
    """A GLM-5-style directory with its MTP layer: the main logits are unaffected by it."""
    cfg, _, _, ref, out = reference_and_ours(tmp_path, 7, 2, 12, layers=2, dense=1, mtp=True)
    assert cfg.model.mtp_num_layers == 3 and cfg.model.mtp_use_repeated_layer
    assert relative_error(out, ref) <= 1e-5


def test_parity_detects_a_wrong_weight(tmp_path):
    """The comparison is sensitive: perturbing one loaded tensor breaks it."""
    _, model, ids, ref, out = reference_and_ours(tmp_path, 4, 1, 10, layers=2, dense=1, mtp=False)
    assert relative_error(out, ref) <= 1e-5
    with torch.no_grad():
        model.decoder.layers[1].self_attention.linear_kv_up_proj.weight.mul_(1.01)
        out = model(ids, torch.arange(10).unsqueeze(0), None)
    assert relative_error(out, ref) > 1e-4


@pytest.mark.parametrize("topk", [64, 5])
def test_packed_documents_match_each_document_alone(tmp_path, topk):
    """Documents packed into one window (micro-batch 2, different documents per row, positions restarting per
    document): each document's logits equal transformers' on that document alone. With index_topk 5 the
    reference selects 5 keys per query within the document alone, so our top-k must never pick another
    document's keys (and pads rows with fewer than 5 keys); with 64 attention is dense within documents."""
    from data_pipeline.packing import collate_batch, pack_sample
    from pretrain.training.step import with_documents

    eod, seq = 1, 30
    # 16 index heads: a key whose ReLU'd index score is 0 in every head (a tie, which the reference's torch.topk
    # and our top-k may break differently) is rare
    hf = write_hf_checkpoint(str(tmp_path), 5, layers=2, dense=1, mtp=False, index_topk=topk, index_n_heads=16)
    gen = torch.Generator().manual_seed(5)
    lengths = [[7, 12, 11], [1, 16, 13]]  # documents end with EOD (a 1-token document is EOD alone)
    texts = []
    for row in lengths:
        docs = [torch.cat([torch.randint(2, hf.config.vocab_size, (n - 1,), generator=gen), torch.tensor([eod])])
                for n in row]
        texts.append(torch.cat(docs + [torch.tensor([eod])]))  # the window's extra label token
    batch = with_documents(collate_batch([pack_sample(t, eod, -1, True, True, False) for t in texts]))
    assert batch["document_layout"].shape == (2, 2, seq)  # the O(S) document layout
    _, model = load_hf_model(str(tmp_path))
    with torch.no_grad():
        out = model(batch["tokens"], batch["position_ids"], batch["document_layout"])
        for row, row_lengths in enumerate(lengths):
            start = 0
            for n in row_lengths:
                ref = hf(batch["tokens"][row:row + 1, start:start + n]).logits[0]
                assert relative_error(out[row, start:start + n], ref) <= 1e-5, (row, start, n)
                start += n
        # the documents matter: the same window without them differs
        plain = model(batch["tokens"], torch.arange(seq).expand(2, -1), None)
    assert relative_error(plain, out) > 1e-3


def test_restarted_positions_without_isolation_match_transformers(tmp_path):
    """data.reset_position_ids without reset_attention_mask: documents see each other, RoPE counts from each
    document's start. Equal to transformers given the same position_ids (within isolated documents RoPE's
    relative form makes restarted positions invisible, so this is the case that shows they take effect)."""
    from data_pipeline.packing import collate_batch, pack_sample
    from pretrain.training.step import with_documents

    eod, seq = 1, 24
    hf = write_hf_checkpoint(str(tmp_path), 6, layers=2, dense=1, mtp=False)
    gen = torch.Generator().manual_seed(6)
    texts = torch.randint(2, hf.config.vocab_size, (2, seq + 1), generator=gen)
    texts[0, [6, 15]] = eod
    texts[1, [10]] = eod
    batch = with_documents(collate_batch([pack_sample(t, eod, -1, True, False, False) for t in texts]))
    assert batch["position_ids"][0, 7] == 0 and batch["position_ids"][1, 11] == 0
    _, model = load_hf_model(str(tmp_path))
    with torch.no_grad():
        ref = hf(batch["tokens"], position_ids=batch["position_ids"]).logits
        out = model(batch["tokens"], batch["position_ids"], batch["document_layout"])
        window = hf(batch["tokens"]).logits  # positions 0 .. seq - 1
    assert relative_error(out, ref) <= 1e-5
    assert relative_error(window, ref) > 1e-3  # the positions matter here
