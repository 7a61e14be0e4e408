"""Expert-parallel all-to-alls hidden behind compute inside one MoE layer (EP > 1, `alltoall_dedup`).

The MoE layer's output for token t is

    y[t] = S(x[t]) + sum_{e in topk(t)} p[t, e] f_e(x[t])

where S is the shared expert and the sum needs the token on the ranks of its experts: the dispatch
all-to-all, the routed experts, the combine all-to-all (`pretrain.model.ep_dispatch`). Two opt-in
overlaps start those all-to-alls asynchronously (`all_to_all_single(async_op=True)`: NCCL runs it on
its own stream, gloo on its worker thread) and wait for them only where their result is needed:

* Shared expert under the dispatch (`model.moe_shared_expert_overlap`, megatron-core's field): S
  needs only x, so it runs while the dispatch is in flight. megatron-core's own version of this key
  runs S on a side CUDA stream through its dispatcher's hooks (CUDA only); ours is the async
  all-to-all above, on any backend.
* Chunked dispatch (`model.moe_overlap_chunks = n`, ours): the router runs once over the
  micro-batch's T tokens (its balancing losses and expert-bias counts see the whole micro-batch,
  unchanged); then the tokens are split into n contiguous chunks, each with its own dispatch plan:

      start dispatch(1) .. dispatch(n)
      for i in 1..n:  wait dispatch(i); experts(i); start combine(i)   # dispatch(i+1) in flight under experts(i)
      wait combine(1) .. combine(n);  y = concat

  as DeepSeek-V3 pairs two micro-batches so that one's all-to-all runs under the other's compute
  (DeepSeek-V3 technical report, section 3.2.2); here the pair is two halves of one micro-batch.

Every token's output is the same function of the same inputs, so both equal the plain layer up to
the order of fp32 sums (expert weight gradients add the chunks' rows in another order).

Backward: the reverse all-to-all of each one is started by the backward of its wait and waited for
by the backward of its start. Autograd runs ready nodes in decreasing creation order, so the other
chunk's expert backward (created later) runs while a reverse all-to-all is in flight; every rank
builds the same graph, so the collectives are issued in the same order everywhere.
docs/parallelism.md ("Hiding the all-to-all") says what to set and what it costs.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist


class AllToAllInFlight:
    """One asynchronous all-to-all of rows (and, in backward, its reverse)."""

    def __init__(self, group, rows: torch.Tensor, output_splits: List[int], input_splits: List[int]):
        self.group, self.output_splits, self.input_splits = group, output_splits, input_splits
        self.work = self.grad_work = self.grad_rows = None
        self._out = StartAllToAll.apply(rows, self)

    def wait(self) -> torch.Tensor:
        """The received rows [sum(output_splits), ...]; waits for the forward all-to-all (once)."""
        # Drop our reference to the buffer: it is StartAllToAll's output, whose autograd node holds this object on
        # its ctx. Kept, that cycle runs through a C++ autograd node that Python's gc cannot see, so every
        # micro-batch's receive buffers (and the nodes) would live for the whole run (2 x H200: 49 -> 71 -> 105 GiB
        # over the first steps of glm5-proxy at EP=2, then out of memory).
        out, self._out = self._out, None
        return WaitAllToAll.apply(out, self)


def start_all_to_all(group, rows: torch.Tensor, output_splits, input_splits):
    """(buffer that the all-to-all fills, its work handle)."""
    rows = rows.contiguous()
    out = rows.new_empty((sum(output_splits),) + tuple(rows.shape[1:]))
    work = dist.all_to_all_single(out, rows, output_split_sizes=list(output_splits),
                                  input_split_sizes=list(input_splits), group=group, async_op=True)
    return out, work


class StartAllToAll(torch.autograd.Function):
    """Forward: start the all-to-all. Backward: wait for the reverse one started by `WaitAllToAll`'s backward."""

    @staticmethod
    def forward(ctx, rows, flight):
        ctx.flight = flight
        out, flight.work = start_all_to_all(flight.group, rows, flight.output_splits, flight.input_splits)
        return out

    @staticmethod
    def backward(ctx, _stand_in):
        flight = ctx.flight
        flight.grad_work.wait()
        grad_rows, flight.grad_rows, flight.grad_work = flight.grad_rows, None, None
        return grad_rows, None


class WaitAllToAll(torch.autograd.Function):
    """Forward: wait for the all-to-all (identity on the filled buffer). Backward: start the reverse one."""

    @staticmethod
    def forward(ctx, out, flight):
        ctx.flight = flight
        flight.work.wait()
        flight.work = None
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        flight = ctx.flight
        flight.grad_rows, flight.grad_work = start_all_to_all(flight.group, grad, flight.input_splits,
                                                              flight.output_splits)
        return grad, None  # a stand-in: `StartAllToAll.backward` returns the reverse all-to-all's rows


def chunk_bounds(tokens: int, chunks: int) -> List[Tuple[int, int]]:
    """`chunks` contiguous [start, end) token ranges covering 0..tokens (sizes differ by at most one)."""
    edges = [tokens * i // chunks for i in range(chunks + 1)]
    return list(zip(edges[:-1], edges[1:]))


def overlapped_forward(layer, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor], chunks: int,
                       shared_under_dispatch: bool):
    """`GLM5MoELayer.forward` with the all-to-alls in flight under the shared expert and/or the other chunks'
    experts (module docstring). Returns (output [s, b, H], None) as megatron's MoELayer does."""
    dispatcher = layer.token_dispatcher
    if padding_mask is not None:
        padding_mask = padding_mask.transpose(0, 1).bool()
    shared = None
    if not shared_under_dispatch:
        shared = layer.shared_experts_compute(hidden_states)  # megatron's place: before the router
    probs, routing_map = layer.route(hidden_states, padding_mask)
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    group = dispatcher.ep_group
    # every chunk's plan first: each exchanges its split sizes and copies them to the host, which would otherwise
    # wait behind the previous chunk's in-flight rows
    plans = [dispatcher.plan_dispatch(x[start:end], routing_map[start:end], probs[start:end])
             for start, end in chunk_bounds(x.shape[0], chunks)]
    flights = []
    for plan, rows, meta in plans:
        splits = (plan["output_splits"], plan["input_splits"])
        flights.append((plan, AllToAllInFlight(group, rows, *splits), AllToAllInFlight(group, meta, *splits)))
    del plans
    if shared_under_dispatch:
        shared = layer.shared_experts_compute(hidden_states)
    combines = []
    for plan, rows_flight, meta_flight in flights:
        expert_in, tokens_per_expert, expert_probs = dispatcher.expand(plan, rows_flight.wait(), meta_flight.wait())
        expert_out, _ = layer.experts(expert_in, tokens_per_expert, expert_probs)
        presummed = dispatcher.presum(plan, expert_out)
        combines.append((plan, AllToAllInFlight(group, presummed, plan["input_splits"], plan["output_splits"])))
    output = torch.cat([dispatcher.gather_combined(plan, flight.wait()) for plan, flight in combines]).view(shape)
    if shared is not None:
        output = output + shared
    return output, None


__all__ = ["AllToAllInFlight", "chunk_bounds", "overlapped_forward"]
