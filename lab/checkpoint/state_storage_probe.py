"""Which tensors of a checkpoint's sharded state are new storage (copies) rather than the model's and optimizer's own.

A save builds the model's and the optimizer's sharded state dicts (`pretrain.training.checkpoint_state`). Their
tensors should be views of the parameters, main weights and optimizer state: then building them costs no device
memory. On glm5-proxy (bf16, fp32 main weights, Muon, one H200) allocated memory stayed 16.875 GiB higher while an
asynchronous save was in flight (benchmarks/results/soak_h200/save_proxy_b): exactly the routed experts' weights,
main weights and momentum, which megatron-core's grouped-expert factory copies into its transposed per-expert
layout (since freed once staged: save_proxy_c). On glm5-proxy this probe counts the same 16.875 GiB.

It trains a few steps, builds the state as `save_checkpoint` does, applies its factories, and reports the bytes
whose storage is not the model's or optimizer's, by state key, the device memory the build allocated, and the
bytes megatron-core's save copies before staging them (non-contiguous tensors; CPU views into a larger storage):

    python lab/checkpoint/state_storage_probe.py --config configs/models/glm5-proxy.yaml train.global_batch_size=4 \
        train.micro_batch_size=4
    python lab/checkpoint/state_storage_probe.py --config configs/models/glm5-tiny.yaml data.seq_length=64   # CPU
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, Iterable, Iterator, Set, Tuple

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))  # run as a script from anywhere

import torch


def storages(tensors: Iterable) -> Set[int]:
    """Storage addresses of every tensor in a nested dict / list / tuple."""
    seen: Set[int] = set()

    def walk(obj) -> None:
        if torch.is_tensor(obj):
            seen.add(obj.untyped_storage().data_ptr())
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)

    walk(list(tensors))
    return seen


def sharded_leaves(state, path: str = "") -> Iterator[Tuple[str, object]]:
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    if isinstance(state, dict):
        for k, v in state.items():
            yield from sharded_leaves(v, f"{path}/{k}")
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from sharded_leaves(v, f"{path}/{i}")
    elif isinstance(state, ShardedBase):
        yield path, state


def new_storage(state, known: Set[int]) -> Tuple[int, int, Dict[str, int]]:
    """(bytes of all sharded tensors, bytes of those not in `known` storage, the latter by key suffix)."""
    total, new, by_key = 0, 0, {}
    for _, sh in sharded_leaves(state):
        data = getattr(sh, "data", None)
        if not torch.is_tensor(data):
            continue
        n = data.numel() * data.element_size()
        total += n
        if data.untyped_storage().data_ptr() not in known:
            new += n
            key = ".".join(sh.key.split(".")[-2:])
            by_key[key] = by_key.get(key, 0) + n
    return total, new, by_key


def save_copies(state) -> Tuple[int, Dict[str, int]]:
    """Bytes megatron-core 0.16.1's save copies before its device-to-host staging, by key suffix:
    `sharded_tensor_to_torch_sharded_tensor` makes every non-contiguous tensor contiguous (a copy on the tensor's
    device), and `FileSystemWriterAsync.prepare_write_data` clones a CPU tensor that is a view into a larger storage
    (its `_clone_if_needed`; device tensors are left as they are). A synchronous save frees the copies when it returns;
    an asynchronous one keeps them, referenced by its request, until the request is finalized."""
    total, by_key = 0, {}
    for _, sh in sharded_leaves(state):
        data = getattr(sh, "data", None)
        if not torch.is_tensor(data):
            continue
        cpu_view = data.device.type == "cpu" and data.untyped_storage().size() != data.numel() * data.element_size()
        if not data.is_contiguous() or cpu_view:
            n = data.numel() * data.element_size()
            total += n
            key = ".".join(sh.key.split(".")[-2:])
            by_key[key] = by_key.get(key, 0) + n
    return total, by_key


def owned_tensors(model_chunks, optimizer) -> Iterator:
    """Parameters, gradient buffers, buffers, main weights and optimizer state: what the state may view."""
    for chunk in model_chunks:
        for p in chunk.parameters():
            yield p
            yield getattr(p, "main_grad", None)
        yield from torch.nn.Module.buffers(chunk)
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for name in ("fp32_from_float16_groups", "float16_groups", "fp32_from_fp32_groups",
                     "shard_fp32_from_float16_groups"):
            yield getattr(inner, name, None)
        opt = getattr(inner, "optimizer", None)
        if opt is not None:
            yield list(opt.state.values())
            yield [g["params"] for g in opt.param_groups]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/models/glm5-tiny.yaml")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    from pretrain import compat
    from pretrain.config import load_config
    from pretrain.training.checkpoint_state import model_sharded_state, optimizer_sharded_state
    from pretrain.training.loop import Trainer

    compat.install()
    cfg = load_config(args.config, [f"train.train_iters={args.steps}", "train.eval_interval=null",
                                    "checkpoint.save=null", "checkpoint.auto_resume=false", "data.mock=true",
                                    "data.data_path=[]", "data.tokenizer=null", "optimizer.lr_warmup_iters=1",
                                    *args.overrides])
    trainer = Trainer(cfg)
    trainer.train()
    cuda = torch.cuda.is_available()
    before = torch.cuda.memory_allocated() if cuda else 0
    state = model_sharded_state(trainer.model)
    _, state["optimizer"] = optimizer_sharded_state(trainer.optimizer, dict(state), is_loading=False)
    # The save applies the state's factories (expert and gated-MLP weights are reshaped, transposed or chunked by
    # them) before it writes: count what it writes, not the factories' inputs.
    from megatron.core.dist_checkpointing.mapping import apply_factories

    apply_factories(state)
    built = (torch.cuda.memory_allocated() - before) if cuda else 0
    total, new, by_key = new_storage(state, storages(owned_tensors(trainer.model, trainer.optimizer)))
    print(f"sharded state: {total / 2**30:.3f} GiB in tensors, {new / 2**30:.3f} GiB of it new storage "
          f"({new / max(total, 1):.1%}); building it allocated {built / 2**30:.3f} GiB of device memory")
    for key, n in sorted(by_key.items(), key=lambda kv: -kv[1])[:20]:
        print(f"  {n / 2**30:9.3f} GiB  {key}")
    cloned, clone_keys = save_copies(state)
    print(f"tensors megatron-core's save copies before staging them to the host: {cloned / 2**30:.3f} GiB "
          f"({cloned / max(total, 1):.1%} of the state)")
    for key, n in sorted(clone_keys.items(), key=lambda kv: -kv[1])[:20]:
        print(f"  {n / 2**30:9.3f} GiB  {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
