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

A synchronous save stages on the trainer's side: `AsyncRequest.execute_sync` calls the request's staging,
`FileSystemWriterAsync.preload_tensors(buckets, non_blocking=True)`, in the trainer process. Its copies are
`tensor.to("cpu", non_blocking=True)`, whose destination PyTorch takes from its caching host allocator: pinned
memory, each block rounded up to a power of two, kept for reuse once freed. The trainer keeps about 1.3x its
checkpoint state in pinned host memory for the rest of the run (glm5-proxy on one H200: host RSS 2.2 -> 30.0 GiB at
the first save, for 21.6 GiB of state), and later saves stage fast (0.4 s instead of 15.5 s for the first). There is
no way to pass megatron a staging choice, so `pageable_staging` rewrites a request's staging function to
`non_blocking=False` (ordinary host memory, freed when the save returns; 15 s per 21.6 GiB at every save) for
`checkpoint.pinned_staging=false`. Returning the pinned cache after each save instead costs as much time (pinning again
every save) and more memory during it (the measurements: docs/training.md, "Host memory of a save").

Asynchronous saves (`checkpoint.async_save`) go through megatron's `AsyncCallsQueue(persistent=True)`,
whose `PersistentAsyncCaller` runs each save's writer in one spawned worker process:

* The worker is a fresh interpreter: none of the patches above exist there, so without psutil it
  hangs as described. `patch_async_worker` wraps each request's writer in `run_in_async_worker`,
  which applies them in the worker first (pickled by name, so unpickling imports this module).
