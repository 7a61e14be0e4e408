"""MoE token dispatch without host syncs or atomics where all experts are local (EP x TP = 1).

GLM-5 routes every token to k = 8 of its experts (report, architecture). With T tokens and a boolean
routing map R [T, E], megatron's dispatchers lay the T k selected (token, expert) pairs out expert by
expert ("rows"), run the experts on that matrix and sum each token's k outputs back. In megatron-core
0.16.1 on a rank that holds every expert, that costs per MoE layer:

* two host syncs in the forward: `masked_select` sizes its output from the data, and the dispatcher
  copies the per-expert token counts to the host (`before_finish` / `before_permutation_2`), so the
  host cannot queue kernels ahead of the GPU;
* a second permutation "by local expert" (`sort_chunks_by_idxs`: split + cat of all rows) that is the
  identity order when there is one rank, in the forward and again in the backward;
* `index_select`'s backward (`index_add_`) and the combine's `scatter_add_`: atomic adds, in bf16.

Here, for a dropless router (exactly k experts per token, so T k rows, known on the host):

    rows      = nonzero(R^T) in expert-major order           (`nonzero_static`: size T k, no sync)
    token(r)  = the token of row r;  slots(t) = the k rows of token t (argsort of token(r))
    permute:    X_perm[r] = X[token(r)]                        backward  dX[t] = sum_{r in slots(t)} dX_perm[r]
    unpermute:  Y[t] = sum_{r in slots(t)} Y_perm[r]           backward  dY_perm[r] = dY[token(r)]

Both directions are gathers followed (where tokens meet) by a k-way sum in fp32: no atomics, the
same result on every run. The token counts per expert stay on the device (our grouped GEMM takes
them there). Anything else (EP or TP > 1, capacity factors, padding for quantization, fused
permutation) stays with megatron's dispatcher.
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; the CPU path needs none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from pretrain.model.notices import warn_once


class PermuteTokens(torch.autograd.Function):
    """X [T, H] -> X[token(r)] [T k, H]; backward sums each token's k row gradients (fp32)."""

    @staticmethod
    def forward(ctx, tokens, row_token, token_rows):
        ctx.save_for_backward(token_rows)
        return tokens.index_select(0, row_token)

    @staticmethod
    def backward(ctx, grad):
        (token_rows,) = ctx.saved_tensors
        return sum_rows(grad, token_rows), None, None


class UnpermuteTokens(torch.autograd.Function):
    """Y_perm [T k, H] -> Y [T, H] (each token's k rows summed, fp32); backward gathers."""

    @staticmethod
    def forward(ctx, rows, row_token, token_rows):
        ctx.save_for_backward(row_token)
        return sum_rows(rows, token_rows)

    @staticmethod
    def backward(ctx, grad):
        (row_token,) = ctx.saved_tensors
        return grad.index_select(0, row_token), None, None


