"""ZeRO-2's per-micro-batch reduce on the GPUs' copy engines inside one node
(`optimizer.zero2_reduce_transport: copy_engine`; GLM-5 report, section 7: ZeRO-2 gradient sharding).

The math is the reduce of `pretrain.optim.zero2_grads`, unchanged: with d ranks in the data-parallel group and
o the owner of a bucket,

    owner o:    G <- G + (1/d) g^(o) + sum_{r != o} (1/d) g^(r)

Only the way the bytes move differs. NCCL's reduce moves them with kernels that run on the SMs beside the
backward; measured on 2 x H200 (docs/parallelism.md), an 8192^3 GEMM beside a 200 MB reduce slows by most of
the reduce's time. Here every rank maps a receive area of each peer (torch symmetric memory: CUDA IPC, so the
group must sit inside one node) and the non-owners write their gradients into the owner's area with
cudaMemcpyAsync, which the copy engines carry without SMs; the owner adds what arrived with one elementwise kernel.

Protocol, per piece of a bucket (a bucket is cut into pieces of at most `slot_elements`, so the receive area does
not grow with the largest parameter). Every rank counts the pieces sent to each owner, c_o, the same on every rank
because every rank launches the same buckets in the same order; the piece uses ring slot s = c_o mod `ring` of
the owner's area for each source:

    non-owner r:  [if slot s was used before: wait for o's "free" signal]  copy piece -> o.area[r][s]
                  put "data" signal to o
    owner o:      for each source r: wait for r's "data" signal, G[piece] += area[r][s], put "free" signal to r

Signals are torch symmetric memory's signal pads (a 0 -> 1 -> 0 handshake per channel and pair of ranks; channel
2s carries "data" of slot s, 2s + 1 "free"). All of it runs on one side stream that waits for the gradients of
the bucket; `wait()` on the returned work makes the caller's stream wait for the side stream, as for NCCL's work.
Memory: a receive area of (d - 1) x `ring` x `slot_elements` x 4 bytes per rank and group (128 MiB at d = 2).
The moves themselves (`Fabric`) are an interface, so the protocol runs on CPU in the tests over shared files.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Protocol

import torch

log = logging.getLogger(__name__)

DEFAULT_SLOT_ELEMENTS = 16_000_000  # 64 MB of fp32 per slot: large enough that a copy runs at the link's speed
DEFAULT_RING = 2


def slot_bytes(slot_elements: int) -> int:
    """Bytes of one slot: `slot_elements` of fp32 (or smaller) elements, rounded up to 16-byte alignment."""
    return -(-slot_elements * 4 // 16) * 16


class Fabric(Protocol):
    """Peer memory and signals of one group (rank, world: this rank's place in it; channels: signal channels
    per pair of ranks)."""

    rank: int
    world: int
    channels: int

    def area(self, rank: int, offset_bytes: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A view of `rank`'s receive area, writable from this rank."""

    def put_signal(self, dst: int, channel: int) -> None:
        ...

    def wait_signal(self, src: int, channel: int) -> None:
        ...


