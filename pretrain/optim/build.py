"""Optimizer and LR schedule from the config, through megatron-core.

Muon (`optimizer.optimizer: muon`) reuses everything below with Muon as the inner optimizer; with
`use_distributed_optimizer` it runs sharded as ZeRO-2 (`parallel.zero2`).
AdamW is megatron-core's `adam` (decoupled weight decay; biases and norm weights without decay),
fp32 on CPU and bf16 mixed precision (fp32 main weights and grads) on GPU. The schedule is
megatron's `OptimizerParamScheduler`, stepped once per iteration: linear warm-up from
`lr_warmup_init` to `lr` over `lr_warmup_iters`, then `lr_decay_style` down to `min_lr` at
`lr_decay_iters` (default: `train.train_iters`).
"""

from __future__ import annotations

from typing import List

from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from pretrain.config.schema import GLM5Config


def build_optimizer(cfg: GLM5Config, model_chunks: List):
    """megatron-core's AdamW, or with `optimizer.optimizer: muon` the same wrappers around Muon
    (`pretrain.training.muon_setup`)."""
    o = cfg.optimizer
    import torch

    mcfg = MegatronOptimizerConfig(
        optimizer="adam",
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        bf16=cfg.model.bf16,
        params_dtype=torch.bfloat16 if cfg.model.bf16 else torch.float32,
        # Muon's ZeRO-2 shards megatron's ordinary wrappers (pretrain.training.zero2_optimizer).
        use_distributed_optimizer=o.use_distributed_optimizer and not zero2_enabled(cfg),
    )
    optimizer = get_megatron_optimizer(mcfg, model_chunks)
    if o.optimizer == "muon":
        from pretrain.training.muon_setup import build_muon_optimizer

        optimizer = build_muon_optimizer(cfg, model_chunks, optimizer)
    if zero2_enabled(cfg):
        from pretrain.training.zero2_optimizer import shard_optimizer

        optimizer = shard_optimizer(optimizer, model_chunks)
    return optimizer


def zero2_enabled(cfg: GLM5Config) -> bool:
    """Muon with `use_distributed_optimizer`: ZeRO-2 (AdamW keeps megatron's distributed optimizer)."""
    return cfg.optimizer.optimizer == "muon" and cfg.optimizer.use_distributed_optimizer


def build_scheduler(cfg: GLM5Config, optimizer) -> OptimizerParamScheduler:
    o, t = cfg.optimizer, cfg.train
    decay_iters = o.lr_decay_iters or t.train_iters
    return OptimizerParamScheduler(
        optimizer,
        init_lr=o.lr_warmup_init,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=o.lr_warmup_iters,
        lr_decay_steps=max(decay_iters, o.lr_warmup_iters + 1),
        lr_decay_style=o.lr_decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=max(t.train_iters, 1),
        wd_incr_style="constant",
        override_opt_param_scheduler=False,
        use_checkpoint_opt_param_scheduler=True,
    )
