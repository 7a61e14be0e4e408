"""megatron-core 0.16.1 without Transformer Engine or apex (part of `pretrain.compat`).

True on the CPU machines and on GPU machines without TE, and the default backend of this project
(`model.transformer_impl: local`). megatron-core guards its TE imports but not every use of them.
"""

from __future__ import annotations

import importlib

from pretrain.compat.registry import Workaround


def te_available() -> bool:
    """True when Transformer Engine's PyTorch extension imports."""
    try:
        importlib.import_module("transformer_engine.pytorch")
        return True
    except Exception:  # ImportError, or a broken CUDA build raising at import
        return False


def patch_mla_have_te() -> None:
    """Pin `multi_latent_attention.HAVE_TE` to whether TE really imports."""
    # HAVE_TE is computed from an import that succeeds even without TE
    # (megatron.core.extensions.transformer_engine guards its own imports), so MLA then treats
    # TE-only code paths as available.
    from megatron.core.transformer import multi_latent_attention

    if not te_available():
        multi_latent_attention.HAVE_TE = False


_MOE_FUSED_NAMES = (
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "fused_permute",
    "fused_permute_with_probs",
    "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs",
    "fused_topk_with_score_function",
    "fused_unpermute",
    "te_general_gemm",
)


def patch_moe_fused_names() -> None:
    """Define moe_utils' TE fused-kernel names as None when TE did not define them."""
    # moe_utils imports these inside `try`; without TE they are never defined, and
    # router_gating_linear references `te_general_gemm` unconditionally (NameError). None selects
    # megatron's own torch fallbacks.
    from megatron.core.transformer.moe import moe_utils

    for name in _MOE_FUSED_NAMES:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


WORKAROUNDS = [
    Workaround(
        name="patch_mla_have_te",
        target="megatron.core.transformer.multi_latent_attention.HAVE_TE",
        reason="HAVE_TE is True without TE, so MLA takes TE-only code paths and fails",
        upstream="open",
        test="tests/test_hf_parity.py::test_logits_match_transformers",
        install=patch_mla_have_te,
    ),
    Workaround(
        name="patch_moe_fused_names",
        target="megatron.core.transformer.moe.moe_utils (te_general_gemm, fused_* names)",
        reason="router_gating_linear raises NameError on te_general_gemm when TE is absent",
        upstream="open",
        test="tests/test_hf_parity.py::test_logits_match_transformers",
        install=patch_moe_fused_names,
    ),
]