def sum_rows(rows: torch.Tensor, token_rows: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j rows[token_rows[t, j]] accumulated in fp32 (at least), in `rows`' dtype.

    An index of -1 is a padding slot that adds nothing (the expert-parallel dispatch,
    `pretrain.model.ep_dispatch`, sums a variable number of rows per token: at most one per rank or
    per local expert). On the GPU one Triton kernel reads each selected row once and writes the sum
    (no [T, k, H] intermediate); elsewhere gather, then sum."""
    if rows.is_cuda and rows.dtype != torch.float64:
        if triton is not None:
            return gather_sum_triton(rows, token_rows)
        warn_once("triton is not importable: MoE combine runs as gather + sum ([T, k, H] intermediate)", stacklevel=2)
    t, k = token_rows.shape
    acc = torch.promote_types(rows.dtype, torch.float32)
    if rows.shape[0] == 0:  # nothing to gather: every slot is padding
        return rows.new_zeros(t, rows.shape[-1])
    flat = token_rows.reshape(-1)
    picked = rows.index_select(0, flat.clamp(min=0)).view(t, k, rows.shape[-1])
    picked = picked.masked_fill((token_rows < 0).unsqueeze(-1), 0)
    return picked.sum(dim=1, dtype=acc).to(rows.dtype)


def gather_sum_triton(rows: torch.Tensor, token_rows: torch.Tensor, block_h: int = 1024) -> torch.Tensor:
    """`sum_rows` as one Triton kernel: program (t, block of H) adds its k rows in fp32 registers
    (slots of -1 skipped)."""
    rows = rows.contiguous()
    token_rows = token_rows.contiguous()
    t, k = token_rows.shape
    hidden = rows.shape[-1]
    out = torch.empty(t, hidden, dtype=rows.dtype, device=rows.device)
    if t == 0:
        return out
    block = min(block_h, triton.next_power_of_2(hidden))
    _gather_sum_kernel[(t, triton.cdiv(hidden, block))](rows, token_rows, out, hidden, K=k, BLOCK_H=block,
                                                         num_warps=4)
    return out


if triton is not None:

    @triton.jit
    def _gather_sum_kernel(src, idx, out, hidden, K: tl.constexpr, BLOCK_H: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = cols < hidden
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(idx + t * K + j).to(tl.int64)
            acc += tl.load(src + row * hidden + cols, mask=mask & (row >= 0), other=0.0).to(tl.float32)
        tl.store(out + t * hidden + cols, acc.to(out.dtype.element_ty), mask=mask)


def route_rows(routing_map: torch.Tensor, topk: int):
    """(rows [T k], row_token [T k], token_rows [T, k], tokens_per_expert [E]) for a map with k experts
    per token. `rows` are flat indices e T + t into R^T: expert-major, token-ascending within an expert
    (megatron's `permute` order)."""
    num_tokens = routing_map.shape[0]
    rows = torch.nonzero_static(routing_map.t().reshape(-1), size=num_tokens * topk).squeeze(1)
    row_token = rows % num_tokens
    token_rows = torch.argsort(row_token, stable=True).view(num_tokens, topk)
    return rows, row_token, token_rows, routing_map.sum(dim=0)


class LocalTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """megatron's all-to-all dispatcher; with every expert on this rank (EP x TP = 1) and dropless
    routing, the sync-free gather path of the module docstring."""

    def takes_local_path(self) -> bool:
        """Whether this dispatcher runs the gather path (every expert here, dropless, no fused permutation);
        otherwise every step is megatron's all-to-all dispatcher's."""
        cfg = self.config
        return (self.ep_size * self.tp_size == 1 and cfg.moe_expert_capacity_factor is None
                and not cfg.moe_router_padding_for_quantization and not cfg.moe_permute_fusion)

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        if not self.takes_local_path():
            return super().dispatch_preprocess(hidden_states, routing_map, probs)
        # nothing of the routing is kept on the module: `probs` carries the autograd graph, which would outlive
        # backward (with full recompute, the recomputed layer's input and its gradient: `compat.model`)
        self.hidden_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        rows, row_token, token_rows, self.tokens_per_expert = route_rows(routing_map, self.config.moe_router_topk)
        self._rows = (row_token, token_rows)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))
        permuted_probs = probs.t().reshape(-1).index_select(0, rows)  # probs at each row's (expert, token)
        return PermuteTokens.apply(hidden_states, row_token, token_rows), permuted_probs

    def token_dispatch(self, hidden_states, probs):
        return (hidden_states, probs) if self.takes_local_path() else super().token_dispatch(hidden_states, probs)

    def dispatch_postprocess(self, hidden_states, probs):
        if not self.takes_local_path():
            return super().dispatch_postprocess(hidden_states, probs)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act(hidden_states)
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return hidden_states, tokens_per_expert, probs

    def combine_preprocess(self, hidden_states):
        return hidden_states if self.takes_local_path() else super().combine_preprocess(hidden_states)

    def token_combine(self, hidden_states, async_finish: bool = True, allocate_on_comm_stream: bool = True):
        if self.takes_local_path():
            return hidden_states
        return super().token_combine(hidden_states, async_finish, allocate_on_comm_stream)

    def combine_postprocess(self, hidden_states):
        if not self.takes_local_path():
            return super().combine_postprocess(hidden_states)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(hidden_states)
            self.shared_experts.post_forward_comm()
        row_token, token_rows = self._rows
        self._rows = None
        output = UnpermuteTokens.apply(hidden_states, row_token, token_rows).view(self.hidden_shape)
        if self.shared_experts is not None:
            output = output + self.shared_experts.get_output()
        return output
