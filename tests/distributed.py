"""Run a function on N local ranks (gloo on CPU) from a test: the project's one rank-spawning helper.

    from tests.distributed import run_ranks

    def _body(rank, world_size, batch):           # module level, so a spawned process can import it
        initialize_parallel(ParallelConfig(tensor_model_parallel_size=2), seed=0)
        ...
        return {"loss": loss, "grads": grads}     # tensors / dicts / lists / numbers

    results = run_ranks(_body, 2, batch)          # [result of rank 0, result of rank 1]

Each rank is a fresh process that no earlier call has touched, so no torch.distributed or megatron
parallel state ever exists in the pytest process, and no state leaks from one call to the next. Without
CUDA it is a fork of a clean server process (multiprocessing's "forkserver") that imported torch,
megatron-core and the project once and did nothing else: forking it instead of spawning an interpreter
per rank saves the ~5 s of CPU each rank would spend importing (most of the multi-rank tests' time on a
2-core machine). On a CUDA host every rank is a spawned interpreter (`rank_start_method`): a process
forked after CUDA was touched (torch's device query in `torch.cuda.is_available()` is enough) cannot use
CUDA ("Cannot re-initialize CUDA in forked subprocess"), and GPU tests share the pytest process with
in-process GPU tests, so nothing forked may be trusted to be clean there. A rank gets the caller's current environment and working directory, as a spawned
process would; `TORCH_COMPILE_DISABLE`, which torch reads at import, is applied to torch's config
explicitly. The environment of a torchrun launch is set before `fn` runs: MASTER_ADDR=127.0.0.1, a
free MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK (and LOCAL_WORLD_SIZE), so
`parallel.initialize.initialize_parallel` works unchanged, and `pretrain.compat.install()` has run
(as in every entry point). Arguments go to the ranks, and return values (moved to CPU, tensors
detached) come back, through `torch.save` files in a temporary directory.

Failures: an exception in any rank fails the caller with that rank's traceback (the other ranks,
possibly blocked in a collective, are killed at once); a rank that dies without reporting (segfault,
`os._exit`) fails with its exit code; ranks still running after `timeout` seconds are killed and a
`TimeoutError` names them. A process group left initialized by `fn` is destroyed after it returns.
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.multiprocessing as mp

__all__ = ["EAGER_ENV", "RankError", "free_port", "rank_start_method", "run_command_lines", "run_ranks",
           "run_ranks_eager", "to_cpu"]

# A rank environment with megatron's jit_fuser functions (the experts' SwiGLU-with-probs, the expert-bias update)
# eager: the same math without ~3-4 s of torch.compile per spawned process. For comparisons whose sides all run in
# ranks (the same code either way); the compiled path is covered by the launch, golden and loss-falls tests.
EAGER_ENV = {"TORCH_COMPILE_DISABLE": "1"}

_POLL_S = 0.05
_GRACE_S = 5.0  # after one rank fails, how long the others get to report before they are killed
# What the fork server imports once, before it forks any rank: what every rank imports anyway.
_PRELOAD = ["torch", "torch.distributed", "megatron.core", "pretrain.compat", "parallel.initialize",
            "pretrain.model.builder", "pretrain.training.loop", "tests.distributed"]


class RankError(RuntimeError):
    """One or more ranks raised or died; the message holds their tracebacks."""


def free_port() -> int:
    """A TCP port that is free now (the OS picks it)."""
    from pretrain.ablate.runner import free_local_port

    return free_local_port()


def to_cpu(value: Any) -> Any:
    """Tensors detached and on CPU, recursively through dicts, lists, tuples (other values as is)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return type(value)((k, to_cpu(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(to_cpu(v) for v in value)
    return value


def rank_start_method() -> str:
    """How ranks start: "spawn" on a CUDA host (a fork of a process that touched CUDA cannot use it),
    else "forkserver" (see the module docstring)."""
    return "spawn" if torch.cuda.is_available() else "forkserver"


def _check_importable(fn: Callable) -> None:
    qualname = getattr(fn, "__qualname__", "")
    module = getattr(fn, "__module__", None)
    if not module or "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(
            f"run_ranks needs a module-level function (a spawned process imports it by name); got {fn!r}"
        )
    target = sys.modules.get(module)
    for part in qualname.split("."):
        target = getattr(target, part, None)
    if target is not fn:
        raise TypeError(f"run_ranks: {module}.{qualname} does not resolve to {fn!r}; define it at module level")


def _worker(
    module: str,
    qualname: str,
    rank: int,
    world_size: int,
    port: int,
    result_dir: str,
    threads: Optional[int],
    env: Dict[str, str],
    cwd: str,
) -> None:
    out = Path(result_dir) / f"rank{rank}.pt"
    os.environ.clear()  # the caller's environment now, not the fork server's from when it started
    os.environ.update(env)
    os.chdir(cwd)
    # torch read this variable when the fork server imported it; what the caller asked for wins
    import torch._dynamo

    torch._dynamo.config.disable = os.environ.get("TORCH_COMPILE_DISABLE", "0") == "1"
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    if threads:
        torch.set_num_threads(threads)
    try:
        from pretrain.compat import install

        install()  # a rank is an entry point: a fresh process starts without the patches
        # The arguments come through a file, not the process's pickle: tensors pickled for a child are
        # shared through file descriptors, and a fork server takes at most ~250 per child.
        args = torch.load(Path(result_dir) / "args.pt", weights_only=False)
        fn: Any = importlib.import_module(module)
        for part in qualname.split("."):
            fn = getattr(fn, part)
        result = to_cpu(fn(rank, world_size, *args))
        torch.save({"ok": True, "result": result}, out)
    except BaseException:  # noqa: BLE001 - everything, including SystemExit / KeyboardInterrupt, is reported
        torch.save({"ok": False, "traceback": traceback.format_exc(), "time": time.time()}, out)
        os._exit(1)  # skip interpreter teardown, which could block in a half-finished collective
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - teardown only
                pass


def _read(path: Path) -> Optional[dict]:
    try:
        return torch.load(path, weights_only=False)
    except Exception:  # noqa: BLE001 - missing or half-written file
        return None


def _kill(procs: List[mp.Process]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 240,
    threads_per_rank: Optional[int] = None,
    env: Optional[Dict[str, str]] = None,
) -> List[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned ranks; return their results by rank.

    `fn` must be a module-level function; `args` must be picklable. `threads_per_rank` sets
    torch's intra-op threads in each rank (default: the machine's cores shared evenly, at least 1,
    so N ranks on a small CPU do not oversubscribe it). `env` adds environment variables in the ranks.
    Raises `RankError` (with the failing ranks' tracebacks) or `TimeoutError` (naming the hung ranks).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    _check_importable(fn)
    if threads_per_rank is None:
        threads_per_rank = max(1, (os.cpu_count() or 1) // world_size)
    method = rank_start_method()
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts (the first call)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="run_ranks_") as tmp:
        torch.save(args, Path(tmp) / "args.pt")
        procs = [
            ctx.Process(
                target=_worker,
                args=(fn.__module__, fn.__qualname__, rank, world_size, port, tmp, threads_per_rank,
                      {**os.environ, **(env or {})}, os.getcwd()),
                name=f"rank{rank}",
                daemon=False,  # a rank may start its own workers (DataLoader); `_kill` reaps the ranks
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        paths = [Path(tmp) / f"rank{rank}.pt" for rank in range(world_size)]
        deadline = time.monotonic() + timeout
        failed_at: Optional[float] = None
        try:
            while True:
                alive = [p.is_alive() for p in procs]
                failed = [r for r, p in enumerate(procs) if not alive[r] and p.exitcode != 0]
                if failed and failed_at is None:
                    failed_at = time.monotonic()
                if not any(alive):
                    break
                if failed_at is not None and time.monotonic() - failed_at > _GRACE_S:
                    break
                if time.monotonic() > deadline:
                    hung = [r for r, a in enumerate(alive) if a]
                    _kill(procs)
                    errors = _errors(procs, paths, skip=hung)
                    raise TimeoutError(
                        f"run_ranks({fn.__qualname__}, world_size={world_size}): ranks {hung} still running "
                        f"after {timeout:.0f}s and were killed" + (f"\n{errors}" if errors else "")
                    )
                time.sleep(_POLL_S)
        finally:
            _kill(procs)
        errors = _errors(procs, paths)
        if errors:
            raise RankError(f"run_ranks({fn.__qualname__}, world_size={world_size}) failed:\n{errors}")
        return [_read(path)["result"] for path in paths]


def run_ranks_eager(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> List[Any]:
    """`run_ranks` in `EAGER_ENV` (plus any `env` given)."""
    env = {**EAGER_ENV, **(kwargs.pop("env", None) or {})}
    return run_ranks(fn, world_size, *args, env=env, **kwargs)


_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _command_lines(rank: int, world_size: int, calls: Dict[str, tuple], cwd: str) -> Dict[str, dict]:
    import contextlib
    import io

    import torch.distributed as dist

    os.chdir(cwd)
    base = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    results = {}
    for name, (module, argv, env) in calls.items():
        os.environ.clear()
        os.environ.update({**base, **env})
        entry = importlib.import_module(module)
        if hasattr(entry, "__path__"):  # a package: `python -m` runs its __main__
            entry = importlib.import_module(f"{module}.__main__")
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = entry.main(list(argv))
        results[name] = {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue(),
                         "process_group": dist.is_initialized()}
    return results


def run_command_lines(calls: Dict[str, tuple], cwd: Optional[str] = None, timeout: float = 240,
                      threads: Optional[int] = None) -> Dict[str, dict]:
    """`python -m MODULE ARGV` for each `calls[name] = (MODULE, ARGV, extra environment)`, run as `MODULE.main(ARGV)`
    in turn in one fresh process forked like a rank (torch and megatron-core already imported: ~9 s saved per
    command line), with the caller's environment plus the extra one (not the torchrun variables a rank gets), in
    `cwd` (default: the caller's). For command lines that end early (a refused launch), or whose work is all in
    `main` (`timeout` and torch's intra-op `threads` as for `run_ranks`): returns, by name, the exit code, what was
    printed to stdout and stderr, and whether a process group existed afterwards."""
    return run_ranks(_command_lines, 1, calls, cwd or os.getcwd(), timeout=timeout, threads_per_rank=threads)[0]


def run_command_line(module: str, argv: list, env: Optional[dict] = None, cwd: Optional[str] = None,
                     timeout: float = 240, threads: Optional[int] = None) -> dict:
    """One `python -m MODULE ARGV` as `run_command_lines` runs it: {code, stdout, stderr, process_group}."""
    return run_command_lines({"main": (module, argv, env or {})}, cwd, timeout, threads)["main"]


def _errors(procs: List[mp.Process], paths: List[Path], skip: List[int] = ()) -> str:
    """Tracebacks of ranks that raised, and exit codes of ranks that died without a report."""
    parts = []  # (order, text): the first rank to raise is usually the cause, the others' errors
    for rank, (p, path) in enumerate(zip(procs, paths)):  # (peer gone, ...) follow from it
        if rank in skip:
            continue
        report = _read(path)
        if report is not None and not report["ok"]:
            parts.append(((0, report.get("time", 0.0)), f"--- rank {rank} raised:\n{report['traceback']}"))
        elif report is None:
            why = "was killed after another rank failed" if p.exitcode in (-9, None) else f"exited with code {p.exitcode}"
            parts.append(((1, rank), f"--- rank {rank} {why} without returning a result"))
    return "\n".join(text for _, text in sorted(parts, key=lambda part: part[0]))
