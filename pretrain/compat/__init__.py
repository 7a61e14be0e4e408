"""Every workaround for megatron-core 0.16.1 lives here, one function per problem.

Moving to a newer megatron-core means revisiting this package only. Two groups:

* `apply_megatron_patches()` — always applied. Fixes for running megatron-core without
  Transformer Engine or apex (true on the CPU machines and on GPU machines without TE).
  It also fixes tensor parallelism on the torch-native backend: MLA's lost rope-key gradient
  under TP, and a torch norm that works with sequence parallelism.
* `install_cpu_support()` — applied only when CUDA is unavailable. megatron-core is written for
  CUDA; this small layer lets its models, parallel linear layers, MoE dispatchers and RNG tracker
  run on CPU with a gloo process group. CPU support is a product feature: the quickstart trains
  on CPU and checkpoint conversion runs on CPU-only nodes.

Both are idempotent. The CPU layer lives in `pretrain/compat/cpu.py`; `patch_triton_interpreter()`
(`triton_interpreter.py`, applied when TRITON_INTERPRET=1) fixes the one third-party problem outside
megatron-core that the CPU tests meet: Triton 3.6's interpreter with NumPy >= 2.4.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
from typing import Iterator

import torch

from pretrain.compat.cpu import install_cpu_support
from pretrain.compat.triton_interpreter import patch_triton_interpreter

_PATCHED = False
_MLA_KV_GATHER: contextvars.ContextVar = contextvars.ContextVar("mla_kv_gather")


def te_available() -> bool:
    """True when Transformer Engine's PyTorch extension imports."""
    try:
        importlib.import_module("transformer_engine.pytorch")
        return True
    except Exception:  # ImportError, or a broken CUDA build raising at import
        return False


# ------------------------------------------------------------------------------------------
# Fixes needed whenever Transformer Engine is absent
# ------------------------------------------------------------------------------------------


def _patch_mla_have_te() -> None:
    # multi_latent_attention.HAVE_TE is computed from an import that succeeds even without TE
    # (megatron.core.extensions.transformer_engine guards its own imports), so MLA then treats
    # TE-only code paths as available. Pin it to the truth.
    from megatron.core.transformer import multi_latent_attention

    if not te_available():
        multi_latent_attention.HAVE_TE = False


def _patch_moe_fused_names() -> None:
    # moe_utils imports its TE fused kernels inside `try`; without TE the names are never
    # defined, and router_gating_linear references `te_general_gemm` unconditionally, raising
    # NameError. Defining them as None selects megatron's own torch fallbacks.
    from megatron.core.transformer.moe import moe_utils

    for name in (
        "fused_compute_score_for_moe_aux_loss",
        "fused_moe_aux_loss",
        "fused_permute",
        "fused_permute_with_probs",
        "fused_sort_chunks_by_index",
        "fused_sort_chunks_by_index_with_probs",
        "fused_topk_with_score_function",
        "fused_unpermute",
        "te_general_gemm",
    ):
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


@contextlib.contextmanager
def grouped_gemm_check_skipped() -> Iterator[None]:
    """Build megatron's `GroupedMLP` without the `grouped_gemm` package.

    `GroupedMLP.__init__` asserts that the `grouped_gemm` CUDA extension is installed, although
    only its forward uses it. Our experts subclass replaces that forward with
    `torch._grouped_mm`, so the check is skipped while the parent constructor runs.
    """
    from megatron.core.transformer.moe import experts

    original = experts.gg.assert_grouped_gemm_is_available
    experts.gg.assert_grouped_gemm_is_available = lambda: None
    try:
        yield
    finally:
        experts.gg.assert_grouped_gemm_is_available = original


def apply_megatron_patches() -> None:
    global _PATCHED
    if _PATCHED:
        return
    _patch_mla_have_te()
    _patch_moe_fused_names()
    _patch_mla_rope_key_grad()
    _patch_tp_reduce_noncontiguous()
    if not torch.cuda.is_available():
        install_cpu_support()
    _PATCHED = True


def _patch_tp_reduce_noncontiguous() -> None:
    # megatron-core 0.16.1 `mappings._reduce` all-reduces `input_.contiguous()` but returns
    # `input_`: a non-contiguous tensor (e.g. the gradient of one slice of a concatenation, which
    # reaches `copy_to_tensor_model_parallel_region`'s backward in DSA's absorbed attention) comes
    # back unreduced, so each TP rank keeps only its own heads' share of the gradient.
    from megatron.core.tensor_parallel import mappings

    def _reduce(input_, group):
        assert group is not None, "group should not be None"
        if group.size() == 1:
            return input_
        out = input_.contiguous()
        torch.distributed.all_reduce(out, group=group)
        return out

    mappings._reduce = _reduce


