"""Checkpoints with exact resume: megatron-core `dist_checkpointing` in step directories.

    path = save_checkpoint(cfg.checkpoint.save, iteration, model_chunks, optimizer, scheduler, cfg,
                           {"data": data_iterator.state_dict(), "skipped_steps": 3})
    restored = load_checkpoint(load_dir, model_chunks, optimizer, scheduler)   # None: nothing to load
    if restored is not None:
        iteration, extra_state = restored

What a step dir holds (layout and crash safety: `checkpoint_files`):

* model and optimizer tensors: the chunks' `sharded_state_dict()` and the ShardedTensors of the
  optimizer's sharded state dict (Adam moments, fp32 main weights), in megatron's `torch_dist`
  format. Every tensor is stored under its parameter's global name with its global shape and
  offset, so loading into another TP / PP / EP / DP layout (or virtual-pipeline split) reshards
  weights and optimizer state alike (why the optimizer's other entries are not stored:
  `checkpoint_state`).
* common state (rank 0): iteration, the shared Adam step, LR-scheduler `state_dict()`, the layout.
* `rank_state/rank_NNNNN.pt`, one per rank: the RNG states that differ between ranks (Python,
  NumPy, torch CPU, CUDA when present, and megatron's model-parallel tracker, forked per TP rank
  for dropout) and `extra_state` (the trainer's data position, counters). Restored on a resume with
  the same layout; under another layout rank 0's extra state is used and the RNG streams restart
  from their seeds (a warning says so): bitwise continuation is then impossible anyway.
* `config.yaml`: the resolved config (`pretrain.config.load_config` reads it back).
* `complete.json`: sizes of all the above, written once every rank has finished.

Writing goes through megatron's `TorchDistSaveShardedStrategy`, chosen explicitly, with its writer
patched by `pretrain.compat.patch_dist_checkpoint_writer`, which `pretrain.compat.install()` applies
(the unpatched writer hangs without psutil and forks processes; on CPU it now writes in threads of
the trainer process). Replicated tensors
are spread over the data-parallel ranks (megatron's fully parallel save) when DP > 1.
"""

from __future__ import annotations

import functools
import os
import shutil
import threading
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state as ps
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from megatron.core.utils import unwrap_model
from torch.distributed.checkpoint.api import CheckpointException

from pretrain.compat import pageable_staging
from pretrain.config import save_config
from pretrain.training import checkpoint_files as files
from pretrain.training.checkpoint_state import (
    SHARDED_STATE_METADATA,
    capture_rng_state,
    check_plain,
    fill_optimizer_state,
    model_keys,
    model_sharded_state,
    optimizer_sharded_state,
    optimizer_step,
    parallel_layout,
    prime_optimizer_state,
    restore_rng_state,
    set_optimizer_step,
)

__all__ = ["CheckpointWarning", "save_checkpoint", "load_checkpoint", "load_weights_and_optimizer",
           "capture_rng_state", "parallel_layout", "async_save_queue", "finalize_async_saves", "close_async_saves",
           "wait_for_pruning"]
