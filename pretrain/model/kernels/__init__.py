"""Triton kernels of DeepSeek Sparse Attention (GLM-5 report, DSA section).

- `indexer_topk`: lightning-indexer scores and exact top-k selection, no [S, S] matrix;
- `sparse_mla`: sparse MLA attention in absorbed form, forward and backward;
- `indexer_kl`: the sparse indexer loss's attention target and index scores at the selected keys;
- `segment_sum`: the deterministic per-key reduction the backward passes can use instead of atomics.

`use_triton(choice, device_type)` picks the implementation from `model.dsa_kernel_backend`:
"triton", "reference" (`pretrain.model.dsa`, `sparse_mla`, `indexer_loss`: PyTorch), or "auto"
(Triton on CUDA tensors when triton imports, the reference otherwise). With TRITON_INTERPRET=1 set
before triton is imported, "triton" also runs on CPU tensors (the CPU tests do; `pretrain.compat.install()`
then fixes Triton 3.6's interpreter).
"""

from __future__ import annotations

import importlib.util
import os
import typing

from pretrain.config.schema import ModelConfig

BACKENDS = typing.get_args(typing.get_type_hints(ModelConfig)["dsa_kernel_backend"])  # the config's choices


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(choice: str, device_type: str) -> bool:
    """Whether the Triton kernels run for tensors on `device_type` under `model.dsa_kernel_backend`:
    "auto" -> on CUDA when triton imports; "triton" -> always (CPU only under TRITON_INTERPRET=1)."""
    if choice not in BACKENDS:
        raise ValueError(f"model.dsa_kernel_backend must be one of {BACKENDS}, got {choice!r}")
    if choice == "reference":
        return False
    if choice == "auto":
        return device_type == "cuda" and triton_available()
    if not triton_available() or not (device_type == "cuda" or interpreting()):
        raise RuntimeError(
            "model.dsa_kernel_backend=triton needs the triton package and CUDA tensors (or TRITON_INTERPRET=1 "
            "on CPU); use dsa_kernel_backend=auto or reference")
    return True

