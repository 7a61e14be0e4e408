"""The optimizer, its data-parallel wrapping and the LR schedule from the config, through megatron-core.

One decision, `data_parallel_mode`, picks how data parallelism treats gradients and optimizer state,
for the model wrapper (`wrap_model_chunks`) and the optimizer (`build_optimizer`) alike:

- "ddp": megatron's DistributedDataParallel all-reduces gradients; every rank updates everything;
- "distributed_optimizer": megatron's distributed optimizer (`optimizer.use_distributed_optimizer`
  with an optimizer updating elements independently, AdamW): flat shards of state and main weights;
- "zero2": Muon with `optimizer.use_distributed_optimizer` (Muon needs whole matrices, not flat
  shards): gradients reduced to one owner per parameter (`pretrain.optim.zero2_grads`), which alone
  keeps state and updates it (`pretrain.optim.zero2_owner`).

Optimizers are registered by name (`register_optimizer`): each is built as megatron-core's AdamW
wrappers (decoupled weight decay; biases and norm weights without decay; fp32 on CPU, bf16 mixed
precision with fp32 main weights and grads on GPU), then the registered builder swaps the inner
optimizer (`adam`: megatron's own, `muon`: `pretrain.optim.roles.build_muon_optimizer`). The schedule
is megatron's `OptimizerParamScheduler`, stepped once per iteration: linear warm-up from
`lr_warmup_init` to `lr` over `lr_warmup_iters`, then `lr_decay_style` down to `min_lr` at
`lr_decay_iters` (default: `train.train_iters`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List

import torch
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from pretrain.config.schema import GLM5Config, ModelConfig, OptimizerConfig, ParallelConfig
from pretrain.optim.roles import build_muon_optimizer, ownership_cost
from pretrain.optim.zero2_grads import DEFAULT_BUCKET_ELEMENTS, Zero2DataParallel
from pretrain.optim.zero2_owner import shard_optimizer


@dataclass(frozen=True)
class OptimizerEntry:
    """A registered optimizer: `build(megatron_optimizer, model_chunks, optimizer_cfg, model_cfg)`
    turns megatron's AdamW wrappers into it; `sharding` is what `use_distributed_optimizer` means
    for it ("distributed_optimizer" or "zero2")."""

    build: Callable
    sharding: str


OPTIMIZERS: Dict[str, OptimizerEntry] = {}


def register_optimizer(name: str, sharding: str):
    """Decorator registering `build` under `optimizer.optimizer: <name>`."""
    if sharding not in ("distributed_optimizer", "zero2"):
        raise ValueError(f"sharding must be 'distributed_optimizer' or 'zero2', got {sharding!r}")

    def register(build: Callable) -> Callable:
        OPTIMIZERS[name] = OptimizerEntry(build, sharding)
        return build

    return register


def optimizer_entry(name: str) -> OptimizerEntry:
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer.optimizer: unknown optimizer {name!r}; registered: {', '.join(sorted(OPTIMIZERS))}")
    return OPTIMIZERS[name]


@register_optimizer("adam", sharding="distributed_optimizer")
def _adamw(megatron_optimizer, model_chunks: List, optimizer_cfg: OptimizerConfig, model_cfg: ModelConfig):
    return megatron_optimizer  # megatron-core's "adam" is AdamW


@register_optimizer("muon", sharding="zero2")
def _muon(megatron_optimizer, model_chunks: List, optimizer_cfg: OptimizerConfig, model_cfg: ModelConfig):
    return build_muon_optimizer(optimizer_cfg, model_cfg, model_chunks, megatron_optimizer)


def data_parallel_mode(optimizer_cfg: OptimizerConfig) -> str:
    """"ddp", "distributed_optimizer" or "zero2" (see the module docstring)."""
    entry = optimizer_entry(optimizer_cfg.optimizer)
    return entry.sharding if optimizer_cfg.use_distributed_optimizer else "ddp"


def wrap_model_chunks(chunks: List, parallel_cfg: ParallelConfig, optimizer_cfg: OptimizerConfig,
                      model_cfg: ModelConfig) -> List[DistributedDataParallel]:
    """The data-parallel wrapper of each model chunk: megatron's DDP, or ZeRO-2's
    `Zero2DataParallel` (ownership balanced by `ownership_cost`)."""
    mode = data_parallel_mode(optimizer_cfg)
    if mode == "zero2":
        cost = ownership_cost(optimizer_cfg, model_cfg)
        transports = {}  # copy-engine transports, one per group, shared by the chunks
        return [Zero2DataParallel(chunk.config, chunk, cost, optimizer_cfg.zero2_grad_reduce,
                                  parallel_cfg.grad_reduce_in_fp32,
                                  bucket_elements=parallel_cfg.bucket_size or DEFAULT_BUCKET_ELEMENTS,
                                  reduce_transport=optimizer_cfg.zero2_reduce_transport, transports=transports)
                for chunk in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=parallel_cfg.grad_reduce_in_fp32,
        overlap_grad_reduce=parallel_cfg.overlap_grad_reduce and ps.get_data_parallel_world_size() > 1,
        use_distributed_optimizer=mode == "distributed_optimizer",
        bucket_size=parallel_cfg.bucket_size,
    )
    return [
        DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]


def build_optimizer(cfg: GLM5Config, model_chunks: List):
    """The registered `optimizer.optimizer` inside megatron-core's wrappers, over `model_chunks` as
    `wrap_model_chunks` wrapped them."""
    o = cfg.optimizer
    entry = optimizer_entry(o.optimizer)
    mode = data_parallel_mode(o)
    if mode == "zero2" and not all(isinstance(c, Zero2DataParallel) for c in model_chunks):
        raise TypeError("ZeRO-2 needs the model chunks wrapped by pretrain.optim.build.wrap_model_chunks")
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
        # ZeRO-2 shards megatron's ordinary wrappers (pretrain.optim.zero2_owner).
        use_distributed_optimizer=mode == "distributed_optimizer",
    )
    optimizer = entry.build(get_megatron_optimizer(mcfg, model_chunks), model_chunks, o, cfg.model)
    if mode == "zero2":
        optimizer = shard_optimizer(optimizer, model_chunks)
    return optimizer


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
