"""What the framework says, once, and where it is shown.

A slower or different path taken because something is missing or unsupported is said in the log, once, never
silently. This is the library's one say-once: `say_once` for a logger line (INFO by default: what the run does),
`warn_once` for a RuntimeWarning (a path the user should change).

`configure_logging` is called once by every entry point (`pretrain.train`, `pretrain.curriculum`,
`pretrain.ablate`, the evaluations, the console scripts): one stderr handler, lines `[rank R] LEVEL logger: text`;
the framework's loggers (`pretrain`, `parallel`, `data_pipeline`) at INFO on global rank 0 and at WARNING on the
other ranks (each notice once, every rank's warnings), third-party loggers (megatron, torch, DeepSpeed, ...) at
WARNING. Library code never configures logging itself.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Hashable, Optional

FRAMEWORK_LOGGERS = ("pretrain", "parallel", "data_pipeline")
THIRD_PARTY_LOGGERS = ("megatron", "torch", "deepspeed", "transformers", "triton", "urllib3", "filelock", "fsspec")

_SAID = set()


def first_time(key: Hashable) -> bool:
    """True the first time `key` is given in this process, False after."""
    if key in _SAID:
        return False
    _SAID.add(key)
    return True


def forget_said() -> None:
    """Forget every notice said so far, so each is said again (tests that check a notice)."""
    _SAID.clear()


def say_once(logger: logging.Logger, message: str, *args, level: int = logging.INFO) -> bool:
    """`logger.log(level, message, *args)` the first time this logger is given this (formatted) message in this
    process; returns whether it was said."""
    text = message % args if args else message
    if not first_time(("log", logger.name, text)):
        return False
    logger.log(level, text)
    return True


def warn_once(message: str, stacklevel: int = 1) -> None:
    """A RuntimeWarning with `message`, the first time it is given in this process; `stacklevel` 1 points at the
    caller of warn_once, 2 at its caller, and so on."""
    if first_time(("warn", message)):
        warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)


class _RankFormatter(logging.Formatter):
    def __init__(self, rank: int):
        super().__init__(f"[rank {rank}] %(levelname)s %(name)s: %(message)s")


def configure_logging(rank: Optional[int] = None, level: int = logging.INFO) -> None:
    """Show the framework's notices (see the module docstring). `rank`: this process's global rank, by default
    the launcher's RANK (torchrun, `launch/*.sh`) or 0. Calling it again replaces the handler it added."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0") or 0)
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, "_glm5_notices", False)]:
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler._glm5_notices = True  # type: ignore[attr-defined]
    handler.setFormatter(_RankFormatter(rank))
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    for name in FRAMEWORK_LOGGERS:
        logging.getLogger(name).setLevel(level if rank == 0 else max(level, logging.WARNING))
    for name in THIRD_PARTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


__all__ = ["FRAMEWORK_LOGGERS", "configure_logging", "first_time", "forget_said", "say_once", "warn_once"]
