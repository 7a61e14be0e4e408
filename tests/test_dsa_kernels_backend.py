"""The DSA layer on the Triton backend, in Triton's interpreter: against transformers' GlmMoeDsaForCausalLM logits and
the reference backend's losses and gradients (sparse attention, the sparse indexer loss, the deterministic backward,
the keys in partitions), and the backend choice. The kernels themselves: tests/test_dsa_kernels.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import triton  # noqa: F401  (the dev extra installs it; the kernels run in its interpreter here)


# ------------------------------------------------------------------------------------------------
# the DSA layer on the Triton backend
# ------------------------------------------------------------------------------------------------


@pytest.fixture()
def interpret(kern):
    return kern


def test_triton_backend_matches_transformers(interpret, tmp_path):
    from pretrain.convert import load_hf_model
    from tests.dsa_helpers import NO_TIE_INDEX_HEADS, hf_checkpoint, positions, relative_error, tokens

    hf = hf_checkpoint(tmp_path, 41, layers=2, dense=1, index_topk=7, index_n_heads=NO_TIE_INDEX_HEADS)
    ids = tokens(41, 2, 14)  # 7 of the 14 tokens see more keys than the top-7 (the interpreter's time grows with them)
    with torch.no_grad():
        ref = hf(ids).logits
    cfg, model = load_hf_model(str(tmp_path), mtp_num_layers=None, dsa_kernel_backend="triton")
    assert cfg.model.dsa_sparse_attention
    with torch.no_grad():
        out = model(ids, positions(2, 14), None)
    assert relative_error(out, ref) <= 1e-5


def test_triton_backend_training_step_matches_reference(interpret, tmp_path):
    """Sparse attention + sparse indexer loss, LM and indexer gradients: Triton with the keys walked in partitions vs
    the reference backend (same weights, same tokens). The same step unpartitioned on the Triton backend is
    tests/test_dsa_indexer_fp8.py's model test (which differs only in selecting in FP8); every key-gradient path,
    partitioned or not, is checked against float64 in tests/test_dsa_kernels.py, and so are the deterministic
    backward's kernels (sparse MLA with the head sums, the sparse KL); here `deterministic_mode` must reach every
    layer's backend."""
    from pretrain.convert import load_hf_model
    from tests.dsa_helpers import NO_TIE_INDEX_HEADS, hf_checkpoint, lm_step, positions, relative_error, tokens

    hf_checkpoint(tmp_path, 42, layers=2, dense=1, index_topk=6, index_n_heads=NO_TIE_INDEX_HEADS)
    # 12 tokens: the Triton interpreter's time grows with the tokens; 6 of them see more keys than the top-6, and
    # the keys split into 3 partitions below
    ids_all = tokens(42, 2, 13)
    ids, labels = ids_all[:, :-1], ids_all[:, 1:]
    common = dict(mtp_num_layers=None, dsa_indexer_loss_coeff=0.5, dsa_indexer_use_sparse_loss=True)

    def backends(model):  # chosen by each DSA layer on its first forward
        return [m.backend for m in model.modules() if getattr(m, "backend", None) is not None]

    _, model = load_hf_model(str(tmp_path), **common, dsa_kernel_backend="triton", deterministic_mode=True)
    with torch.no_grad():  # only to have the layers choose their backend: a short sequence does
        model(ids[:, :4], positions(2, 4), None)
    assert len(backends(model)) == 2 and all(b.deterministic and b.name == "triton" for b in backends(model))
    part_mib = 6 * 24 * 5 / 2**20  # kv + fp32 dkv rows of 5 keys (latent 16 + rope 8): 12 keys in 3 partitions of 4
    _, model = load_hf_model(str(tmp_path), **common, dsa_kernel_backend="reference")
    ref_loss, ref_grads, ref_kl = lm_step(model, ids, labels, scale=1.0)
    _, model = load_hf_model(str(tmp_path), **common, dsa_kernel_backend="triton", dsa_key_partition_mib=part_mib)
    loss, grads, recorded = lm_step(model, ids, labels, scale=1.0)
    # the layers' backend got the budget (model.dsa_key_partition_mib), and not determinism
    assert {b.key_partition_bytes for b in backends(model)} == {int(part_mib * 2**20)}
    assert not any(b.deterministic for b in backends(model))
    assert relative_error(loss, ref_loss) <= 1e-5
    assert set(recorded) == set(ref_kl) and len(recorded) == 2
    for layer in recorded:
        assert abs(float(recorded[layer]) - float(ref_kl[layer])) <= 1e-5 * abs(float(ref_kl[layer])) + 1e-7
    indexer_seen = 0
    for n, g in ref_grads.items():
        if g is None:
            assert grads[n] is None, n
            continue
        assert relative_error(grads[n], g) <= 1e-4, (n, relative_error(grads[n], g))
        indexer_seen += ".indexer." in n
    assert indexer_seen >= 8  # the indexer really trained through the kernels


