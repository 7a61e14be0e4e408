"""megatron-core 0.16.1's GPTModel, GroupedMLP and TransformerLayer, as GLM-5 builds them (part of
`pretrain.compat`).

The GPTModel and GroupedMLP helpers are used where the model is built (`pretrain.model.glm5_model`,
`pretrain.model.experts`) and change nothing process-wide; `silence_unknown_mlp_type` (applied by `install()`)
filters one line of TransformerLayer's log; `dispatchers_release_routing` (applied by `install()`) makes
megatron's token dispatchers let go of a micro-batch's routing once its tokens are combined.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Iterator

import torch

from pretrain.compat.registry import Workaround


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


class MTPLogitsWithoutLabels:
    """GPTModel mixin: a forward without labels returns the main head's logits, also with MTP.

    MTP only contributes losses; megatron-core 0.16.1's `GPTModel._postprocess` would try to roll
    the missing labels for the MTP loss and fail. The model class provides
    `output_logits(hidden_states, runtime_gather_output)`.
    """

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, *args, **kwargs):
        if labels is None and self.config.mtp_num_layers and self.post_process:
            return self.output_logits(hidden_states, kwargs.get("runtime_gather_output"))
        return super()._postprocess(hidden_states, input_ids, position_ids, labels, *args, **kwargs)


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


UNKNOWN_MLP_TYPE = "Unknown MLP type"
TRANSFORMER_LAYER_LOGGER = "megatron.core.transformer.transformer_layer"


class _DropUnknownMLPType(logging.Filter):
    """Drops TransformerLayer's "Unknown MLP type: ... Using default kwargs." (a WARNING per layer).

    megatron-core 0.16.1 hands its process groups only to MLP classes it names by identity (MLP, MoELayer,
    GroupedMLP, ...), so every layer of `GLM5MoELayer` (a MoELayer subclass) logs it. The default kwargs are right
    for it: with no `pg_collection` it takes megatron's default groups, which are the ones the whole model uses
    (`build_model` passes no other), so the line says nothing about the run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(UNKNOWN_MLP_TYPE)


def silence_unknown_mlp_type() -> None:
    logger = logging.getLogger(TRANSFORMER_LAYER_LOGGER)
    if not any(isinstance(f, _DropUnknownMLPType) for f in logger.filters):
        logger.addFilter(_DropUnknownMLPType())


# what each of megatron's dispatchers keeps of a forward on itself, unused once `combine_postprocess` returns
DISPATCHER_ROUTING_ATTRS = {"MoEAlltoAllTokenDispatcher": ("probs", "routing_map"),
                            "MoEAllGatherTokenDispatcher": ("local_probs", "local_map")}


def _releasing(combine_postprocess, attrs):
    @functools.wraps(combine_postprocess)
    def wrapper(self, hidden_states):
        output = combine_postprocess(self, hidden_states)
        for name in attrs:
            setattr(self, name, None)
        return output

    wrapper.releases_routing = True
    return wrapper


def dispatchers_release_routing() -> None:
    """Drop the routing probabilities (and map) a dispatcher stores on itself once the tokens are combined.

    megatron-core 0.16.1's all-to-all and all-gather dispatchers keep `probs` / `local_probs` until the layer's
    next forward. Those are the router's output, attached to the autograd graph, so the graph stays alive after
    backward: with full recompute it holds the recomputed layer's input (the checkpoint's detached copy) and
    that input's gradient, two [tokens, hidden] tensors per MoE layer: 13.7 GiB held between steps on
    glm5-proxy at 128K on one H200, each layer's freed only when the next forward reaches it."""
    from megatron.core.transformer.moe import token_dispatcher

    for cls_name, attrs in DISPATCHER_ROUTING_ATTRS.items():
        cls = getattr(token_dispatcher, cls_name)
        if not getattr(cls.combine_postprocess, "releases_routing", False):
            cls.combine_postprocess = _releasing(cls.combine_postprocess, attrs)


WORKAROUNDS = [
    Workaround(
        name="gpt_model_mtp_block_class",
        target="megatron.core.models.gpt.gpt_model.MultiTokenPredictionBlock",
        reason="GPTModel has no spec hook for its MTP block class; GLM-5's depth-shared MTP needs its own",
        upstream="open",
        test="tests/test_mtp.py::test_shared_mtp_gradient_is_sum_of_depths",
    ),
    Workaround(
        name="MTPLogitsWithoutLabels",
        target="megatron.core.models.gpt.gpt_model.GPTModel._postprocess",
        reason="a forward without labels on a model with MTP tries to roll the missing labels and fails",
        upstream="open",
        test="tests/test_hf_parity.py::test_logits_match_with_mtp_layer_in_checkpoint",
    ),
    Workaround(
        name="grouped_gemm_check_skipped",
        target="megatron.core.transformer.moe.experts.GroupedMLP.__init__ (grouped_gemm check)",
        reason="asserts the grouped_gemm CUDA extension, which our torch._grouped_mm experts do not use",
        upstream="open",
        test="tests/test_param_count.py::test_glm5_744b_parameter_count",
    ),
    Workaround(
        name="silence_unknown_mlp_type",
        target="megatron.core.transformer.transformer_layer logger (\"Unknown MLP type ... Using default kwargs.\")",
        reason="TransformerLayer warns once per MoE layer that it does not know GLM5MoELayer, whose default kwargs "
               "(megatron's default process groups) are the model's own",
        upstream="open",
        test="tests/test_notices.py::test_training_log_shows_framework_notices_and_no_megatron_noise",
        install=silence_unknown_mlp_type,
    ),
    Workaround(
        name="dispatchers_release_routing",
        target="megatron.core.transformer.moe.token_dispatcher.MoE{AlltoAll,AllGather}TokenDispatcher"
               ".combine_postprocess",
        reason="the dispatchers keep the router's probabilities, attached to the autograd graph, until the next "
               "forward: with full recompute every MoE layer's recomputed input and its gradient outlive backward",
        upstream="open",
        test="tests/test_moe_dispatch_retention.py::test_nothing_keeps_the_graph_after_backward",
        install=dispatchers_release_routing,
    ),
]
