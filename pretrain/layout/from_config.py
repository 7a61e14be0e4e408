"""The layout planner's view of a resolved config: the `Layout` and `Workload` it runs (docs/layout.md).

Shared by the search (`pretrain.layout.search`), the plan's projection and `pretrain.tools.pipeline_split`'s
calibrated costs, so that none of them imports another to read a config.
"""

from __future__ import annotations

from typing import Optional, Tuple

from pretrain.layout.types import Layout, Workload


def layout_of(cfg, world_size: int) -> Tuple[Layout, Workload]:
    """The layout and workload a config runs at `world_size` GPUs."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    dp = max(world_size // (tp * pp * cp), 1)
    recompute = {None: "none", "selective": "selective", "full": "full"}[m.recompute_granularity]
    zero = "zero2" if cfg.optimizer.use_distributed_optimizer else "ddp"
    layout = Layout(tp=tp, pp=pp, vpp=p.virtual_pipeline_model_parallel_size or 1, ep=p.expert_model_parallel_size,
                    etp=p.expert_tensor_parallel_size, cp=cp, dp=dp, micro_batch_size=t.micro_batch_size,
                    num_microbatches=max(t.global_batch_size // (t.micro_batch_size * dp), 1),
                    sequence_parallel=p.sequence_parallel, recompute=recompute,
                    activation_offload=m.activation_offload, optimizer=cfg.optimizer.optimizer, zero=zero,
                    zero2_grad_reduce=cfg.optimizer.zero2_grad_reduce,
                    output_loss_backend=m.output_loss_backend, output_chunk_size=m.output_chunk_size or 4096,
                    pipeline_layout=configured_layout(cfg),
                    microbatch_group=p.microbatch_group_size_per_vp_stage if p.virtual_pipeline_model_parallel_size
                    else None)
    return layout, Workload(cfg.data.seq_length, t.global_batch_size)


def configured_layout(cfg) -> Optional[str]:
    """The config's uneven stages as a layout string (`parallel.pipeline_model_parallel_layout`, or
    num_layers_in_first/last_pipeline_stage and account_for_embedding/loss_in_pipeline_split resolved by
    `pretrain.config.pipeline_layout.stage_entries`); None when the config keeps megatron's even split."""
    from pretrain.config.pipeline_layout import format_layout, stage_entries

    p = cfg.parallel
    if p.pipeline_model_parallel_layout is None and p.num_layers_in_first_pipeline_stage is None and (
            p.num_layers_in_last_pipeline_stage is None and not p.account_for_embedding_in_pipeline_split
            and not p.account_for_loss_in_pipeline_split):
        return None
    return format_layout(stage_entries(cfg.model, p))
