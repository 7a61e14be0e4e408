"""MTP on the stage before the loss: the embedding copy that megatron-core 0.16.1 does not tie.

GLM-5 places MTP's embedding and transformer layer on the second-to-last pipeline stage and its
output layer with the main head on the last (`docs/parallelism.md`, pipeline section). megatron-core
0.16.1 builds that from a `pipeline_model_parallel_layout` whose "m" entries sit in the stage before
"L" (`mtp_standalone`): the MTP stage holds a copy of the word embeddings, zero-filled at build and
meant to be tied to the first stage's by the embedding process group. Two things go wrong there for
a model with untied output weights (GLM-5):

* the embedding group stays megatron's default, first and last pipeline rank. The last rank then
  all-reduces its *output layer* weight (what `shared_embedding_or_output_weight` answers on a
  stage with neither embedding nor MTP) into the embedding, at build and after every step, and an
  MTP rank in the middle of the pipeline is left out (its copy stays zero). `embedding_ranks` gives
  `initialize_model_parallel` the first rank plus the MTP ranks instead.
* with PP = 2 the MTP stage is pipeline rank 0's last virtual chunk: the rank holds both copies,
  the group is that rank alone, and nothing ties them. `tie_local_embedding_copies` copies the
  first chunk's values into the MTP copy after the chunks are built, and the patched
  `_allreduce_word_embedding_grads` sums the two copies' gradients (then runs megatron's reduction
  and hands its result to every local copy), so both copies take the same optimizer step.

One more, for any interleaved PP = 2 with batched transfers (`parallel.overlap_p2p_comm: false`): there the
previous and the next pipeline rank are the same rank, and `_batched_p2p_ops` posts [send to prev, receive from
prev, send to next, receive from next] in one batch. Point-to-point messages between two ranks match in the order
they are posted, so the peer's first receive from this rank (an activation) takes this rank's first send to it (a
gradient): activations and gradients of equal shape arrive swapped, silently, whenever a step sends both
(from 2 x PP micro-batches on). `order_batched_p2p_ops` posts sends next-then-prev and receives prev-then-next, so
the k-th activation sent is the k-th received.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch

from pretrain.compat.registry import Workaround
from pretrain.config.pipeline_layout import parse_layout


def embedding_ranks(layout: Optional[str], pipeline_size: int) -> Optional[Callable[[List[int]], List[int]]]:
    """`get_embedding_ranks` for megatron's `initialize_model_parallel`: None (megatron's default, first
    and last rank) unless `layout` puts MTP on a rank before the last; then the first rank and those."""
    if layout is None or pipeline_size == 1:
        return None
    stages = parse_layout(layout)
    mtp = sorted({i % pipeline_size for i, stage in enumerate(stages) if "m" in stage})
    if not mtp or mtp == [pipeline_size - 1]:
        return None

    def ranks(pp_ranks: List[int]) -> List[int]:
        return sorted({pp_ranks[0]} | {pp_ranks[r] for r in mtp})

    return ranks


def _embedding_copies(chunks) -> List[torch.nn.Parameter]:
    """The word-embedding weights this rank holds: the first stage's and an MTP stage's copy."""
    from megatron.core.utils import get_attr_wrapped_model

    out = []
    for chunk in chunks:
        model = get_attr_wrapped_model(chunk, "pre_process", return_model_obj=True)
        if (model.pre_process or getattr(model, "mtp_process", False)) and hasattr(model, "embedding"):
            out.append(model.embedding.word_embeddings.weight)
    return out


@torch.no_grad()
def tie_local_embedding_copies(chunks) -> None:
    """Give every embedding copy on this rank the first one's values (after all chunks are built)."""
    copies = _embedding_copies(chunks)
    for copy in copies[1:]:
        copy.copy_(copies[0])


def _grad(weight):
    return getattr(weight, "main_grad", None) if hasattr(weight, "main_grad") else weight.grad


def allreduce_word_embedding_grads_with_local_copies(original):
    def allreduce(model, config, embd_group=None, pp_group=None):
        grads = [g for g in (_grad(w) for w in _embedding_copies(model)) if g is not None]
        if len(grads) > 1:
            total = torch.stack(grads).sum(0)
            for g in grads:
                g.copy_(total)
        original(model, config, embd_group, pp_group)
        if len(grads) > 1:
            # megatron reduced the copy of model[0] (first stage) or model[-1]; the first rank holds model[0]'s
            from megatron.core import parallel_state as ps

            picked = grads[0] if ps.is_pipeline_first_stage(ignore_virtual=True) else grads[-1]
            for g in grads:
                if g is not picked:
                    g.copy_(picked)

    allreduce.__wrapped__ = original
    return allreduce