_WRITER_THREADS = 2  # files written per rank, in parallel
_RANK_STATE_DIR = "rank_state"


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped, or part of the state could not be restored."""


# ------------------------------------------------------------------------------------- save
def save_checkpoint(
    save_dir: str,
    iteration: int,
    model_chunks: Sequence[torch.nn.Module],
    optimizer,
    scheduler,
    cfg,
    extra_state: Dict[str, Any],
    async_queue=None,
) -> str:
    """Save a complete checkpoint of `iteration` into `save_dir/iter_{iteration:07d}`; return its path.

    Collective: every rank calls it. `extra_state` may differ per rank and must hold plain values
    (dict, list, tuple, str, int, float, bool, None, tensors). `latest` names the new step dir only
    once every rank has written, and `cfg.checkpoint.keep_last` older step dirs are kept.

    With `async_queue` (`async_save_queue()`), the tensors are staged and the call returns while they
    are written in the background; the step dir is published by `finalize_async_saves` (the trainer
    calls it every step without waiting, and waits before the next save and at exit). Until then
    `latest` names the previous checkpoint, which a crash in between therefore leaves as the one resumed.
    """
    check_plain(extra_state, "extra_state")
    if async_queue is not None:
        finalize_async_saves(async_queue, blocking=True)  # one save in flight at a time
    wait_for_pruning()  # pruning removes stale `.partial` dirs: not while this save writes one
    rank = dist.get_rank()
    save_path = Path(save_dir)
    staging = save_path / (files.step_dir_name(iteration) + files.PARTIAL_SUFFIX)
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()

    state = model_sharded_state(model_chunks)
    _, state["optimizer"] = optimizer_sharded_state(optimizer, dict(state), is_loading=False)
    state.update(iteration=iteration, optimizer_step=optimizer_step(optimizer), scheduler=scheduler.state_dict(),
                 layout=parallel_layout())
    # Always as a request: a synchronous save runs it here (what megatron's own synchronous path does), after
    # choosing where it stages (`checkpoint.pinned_staging`).
    request = dist_checkpointing.save(
        state, str(staging), sharded_strategy=_save_strategy(), content_metadata=dict(SHARDED_STATE_METADATA),
        async_sharded_save=True,
    )
    if async_queue is None:
        if not cfg.checkpoint.pinned_staging:
            request = pageable_staging(request)
        request.execute_sync()
    _save_rank_state(staging, rank, {"rng": capture_rng_state(), "extra": extra_state})
    if rank == 0:
        save_config(cfg, staging / "config.yaml")
    finish = functools.partial(_publish, save_path, staging, iteration, cfg.checkpoint.keep_last)
    if async_queue is None:
        finish()
    else:
        request.add_finalize_fn(finish)
        async_queue.schedule_async_request(request)
    return str(save_path / files.step_dir_name(iteration))


def _publish(save_path: Path, staging: Path, iteration: int, keep_last: int) -> None:
    """Once every rank's shards are written: each rank makes its own files durable, rank 0 records the
    step dir's sizes and points `latest` at it; old step dirs are deleted in the background."""
    rank = dist.get_rank()
    files.fsync_rank_files(staging, rank)
    dist.barrier()  # every rank's files are on disk
    if rank == 0:
        files.write_completion_record(staging, iteration, {"layout": parallel_layout()})
        files.publish(save_path, staging, iteration)
        _start_pruning(save_path, keep_last, iteration)
    dist.barrier()


_pruning: Optional[threading.Thread] = None


def _start_pruning(save_path: Path, keep_last: int, newest: int) -> None:
    # Deleting older step dirs (many files on a parallel file system) is nobody's critical path.
    global _pruning
    _pruning = threading.Thread(target=files.prune, args=(save_path, keep_last, newest), name="ckpt-prune")
    _pruning.start()


def wait_for_pruning() -> None:
    """Wait for the previous save's deletion of older checkpoints (before the next save, at exit)."""
    global _pruning
    if _pruning is not None:
        _pruning.join()
        _pruning = None


