"""What a checkpoint holds besides files: sharded model/optimizer state, RNG streams, the layout.

Optimizer state is stored so that any parallel layout can load it. megatron's optimizers describe
their tensors (Adam's `exp_avg`, `exp_avg_sq`, fp32 main weights, ...) as ShardedTensors named after
the model parameter, which dist_checkpointing reshards; but the rest of their state dict
(param_groups, the step) is nested by the saving rank's optimizer structure, and that structure
depends on the layout: a ChainedOptimizer has a separate expert optimizer only where experts are
expert-parallel (EP > 1, or expert-TP < TP), and pipeline stages without MoE layers have none.
dist_checkpointing keeps rank 0's copy of that part for everyone, so megatron-core 0.16.1's own
`optimizer.load_state_dict` fails when the structure differs (KeyError / list-length errors).

Here only the ShardedTensors are saved, plus the one Adam step all parameters share. On load the
current optimizer gets zero states carrying the saved step (per parameter for torch Adam, per param
group for TE / apex FusedAdam), its own sharded state dict is taken, the loaded tensors fill it, and
it is loaded back: param_groups come from the config, and the scheduler's `load_state_dict` then
sets lr and weight decay. Same layout or not, the restored optimizer equals the saved one bitwise
(tests/test_checkpoint.py).
"""

from __future__ import annotations

import random
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps, tensor_parallel
from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase
from megatron.core.utils import unwrap_model

from pretrain.optim.roles import sub_optimizers

# How model and optimizer describe their shards (megatron-LM's choices for a reshardable checkpoint).
SHARDED_STATE_METADATA = {
    "distrib_optim_sharding_type": "fully_sharded_model_space",  # DistributedOptimizer: model-space tensors
    "chained_optim_avoid_prefix": True,  # dense and expert optimizers keyed by parameter name only
    "singleton_local_shards": False,
}


def model_keys(model_chunks: Sequence[torch.nn.Module]) -> List[str]:
    # megatron-LM's names: "model", or "model0", "model1", ... for virtual pipeline chunks.
    return ["model"] if len(model_chunks) == 1 else [f"model{i}" for i in range(len(model_chunks))]


def model_sharded_state(model_chunks, metadata: Optional[dict] = None) -> Dict[str, Any]:
    """The chunks' sharded state dicts, keyed like the bare model (no DDP / Float16Module prefix), so
    an fp32 CPU checkpoint and a bf16 GPU checkpoint name their tensors alike."""
    return {
        key: chunk.sharded_state_dict(metadata=dict(metadata or SHARDED_STATE_METADATA))
        for key, chunk in zip(model_keys(model_chunks), unwrap_model(list(model_chunks)))
    }


def optimizer_sharded_state(optimizer, model_state: dict, is_loading: bool, metadata=None) -> Tuple[dict, dict]:
    """(the optimizer's sharded state dict, its ShardedTensors alone with list positions as dict keys)."""
    full = optimizer.sharded_state_dict(model_state, is_loading=is_loading,
                                        metadata=dict(metadata or SHARDED_STATE_METADATA))
    tensors, _ = extract_matching_values(full, lambda v: isinstance(v, ShardedBase), return_lists_as_dicts=True)
    return full, tensors


def fill_optimizer_state(template: Any, loaded: Any) -> Any:
    """`template` (a sharded state dict of the current optimizer) with its shards replaced by the
    loaded tensors (`loaded` has the template's shape, lists as dicts) and local objects unwrapped."""
    if isinstance(template, dict):
        return {k: fill_optimizer_state(v, _child(loaded, k)) for k, v in template.items()}
    if isinstance(template, list):
        return [fill_optimizer_state(v, _child(loaded, i)) for i, v in enumerate(template)]
    if isinstance(template, LocalNonpersistentObject):
        return template.unwrap()
    if isinstance(template, ShardedBase):
        if loaded is None:
            raise KeyError(f"optimizer tensor {template.key} was not loaded")
        return loaded
    return template


