"""The checkpoint directory on disk: step directories, completion records, the `latest` marker.

    save_dir/
      latest                  {"step_dir": "iter_0000200", "iteration": 200}: written last, atomically
      iter_0000100/           one complete checkpoint (megatron dist_checkpointing files, ...)
        complete.json         every other file of the step dir with its size: written before `latest`
      iter_0000200/
      iter_0000300.partial/   a save in progress (or one that crashed): never loaded

A save writes into `<step>.partial`; each rank fsyncs the files it wrote (`fsync_rank_files`), then
rank 0 adds the completion record (file sizes), renames
the directory to its final name, and only then replaces `latest`. A crash at any point therefore
leaves `latest` naming the previous complete checkpoint. On load, the step dir `latest` names is
checked against its completion record (missing or truncated files, unreadable metadata); a step dir
that fails is reported and the next older valid one is used. While a checkpoint is read, `reading()`
tells a file's own failure (an OS error, a torch file that is no archive) from every other error: only
the former is damage an older checkpoint can stand in for (`UnreadableFile`); the latter (a code,
config or layout error) must surface, not cost the steps since the older checkpoint. This module only
touches files and knows nothing of torch.distributed; `check_step_dir` runs on rank 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, List, Optional, Tuple, Union

from pretrain.atomic_io import atomic_write_text, fsync_path

PathLike = Union[str, os.PathLike]

LATEST = "latest"
COMPLETE = "complete.json"
PARTIAL_SUFFIX = ".partial"
_OLD_SUFFIX = ".replaced"
_STEP_RE = re.compile(r"^iter_(\d{7,})$")
RECORD_FORMAT = 1


def step_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def step_iteration(name: str) -> Optional[int]:
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def step_dirs(save_dir: PathLike) -> List[Tuple[int, Path]]:
    """(iteration, path) of every final-named step dir, oldest first (partial ones excluded)."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    found = [(step_iteration(p.name), p) for p in root.iterdir() if p.is_dir()]
    return sorted((it, p) for it, p in found if it is not None)


# ---------------------------------------------------------------------------------------- writing
def _files(step_dir: Path) -> Iterable[Path]:
    for path in sorted(step_dir.rglob("*")):
        if path.is_file() and path.name != COMPLETE:
            yield path


_RANK_SHARD_RE = re.compile(r"^__(\d+)_\d+\.distcp$")  # torch_dist's shard files: __<rank>_<n>.distcp
_RANK_STATE_RE = re.compile(r"^rank_(\d+)\.")  # rank_state/rank_<rank>.pt (and its .tmp while it is written)


def rank_files(step_dir: PathLike, rank: int) -> List[Path]:
    """The files of `step_dir` that `rank` wrote: its shard files and its rank state; rank 0 also every
    file no rank's name marks (common state, metadata, config)."""
    mine = []
    for path in _files(Path(step_dir)):
        owner = _RANK_SHARD_RE.match(path.name) or (_RANK_STATE_RE.match(path.name)
                                                     if path.parent.name == "rank_state" else None)
        if (int(owner.group(1)) if owner else 0) == rank:
            mine.append(path)
    return mine


def fsync_rank_files(step_dir: PathLike, rank: int) -> None:
    """Make the files `rank` wrote durable (each rank its own, in parallel), and on rank 0 the directories."""
    step_dir = Path(step_dir)
    for path in rank_files(step_dir, rank):
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    if rank == 0:
        for sub in {p.parent for p in _files(step_dir)} | {step_dir}:
            fsync_path(sub)


def write_completion_record(step_dir: PathLike, iteration: int, info: Optional[dict] = None) -> dict:
    """Record the size of every file of `step_dir` in `complete.json` (written atomically). The files
    must be durable already (`fsync_rank_files` on every rank)."""
    step_dir = Path(step_dir)
    files = {path.relative_to(step_dir).as_posix(): path.stat().st_size for path in _files(step_dir)}
    record = {"format": RECORD_FORMAT, "iteration": iteration, **(info or {}), "files": files}
    atomic_write_text(step_dir / COMPLETE, json.dumps(record, indent=1) + "\n")
    return record


def write_latest(save_dir: PathLike, iteration: int) -> None:
    marker = {"step_dir": step_dir_name(iteration), "iteration": iteration}
    atomic_write_text(Path(save_dir) / LATEST, json.dumps(marker) + "\n")


def publish(save_dir: PathLike, staging: PathLike, iteration: int) -> Path:
    """Rename a completed staging dir to its final name, then point `latest` at it.

    Saving an iteration that already has a step dir (e.g. right after resuming from it) moves the old
    one aside first and deletes it once `latest` names the new one.
    """
    save_dir, staging = Path(save_dir), Path(staging)
    final = save_dir / step_dir_name(iteration)
    replaced = final.with_name(final.name + _OLD_SUFFIX)
    if final.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
    os.replace(staging, final)
    fsync_path(save_dir)
    write_latest(save_dir, iteration)
    shutil.rmtree(replaced, ignore_errors=True)
    return final


