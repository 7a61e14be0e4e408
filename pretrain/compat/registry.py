"""The record every megatron-core 0.16.1 workaround is listed with (see `pretrain.compat`).

Each concern module of `pretrain.compat` (Transformer Engine absent, tensor parallel, dist
checkpointing, datasets, CPU, Triton interpreter, ...) ends with `WORKAROUNDS = [Workaround(...), ...]`;
`pretrain.compat` gathers them into one table and `pretrain.compat.install()` applies those with an
`install` function. Helpers used at their call site (context managers, replacement classes) are
listed too, with `install=None`, so the table names every place where we work around megatron-core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Optional


@dataclass(frozen=True)
class Workaround:
    name: str  # the function, class or context manager in pretrain.compat
    target: str  # what it changes or replaces, e.g. "megatron.core.tensor_parallel.mappings._reduce"
    reason: str  # one line: what breaks without it
    upstream: str  # upstream issue, or the megatron-core version that fixes it, or "open"
    test: str  # the test that fails without it, "tests/test_x.py::test_y"
    install: Optional[Callable[[], None]] = None  # applied once by install(); None: used at its call site
    when: Literal["always", "cpu", "triton_interpreter"] = "always"  # when install() applies it
