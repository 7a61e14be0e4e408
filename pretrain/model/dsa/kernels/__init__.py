"""Triton (and Gluon) kernels of DeepSeek Sparse Attention (GLM-5 report, DSA section).

- `indexer_topk`: lightning-indexer scores and exact top-k selection (`radix_select`), no [S, S] matrix;
- `sparse_mla`: sparse MLA attention in absorbed form, forward and backward (`sparse_mla_dkv`: the key gradient's
  own pass from 32 heads); `hopper`: the same on Hopper, warp-specialized, in Gluon (the forwards at 64 and at 8-32
  heads per rank, the 64-head backward's first pass);
- `packed_indices`: the int16 top-k indices kept for backward, unpacked in one pass;
- `indexer_kl`: the sparse indexer loss (KL at the selected keys) and its gradient, in one kernel;
- `segment_sum`: the deterministic per-key reduction the backward passes can use instead of atomics;
- `atomics`: the fp32 row adds of the key gradients;
- `tuning`: `DSAKernelTuning`, every switch and launch parameter of the kernels in one frozen object;
- `plan`: which kernels run for a layer's heads per rank and GPU (`kernel_plan`), said once in the log;
- `common`: launch parameters and the tile loads the kernels share, the GPU's capability; `ranges`: the checks on
  visible-key ranges that the kernels and the reference share.

The DSA layer reaches them through `pretrain.model.dsa.backend.TritonBackend`; the PyTorch reference
(`pretrain.model.dsa.indexer`, `sparse_mla`, `indexer_loss`) is their oracle. With TRITON_INTERPRET=1
set before triton is imported, they also run on CPU tensors (the CPU tests do).
"""

from __future__ import annotations

import importlib.util
import os


def interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_available() -> bool:
    """Whether the triton package is installed (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


if interpreting() and triton_available():
    # Imported from its module: the compat package's __init__ is not needed for this one fix.
    from pretrain.compat.triton_interpreter import patch_triton_interpreter

    patch_triton_interpreter()
