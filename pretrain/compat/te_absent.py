"""megatron-core 0.16.1 without Transformer Engine or apex (part of `pretrain.compat`).

True on the CPU machines and on GPU machines without TE, and the default backend of this project
(`model.transformer_impl: local`). megatron-core guards its TE imports but not every use of them.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import List, Optional, Tuple

import torch

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


class _NoFP8:
    """Stands in for TE's FP8GlobalStateManager: FP8 is never on without TE."""

    @staticmethod
    def is_fp8_enabled() -> bool:
        return False

    @staticmethod
    def get_fp8_recipe():
        return None


def patch_checkpoint_without_output_fp8() -> None:
    """Selective recompute of norms and activations without TE: FP8 reads as off."""
    # `CheckpointWithoutOutput.__init__(fp8=False)` sets `self.fp8 = fp8 is not None`, i.e. True for
    # the default False, so its forward asks TE's FP8GlobalStateManager, a name that exists only when
    # TE imported: every `recompute_modules` entry built on it (layernorm, moe_act, mla_up_proj) raises
    # NameError. A stand-in that answers "FP8 off" takes the non-FP8 branch, which is the right one.
    # The same branch enters TE's `activation_recompute_forward` and `fp8_autocast` contexts, which
    # do nothing when FP8 is off: plain null contexts.
    from megatron.core.tensor_parallel import random

    if not hasattr(random, "FP8GlobalStateManager"):
        random.FP8GlobalStateManager = _NoFP8
        random.activation_recompute_forward = lambda *args, **kwargs: contextlib.nullcontext()
        random.fp8_autocast = lambda *args, **kwargs: contextlib.nullcontext()


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


def foreach_l2_norm(chunk_size: int, noop_flag, tensor_lists: List[List[torch.Tensor]], per_tensor: bool,
                    *args) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The l2 norm of every tensor in `tensor_lists[0]` together, as a 1-element fp32 tensor on their device,
    without a host synchronization (amp_C.multi_tensor_l2norm's signature; `per_tensor` is not supported,
    as in megatron's own fallback)."""
    # megatron calls it only with gradients (clip_grads: `if grads_for_norm`), never with an empty list
    norms = torch._foreach_norm(tensor_lists[0], 2, dtype=torch.float32)  # one fused launch per (device, dtype)
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def sync_free_grad_norm() -> None:
    """Swap megatron's apex-free gradient-norm fallback for `foreach_l2_norm` (no host sync per gradient)."""
    # Without apex or TE, clip_grads.l2_norm_impl is megatron.core.utils.local_multi_tensor_l2_norm, which
    # builds `torch.tensor(l2)` from a list of 0-dim device tensors: one `.item()`, a host synchronization,
    # per gradient, then a `float()`. A glm5-proxy step syncs about 190 times in the gradient norm (126 on
    # the first of 2 pipeline stages), each draining the GPU's queue while the host launches the next norm.
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm


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
    Workaround(
        name="patch_checkpoint_without_output_fp8",
        target="megatron.core.tensor_parallel.random (FP8GlobalStateManager, activation_recompute_forward, fp8_autocast)",
        reason="CheckpointWithoutOutput reads fp8=False as True and calls TE's FP8 manager: selective "
               "recompute of norms raises NameError without TE",
        upstream="open",
        test="tests/test_memory_features.py::test_each_feature_leaves_losses_and_every_gradient_unchanged",
        install=patch_checkpoint_without_output_fp8,
    ),
    Workaround(
        name="sync_free_grad_norm",
        target="megatron.core.optimizer.clip_grads.l2_norm_impl",
        reason="without apex or TE the gradient norm's fallback syncs the host once per gradient (about 190 "
               "syncs a step on glm5-proxy), each draining the GPU's queue",
        upstream="open",
        test="tests/test_compat_grad_norm.py::test_grad_norm_matches_float64_without_a_host_sync",
        install=sync_free_grad_norm,
    ),
]