def async_save_queue():
    """The persistent queue asynchronous saves run on (`checkpoint.async_save`): one writer process per
    rank (a thread on CPU hosts, `pretrain.compat`), started at the first save and kept."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    return AsyncCallsQueue(persistent=True)


def finalize_async_saves(async_queue, blocking: bool = False) -> None:
    """Publish the saves whose writes have finished on every rank (all of them with `blocking`).
    Collective: one all-reduce when a save is in flight; nothing otherwise."""
    if async_queue is not None and async_queue.get_num_unfinalized_calls():
        async_queue.maybe_finalize_async_calls(blocking=blocking)


def close_async_saves(async_queue) -> None:
    """Finish the save in flight and stop the writer (at the end of training; collective)."""
    if async_queue is not None:
        finalize_async_saves(async_queue, blocking=True)
        async_queue.close()
    wait_for_pruning()


def _save_strategy():
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=_WRITER_THREADS)
    dp_group = ps.get_data_parallel_group(with_context_parallel=True)
    if dist.get_world_size(dp_group) > 1:
        strategy = FullyParallelSaveStrategyWrapper(strategy, dp_group)
    return strategy


def _save_rank_state(step_dir: Path, rank: int, state: dict) -> None:
    path = step_dir / _RANK_STATE_DIR / f"rank_{rank:05d}.pt"
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # made durable with the rank's other files before the step dir is published


# ------------------------------------------------------------------------------------- load
def load_checkpoint(
    load_dir: str, model_chunks: Sequence[torch.nn.Module], optimizer, scheduler
) -> Optional[Tuple[int, Dict[str, Any]]]:
    """Restore the newest valid checkpoint under `load_dir`; return (iteration, extra_state).

    Collective. Returns None when `load_dir` holds no checkpoint. A step dir whose files are damaged
    (partial, missing or truncated files, an unreadable completion record, metadata or file) is
    skipped with a `CheckpointWarning` and the previous valid one is used; if none is usable, raises
    RuntimeError. Any other failure while loading (a model or optimizer that does not match the
    checkpoint, a bug) raises RuntimeError naming the step dir at once: an older checkpoint would hit
    it too, or silently cost the steps since. `optimizer` and `scheduler` may be None (weights only).
    """
    rank = dist.get_rank()
    found: List[Any] = [None]
    if rank == 0:
        candidates, problems = files.loadable_candidates(load_dir)
        found[0] = ([(c.iteration, str(c.path)) for c in candidates], problems)
    dist.broadcast_object_list(found, src=0)
    candidates, problems = found[0]
    for problem in problems:
        _warn(problem)
    if not candidates:
        if problems:
            raise RuntimeError(f"no usable checkpoint in {load_dir}: " + "; ".join(problems))
        return None

    failures = []
    for iteration, path in candidates:
        loaded, unreadable = _load_all_ranks(path, model_chunks, optimizer)
        if loaded is not None:
            if problems or failures:
                _warn(f"resuming from checkpoint {path} (iteration {iteration})")
            return _apply(loaded, Path(path), model_chunks, optimizer, scheduler)
        failures.append(f"{path}: {unreadable}")
        _warn(f"could not read checkpoint {path} ({unreadable}); falling back to an older one")
    raise RuntimeError(f"no usable checkpoint in {load_dir}: " + "; ".join(problems + failures))


def load_weights_and_optimizer(step_dir: str, model_chunks: Sequence[torch.nn.Module], optimizer) -> None:
    """Model weights and optimizer state (moments, Muon momentum, fp32 main weights, the Adam step) of
    one step dir, without its iteration, scheduler, RNG streams or data position. Collective.

    For a run that continues another run's optimizer from iteration 0 with its own schedule and data
    (`checkpoint.pretrained_optimizer`, e.g. the next stage of a context curriculum). The optimizer
    must hold the same parameters as the one that saved it (the same trainable set).
    """
    loaded, unreadable = _load_all_ranks(step_dir, model_chunks, optimizer)
    if loaded is None:
        raise RuntimeError(f"could not read checkpoint {step_dir}: {unreadable}")
    try:
        _apply_state(loaded, model_chunks, optimizer, None)
    except Exception as exc:
        raise RuntimeError(f"could not apply checkpoint {step_dir}: {type(exc).__name__}: {exc}") from exc
    dist.barrier()


_READ_OK, _READ_UNREADABLE, _READ_FAILED = 0, 1, 2


def _load_all_ranks(path: str, model_chunks, optimizer) -> Tuple[Optional[dict], Optional[str]]:
    """The step dir's state on every rank, or (None, reason) if a file of it was unreadable on any rank.

    Raises RuntimeError naming `path` on every rank if any rank failed for another reason. The ranks
    agree on the outcome first, so none is left waiting in a collective. Nothing of the model is
    modified here, so an unreadable file can fall back to an older checkpoint.
    """
    loaded, unreadable, error = None, None, None
    try:
        loaded = _read_state(Path(path), model_chunks, optimizer)
    except files.UnreadableFile as exc:
        unreadable = str(exc)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - raised below, once every rank knows
        error = exc
    outcome = _READ_FAILED if error is not None else _READ_UNREADABLE if unreadable else _READ_OK
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    worst = torch.tensor([outcome], dtype=torch.int32, device=device)  # NCCL: on the GPU
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if worst.item() == _READ_FAILED:
        what = _describe(error) if error is not None else "it failed on another rank"
        raise RuntimeError(
            f"could not load checkpoint {path}: {what}. Its files are all there at their recorded sizes, so this "
            "is most likely no damage on disk but a model, optimizer or layout that does not fit the checkpoint, "
            f"or a bug; no older checkpoint was tried (move {path} aside to resume from an older one)"
        ) from error
    if worst.item() == _READ_UNREADABLE:
        return None, unreadable or "a file is unreadable on another rank"
    return loaded, None


def _describe(error: BaseException) -> str:
    """One line for an error; torch's CheckpointException (a traceback per rank) by its first cause."""
    if isinstance(error, CheckpointException) and error.failures:
        failure = next(iter(error.failures.values()))
        error = failure[0] if isinstance(failure, tuple) else failure
    return f"{type(error).__name__}: {error}".strip()


