"""The optimizer step with a gradient norm the training loop has already computed.

Global-norm clipping (Pascanu et al., 2013) scales every gradient by min(1, c / (||g||_2 + 1e-6)) before
the update; the training loop needs ||g|| before the step anyway, to skip a step whose loss or gradient
norm is not finite. megatron-core 0.16.1's `optimizer.step()` computes the norm a second time (another
pass over every gradient, an all-reduce and a host synchronization, which drains the GPU's queue while
the host then launches the update). `step_with_norm` does what megatron's step does after its own
`prepare_grads` and norm (`MixedPrecisionOptimizer.step`, `FP32Optimizer.step`, `ChainedOptimizer.step`):
clip every sub-optimizer's gradients by the given total norm, then `step_with_ready_grads`.
"""

from __future__ import annotations

from megatron.core.optimizer import optimizer as mcore_optimizer

from pretrain.optim.roles import sub_optimizers


def step_with_norm(optimizer, grad_norm: float) -> bool:
    """Clip by `grad_norm` (the global norm from `optimizer.get_grad_norm()` after `prepare_grads()`) and
    update; True when every sub-optimizer stepped."""
    for sub in sub_optimizers(optimizer):
        if getattr(sub, "is_stub_optimizer", False) or sub.config.clip_grad <= 0.0:
            continue
        params = sub.get_parameters()
        if params:
            # looked up at call time, as megatron's step does: `pretrain.compat` swaps it on CPU hosts
            decoupled = sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
            mcore_optimizer.clip_grad_by_total_norm_fp32(params, max_norm=sub.config.clip_grad, total_norm=grad_norm,
                                                         use_decoupled_grad=decoupled)
    return bool(optimizer.step_with_ready_grads())