def _child(loaded: Any, key: Any) -> Any:
    return loaded.get(key) if isinstance(loaded, dict) else None


def _inner_optimizers(optimizer) -> Iterator[torch.optim.Optimizer]:
    for sub in sub_optimizers(optimizer):
        inner = getattr(sub, "optimizer", None)
        if inner is not None:
            yield inner


def optimizer_step(optimizer) -> Dict[str, Any]:
    """The step count all parameters share (0 before the first step), and where the optimizer keeps
    it: per parameter (torch Adam) or per param group (TE / apex FusedAdam)."""
    steps, in_groups = set(), False
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            if "step" in group:
                steps.add(int(group["step"]))
                in_groups = True
            for param in group["params"]:
                if "step" in inner.state.get(param, {}):
                    steps.add(int(inner.state[param]["step"]))
    if len(steps) > 1:
        raise ValueError(f"optimizer steps differ between parameters: {sorted(steps)}")
    step = steps.pop() if steps else 0
    if dist.is_initialized() and dist.get_world_size() > 1:
        # ZeRO-2: a rank may own no parameter that counts steps; the step is every rank's largest.
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        t = torch.tensor([step, int(in_groups)], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        step, in_groups = int(t[0]), bool(t[1])
    return {"step": step, "in_param_groups": in_groups}


def prime_optimizer_state(optimizer, saved: Dict[str, Any]) -> None:
    """Give every parameter its (zero) optimizer state and the saved step before the state dict that
    the loaded tensors fill is taken: torch Adam refuses a parameter state without its step."""
    for sub in sub_optimizers(optimizer):
        if getattr(sub, "init_state_fn", None) is not None and getattr(sub, "optimizer", None) is not None:
            sub.init_state_fn(sub.optimizer, sub.config)
    set_optimizer_step(optimizer, saved)


def set_optimizer_step(optimizer, saved: Dict[str, Any]) -> None:
    step = saved["step"]
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            if saved["in_param_groups"] or "step" in group:
                group["step"] = step
                continue
            for param in group["params"]:
                state = inner.state.get(param)
                if not state:
                    continue
                old = state.get("step")
                if torch.is_tensor(old):
                    state["step"] = torch.full_like(old, float(step))
                elif group.get("capturable") or group.get("fused"):
                    state["step"] = torch.full((), float(step), dtype=torch.float32, device=param.device)
                else:  # as torch.optim.Adam creates it
                    state["step"] = torch.tensor(float(step), dtype=torch.float32)


def parallel_layout() -> Dict[str, int]:
    """This run's world size and parallel sizes (checkpoints saved under another layout are resharded)."""
    return {
        "world_size": dist.get_world_size(),
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size": ps.get_virtual_pipeline_model_parallel_world_size() or 1,
        "context_parallel_size": ps.get_context_parallel_world_size(),
        "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
        "expert_tensor_parallel_size": ps.get_expert_tensor_parallel_world_size(),
        "data_parallel_size": ps.get_data_parallel_world_size(),
    }


def capture_rng_state() -> Dict[str, Any]:
    """Every random stream training draws from, as plain values (loadable with weights_only=True)."""
    name, key, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (name, key.tolist(), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
        # megatron's model-parallel tracker: per-TP-rank streams for dropout and initialization
        "tracker": {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def check_plain(value: Any, where: str) -> None:
    """Refuse at save time what `torch.load(weights_only=True)` would refuse at resume time."""
    if value is None or isinstance(value, (str, int, float, bool, torch.Tensor)):
        return
    if isinstance(value, dict):
        for k, v in value.items():
            check_plain(k, f"{where} key")
            check_plain(v, f"{where}[{k!r}]")
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_plain(v, f"{where}[{i}]")
        return
    raise TypeError(f"{where} is a {type(value).__name__}; checkpoint extra state must hold plain values")
