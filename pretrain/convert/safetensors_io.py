"""Sharded safetensors directories: lazy reading and atomic, size-capped writing."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from typing import Dict, Iterable, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"
_PACKED_EXPERT = re.compile(r"^(?P<prefix>.*\.mlp\.experts\.)(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


class MissingTensorError(KeyError):
    pass


class SafetensorsDir:
    """Tensors of a directory holding `model.safetensors` or an index plus shards.

    Reads one tensor at a time (memory stays at one tensor, whatever the checkpoint size).
    Per-expert HF names also resolve against transformers' packed layout
    (`experts.gate_up_proj` [E, 2F, H], `experts.down_proj` [E, H, F]).
    """

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, INDEX_NAME)
        if os.path.exists(index):
            with open(index) as f:
                self.weight_map: Dict[str, str] = json.load(f)["weight_map"]
        else:
            files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {path}")
            self.weight_map = {}
            for name in files:
                with safe_open(os.path.join(path, name), "pt") as f:
                    self.weight_map.update({k: name for k in f.keys()})
        self._handles: Dict[str, object] = {}

    def keys(self) -> Iterable[str]:
        return self.weight_map.keys()

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map or self._packed_source(name) is not None

    def _handle(self, file: str):
        if file not in self._handles:
            self._handles[file] = safe_open(os.path.join(self.path, file), "pt")
        return self._handles[file]

    def _packed_source(self, name: str) -> Optional[tuple]:
        m = _PACKED_EXPERT.match(name)
        if not m:
            return None
        packed = m["prefix"] + ("down_proj" if m["proj"] == "down" else "gate_up_proj")
        return (packed, int(m["e"]), m["proj"]) if packed in self.weight_map else None

    def get(self, name: str) -> torch.Tensor:
        if name in self.weight_map:
            return self._handle(self.weight_map[name]).get_tensor(name)
        packed = self._packed_source(name)
        if packed is None:
            raise MissingTensorError(f"tensor {name!r} is not in the checkpoint at {self.path}")
        key, e, proj = packed
        block = self._handle(self.weight_map[key]).get_slice(key)[e]
        if proj == "down":
            return block.contiguous()
        gate, up = torch.chunk(block, 2, dim=0)
        return (gate if proj == "gate" else up).contiguous()


class ShardedWriter:
    """Writes tensors into `prefix-0000i-of-0000N.safetensors` shards plus an index.

    Everything goes to a temporary directory next to `out_dir`, which replaces `out_dir` only
    when `close()` succeeds: an interrupted run leaves no directory that looks complete.
    """

    def __init__(self, out_dir: str, max_shard_bytes: int = 5 * 2**30, prefix: str = "model"):
        self.out_dir = os.path.abspath(out_dir)
        if os.path.exists(self.out_dir) and os.listdir(self.out_dir):
            raise FileExistsError(f"output directory {self.out_dir} exists and is not empty")
        parent = os.path.dirname(self.out_dir)
        os.makedirs(parent, exist_ok=True)
        self.tmp = tempfile.mkdtemp(prefix=".partial-" + os.path.basename(self.out_dir) + "-", dir=parent)
        self.max_shard_bytes, self.prefix = max_shard_bytes, prefix
        self._buffer: Dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._shards: list = []  # list of key lists
        self.total_size = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._buffer and self._buffer_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._buffer[name] = tensor.contiguous()
        self._buffer_bytes += nbytes
        self.total_size += nbytes

    def _flush(self) -> None:
        if not self._buffer:
            return
        save_file(self._buffer, os.path.join(self.tmp, f"shard-{len(self._shards)}.tmp"), metadata={"format": "pt"})
        self._shards.append(list(self._buffer))
        self._buffer, self._buffer_bytes = {}, 0

    def write_json(self, name: str, obj) -> None:
        with open(os.path.join(self.tmp, name), "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)

    def write_text(self, name: str, text: str) -> None:
        with open(os.path.join(self.tmp, name), "w") as f:
            f.write(text)

    def close(self) -> str:
        self._flush()
        n = len(self._shards)
        weight_map = {}
        for i, keys in enumerate(self._shards):
            final = f"{self.prefix}-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.tmp, f"shard-{i}.tmp"), os.path.join(self.tmp, final))
            weight_map.update({k: final for k in keys})
        self.write_json(INDEX_NAME, {"metadata": {"total_size": self.total_size}, "weight_map": weight_map})
        if os.path.exists(self.out_dir):
            os.rmdir(self.out_dir)  # empty, checked in __init__
        os.replace(self.tmp, self.out_dir)
        return self.out_dir

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.close()
        else:
            self.abort()