def prune(save_dir: PathLike, keep_last: int, newest: int) -> List[Path]:
    """Delete step dirs older than the `keep_last` newest valid ones up to `newest`, and stale partials.

    Step dirs newer than `newest` (left by a run that went further before it was rolled back) are
    never loaded and are left alone. `keep_last <= 0` keeps everything.
    """
    removed: List[Path] = []
    root = Path(save_dir)
    for path in root.iterdir():
        if path.is_dir() and (path.name.endswith(PARTIAL_SUFFIX) or path.name.endswith(_OLD_SUFFIX)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if keep_last <= 0:
        return removed
    older = [(it, p) for it, p in step_dirs(root) if it <= newest]
    valid = [it for it, p in older if check_step_dir(p, read_metadata=False) is None]
    if len(valid) < keep_last:
        return removed
    oldest_kept = sorted(valid)[-keep_last]
    for it, path in older:
        if it < oldest_kept:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


# ---------------------------------------------------------------------------------------- reading
def check_step_dir(step_dir: PathLike, read_metadata: bool = True) -> Optional[str]:
    """None if `step_dir` matches its completion record (and, with `read_metadata`, its checkpoint
    metadata parses); else what is wrong."""
    step_dir = Path(step_dir)
    if not step_dir.is_dir():
        return "the directory does not exist"
    try:
        record = json.loads((step_dir / COMPLETE).read_text(encoding="utf-8"))
        files = {str(name): int(size) for name, size in record["files"].items()}
    except FileNotFoundError:
        return f"no completion record ({COMPLETE}): the save did not finish"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"unreadable completion record {COMPLETE}: {exc}"
    for name, size in files.items():
        path = step_dir / name
        if not path.is_file():
            return f"file {name} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"file {name} has {actual} bytes, the completion record says {size} (truncated or overwritten)"
    if not read_metadata:
        return None
    from torch.distributed.checkpoint import FileSystemReader

    try:
        json.loads((step_dir / "metadata.json").read_text(encoding="utf-8"))
        FileSystemReader(str(step_dir)).read_metadata()  # `.metadata`, a pickle
    except (OSError, ValueError, EOFError, pickle.UnpicklingError) as exc:
        return f"unreadable checkpoint metadata: {type(exc).__name__}: {exc}"
    return None


class UnreadableFile(Exception):
    """A checkpoint file could not be read (an OS error, or its bytes are not what was written)."""


def caused_by_os_error(exc: BaseException) -> bool:
    """Whether an OSError is among `exc`'s causes, including the per-rank failures that
    torch.distributed.checkpoint's `CheckpointException` collects."""
    seen = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return True
        todo += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():  # CheckpointException: (exc, traceback)
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
    return False


@contextlib.contextmanager
def reading(path: PathLike) -> Iterator[None]:
    """Raise `UnreadableFile` naming `path` when what runs inside fails because of the file: an OS error,
    or (`*.pt`) a file that is no zip archive, as every `torch.save` output is. Other errors pass
    through unchanged: a file that reads but does not fit the model is no damage on disk."""
    path = Path(path)
    try:
        yield
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        damaged = path.suffix == ".pt" and path.is_file() and not zipfile.is_zipfile(path)
        if damaged or caused_by_os_error(exc):
            raise UnreadableFile(f"{path} is unreadable ({type(exc).__name__}: {exc})") from exc
        raise


def read_latest(save_dir: PathLike) -> Tuple[Optional[int], Optional[str]]:
    """(iteration named by `latest`, None) or (None, why it could not be used); (None, None) if absent."""
    path = Path(save_dir) / LATEST
    if not path.exists():
        return None, None
    try:
        marker = json.loads(path.read_text(encoding="utf-8"))
        iteration = step_iteration(marker["step_dir"])
        if iteration is None:
            raise ValueError(f"not a step dir name: {marker['step_dir']!r}")
        return iteration, None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"the marker {path} is unreadable ({exc})"


@dataclass
class Candidate:
    iteration: int
    path: Path


def loadable_candidates(load_dir: PathLike) -> Tuple[List[Candidate], List[str]]:
    """Valid step dirs to try, best first, and a warning for each one skipped.

    The step dir `latest` names comes first, then older valid ones (newest first). Without a usable
    marker, every valid step dir is a candidate, newest first.
    """
    warnings: List[str] = []
    latest, problem = read_latest(load_dir)
    if problem:
        warnings.append(problem + "; using the newest valid step dir")
    dirs = step_dirs(load_dir)
    if latest is not None:
        newer = [p.name for it, p in dirs if it > latest]
        if newer:
            warnings.append(f"ignoring step dirs newer than the one `latest` names ({', '.join(newer)}): "
                            "a save that did not finish, or a run rolled back past them")
        dirs = [(it, p) for it, p in dirs if it <= latest]
        if latest not in {it for it, _ in dirs}:
            dirs.append((latest, Path(load_dir) / step_dir_name(latest)))
    candidates = []
    for it, path in sorted(dirs, reverse=True):
        reason = check_step_dir(path)
        if reason is None:
            candidates.append(Candidate(it, path))
        else:
            warnings.append(f"skipping checkpoint {path}: {reason}")
    return candidates, warnings
