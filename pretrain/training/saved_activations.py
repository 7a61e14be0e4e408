"""What autograd keeps for backward: the tensors saved during a forward pass, by storage.

Between a layer's forward and its backward, activation memory is what the autograd graph holds:
every tensor an operation saves (`save_for_backward`, the inputs a matmul keeps, ...). Under
`torch.autograd.graph.saved_tensors_hooks` each of them passes through a pack hook; `SavedTensors`
records them and counts each underlying storage once (views of one tensor, or one tensor saved by
several operations, cost its storage once), skipping given storages such as the parameters'.
Bytes are the storage's full size, since a saved view keeps all of its storage alive. Only what
is still held when asked counts: a graph built and consumed inside the forward (a loss whose
gradient is taken on the spot) saves tensors that die with it.

Each record carries the allocation site that saved it: the innermost stack frame in this
project's or megatron's code (`pretrain.training.memory_snapshot.allocation_site`'s rule), so a
breakdown says which line to change. Usage:

    with SavedTensors(exclude=model.parameters()) as saved:
        loss = model(...)
    print(saved.report(tokens=b * s))
"""

from __future__ import annotations

import os
import traceback
import weakref
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import torch

SITE_MARKERS = ("pretrain/", "parallel/", "megatron/core/")


@dataclass
class SavedRecord:
    site: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    nbytes: int  # of the whole storage


class _Packed:
    """What the graph holds instead of the tensor: its death tells that the graph let go."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


_REPOSITORY = str(Path(__file__).resolve().parents[2]) + os.sep


def short_path(filename: str) -> str:
    """A source file's path as a report shows it: inside site-packages from there, inside this repository relative
    to its root, else as given."""
    if "site-packages/" in filename:
        return filename.split("site-packages/")[-1]
    return filename[len(_REPOSITORY):] if filename.startswith(_REPOSITORY) else filename


def _site(markers=SITE_MARKERS) -> str:
    for frame in reversed(traceback.extract_stack()[:-3]):  # innermost first, skipping this module
        # torch-function modes (the CPU layer of pretrain.compat) wrap every call: not the caller
        if (any(m in frame.filename for m in markers) and not frame.filename.endswith("saved_activations.py")
                and frame.name != "__torch_function__"):
            return f"{short_path(frame.filename)}:{frame.lineno} {frame.name}"
    return "?"


def _key(t: torch.Tensor):
    storage = t.untyped_storage()
    return t.device, storage.data_ptr(), storage.nbytes()


class SavedTensors:
    """Context manager counting the unique storages autograd saves inside it (see the module docstring).
    `exclude`: tensors (e.g. parameters) whose storages are not activations; `sites`: record where each
    storage was saved (a stack walk per saved tensor: for measurements, not for training)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = (), sites: bool = True):
        self.excluded = {_key(t) for t in exclude}
        self.sites = sites
        self.records: Dict[tuple, SavedRecord] = {}
        self._holders: Dict[tuple, List[weakref.ref]] = defaultdict(list)
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None

    def _pack(self, t: torch.Tensor) -> _Packed:
        packed = _Packed(t)
        key = _key(t)
        if key not in self.excluded and key[2] > 0:
            if not any(ref() is not None for ref in self._holders[key]):  # new, or its address reused
                self._holders[key] = []
                self.records[key] = SavedRecord(_site() if self.sites else "", tuple(t.shape), t.dtype, key[2])
            self._holders[key].append(weakref.ref(packed))
        return packed

    def __enter__(self) -> "SavedTensors":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda p: p.tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def live(self) -> List[SavedRecord]:
        """The saved storages some graph still holds (ask between forward and backward)."""
        return [r for key, r in self.records.items() if any(ref() is not None for ref in self._holders[key])]

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.live())

    def by_site(self) -> Dict[str, int]:
        out: Dict[str, int] = defaultdict(int)
        for r in self.live():
            out[r.site] += r.nbytes
        return dict(out)

    def report(self, tokens: int = 1, top: int = 40) -> str:
        """One line per saved storage, largest first: bytes per token, shape, dtype, site."""
        rows: List[SavedRecord] = sorted(self.live(), key=lambda r: -r.nbytes)
        total = sum(r.nbytes for r in rows)
        lines = [f"saved for backward: {total / tokens:,.0f} bytes per token "
                 f"({len(rows)} storages, {total:,} bytes over {tokens} tokens)"]
        for r in rows[:top]:
            lines.append(f"  {r.nbytes / tokens:10,.1f} B/token  {str(list(r.shape)):<22} "
                         f"{str(r.dtype).replace('torch.', ''):<9} {r.site}")
        return "\n".join(lines)


__all__ = ["SavedRecord", "SavedTensors"]