@pytest.mark.parametrize("sparse_kl", [True, False], ids=["sparse_kl", "dense_kl_warmup"])
def test_triton_backend_dense_attention_sparse_kl(interpret, tmp_path, sparse_kl):
    """Dense attention with the selected-keys KL (dsa_indexer_use_sparse_loss=true), and with the dense KL of the
    recipe's warm-up (false; the Triton top-k then gives only the recall metric): the Triton backend gives the
    reference backend's indexer loss and gradients (the reference is checked against a float64 KL in
    tests/test_dsa_model_indexer_loss.py)."""
    from pretrain.convert import load_hf_model
    from tests.dsa_helpers import NO_TIE_INDEX_HEADS, hf_checkpoint, lm_step, relative_error, tokens

    hf_checkpoint(tmp_path, 43, layers=2, dense=1, index_topk=6, index_n_heads=NO_TIE_INDEX_HEADS)
    ids_all = tokens(43, 2, 13)
    common = dict(mtp_num_layers=None, dsa_sparse_attention=False, dsa_indexer_loss_coeff=0.5,
                  dsa_indexer_use_sparse_loss=sparse_kl)
    runs = [lm_step(load_hf_model(str(tmp_path), **common, dsa_kernel_backend=backend)[1], ids_all[:, :-1],
                    ids_all[:, 1:], scale=1.0) for backend in ("reference", "triton")]
    (_, ref_grads, ref_kl), (_, grads, kl) = runs
    assert set(kl) == set(ref_kl) and len(kl) == 2
    for layer in kl:
        assert abs(float(kl[layer]) - float(ref_kl[layer])) <= 1e-5 * abs(float(ref_kl[layer])), layer
    indexer = [n for n, g in ref_grads.items() if ".indexer." in n and g is not None]
    assert len(indexer) >= 8
    for n in indexer:
        assert relative_error(grads[n], ref_grads[n]) <= 1e-4, (n, relative_error(grads[n], ref_grads[n]))


def test_backend_choice(kern, monkeypatch):
    from pretrain.model.dsa import backend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pick = backend.select_backend
    assert isinstance(pick("auto", "cuda"), backend.TritonBackend)
    assert isinstance(pick("auto", "cpu"), backend.ReferenceBackend)
    assert isinstance(pick("reference", "cuda"), backend.ReferenceBackend)
    assert pick("triton", "cuda", deterministic=True).deterministic
    assert pick("auto", "cuda", key_partition_bytes=1 << 24).key_partition_bytes == 1 << 24
    with pytest.warns(RuntimeWarning, match="dsa_key_partition_mib applies to the Triton kernels"):
        assert isinstance(pick("auto", "cpu", key_partition_bytes=1 << 24), backend.ReferenceBackend)
    with pytest.raises(RuntimeError, match="dsa_kernel_backend=triton needs"):
        pick("triton", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert isinstance(pick("triton", "cpu"), backend.TritonBackend)
    assert isinstance(pick("auto", "cpu"), backend.ReferenceBackend)
    with pytest.raises(ValueError, match="must be one of"):
        pick("cuda", "cuda")
    # auto on CUDA without triton: the reference, and one warning per process saying it is slower
    from pretrain.notices import forget_said

    forget_said()
    monkeypatch.setattr(backend, "triton_available", lambda: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            assert isinstance(pick("auto", "cuda"), backend.ReferenceBackend)
        assert isinstance(pick("auto", "cpu"), backend.ReferenceBackend)
    assert len([w for w in caught if "14x slower" in str(w.message)]) == 1
    # the backend holds a tuning (the defaults unless given) and hands it to the kernels
    from pretrain.model.dsa.kernels.tuning import DEFAULT_TUNING, DSAKernelTuning

    monkeypatch.setattr(backend, "triton_available", lambda: True)
    tuning = DSAKernelTuning(vector_atomics=True)
    assert pick("triton", "cuda").tuning is DEFAULT_TUNING and pick("triton", "cuda", tuning=tuning).tuning is tuning
    with pytest.raises(TypeError, match="DSAKernelTuning"):
        backend.TritonBackend(tuning={"vector_atomics": True})


def test_preflight_refuses_triton_without_a_gpu(monkeypatch):
    from pretrain.config import ConfigError, load_config
    from pretrain.training.preflight import preflight

    cfg = load_config("configs/models/glm5-tiny.yaml", ["model.dsa_kernel_backend=triton", "data.mock=true"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="dsa_kernel_backend=triton needs"):
        preflight(cfg, world_size=1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    preflight(cfg, world_size=1)
