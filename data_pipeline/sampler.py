"""The data position: which samples each data-parallel rank reads, and an exact resume.

Megatron-LM's `MegatronPretrainingSampler` semantics. The dataset's sample order is fixed (see
`datasets.py`); `consumed_samples` counts samples read by all data-parallel ranks together. Each
micro-batch step takes the next `micro_batch_size * dp_size` samples and rank r reads the slice
`[r * micro_batch_size, (r + 1) * micro_batch_size)` of them:

    step t, rank r:  samples  c + t * m * D + r * m  ...  c + t * m * D + (r + 1) * m - 1

(c = consumed_samples at start, m = micro_batch_size, D = dp_size). A resumed iterator started at
the saved `consumed_samples` therefore reads exactly what an uninterrupted one would have read
next, for any data-parallel size, since the position is global. `dp_rank` / `dp_size` are the
data-parallel rank and size (megatron's `parallel_state.get_data_parallel_rank()`), so the
tensor-, pipeline- and context-parallel ranks of one replica read the same samples.

Loading runs in `data.num_workers` worker processes (torch's DataLoader: each worker reads, packs
and masks whole micro-batches, `prefetch_factor` of them ahead, into pinned memory on a GPU host); the
batches come back in sampler order whatever the workers' timing, and the position counts only batches
handed out, so a resume reads the same samples with any number of workers. `wait_seconds` is the time
the trainer spent blocked on the next batch (the `data_wait_s` metric, `data_wait_metrics`).

`state_dict()` stores the position with a fingerprint of the dataset (blend names and weights,
long-document filters, documents and tokens per source, split, seed, seq_length, sample count).
`load_state_dict()` refuses a checkpoint whose fingerprint differs, naming what changed: the
same `consumed_samples` in different data is a different sample.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.util  # noqa: F401  (its exit hook is registered before ours, so ours runs first)
import os
import signal
import time
import weakref
from typing import Any, Dict, Iterator, List, Optional

import numpy
import torch
from megatron.core.datasets.blended_dataset import BlendedDataset

from data_pipeline.long_context import split_min_document_length
from data_pipeline.packing import collate_batch


class DataPositionError(ValueError):
    """A saved data position that does not belong to this dataset."""


class PretrainingSampler:
    """Batch sampler: this rank's indices of every micro-batch step from `consumed_samples` on.

    An incomplete last step (fewer than micro_batch_size * dp_size samples left) is dropped, so all
    ranks always take the same number of steps.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        if micro_batch_size <= 0 or dp_size <= 0 or not 0 <= dp_rank < dp_size:
            raise ValueError(
                f"need micro_batch_size > 0 and 0 <= dp_rank < dp_size; got micro_batch_size={micro_batch_size}, "
                f"dp_rank={dp_rank}, dp_size={dp_size}"
            )
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __len__(self) -> int:
        return max(0, self.total_samples - self.consumed_samples) // (self.micro_batch_size * self.dp_size)

    def __iter__(self) -> Iterator[List[int]]:
        step = self.micro_batch_size * self.dp_size
        first = self.consumed_samples + self.dp_rank * self.micro_batch_size
        for start in range(first, first + len(self) * step, step):
            yield list(range(start, start + self.micro_batch_size))


class DataIterator:
    """Micro-batches (dicts of tensors, `packing.collate_batch`) for one data-parallel rank, resumable.

    `consumed_samples` advances by micro_batch_size * dp_size per batch handed out (not per batch a
    loader worker has prefetched), so `state_dict()` is exact at any point. With `num_workers` > 0,
    that many worker processes each prepare `prefetch_factor` batches ahead.
    """

    def __init__(
        self,
        dataset,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        consumed_samples: int = 0,
        num_workers: int = 0,
        prefetch_factor: int = 2,
    ):
        if num_workers < 0 or prefetch_factor < 1:
            raise ValueError(f"need num_workers >= 0 and prefetch_factor >= 1; got num_workers={num_workers}, "
                             f"prefetch_factor={prefetch_factor}")
        self.dataset = dataset
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.wait_seconds = 0.0  # blocked in __next__ since the last `take_wait_seconds`
        self.consumed_samples = consumed_samples
        self.fingerprint = dataset_fingerprint(dataset)
        self._batches: Optional[Iterator] = None
        PretrainingSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)  # check arguments

    def __iter__(self) -> "DataIterator":
        return self

    def __next__(self) -> Dict[str, torch.Tensor]:
        if self._batches is None:
            self._start_loader()
        start = time.perf_counter()
        try:
            batch = next(self._batches)
        finally:
            self.wait_seconds += time.perf_counter() - start
        self.consumed_samples += self.micro_batch_size * self.dp_size
        return batch

    def _start_loader(self) -> None:
        """Start the loader (its worker processes, if any) at `consumed_samples`."""
        sampler = PretrainingSampler(
            len(self.dataset), self.consumed_samples, self.micro_batch_size, self.dp_rank, self.dp_size
        )
        loader = torch.utils.data.DataLoader(
            self.dataset,
            batch_sampler=sampler,
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor if self.num_workers else None,
            collate_fn=collate_batch,
            worker_init_fn=ignore_stop_signals if self.num_workers else None,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=False,
            # The loader draws its base seed from this generator, not the global RNG, so starting
            # an iterator (e.g. after a resume) leaves the training RNG stream untouched.
            generator=torch.Generator().manual_seed(0),
        )
        with stop_signals_held():  # the workers fork here: they start with the stop signals held
            self._batches = iter(loader)
        if self.num_workers:
            _OPEN_LOADERS.add(self._batches)

    def close(self) -> None:
        """Stop the loader's worker processes, if any (a later `next` starts new ones at the same position)."""
        batches, self._batches = self._batches, None
        shutdown = getattr(batches, "_shutdown_workers", None)  # torch's multi-process iterator
        if shutdown is not None:
            shutdown()

    def take_wait_seconds(self) -> float:
        """Seconds blocked waiting for batches since the last call (starting the loader included)."""
        waited, self.wait_seconds = self.wait_seconds, 0.0
        return waited

    def __len__(self) -> int:
        """Micro-batches left."""
        return len(PretrainingSampler(len(self.dataset), self.consumed_samples, self.micro_batch_size,
                                      self.dp_rank, self.dp_size))

    def state_dict(self) -> Dict[str, Any]:
        return {"consumed_samples": self.consumed_samples, "fingerprint": self.fingerprint}

    def load_state_dict(self, state: Dict[str, Any], strict: bool = True) -> None:
        """Continue from `state`. A position saved for other data raises DataPositionError, unless strict=False."""
        changes = fingerprint_changes(state["fingerprint"], self.fingerprint)
        if changes and strict:
            raise DataPositionError(
                "refusing to resume the data position: the checkpoint was saved for different data ("
                + "; ".join(changes)
                + "). The same consumed_samples would now be a different sample. Restore the data config "
                "the run started with, or, to accept a different sample order (e.g. after changing "
                "train.train_iters), load with strict=False."
            )
        self.consumed_samples = int(state["consumed_samples"])
        self.close()  # drops prefetched batches of the old position