* The device tensors a request stages stay referenced until its write is finalized: by the worker's
  request (CUDA IPC handles, kept until the write ends) and by the trainer's (in the queue of active
  requests). Most are views of live parameters and optimizer state, but the state's factories make
  copies, which then occupy GPU memory for the whole write: megatron's `GroupedMLP` saves every
  routed expert transposed (weights, fp32 main weights, optimizer moments; 16.9 GiB per H200 on
  glm5-proxy). `patch_async_worker` also drops both references as soon as the worker has staged
  the tensors to host memory (`stage_and_release`, then the trainer after its wait for staging), so
  the copies are freed before training resumes, as after a synchronous save. The buckets keep their
  number (megatron's `retrieve_write_results` checks it); only their device tensors go.
* CPU only, the caller cannot work at all: the worker starts with
  `torch.cuda.set_device(rank % torch.cuda.device_count())` (a division by zero without a GPU), the
  CPU writer above is a closure and its results queue a `queue.Queue` (neither pickles), and the
  tensors handed to the writer are the live parameters (`preload_tensors` copies GPU tensors to the
  host; CPU tensors it passes through, and the optimizer would rewrite them mid-write). On CPU the
  persistent caller is `ThreadAsyncCaller`: the same contract, one writer thread in the trainer
  process, and the staged tensors are copies taken before the call returns.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from pretrain.compat.registry import Workaround
from pretrain.notices import say_once

log = logging.getLogger(__name__)

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


def run_in_async_worker(save_fn, *args, **kwargs):
    """A save request's writer, run in megatron's spawned checkpoint worker with our patches applied."""
    patch_dist_checkpoint_writer()
    return save_fn(*args, **kwargs)


def staged_buckets(preload_fn):
    """The write buckets (file name, storage key, (bytes items, [(item, tensor)])) that megatron's
    `FileSystemWriterAsync.preload_tensors` stages, or None when `preload_fn` is not that function."""
    args = getattr(preload_fn, "args", ())
    if isinstance(preload_fn, functools.partial) and args and isinstance(args[0], list):
        return args[0]
    return None


def release_staged(buckets) -> None:
    """Drop `buckets`' references to their tensors, in place: every holder of the list lets go of them.
    Each bucket stays, with no tensors (megatron counts the buckets when it collects the write results)."""
    for index, (file_name, storage_key, (bytes_data, _)) in enumerate(buckets):
        buckets[index] = (file_name, storage_key, (bytes_data, []))


def stage_and_release(preload_fn):
    """The worker's staging: megatron's `preload_fn` copies the tensors to host memory (and synchronizes),
    then the worker's references to the device tensors are dropped, before it tells the trainer staging
    is done. The write that follows uses the host copies only."""
    staged = preload_fn()
    release_staged(staged_buckets(preload_fn))
    return staged


def worker_schedule(original):
    """`original` (a persistent caller's `schedule_async_call`) with each request's writer run through
    `run_in_async_worker` and its device tensors let go of once staged, in the worker and in the trainer."""

    def schedule_async_call(self, async_req):
        buckets = None
        if async_req.async_fn is not None:
            buckets = staged_buckets(async_req.preload_fn)
            if buckets is None and async_req.preload_fn is not None:
                say_once(log, "asynchronous checkpoint save: the request's staging function is not megatron-core "
                         "0.16.1's partial(preload_tensors, buckets, ...); the GPU tensors it stages stay allocated "
                         "until the write is finalized", level=logging.WARNING)
            async_req = async_req._replace(
                async_fn=functools.partial(run_in_async_worker, async_req.async_fn),
                preload_fn=(async_req.preload_fn if buckets is None
                            else functools.partial(stage_and_release, async_req.preload_fn)))
        original(self, async_req)  # returns once the worker has staged the tensors (megatron's preload queue)
        if buckets is not None:
            release_staged(buckets)  # the trainer's request, writer and staging function share this list
            if torch.cuda.is_available():
                torch.cuda.ipc_collect()  # frees any block the worker let go of after the trainer did

    schedule_async_call._glm5_patched = True
    return schedule_async_call


def patch_async_worker() -> None:
    """GPU hosts: megatron's persistent caller schedules through `worker_schedule`."""
    from megatron.core.dist_checkpointing.strategies import async_utils

    caller = async_utils.PersistentAsyncCaller
    if not getattr(caller.schedule_async_call, "_glm5_patched", False):
        caller.schedule_async_call = worker_schedule(caller.schedule_async_call)


def _snapshot(buckets):
    # preload_tensors' bucket layout: (file name, storage key, (bytes items, [(item, tensor)])).
    return [(name, key, (data, [(item, t.detach().clone()) for item, t in tensors]))
            for name, key, (data, tensors) in buckets]


def thread_async_caller_class():
    """`ThreadAsyncCaller`: megatron's persistent async caller as one writer thread (CPU hosts)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCaller

    class ThreadAsyncCaller(AsyncCaller):
        def __init__(self):
            self.thread = None
            self.requests: queue.Queue = queue.Queue()
            self.done: queue.Queue = queue.Queue()
            self.finished = True  # the current request has been written (or there is none)

        def schedule_async_call(self, async_req) -> None:
            if async_req.async_fn is None:
                return
            args = list(async_req.async_fn_args)
            if async_req.preload_fn:  # staged now, in the trainer thread: training may change the weights next
                args[1] = _snapshot(async_req.preload_fn())
            if self.thread is None:
                self.thread = threading.Thread(target=self._loop, name="ckpt-async", daemon=True)
                self.thread.start()
            self.finished = False
            self.requests.put((async_req, args))

        def _loop(self) -> None:
            while True:
                item = self.requests.get()
                if item is None:
                    return
                async_req, args = item
                try:
                    async_req.async_fn(*args, **async_req.async_fn_kwargs)
                except BaseException as exc:  # noqa: BLE001 - reported by the finalization (empty results)
                    self.done.put(exc)
                    continue
                self.done.put(None)

        def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
            if not self.finished:
                try:
                    self.done.get(block=blocking)
                    self.finished = True
                except queue.Empty:
                    pass
            is_alive = not self.finished
            return (not is_alive) if no_dist else bool(self.sync_all_async_calls(int(is_alive)))

        def close(self, abort: bool = False) -> None:
            if self.thread is not None:
                self.requests.put(None)
                if not abort:
                    self.thread.join()
                self.thread = None

        def __del__(self):
            pass

    return ThreadAsyncCaller


def pageable_staging(request):
    """`request` (a save's `AsyncRequest`) staged to ordinary host memory instead of PyTorch's pinned host cache:
    megatron's `partial(preload_tensors, buckets, True)` becomes `partial(preload_tensors, buckets, False)`. For a
    synchronous save (`execute_sync`), whose copies are freed when it returns. Any other staging function is left
    as it is, and said once."""
    buckets = staged_buckets(request.preload_fn)
    if buckets is None:
        if request.preload_fn is not None:
            say_once(log, "checkpoint.pinned_staging=false: the save request's staging function is not megatron-core "
                     "0.16.1's partial(preload_tensors, buckets, ...); it stages as it chooses, pinned memory included",
                     level=logging.WARNING)
        return request
    return request._replace(preload_fn=functools.partial(request.preload_fn.func, buckets, False))


def use_thread_async_caller() -> None:
    """CPU hosts: `AsyncCallsQueue(persistent=True)` gets a `ThreadAsyncCaller`."""
    from megatron.core.dist_checkpointing.strategies import async_utils

    if getattr(async_utils.PersistentAsyncCaller, "_glm5_thread_caller", False):
        return
    caller = thread_async_caller_class()
    caller._glm5_thread_caller = True
    async_utils.PersistentAsyncCaller = caller


WORKAROUNDS = [
    Workaround(
        name="patch_dist_checkpoint_writer",
        target="megatron.core.dist_checkpointing.strategies.filesystem_async (FileSystemWriterAsync)",
        reason="every torch_dist save hangs without psutil; on CPU the forked writers leave a spawn server behind",
        upstream="open",
        test="tests/test_dsa_training_hf_start.py::test_hf_to_checkpoint_cli_finishes_without_psutil",
        install=patch_dist_checkpoint_writer,
    ),
    Workaround(
        name="patch_async_worker",
        target="megatron.core.dist_checkpointing.strategies.async_utils.PersistentAsyncCaller.schedule_async_call",
        reason="the spawned checkpoint worker runs megatron's writer without our patches (hangs without psutil), and "
               "the worker and the trainer hold the staged GPU tensors (the experts' checkpoint copies) until the "
               "write is finalized",
        upstream="open",
        test="tests/test_checkpoint_async.py::test_async_worker_applies_the_writer_patch",
        install=patch_async_worker,
    ),
    Workaround(
        name="pageable_staging",
        target="megatron.core.dist_checkpointing.strategies.filesystem_async.FileSystemWriterAsync.preload_tensors "
               "(the save request's staging function)",
        reason="megatron stages every save with non_blocking=True (pinned memory PyTorch keeps: 1.3x the checkpoint "
               "state in host RAM) and takes no choice; checkpoint.pinned_staging=false stages in pageable memory",
        upstream="open",
        test="tests/test_checkpoint_async.py::test_sync_save_keeps_pinned_staging_unless_told_not_to",
    ),
    Workaround(
        name="use_thread_async_caller",
        target="megatron.core.dist_checkpointing.strategies.async_utils.PersistentAsyncCaller",
        reason="on CPU the persistent caller divides by torch.cuda.device_count(), cannot pickle the CPU writer, "
               "and would write live parameters",
        upstream="open",
        test="tests/test_checkpoint_async.py::test_crash_during_async_save_resumes_the_previous_checkpoint",
        install=use_thread_async_caller,
        when="cpu",
    ),
]
