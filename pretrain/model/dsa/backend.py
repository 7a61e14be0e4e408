"""The two implementations of DSA's sparse operations, behind one interface.

A DSA layer picks its backend once (`select_backend`, from `model.dsa_kernel_backend` and the
device of its tensors) and calls the same four methods whichever it got:

- `topk`: the lightning indexer's top-k key indices (GLM-5 report, DSA; DeepSeek-V3.2 section 2.1);
- `sparse_attention`: absorbed sparse MLA attention over those keys, forward and backward (an
  autograd function); `attention_forward` / `attention_backward`: the same two passes as plain
  functions, for `sparse_core`, which wraps them with MLA's up-projections in one autograd function;
- `sparse_kl_plan` / `sparse_kl`: the sparse indexer KL and its gradient, given a target (the
  attention backward's head-summed probabilities at the selected keys, `attention_backward`'s
  `head_sums`, or dense attention's at the selected keys).

`ReferenceBackend` is PyTorch (`indexer`, `sparse_mla`, `indexer_loss`: any device, the oracle of
the kernels); `TritonBackend` runs the kernels of `pretrain.model.dsa.kernels` (CUDA tensors, or CPU
under TRITON_INTERPRET=1). Both return the same results up to floating-point rounding.

Choices: "reference"; "triton" (an error where Triton cannot run); "auto": Triton on CUDA tensors
when triton is installed, the reference otherwise. On CUDA without triton "auto" warns once per
process, since the reference is much slower there.

`TritonBackend` holds a `DSAKernelTuning` (the kernels' switches and launch parameters; default: the measured
choices) and hands it to every kernel call. Which kernels run for a layer's heads and GPU (`kernels.plan`) is said
once in the log at INFO when the first sparse attention runs, e.g. "DSA kernels: 16 heads/rank sm_90 ->
forward=gluon-keys-as-M, backward=triton, dkv=fused, partitioned(96 MiB)".
"""

from __future__ import annotations

import logging
import typing
import warnings
from typing import Callable, Optional

import torch

from pretrain.model.dsa.indexer import VisibleKeys, indexer_topk
from pretrain.model.dsa.indexer_fp8 import selection_inputs
from pretrain.model.dsa.indexer_loss import apply_kl, sparse_kl_plan
from pretrain.model.dsa.kernels import interpreting, triton_available
from pretrain.model.dsa.kernels.tuning import DEFAULT_TUNING, DSAKernelTuning
from pretrain.config.schema import ModelConfig
from pretrain.model.notices import say_once, warn_once

log = logging.getLogger(__name__)
from pretrain.model.dsa.sparse_mla import output_delta, sparse_mla_attention, sparse_mla_backward, sparse_mla_forward

BACKENDS = typing.get_args(typing.get_type_hints(ModelConfig)["dsa_kernel_backend"])  # the config field's choices


class ReferenceBackend:
    """PyTorch, `chunk` query rows at a time (memory linear in the sequence length). `indexer_fp8`
    (`model.dsa_indexer_fp8`): the top-k ranks keys by FP8 index scores (`indexer_fp8`), in both backends."""

    name = "reference"

    def __init__(self, indexer_fp8: bool = False):
        self.indexer_fp8 = bool(indexer_fp8)

    def topk(self, q, k, w, topk: int, keys: VisibleKeys, chunk: int, with_lse: bool = False):
        """q_I [b, s, H_I, d_I], k_I [b, T, d_I], w [b, s, H_I] -> indices [b, s, min(topk, T)], -1 padded;
        `with_lse`: (indices, lse) with lse for `sparse_kl_plan` (the reference's KL forms its own: None)."""
        if self.indexer_fp8:
            q8, k8, w8, k_scale = selection_inputs(q, k, w)
            indices = indexer_topk(q8, k8, w8, topk, keys, chunk, k_scale)
        else:
            indices = indexer_topk(q, k, w, topk, keys, chunk)
        return (indices, None) if with_lse else indices

    def sparse_attention(self, q_abs, kv, indices, scale: float, v_dim: int, chunk: int):
        """q_abs [b, s, h, D], kv [b, T, D] -> (out [b, s, h, v_dim], lse [b, s, h] fp32)."""
        self._say_plan(q_abs)
        return sparse_mla_attention(q_abs, kv, indices, scale, v_dim, chunk)

    def attention_forward(self, q_abs, kv, indices, scale: float, v_dim: int, chunk: int):
        """`sparse_attention`'s forward, no autograd: (out, lse)."""
        self._say_plan(q_abs)
        return sparse_mla_forward(q_abs, kv, indices, scale, v_dim, chunk)

    @staticmethod
    def _say_plan(q_abs) -> None:
        say_once(log, f"DSA kernels: {q_abs.shape[2]} heads/rank {q_abs.device.type} -> reference (PyTorch) backend")

    def attention_backward(self, q_abs, kv, indices, lse, grad_out, out, scale: float, v_dim: int, chunk: int,
                           head_sums=None):
        """`sparse_attention`'s backward, no autograd: (dq_abs, dkv) from the forward's out and lse;
        `head_sums` (zeroed [b, s, K] fp32) receives sum_h P_h at the selected keys, the KL's target."""
        delta = output_delta(grad_out, out, chunk)
        return sparse_mla_backward(q_abs, kv, indices, lse, delta, grad_out, scale, v_dim, chunk, head_sums)

    def sparse_kl_plan(self, indices, target: Callable, chunk: int, max_rows: Optional[int] = None,
                       lse=None, normalize: bool = False, grad_scale: float = 1.0) -> Callable:
        """`indexer_loss.sparse_kl_plan` with `chunk` query rows per block (at most `max_rows`: what the
        target's own blocks allow); `lse`: what `topk(with_lse=True)` gave (None here); `normalize`: the target
        rows are raw head sums, L1-normalized by the plan; `grad_scale`: a factor on the gradients only."""
        return sparse_kl_plan(indices, target, chunk if max_rows is None else min(chunk, max_rows),
                              normalize=normalize, grad_scale=grad_scale)

    def sparse_kl(self, q, k, w, indices, target: Callable, chunk: int, max_rows: Optional[int] = None, params=(),
                  lse=None, split=None):
        """(mean sparse KL, recall) of that plan, its gradient formed in forward; `params`, `split`: see
        `indexer_loss.apply_kl`."""
        return apply_kl(q, k, w, self.sparse_kl_plan(indices, target, chunk, max_rows, lse), params, split)