def patch_embedding_grad_allreduce() -> None:
    import importlib

    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")  # the package re-exports a function
    if getattr(fmg._allreduce_word_embedding_grads, "__wrapped__", None) is None:
        fmg._allreduce_word_embedding_grads = allreduce_word_embedding_grads_with_local_copies(
            fmg._allreduce_word_embedding_grads)


def patch_shape_exchange() -> None:
    """Exchange the shapes through megatron's own `_p2p_ops`, as the tensors that follow them travel."""
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    original = p2p.P2PCommunicator._communicate_shapes
    if getattr(original, "__wrapped__", None) is not None:
        return

    def communicate_shapes(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
        device = torch.cuda.current_device()

        def shape_of(t):
            return None if t is None else torch.tensor(t.size(), device=device, dtype=torch.int64)

        recv_prev_shape = torch.empty((3,), device=device, dtype=torch.int64) if recv_prev else None
        recv_next_shape = torch.empty((3,), device=device, dtype=torch.int64) if recv_next else None
        sent_prev, sent_next = shape_of(tensor_send_prev), shape_of(tensor_send_next)
        reqs = p2p._p2p_ops(tensor_send_prev=sent_prev, tensor_recv_prev=recv_prev_shape,
                            tensor_send_next=sent_next, tensor_recv_next=recv_next_shape,
                            group=self.pp_group, prev_pipeline_rank=self.prev_rank, next_pipeline_rank=self.next_rank)
        # Wait for the shapes this rank receives only: a shape sent now may be received in the peer's next
        # call, after the peer has waited for this call's tensor (gloo sends complete when received).
        pending = [(r, t) for r, t in getattr(self, "_shape_sends", []) if not r.is_completed()]
        for key, tensor in (("send_prev", sent_prev), ("send_next", sent_next)):
            if key in reqs:
                pending.append((reqs[key], tensor))
        self._shape_sends = pending
        for key in ("recv_prev", "recv_next"):
            if key in reqs:
                reqs[key].wait()
        return ([0, 0, 0] if recv_prev_shape is None else recv_prev_shape.tolist(),
                [0, 0, 0] if recv_next_shape is None else recv_next_shape.tolist())

    communicate_shapes.__wrapped__ = original
    p2p.P2PCommunicator._communicate_shapes = communicate_shapes


def order_batched_p2p_ops() -> None:
    """Post each batch's sends to the next rank before those to the previous one, and the receives from the
    previous rank before those from the next (module docstring): the order megatron's unbatched `_p2p_ops` keeps."""
    from megatron.core.pipeline_parallel import p2p_communication as p2p

    original = p2p._batched_p2p_ops
    if getattr(original, "__wrapped__", None) is not None:
        return

    def batched(*, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next, group,
                prev_pipeline_rank, next_pipeline_rank):
        ops = [(torch.distributed.isend, tensor_send_next, next_pipeline_rank),
               (torch.distributed.irecv, tensor_recv_prev, prev_pipeline_rank),
               (torch.distributed.isend, tensor_send_prev, prev_pipeline_rank),
               (torch.distributed.irecv, tensor_recv_next, next_pipeline_rank)]
        ops = [torch.distributed.P2POp(op, t, peer, group) for op, t, peer in ops if t is not None]
        return torch.distributed.batch_isend_irecv(ops) if ops else []

    batched.__wrapped__ = original
    p2p._batched_p2p_ops = batched


_PENDING_SENDS: dict = {}  # id(a tensor being sent) -> its send request (gloo, unbatched p2p)
_HELD: list = []  # (send request, the storage a deallocation replaced): kept until the send completes


def hold_storage_of_pending_sends() -> None:
    """On gloo, keep a deallocated pipeline output's storage until its asynchronous send has completed."""
    # megatron's interleaved schedule with overlapped transfers posts a stage's output to the next rank and
    # right away "deallocates" it (`deallocate_output_tensor`: `out.data = torch.empty(1)`, with
    # deallocate_pipeline_outputs true), waiting for that send only before the next one. gloo sends from a
    # background thread, so the replaced storage can be freed and reused before it is read: the next stage then
    # sometimes computes on another micro-batch's bytes (tests/test_pipeline_layout.py at 4 micro-batches, about
    # one run in ten). Here the replaced storage stays referenced until the send's request reports completion.
    from megatron.core.pipeline_parallel import p2p_communication as p2p
    from megatron.core.pipeline_parallel import schedules

    ops, deallocate = p2p._p2p_ops, schedules.deallocate_output_tensor
    if getattr(ops, "__wrapped__", None) is not None:
        return

    def p2p_ops(**kwargs):
        reqs = ops(**kwargs)
        for key in ("send_next", "send_prev"):
            if key in reqs and kwargs.get(f"tensor_{key}") is not None:
                _PENDING_SENDS[id(kwargs[f"tensor_{key}"])] = reqs[key]
        return reqs

    def deallocate_output_tensor(out, deallocate_pipeline_outputs=False):
        _HELD[:] = [(req, data) for req, data in _HELD if not req.is_completed()]
        req = _PENDING_SENDS.pop(id(out), None) if out is not None else None
        if deallocate_pipeline_outputs and req is not None and not req.is_completed():
            _HELD.append((req, out.data))
        deallocate(out, deallocate_pipeline_outputs)

    p2p_ops.__wrapped__ = ops
    deallocate_output_tensor.__wrapped__ = deallocate
    p2p._p2p_ops = p2p_ops
    schedules.deallocate_output_tensor = deallocate_output_tensor


WORKAROUNDS = [
    Workaround(
        name="embedding_ranks",
        target="megatron.core.parallel_state.initialize_model_parallel(get_embedding_ranks=...)",
        reason="with MTP before the last stage the default embedding group (first, last rank) all-reduces the last "
               "stage's output layer into the embedding and leaves a middle MTP rank's copy at zero",
        upstream="open",
        test="tests/test_pipeline_layout.py::test_pp2_vpp2_mtp_before_last_stage_matches_one_rank",
    ),
    Workaround(
        name="tie_local_embedding_copies",
        target="megatron.core.models.common.language_module.LanguageModule.setup_embeddings_and_output_layer",
        reason="an MTP chunk on the first pipeline rank (PP=2) keeps its zero-filled embedding copy",
        upstream="open",
        test="tests/test_pipeline_layout.py::test_pp2_vpp2_mtp_before_last_stage_matches_one_rank",
    ),
    Workaround(
        name="patch_embedding_grad_allreduce",
        target="megatron.core.distributed.finalize_model_grads._allreduce_word_embedding_grads",
        reason="two embedding copies on one rank (first stage and an MTP chunk) are never summed",
        upstream="open",
        test="tests/test_pipeline_layout.py::test_pp2_vpp2_mtp_before_last_stage_matches_one_rank",
        install=patch_embedding_grad_allreduce,
    ),
    Workaround(
        name="patch_shape_exchange",
        target="megatron.core.pipeline_parallel.p2p_communication.P2PCommunicator._communicate_shapes",
        reason="with MTP before the last stage every p2p call first exchanges shapes in one batch of both "
               "directions, which blocks where the interleaved schedule sends now and the peer receives later "
               "(the PP=2 x VPP=2 steady state hangs on gloo)",
        upstream="open",
        test="tests/test_pipeline_layout.py::test_pp2_vpp2_mtp_before_last_stage_matches_one_rank",
        install=patch_shape_exchange,
    ),
    Workaround(
        name="order_batched_p2p_ops",
        target="megatron.core.pipeline_parallel.p2p_communication._batched_p2p_ops",
        reason="interleaved PP = 2 with batched transfers (overlap_p2p_comm false) sends a gradient and an activation "
               "to the same rank in one batch, and they arrive swapped: wrong losses from 2 x PP micro-batches on",
        upstream="open",
        test="tests/test_pipeline_layout.py::test_pp2_vpp2_mtp_before_last_stage_matches_one_rank",
        install=order_batched_p2p_ops,
    ),
    Workaround(
        name="hold_storage_of_pending_sends",
        target="megatron.core.pipeline_parallel.schedules.deallocate_output_tensor (with p2p_communication._p2p_ops)",
        reason="on gloo, an overlapped pipeline send can read its output after deallocate_output_tensor replaced and "
               "freed the storage: a later stage sometimes computes on another micro-batch's values",
        upstream="open",
        test="tests/test_pipeline_layout.py::test_pp2_vpp2_mtp_before_last_stage_matches_one_rank",
        install=hold_storage_of_pending_sends,
        when="cpu",
    ),
]