@functools.lru_cache(maxsize=None)
def grouped_mm_available(device_type: str) -> bool:
    """Whether `torch._grouped_mm` runs on this device type in this torch build."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
        a = torch.ones(16, 16, device=device_type, dtype=dtype)
        b = torch.ones(2, 16, 16, device=device_type, dtype=dtype)
        offs = torch.tensor([8, 16], device=device_type, dtype=torch.int32)
        torch._grouped_mm(a, b, offs=offs)
        return True
    except Exception:
        return False


@contextlib.contextmanager
def gpt_model_mtp_block_class(block_cls: type) -> Iterator[None]:
    """Make `GPTModel.__init__` build `block_cls` as its MTP block.

    GPTModel 0.16.1 instantiates `MultiTokenPredictionBlock` by name, with no spec hook for the
    block class; GLM-5's depth-shared MTP needs its own block (pretrain.model.mtp).
    """
    from megatron.core.models.gpt import gpt_model

    original = gpt_model.MultiTokenPredictionBlock
    gpt_model.MultiTokenPredictionBlock = block_cls
    try:
        yield
    finally:
        gpt_model.MultiTokenPredictionBlock = original


# ------------------------------------------------------------------------------------------
# Tensor/sequence parallelism on the torch-native backend
# ------------------------------------------------------------------------------------------


class SequenceParallelTorchNorm:
    """torch's RMSNorm/LayerNorm usable with sequence parallelism.

    megatron's `WrappedTorchNorm` asserts `sequence_parallel` is off (only TE/apex norms tag
    their weights), which makes every TP > 1 MoE model untrainable without TE: MoELayer refuses
    to train with TP > 1 unless sequence parallelism is on. The norm itself is sequence-local;
    tagging its weights `sequence_parallel` makes `finalize_model_grads` sum their gradients over
    the TP group, exactly as for TE's norms.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(f"normalization {config.normalization!r} is not supported (RMSNorm or LayerNorm)")
        for param in norm.parameters():
            setattr(param, "sequence_parallel", config.sequence_parallel)
        return norm


class _SumTrailingGradOverTP(torch.autograd.Function):
    """Identity forward; backward sums the last `width` features' gradient over the TP group."""

    @staticmethod
    def forward(ctx, x, width: int, group):
        ctx.width, ctx.group = width, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        tail = grad[..., -ctx.width :].contiguous()
        torch.distributed.all_reduce(tail, group=ctx.group)
        grad[..., -ctx.width :] = tail
        return grad, None, None


def _patch_mla_rope_key_grad() -> None:
    # MLA with column-parallel down projections (the local backend) all-gathers
    # [kv_latent | k_pos_emb] over TP, and each rank's heads then use the whole shared rope key
    # k_pos_emb. The gather's backward only keeps this rank's column slice of the gradient, so
    # the other ranks' heads' share of d loss / d k_pos_emb is lost (Megatron-LM issue 1699):
    # the rope key's weights train on 1/TP of their gradient. Summing the rope columns' gradient
    # over TP before the gather's backward restores it. The kv gather is the one whose output is
    # kv_lora_rank + qk_pos_emb_head_dim wide, called inside MLA's projection code after the q
    # gather; `_MLA_KV_GATHER` carries that width while an MLA module projects.
    from megatron.core.transformer import multi_latent_attention as mla

    original_gather = mla.gather_from_tensor_model_parallel_region
    original_qkv = mla.MLASelfAttention.get_query_key_value_tensors

    def gather(x, *args, **kwargs):
        full = original_gather(x, *args, **kwargs)
        state = _MLA_KV_GATHER.get(None)
        if state is None or full.size(-1) != state["width"]:
            return full
        state["seen"] += 1
        if state["seen"] != state["kv_call"]:
            return full  # the q gather, when q_lora_rank happens to equal the kv width
        return _SumTrailingGradOverTP.apply(full, state["rope"], state["group"])

    def get_query_key_value_tensors(self, *args, **kwargs):
        cfg = self.config
        width = cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim
        kv_call = 2 if cfg.q_lora_rank == width else 1
        token = _MLA_KV_GATHER.set(
            {"width": width, "rope": cfg.qk_pos_emb_head_dim, "group": self.tp_group, "seen": 0, "kv_call": kv_call}
        )
        try:
            return original_qkv(self, *args, **kwargs)
        finally:
            _MLA_KV_GATHER.reset(token)

    mla.gather_from_tensor_model_parallel_region = gather
    mla.MLASelfAttention.get_query_key_value_tensors = get_query_key_value_tensors