class TritonBackend:
    """The Triton kernels; `deterministic` (megatron's `deterministic_mode`) reduces key gradients
    in a fixed order instead of with atomics; `key_partition_bytes` (`model.dsa_key_partition_mib`): the
    attention backward walks the keys in partitions of that many bytes of kv + fp32 dkv rows, 0: one pass, None: the
    tuning's (default: the kernels' measured budget, `kernels.plan.kernel_plan`). `tuning`: the kernels'
    `DSAKernelTuning` (None: the defaults)."""

    name = "triton"

    def __init__(self, deterministic: bool = False, key_partition_bytes: Optional[int] = None,
                 indexer_fp8: bool = False, tuning: Optional[DSAKernelTuning] = None):
        self.deterministic = bool(deterministic)
        self.key_partition_bytes = key_partition_bytes
        self.indexer_fp8 = bool(indexer_fp8)
        self.tuning = DEFAULT_TUNING if tuning is None else tuning
        if not isinstance(self.tuning, DSAKernelTuning):
            raise TypeError(f"TritonBackend's tuning must be a DSAKernelTuning, got {type(self.tuning).__name__}")

    def plan(self, q_abs, kv, v_dim: int):
        """The `kernels.plan.KernelPlan` of the sparse attention on these inputs (said once in the log at INFO)."""
        from pretrain.model.dsa.kernels.sparse_mla import attention_plan

        plan = attention_plan(q_abs, kv, v_dim, self.tuning, self.deterministic, self.key_partition_bytes)
        say_once(log, plan.describe())
        return plan

    def topk(self, q, k, w, topk: int, keys: VisibleKeys, chunk: int, with_lse: bool = False):
        """As the reference (int32 indices); the kernel bounds its own score buffer, `chunk` is unused.
        `keys.ranges()` never move backwards (built so, or checked), so the kernel skips its check's host sync.
        With `indexer_fp8` the score kernel multiplies e4m3 q_I and k_I on FP8 tensor cores. `with_lse`: also each
        row's log sum exp over its selected keys' index scores ([b, s] fp32, 4 bytes a token), which spares the
        sparse KL's kernel a walk over the selection; None with FP8 selection, whose scores are not the KL's."""
        from pretrain.model.dsa.kernels.indexer_topk import indexer_topk as kernel

        if self.indexer_fp8:
            q8, k8, w8, k_scale = selection_inputs(q, k, w)
            indices = kernel(q8, k8, w8, topk, *keys.ranges(), check_ranges=False, k_scale=k_scale,
                             tuning=self.tuning)
            return (indices, None) if with_lse else indices
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if with_lse else None
        indices = kernel(q, k, w, topk, *keys.ranges(), check_ranges=False, lse=lse, tuning=self.tuning)
        return (indices, lse) if with_lse else indices

    def sparse_attention(self, q_abs, kv, indices, scale: float, v_dim: int, chunk: int):
        """As the reference; one program per query token, `chunk` is unused."""
        from pretrain.model.dsa.kernels.sparse_mla import sparse_mla_attention as kernel

        self.plan(q_abs, kv, v_dim)
        return kernel(q_abs, kv, indices, scale, v_dim, self.deterministic, self.tuning)

    def attention_forward(self, q_abs, kv, indices, scale: float, v_dim: int, chunk: int):
        """As the reference's (the kernel's forward)."""
        from pretrain.model.dsa.kernels.sparse_mla import sparse_mla_forward as kernel

        self.plan(q_abs, kv, v_dim)
        return kernel(q_abs, kv, indices, scale, v_dim, self.tuning)

    def attention_backward(self, q_abs, kv, indices, lse, grad_out, out, scale: float, v_dim: int, chunk: int,
                           head_sums=None):
        """As the reference's (the kernel's backward, which sums P over heads as it goes)."""
        from pretrain.model.dsa.kernels.sparse_mla import output_delta as delta_of, sparse_mla_backward as kernel
        from pretrain.model.dsa.kernels.sparse_mla import unit_feature_stride

        # the latent gradient arrives head-major from W_UV's product: the kernels read it in place (no 2 h C copy)
        grad_out = unit_feature_stride(grad_out)
        return kernel(q_abs, kv, indices, lse, delta_of(grad_out, out), grad_out, scale, v_dim, self.deterministic,
                      head_sums, key_partition_bytes=self.key_partition_bytes, tuning=self.tuning)

    def sparse_kl_plan(self, indices, target: Callable, chunk: int, max_rows: Optional[int] = None,
                       lse=None, normalize: bool = False, grad_scale: float = 1.0) -> Callable:
        """As the reference, in one kernel per block of query rows (`kernels.indexer_kl.sparse_kl`: no [rows, K]
        tensor besides the target, which it asks for `max_rows` rows at a time, all at once if None; `chunk` is
        unused); `lse` from `topk(with_lse=True)` spares it a walk over the selection; the kernel normalizes the
        target and scales the gradients itself."""
        from pretrain.model.dsa.kernels.indexer_kl import sparse_kl as kernel

        deterministic, tuning = self.deterministic, self.tuning
        return lambda q, k, w: kernel(q, k, w, indices, target, max_rows, deterministic, lse, normalize, grad_scale,
                                      tuning)

    def sparse_kl(self, q, k, w, indices, target: Callable, chunk: int, max_rows: Optional[int] = None, params=(),
                  lse=None, split=None):
        """As the reference's."""
        return apply_kl(q, k, w, self.sparse_kl_plan(indices, target, chunk, max_rows, lse), params, split)


