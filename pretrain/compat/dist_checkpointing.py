"""megatron-core 0.16.1's torch_dist checkpoint writer (part of `pretrain.compat`).

Two problems of `dist_checkpointing/strategies/filesystem_async.py`, whose `FileSystemWriterAsync`
writes every torch_dist checkpoint (a synchronous save runs the same code via `execute_sync`):

* The hang. `write_preloaded_data`, the worker that writes one file, calls `_process_memory()`
  (for a debug log line) *outside* its try block, and that raises without psutil. The worker
  dies before it signals its `JoinableQueue`, so the parent waits in `count_queue.join()`
  forever: every save hangs when psutil is not installed. The number is only logged: 0 is exact
  enough. Applied everywhere (GPU hosts without psutil hang the same way).
* CPU only: the writer forks one process per output file and collects results through a
  `multiprocessing.Manager` queue started with the "spawn" method, which re-imports `__main__`
  (a script without an `if __name__ == "__main__"` guard re-runs itself) and leaves a server
  process behind, orphaned if the trainer is SIGKILLed. On CPU the tensors are already in host
  memory and nothing overlaps with training, so the same per-file writer runs in threads of
  this process and results go through a plain `queue.Queue`: same files, same format, no child
  processes. GPU hosts keep megatron's forked writers (writes proceed without the GIL).
"""

from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor

import torch

from pretrain.compat.registry import Workaround

_CKPT_WRITER_PATCHED = False


def patch_dist_checkpoint_writer() -> None:
    """Make `dist_checkpointing.save` (torch_dist format) finish, on every host, and on CPU in-process."""
    global _CKPT_WRITER_PATCHED
    if _CKPT_WRITER_PATCHED:
        return
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa

    if not fsa.HAVE_PSUTIL:
        fsa._process_memory = lambda: 0
    if not torch.cuda.is_available():
        fsa.FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(_threaded_writer(fsa))
        fsa._get_write_results_queue = queue.Queue
    _CKPT_WRITER_PATCHED = True


def _threaded_writer(fsa):
    writer_cls = fsa.FileSystemWriterAsync

    def write_buckets_in_threads(transform_list, use_msc, rank, write_buckets, global_results_queue):
        # Same contract as `write_preloaded_data_multiproc`: put {file index: [WriteResult]} or
        # the first worker's exception into `global_results_queue`.
        results_queue, count_queue = queue.Queue(), queue.Queue()
        kwargs = {"use_msc": use_msc} if use_msc else {}
        with ThreadPoolExecutor(max_workers=max(1, len(write_buckets)), thread_name_prefix="ckpt-write") as pool:
            for index in range(len(write_buckets)):
                count_queue.put(index)  # each worker pops one entry and calls task_done()
            futures = [
                pool.submit(writer_cls.write_preloaded_data, transform_list, index, bucket, results_queue,
                            count_queue, True, **kwargs)
                for index, bucket in enumerate(write_buckets)
            ]
        failed = [f.exception() for f in futures if f.exception() is not None]
        if failed:  # raised outside the worker's own try block
            global_results_queue.put(failed[0])
            return
        results: dict | Exception = {}
        for _ in write_buckets:
            index, value = results_queue.get_nowait()
            if isinstance(value, Exception):
                results = value
                break
            results[index] = value
        global_results_queue.put(results)

    return write_buckets_in_threads


WORKAROUNDS = [
    Workaround(
        name="patch_dist_checkpoint_writer",
        target="megatron.core.dist_checkpointing.strategies.filesystem_async (FileSystemWriterAsync)",
        reason="every torch_dist save hangs without psutil; on CPU the forked writers leave a spawn server behind",
        upstream="open",
        test="tests/test_dsa_training_hf_start.py::test_hf_to_checkpoint_cli_finishes_without_psutil",
        install=patch_dist_checkpoint_writer,
    ),
]
