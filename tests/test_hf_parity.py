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