@contextlib.contextmanager
def rank_zero_without_process_group() -> Iterator[None]:
    """Let megatron's BlendedDataset build its cache in a process without torch.distributed.

    megatron-core 0.16.1 `BlendedDataset._build_indices` calls `torch.distributed.get_rank()` on a
    cache miss without checking `is_initialized()` (GPTDataset does check), which raises in a plain
    process. A lone process is rank 0, so answer 0 while the builder runs.
    """
    if torch.distributed.is_initialized():
        yield
        return
    original = torch.distributed.get_rank
    torch.distributed.get_rank = lambda group=None: 0
    try:
        yield
    finally:
        torch.distributed.get_rank = original


# ------------------------------------------------------------------------------------------
# dist_checkpointing: writing torch_dist checkpoints (used by pretrain.training.checkpoint)
# ------------------------------------------------------------------------------------------

_CKPT_WRITER_PATCHED = False


def patch_dist_checkpoint_writer() -> None:
    """Make `dist_checkpointing.save` (torch_dist format) finish, on every host, and on CPU in-process.

    Called by `pretrain.training.checkpoint` before its first save; idempotent. Two problems of
    megatron-core 0.16.1's `strategies/filesystem_async.py`, whose `FileSystemWriterAsync` writes
    every torch_dist checkpoint (a synchronous save runs the same code via `execute_sync`):

    * The hang. `write_preloaded_data`, the worker that writes one file, calls `_process_memory()`
      (for a debug log line) *outside* its try block, and that raises without psutil. The worker
      dies before it signals its `JoinableQueue`, so the parent waits in `count_queue.join()`
      forever: every save hangs when psutil is not installed. The number is only logged: 0 is exact
      enough. Applied everywhere (GPU hosts without psutil hang the same way).
    * CPU only: the writer forks one process per output file and collects results through a
      `multiprocessing.Manager` queue started with the "spawn" method, which re-imports `__main__`
      (a script without an `if __name__ == "__main__"` guard re-runs itself) and leaves a server
      process behind, orphaned if the trainer is SIGKILLed. On CPU the tensors are already in host
      memory and nothing overlaps with training, so the same per-file writer runs in threads of
      this process and results go through a plain `queue.Queue`: same files, same format, no child
      processes. GPU hosts keep megatron's forked writers (writes proceed without the GIL).
    """
    global _CKPT_WRITER_PATCHED
    if _CKPT_WRITER_PATCHED:
        return
    import queue
    from concurrent.futures import ThreadPoolExecutor

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa

    if not fsa.HAVE_PSUTIL:
        fsa._process_memory = lambda: 0

    if not torch.cuda.is_available():
        writer_cls = fsa.FileSystemWriterAsync

        def write_buckets_in_threads(transform_list, use_msc, rank, write_buckets, global_results_queue):
            # Same contract as `write_preloaded_data_multiproc`: put {file index: [WriteResult]} or
            # the first worker's exception into `global_results_queue`.
            results_queue, count_queue = queue.Queue(), queue.Queue()
            kwargs = {"use_msc": use_msc} if use_msc else {}
            with ThreadPoolExecutor(max_workers=max(1, len(write_buckets)), thread_name_prefix="ckpt-write") as pool:
                for index in range(len(write_buckets)):
                    count_queue.put(index)  # each worker pops one entry and calls task_done()
                futures = [
                    pool.submit(writer_cls.write_preloaded_data, transform_list, index, bucket, results_queue,
                                count_queue, True, **kwargs)
                    for index, bucket in enumerate(write_buckets)
                ]
            failed = [f.exception() for f in futures if f.exception() is not None]
            if failed:  # raised outside the worker's own try block
                global_results_queue.put(failed[0])
                return
            results: dict | Exception = {}
            for _ in write_buckets:
                index, value = results_queue.get_nowait()
                if isinstance(value, Exception):
                    results = value
                    break
                results[index] = value
            global_results_queue.put(results)

        writer_cls.write_preloaded_data_multiproc = staticmethod(write_buckets_in_threads)
        fsa._get_write_results_queue = queue.Queue
    _CKPT_WRITER_PATCHED = True


__all__ = [
    "SequenceParallelTorchNorm",
    "apply_megatron_patches",
    "gpt_model_mtp_block_class",
    "grouped_gemm_check_skipped",
    "grouped_mm_available",
    "install_cpu_support",
    "patch_dist_checkpoint_writer",
    "patch_triton_interpreter",
    "rank_zero_without_process_group",
    "te_available",
]
