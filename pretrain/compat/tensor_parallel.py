"""Tensor/sequence parallelism on megatron-core 0.16.1's torch-native backend (part of `pretrain.compat`).

Three problems, each found by comparing a TP = 2 run with a single-rank run
(tests/test_parallel_equivalence.py, tests/test_dsa_model_tensor_parallel.py):

* `mappings._reduce` returns a non-contiguous input unreduced;
* MLA's shared rope key loses the other ranks' share of its gradient (Megatron-LM issue 1699);
* megatron's torch norm refuses sequence parallelism, which MoE with TP > 1 requires.
"""

from __future__ import annotations

import contextvars

import torch

from pretrain.compat.registry import Workaround

_MLA_KV_GATHER: contextvars.ContextVar = contextvars.ContextVar("mla_kv_gather")


def patch_tp_reduce_noncontiguous() -> None:
    """All-reduce and return the contiguous copy in `mappings._reduce`."""
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


def patch_mla_rope_key_grad() -> None:
    """Sum the shared rope key's gradient over TP before MLA's kv gather backward."""
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


WORKAROUNDS = [
    Workaround(
        name="patch_tp_reduce_noncontiguous",
        target="megatron.core.tensor_parallel.mappings._reduce",
        reason="a non-contiguous tensor comes back unreduced, so TP ranks keep only their own heads' gradient",
        upstream="open",
        test="tests/test_dsa_model_tensor_parallel.py::test_tp2_dsa_matches_single_rank",
        install=patch_tp_reduce_noncontiguous,
    ),
    Workaround(
        name="patch_mla_rope_key_grad",
        target="megatron.core.transformer.multi_latent_attention (kv gather of MLASelfAttention)",
        reason="under TP the shared rope key trains on 1/TP of its gradient",
        upstream="Megatron-LM issue 1699",
        test="tests/test_parallel_equivalence.py::test_tp2_matches_single_rank",
        install=patch_mla_rope_key_grad,
    ),
    Workaround(
        name="SequenceParallelTorchNorm",
        target="megatron.core.transformer.torch_norm.WrappedTorchNorm",
        reason="asserts sequence_parallel is off, so no TP > 1 MoE model trains without TE",
        upstream="open",
        test="tests/test_parallel_equivalence.py::test_tp2_matches_single_rank",
    ),
]