class SymmetricMemoryFabric:
    """`Fabric` over torch symmetric memory (CUDA, one node): `area` of a peer is its IPC-mapped buffer, so
    `copy_` into it is a peer cudaMemcpyAsync; signals are the buffer's signal pads, set on the current stream."""

    def __init__(self, group, nbytes: int, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        self.buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, group.group_name)
        self.rank, self.world = self.handle.rank, self.handle.world_size
        self.channels = self.handle.signal_pad_size // 4 // self.world

    def area(self, rank: int, offset_bytes: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        size = torch.empty((), dtype=dtype).element_size()
        return self.handle.get_buffer(rank, (numel,), dtype, offset_bytes // size)

    def put_signal(self, dst: int, channel: int) -> None:
        self.handle.put_signal(dst, channel)

    def wait_signal(self, src: int, channel: int) -> None:
        self.handle.wait_signal(src, channel)


class CopyEngineWork:
    """What `CopyEngineReduce.reduce` returns: `wait()` orders the caller's stream after the transfer."""

    def __init__(self, event: Optional["torch.cuda.Event"]):
        self.event = event

    def wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class CopyEngineReduce:
    """Reduces buckets to their owners through a `Fabric`: see the module docstring."""

    def __init__(self, fabric: Fabric, slot_elements: int = DEFAULT_SLOT_ELEMENTS, ring: int = DEFAULT_RING,
                 device: Optional[torch.device] = None):
        if ring < 1 or slot_elements < 1:
            raise ValueError(f"ring ({ring}) and slot_elements ({slot_elements}) must be >= 1")
        if fabric.channels < 2 * ring:
            raise ValueError(f"the fabric has {fabric.channels} signal channels; a ring of {ring} slots needs {2 * ring}")
        self.fabric, self.slot_elements, self.ring = fabric, slot_elements, ring
        self.slot_bytes = slot_bytes(slot_elements)
        self.sent: List[int] = [0] * fabric.world  # pieces sent to each owner so far (the same on every rank)
        self._views: Dict[tuple, torch.Tensor] = {}  # (rank, offset, dtype) -> the whole slot, made once
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None

    @staticmethod
    def area_bytes(world: int, slot_elements: int = DEFAULT_SLOT_ELEMENTS, ring: int = DEFAULT_RING) -> int:
        """Bytes of the receive area one rank holds for a group of `world` ranks."""
        return max(world - 1, 1) * ring * slot_bytes(slot_elements)

    def _slot_offset(self, source: int, owner: int, slot: int) -> int:
        index = source if source < owner else source - 1  # the owner has no slot of its own
        return (index * self.ring + slot) * self.slot_bytes

    def _slot(self, rank: int, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The first `numel` elements of a slot; the slot's view is made once (a peer view costs host time)."""
        key = (rank, offset, dtype)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self.fabric.area(rank, offset, self.slot_bytes // dtype.itemsize, dtype)
        return view[:numel]

    def reduce(self, send: Optional[torch.Tensor], owner: int, grad: Optional[torch.Tensor],
               dtype: torch.dtype) -> CopyEngineWork:
        """Non-owner: send `send` (the bucket's gradients, in the reduce dtype `dtype`) to `owner`. Owner: `grad`
        (fp32) += `send` (its own contribution; None when already in `grad`) + every peer's `send`."""
        if not self.cuda:
            self._enqueue(send, owner, grad, dtype)
            return CopyEngineWork(None)
        ready = torch.cuda.Event()
        ready.record()
        self.stream.wait_event(ready)
        with torch.cuda.stream(self.stream):
            self._enqueue(send, owner, grad, dtype)
            done = torch.cuda.Event()
            done.record()
        return CopyEngineWork(done)

    def _enqueue(self, send: Optional[torch.Tensor], owner: int, grad: Optional[torch.Tensor],
                 dtype: torch.dtype) -> None:
        f = self.fabric
        is_owner = f.rank == owner
        if is_owner and send is not None:
            grad.add_(send)
        numel = grad.numel() if is_owner else send.numel()
        for start in range(0, numel, self.slot_elements):
            end = min(start + self.slot_elements, numel)
            slot = self.sent[owner] % self.ring
            reused = self.sent[owner] >= self.ring
            self.sent[owner] += 1
            if is_owner:
                for src in range(f.world):
                    if src == owner:
                        continue
                    f.wait_signal(src, 2 * slot)
                    grad[start:end].add_(self._slot(f.rank, self._slot_offset(src, owner, slot), end - start, dtype))
                    f.put_signal(src, 2 * slot + 1)
            else:
                if reused:
                    f.wait_signal(owner, 2 * slot + 1)
                self._slot(owner, self._slot_offset(f.rank, owner, slot), end - start, dtype).copy_(send[start:end])
                f.put_signal(owner, 2 * slot)


def make_reducers(groups: Dict[str, object], device: torch.device, fabric_factory=None,
                  slot_elements: int = DEFAULT_SLOT_ELEMENTS, ring: int = DEFAULT_RING) -> Dict[str, CopyEngineReduce]:
    """One `CopyEngineReduce` per group of more than one rank (a collective over each group, in the order given)."""
    factory = fabric_factory or (lambda group, nbytes: SymmetricMemoryFabric(group, nbytes, device))
    out = {}
    for name, group in groups.items():
        if group.size() > 1:
            fabric = factory(group, CopyEngineReduce.area_bytes(group.size(), slot_elements, ring))
            out[name] = CopyEngineReduce(fabric, slot_elements, ring, device)
    if out:
        mib = sum(CopyEngineReduce.area_bytes(groups[k].size(), slot_elements, ring) for k in out) / 2**20
        log.info("ZeRO-2 reduces on the copy engines (%s data-parallel groups): %.0f MiB of receive areas per rank",
                 " and ".join(out), mib)
    return out