def _reference(key_partition_bytes, indexer_fp8: bool) -> ReferenceBackend:
    if key_partition_bytes:
        warnings.warn("model.dsa_key_partition_mib applies to the Triton kernels; the PyTorch reference backend "
                      "chosen here walks its keys in one pass", RuntimeWarning, stacklevel=3)
    return ReferenceBackend(indexer_fp8)


def select_backend(choice: str, device_type: str, deterministic: bool = False,
                   key_partition_bytes: Optional[int] = None, indexer_fp8: bool = False,
                   tuning: Optional[DSAKernelTuning] = None):
    """The backend for tensors on `device_type` under `model.dsa_kernel_backend` = `choice`; `tuning`: the Triton
    kernels' (None: the defaults)."""
    if choice not in BACKENDS:
        raise ValueError(f"model.dsa_kernel_backend must be one of {BACKENDS}, got {choice!r}")
    if choice == "reference":
        return _reference(key_partition_bytes, indexer_fp8)
    if choice == "auto":
        if device_type != "cuda":
            return _reference(key_partition_bytes, indexer_fp8)
        if not triton_available():
            warn_once("model.dsa_kernel_backend=auto: triton is not installed, so DSA runs its PyTorch reference on "
                      "CUDA (about 14x slower than the Triton kernels); install triton", stacklevel=2)
            return _reference(key_partition_bytes, indexer_fp8)
        return TritonBackend(deterministic, key_partition_bytes, indexer_fp8, tuning)
    if not triton_available() or not (device_type == "cuda" or interpreting()):
        raise RuntimeError(
            "model.dsa_kernel_backend=triton needs the triton package and CUDA tensors (or TRITON_INTERPRET=1 "
            "on CPU); use dsa_kernel_backend=auto or reference")
    return TritonBackend(deterministic, key_partition_bytes, indexer_fp8, tuning)


__all__ = ["BACKENDS", "ReferenceBackend", "TritonBackend", "select_backend"]
