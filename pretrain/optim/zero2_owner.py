"""megatron-core's optimizer wrappers made ZeRO-2 owners (`pretrain.optim.zero2_grads`; GLM-5 report,
section 7).

`optimizer.optimizer: muon` with `optimizer.use_distributed_optimizer: true` wraps the model chunks
in `Zero2DataParallel` (gradients reduced to one owner per parameter; `pretrain.optim.build`) and builds
megatron's ordinary optimizer wrappers around Muon; `shard_optimizer` then turns each wrapper into
the owner of its share:

- the inner Muon updates only owned parameters (momentum and AdamW moments exist only there: the
  optimizer state is sharded); bf16 training keeps fp32 main weights only for owned parameters;
- the step goes bucket by bucket in `broadcast_order`: the owner updates a bucket, copies it into
  the bf16 model weights and starts its broadcast, then moves on to its next bucket while the
  broadcast runs; non-owners only receive (a bucket of many owners, `zero2_scatter`: each
  updates its segment, then one all-gather);
- the gradient norm is summed over the owned gradients of all ranks (world group: every parameter
  counted once, tensor-parallel duplicates excluded as before);
- checkpoints hold each owner's state as the main replica of that tensor, so any data-parallel size
  (ZeRO-2 or replicated) can load it: ownership is recomputed and each rank reads what it owns.
"""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    make_sharded_optimizer_tensor,
    optim_state_to_sharding_state,
)
from megatron.core.optimizer.optimizer import FP32Optimizer, Float16OptimizerWithFloat16Params

from pretrain.optim.roles import inner_to_model_params, sub_optimizers
from pretrain.optim.zero2_buckets import broadcast_bucket
from pretrain.optim.zero2_grads import Zero2DataParallel


def _main_replica(tree) -> None:
    """Mark every sharded tensor in `tree` as the main replica over data parallelism (its last
    replica-id component): only the owner emits optimizer tensors, so it is the one that saves them."""
    if isinstance(tree, dict):
        for v in tree.values():
            _main_replica(v)
    elif isinstance(tree, list):
        for v in tree:
            _main_replica(v)
    elif isinstance(tree, ShardedBase) and hasattr(tree, "replica_id"):
        rid = tree.replica_id
        tree.replica_id = (*rid[:-1], 0) if isinstance(rid, tuple) and rid else 0


# Shared by both wrappers below (plain functions: a mixin base would change the object layout and
# forbid turning megatron's instances into these classes). `shard_optimizer` sets `_zero_buckets`
# (this optimizer's buckets in broadcast order) and `_zero_owned` (the model parameters it owns).
@torch.no_grad()
def _owner_step(self) -> bool:
    """Inner Muon step bucket by bucket; each bucket's broadcast starts as soon as its owner has it."""
    if self.is_stub_optimizer:
        return True
    works = []
    for bucket in self._zero_buckets:
        if bucket.owned_params:  # a whole bucket, or this rank's segment of a scatter bucket
            mains = [getattr(p, "main_param", p) for p in bucket.owned_params]
            self.optimizer.step(params=mains)
            for p, main in zip(bucket.owned_params, mains):
                if main is not p:
                    p.data.copy_(main.data)
        works.append(broadcast_bucket(bucket))
    for w in works:
        if w is not None:
            w.wait()
    return True


def _sharded_torch_state(torch_state: dict, model_params: List, model_sharded_state_dict) -> dict:
    id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, model_params)
    optim_state_to_sharding_state(torch_state, id_map, exclude_keys="step")
    _main_replica(torch_state["state"])
    return id_map


class ZeroFP32Optimizer(FP32Optimizer):
    """FP32Optimizer (fp32 training: the model weights are the optimizer's) as a ZeRO-2 owner."""

    step_with_ready_grads = _owner_step

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None):
        if is_loading:
            self.init_state_fn(self.optimizer, self.config)
        state = self.optimizer.state_dict()
        _sharded_torch_state(state, self.get_parameters(), model_sharded_state_dict)
        return state


class ZeroFloat16Optimizer(Float16OptimizerWithFloat16Params):
    """Float16OptimizerWithFloat16Params (bf16 weights, fp32 main copies) as a ZeRO-2 owner: main
    copies of parameters owned elsewhere are freed."""

    step_with_ready_grads = _owner_step

    def _pairs(self):
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            yield from zip(model_group, main_group)

    def _copy_model_grads_to_main_grads(self):
        for model_param, main_param in self._pairs():
            main_param.grad = model_param.main_grad if model_param in self._zero_owned else None
            model_param.grad = None
        for group in self.fp32_from_fp32_groups:
            for p in group:
                p.grad = p.main_grad if p in self._zero_owned else None

    def _get_model_and_main_params_data_float16(self):
        owned = [(m, w) for m, w in self._pairs() if m in self._zero_owned]
        return [m.data for m, _ in owned], [w.data for _, w in owned]

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None):
        if is_loading:
            self.init_state_fn(self.optimizer, self.config)
        state = {"optimizer": self.optimizer.state_dict()}
        model_params = [m for m, _ in self._pairs()]
        id_map = _sharded_torch_state(state["optimizer"], model_params, model_sharded_state_dict)
        fp32, i = [], 0
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            out = []
            for model_param, main_param in zip(model_group, main_group):
                if model_param in self._zero_owned:
                    out.append(make_sharded_optimizer_tensor(id_map[i], main_param, prefix="optimizer.state.fp32_param"))
                else:  # another rank's: nothing to save or load here
                    out.append(LocalNonpersistentObject(main_param))
                i += 1
            fp32.append(out)
        _main_replica(fp32)
        state["fp32_from_fp16_params"] = fp32
        return state


def shard_optimizer(optimizer, model_chunks: List[Zero2DataParallel]):
    """Make every sub-optimizer of `optimizer` (megatron wrappers around Muon) a ZeRO-2 owner."""
    owned = {p for chunk in model_chunks for p in chunk.param_owner if chunk.owns(p)}
    buckets = [b for chunk in model_chunks for b in chunk.broadcast_order()]
    world = dist.group.WORLD
    for sub in sub_optimizers(optimizer):
        if sub.optimizer is None:
            continue
        if isinstance(sub, Float16OptimizerWithFloat16Params):
            sub.__class__ = ZeroFloat16Optimizer
        elif isinstance(sub, FP32Optimizer):
            sub.__class__ = ZeroFP32Optimizer
        else:
            raise TypeError(f"ZeRO-2 with Muon cannot shard a {type(sub).__name__}")
        to_model = inner_to_model_params(sub)  # inner (main) parameter id -> model parameter
        inner = [p for group in sub.optimizer.param_groups for p in group["params"]]
        mine = {id(to_model[id(p)]) for p in inner}
        sub._zero_buckets = [b for b in buckets if id(b.params[0]) in mine]
        if any(id(p) not in mine for b in sub._zero_buckets for p in b.params):
            raise RuntimeError("a ZeRO-2 bucket spans two optimizers (dense and expert parameters mixed)")
        sub._zero_owned = {to_model[id(p)] for p in inner if to_model[id(p)] in owned}
        foreign = [p for p in inner if to_model[id(p)] not in owned]
        sub.optimizer.set_foreign(foreign)
        for p in foreign:
            if p is not to_model[id(p)]:  # an fp32 main copy of a parameter owned elsewhere
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        # Each rank holds the gradients it owns: the norm is summed over all ranks.
        sub.grad_stats_parallel_group = world
    return optimizer
