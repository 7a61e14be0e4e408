"""megatron's full-recompute units, routed through another checkpoint function.

megatron-core 0.16.1 runs each full-recompute unit of the decoder (`transformer_block`) and of the MTP
layer (`multi_token_prediction`) through `tensor_parallel.checkpoint(function,
distribute_saved_activations, *args)`. The activation-offload backends wrap that call: the torch
backend offloads the unit's saved inputs around megatron's checkpoint, the DeepSpeed backend replaces
it with `deepspeed.checkpointing.checkpoint`. Only these two modules see the change.
"""

from __future__ import annotations

_BLOCK = "megatron.core.transformer.transformer_block"  # full recompute of decoder layers
_MTP = "megatron.core.transformer.multi_token_prediction"  # full recompute of the MTP layer
_ROUTED: dict = {}  # module name -> its own `tensor_parallel`


class _RoutedTensorParallel:
    """megatron's `tensor_parallel` namespace as one module sees it, with `checkpoint` replaced."""

    def __init__(self, original, checkpoint):
        self._original, self.checkpoint = original, checkpoint

    def __getattr__(self, name):
        return getattr(self._original, name)


def route_recompute_units(wrap, modules=(_BLOCK, _MTP)) -> None:
    """Route the recompute units of `modules` (their `tensor_parallel.checkpoint` calls: full recompute)
    through `wrap(original_checkpoint) -> checkpoint`; `wrap=None` restores megatron's everywhere.
    Only these modules see the change; every other user of `tensor_parallel` keeps megatron's."""
    import importlib

    for name in list(_ROUTED) if wrap is None else modules:
        module = importlib.import_module(name)
        original = _ROUTED.setdefault(name, module.tensor_parallel)
        module.tensor_parallel = original if wrap is None else _RoutedTensorParallel(original, wrap(original.checkpoint))