# Every worker-backed loader iterator not yet collected. The workers ignore SIGTERM (ignore_stop_signals), and at
# interpreter exit multiprocessing stops daemonic children with SIGTERM and then joins them: one loader left
# open at exit (its DataIterator alive, or dropped but not yet collected) would hang the process forever. This
# hook, registered after multiprocessing's (atexit is last-in first-out), runs first and stops them through the
# loader's own shutdown.
_OPEN_LOADERS: "weakref.WeakSet" = weakref.WeakSet()


def _close_open_loaders() -> None:
    for batches in list(_OPEN_LOADERS):
        batches._shutdown_workers()  # torch's own shutdown of a multi-process loader iterator (what its __del__ runs)


atexit.register(_close_open_loaders)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@contextlib.contextmanager
def stop_signals_held():
    """Hold (block) SIGTERM and SIGUSR1 in this thread while loader workers fork. A worker inherits the block, so a
    preemption signal that reaches it before `ignore_stop_signals` runs waits instead of killing it (it is discarded
    once ignored); this process receives any that arrived once the block is lifted, so none is lost."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def ignore_stop_signals(_worker_id: int) -> None:
    """A loader worker ignores SIGTERM and SIGUSR1: Slurm signals every process of a job step on preemption,
    and the trainer must still read batches until it has checkpointed. They stop through the loader's shutdown
    (`DataIterator.close`, also run at interpreter exit), never by SIGTERM. The worker started with both held
    (`stop_signals_held`); it lifts the hold once they are ignored."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def data_wait_metrics(iterators, step_time_s: float) -> Dict[str, float]:
    """The step's data wait: `data_wait_s`, the seconds the trainer was blocked on the next micro-batch
    (all of `iterators`, e.g. one per virtual-pipeline chunk), and `data_wait_frac`, its share of the step."""
    waited = sum(it.take_wait_seconds() for it in iterators if it is not None)
    return {"data_wait_s": waited, "data_wait_frac": waited / step_time_s if step_time_s > 0 else 0.0}


# ---------------------------------------------------------------------------------------------
# fingerprint
# ---------------------------------------------------------------------------------------------


def dataset_fingerprint(dataset) -> Dict[str, Any]:
    """What decides the sample at each index: sources, weights, filters, split, seed, length, count.

    Sources are named by file name, not full path, so moving the data keeps the fingerprint; their
    document and token counts catch a regenerated dataset under the same name.
    """
    parts = dataset.datasets if isinstance(dataset, BlendedDataset) else [dataset]
    weights = [float(w) for w in dataset.weights] if isinstance(dataset, BlendedDataset) else [1.0]
    config = parts[0].config
    sources = []
    for part, weight in zip(parts, weights):
        prefix, min_length = split_min_document_length(part.dataset_path or "")
        lengths = numpy.asarray(part.dataset.sequence_lengths)
        sources.append(
            {
                "name": os.path.basename(prefix) if prefix else "mock",
                "weight": round(weight, 12),
                "min_document_length": min_length,
                "documents": int(len(part.indices)),
                "tokens": int(lengths[part.indices].sum(dtype=numpy.int64)),
            }
        )
    return {
        "split": parts[0].index_split.name,
        "split_weights": config.split,
        "seed": int(config.random_seed),
        "seq_length": int(config.sequence_length),
        "num_samples": int(len(dataset)),
        "eod": int(config.tokenizer.eod),
        "sources": sources,
    }


def fingerprint_changes(saved: Dict[str, Any], current: Dict[str, Any]) -> List[str]:
    """Human-readable differences, e.g. "seq_length: 4096 in the checkpoint, 8192 now"."""
    changes = []
    for key in sorted(set(saved) | set(current)):
        if key == "sources":
            continue
        if saved.get(key) != current.get(key):
            changes.append(f"{key}: {saved.get(key)!r} in the checkpoint, {current.get(key)!r} now")
    old, new = saved.get("sources", []), current.get("sources", [])
    if len(old) != len(new):
        names = lambda sources: [s["name"] for s in sources]  # noqa: E731
        changes.append(f"sources: {names(old)} in the checkpoint, {names(new)} now")
    else:
        for i, (a, b) in enumerate(zip(old, new)):
            for key in sorted(set(a) | set(b)):
                if a.get(key) != b.get(key):
                    changes.append(f"sources[{i}].{key}: {a.get(key)!r} in the checkpoint, {b.get(key)!r} now")
    return changes