def _read_state(step_dir: Path, model_chunks, optimizer) -> dict:
    """The common state (iteration, scheduler, ...) with the requested shards, under "optimizer" the
    current optimizer's state dict filled with the loaded tensors, and under "rank_state" this rank's
    RNG and extra state (rank 0's if the layout changed). `files.reading` marks which calls read a file.
    """
    path = str(step_dir)
    with files.reading(step_dir / COMMON_STATE_FNAME):
        common = dist_checkpointing.load_common_state_dict(path)
    metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or dict(SHARDED_STATE_METADATA)
    request = model_sharded_state(model_chunks, metadata)
    saved_step = common["optimizer_step"]
    # A checkpoint from before the first step (e.g. initial weights) has no optimizer state:
    # a fresh optimizer is exactly its state.
    with_optimizer = optimizer is not None and saved_step["step"] > 0
    if with_optimizer:
        prime_optimizer_state(optimizer, saved_step)
        template, request["optimizer"] = optimizer_sharded_state(optimizer, dict(request), True, metadata)
    with files.reading(step_dir):  # the shards: only an OS error among the causes counts as damage
        loaded = dist_checkpointing.load(request, path)
    if with_optimizer:
        loaded["optimizer"] = fill_optimizer_state(template, loaded["optimizer"])
    same_layout = loaded.get("layout") == parallel_layout()
    rank_file = step_dir / _RANK_STATE_DIR / f"rank_{dist.get_rank() if same_layout else 0:05d}.pt"
    with files.reading(rank_file):
        loaded["rank_state"] = torch.load(rank_file, weights_only=True)
    return loaded


def _apply(loaded: dict, step_dir: Path, model_chunks, optimizer, scheduler) -> Tuple[int, Dict[str, Any]]:
    try:
        _apply_state(loaded, model_chunks, optimizer, scheduler)
    except Exception as exc:
        raise RuntimeError(f"could not apply checkpoint {step_dir}: {type(exc).__name__}: {exc}") from exc
    saved_layout, layout = loaded.get("layout"), parallel_layout()
    if saved_layout == layout:
        restore_rng_state(loaded["rank_state"]["rng"])
    else:
        _warn(
            f"checkpoint {step_dir} was saved with parallel layout {saved_layout}, this run uses {layout}: "
            "weights, optimizer and scheduler were resharded; RNG states were not restored (dropout and other "
            "random streams restart from their seeds) and rank 0's extra state is used on every rank"
        )
    dist.barrier()
    return int(loaded["iteration"]), loaded["rank_state"]["extra"]


def _apply_state(loaded: dict, model_chunks, optimizer, scheduler) -> None:
    for key, chunk in zip(model_keys(model_chunks), unwrap_model(list(model_chunks))):
        chunk.load_state_dict(loaded[key], strict=True)
    if optimizer is not None and loaded["optimizer_step"]["step"] > 0:  # else: saved before any step
        optimizer.load_state_dict(loaded["optimizer"])
        set_optimizer_step(optimizer, loaded["optimizer_step"])
    elif optimizer is not None:
        optimizer.reload_model_params()  # fp32 main copies (bf16 training) follow the loaded weights
    if scheduler is not None and loaded.get("scheduler") is not None:
        scheduler.load_state_dict(loaded["scheduler"])


def _warn(message: str) -> None:
    if dist.get_rank() == 0:
        warnings.warn(message, CheckpointWarning, stacklevel=3)
