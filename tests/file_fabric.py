"""A `pretrain.optim.zero2_copy_engine.Fabric` for CPU ranks: each rank's receive area and the signal pads are files
mapped shared into every rank's process (`torch.from_file(shared=True)`), so a `copy_` into a peer's area is a write
the peer sees, as a copy into a peer-mapped GPU buffer is. Signals follow torch symmetric memory's handshake: a put
waits for its pad to be 0 and sets it to 1; a wait waits for 1 and sets it back to 0 (on the host, at once, where
the GPU's run in stream order). A wait that outlasts `timeout_s` raises, so a protocol that deadlocks fails a test.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

CHANNELS = 16


class FileFabric:
    def __init__(self, directory: str, group, nbytes: int, timeout_s: float = 60.0):
        self.rank, self.world, self.timeout_s = group.rank(), group.size(), timeout_s
        prefix = os.path.join(directory, f"fabric{group.group_name}")
        self.areas = [torch.from_file(f"{prefix}.area{r}", shared=True, size=nbytes, dtype=torch.uint8)
                      for r in range(self.world)]
        # pads[dst, channel, src]
        self.pads = torch.from_file(f"{prefix}.pads", shared=True, size=self.world * CHANNELS * self.world,
                                    dtype=torch.int32).view(self.world, CHANNELS, self.world)
        self.channels = CHANNELS
        self.peer_views = 0  # views of a peer's area this rank made (the transport writes through them)
        dist.barrier(group=group)  # every file exists, zeroed, before anyone writes

    def area(self, rank: int, offset_bytes: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        view = self.areas[rank][offset_bytes:offset_bytes + numel * dtype.itemsize].view(dtype)
        if rank != self.rank:
            self.peer_views += 1
        return view

    def _spin(self, dst: int, channel: int, src: int, want: int, then: int) -> None:
        began = time.monotonic()
        while int(self.pads[dst, channel, src]) != want:
            if time.monotonic() - began > self.timeout_s:
                raise TimeoutError(f"rank {self.rank}: pad [{dst}, {channel}, {src}] stayed != {want}")
            time.sleep(0.0005)
        self.pads[dst, channel, src] = then

    def put_signal(self, dst: int, channel: int) -> None:
        self._spin(dst, channel, self.rank, 0, 1)

    def wait_signal(self, src: int, channel: int) -> None:
        self._spin(self.rank, channel, src, 1, 0)
