"""Routed experts as grouped GEMMs (GLM-5 report, architecture: 256 SwiGLU experts, top-8).

For the tokens routed to local expert e (contiguous after megatron's permutation):

    y_e = (silu(X_e W1g_e) * (X_e W1u_e)) * p_e  W2_e

computed for all local experts at once by `torch._grouped_mm` over the permuted token matrix
(one kernel per projection instead of a loop over experts). Where `_grouped_mm` is unavailable
for the device (or the weights' dtype differs from the activations') the same math runs as a
per-expert Python loop, which syncs with the host for the token counts; that is logged once.

Weights keep megatron's `GroupedMLP` layout (`weight1` [H, E*2F], `weight2` [E*F, H]) and its
sharded checkpoint format, so expert- and expert-tensor-parallel resharding work unchanged; only
the GEMM backend differs (megatron's needs the `grouped_gemm` CUDA extension).
"""

from __future__ import annotations

import functools
import warnings

import torch
from megatron.core.transformer.moe.experts import GroupedMLP

from pretrain.compat import grouped_gemm_check_skipped, grouped_mm_available


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """x [T, K] (rows grouped by expert), w [E, K, N] -> [T, N]."""
    if grouped_mm_available(x.device.type) and x.dtype == w.dtype:
        offs = torch.cumsum(tokens_per_expert.to(device=x.device, dtype=torch.int32), dim=0, dtype=torch.int32)
        return torch._grouped_mm(x, w, offs=offs)
    _warn_expert_loop(x.device.type, str(x.dtype), str(w.dtype))
    counts = tokens_per_expert.tolist()
    chunks = torch.split(x, counts, dim=0)
    return torch.cat([c @ w[e] for e, c in enumerate(chunks)], dim=0)


@functools.lru_cache(maxsize=None)
def _warn_expert_loop(device_type: str, x_dtype: str, w_dtype: str) -> None:
    why = (f"torch._grouped_mm does not run on {device_type} in torch {torch.__version__}"
           if not grouped_mm_available(device_type) else f"activations are {x_dtype} but expert weights {w_dtype}")
    warnings.warn(f"routed experts run as a per-expert Python loop with a host sync per layer ({why}); "
                  "expect slower MoE layers", RuntimeWarning, stacklevel=3)


class GroupedGemmExperts(GroupedMLP):
    def __init__(self, num_local_experts: int, config, pg_collection=None):
        with grouped_gemm_check_skipped():
            super().__init__(num_local_experts, config, pg_collection=pg_collection)
        # megatron marks these weights dense (`allreduce=True`) whenever EP == 1, so DDP reduces
        # them over the dense data-parallel group. With ETP < TP the expert-data-parallel group
        # also spans TP ranks holding the same expert shard (each saw different tokens under
        # sequence parallelism), and that is the group their gradients must be summed over.
        etp, tp = config.expert_tensor_parallel_size, config.tensor_model_parallel_size
        expert_parallel = config.expert_model_parallel_size > 1 or (etp or tp) != tp
        for weight in (self.weight1, self.weight2):
            weight.allreduce = not expert_parallel

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        x = permuted_local_hidden_states
        h = self.config.hidden_size
        w1 = self.weight1.view(self.num_local_experts, h, -1)
        w2 = self.weight2.view(self.num_local_experts, -1, h)
        if x.nelement() == 0:
            # Keep every expert weight in the autograd graph even with no routed tokens, so
            # gradient buffers and reductions see the same set of parameters on every rank.
            fc1 = x @ w1[0]
            out = self.activation_func_with_probs(fc1, permuted_probs.unsqueeze(-1)) @ w2[0]
            return out + 0.0 * (w1.sum() + w2.sum()), None
        fc1 = grouped_matmul(x, w1, tokens_per_expert)
        inter = self.activation_func_with_probs(fc1, permuted_probs.unsqueeze(-1))
        return grouped_matmul(inter, w2, tokens_per_expert), None
