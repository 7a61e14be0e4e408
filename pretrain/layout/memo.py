"""Memo tables the planner's models share between the layouts of a search (docs/layout.md, the search's time).

A search of 2,048 GPUs sizes and times tens of thousands of layouts, and most of what it computes for one it
computes again for the next: the state terms do not change with the recompute setting or the micro-batch, the
activations not with EP or the ZeRO-2 reduce mode, a pipeline rank's time not with the data-parallel size. Each
model keys its terms by exactly the fields of the layout (and the dims, workload, ...) it reads, and remembers them
here. A key names every input of the terms it keeps, so a remembered value is the one the model would compute
again, to the bit; values are shared, so callers copy what they change. (Pure functions of a few hashable arguments
use `functools.lru_cache` instead; these tables take keys built from the fields a model reads.)
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, Hashable, TypeVar

__all__ = ["Memo", "MAX_ENTRIES", "clear_memos"]

T = TypeVar("T")
_MEMOS: "weakref.WeakSet[Memo]" = weakref.WeakSet()  # every table, for clear_memos
MAX_ENTRIES = 50_000  # per table: a search of 2,048 GPUs fills up to ~20,000; a full table starts again empty


class Memo:
    """A bounded table of computed values by key: `memo.get(key, compute)`."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.table: Dict[Hashable, object] = {}
        self.max_entries = max_entries
        _MEMOS.add(self)

    def get(self, key: Hashable, compute: Callable[[], T]) -> T:
        try:
            return self.table[key]  # type: ignore[return-value]
        except KeyError:
            pass
        if len(self.table) >= self.max_entries:
            self.table.clear()
        value = self.table[key] = compute()
        return value

    def clear(self) -> None:
        self.table.clear()

    def __len__(self) -> int:
        return len(self.table)


def clear_memos() -> None:
    """Empty every table: what is asked next is computed afresh (tests compare it with what was remembered)."""
    for memo in list(_MEMOS):
        memo.clear()
