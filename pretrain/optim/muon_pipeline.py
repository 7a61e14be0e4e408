"""Muon's Newton-Schulz work shared between pipeline stages (`optimizer.muon_pipeline_balance`).

Every pipeline rank runs its optimizer step at the same point of the training step, after the schedule,
and the next step's first forward waits for the first stage's update. Stages carry unequal Muon work: their
layer counts differ (the last stage holds the MTP layer and the output head instead of decoder layers), and
Newton-Schulz costs 5 (4 m^2 n + 2 m^3) flops per [m, n] block (m <= n) whatever the stage's forward costs.
On glm5-proxy's PP = 2 layout the first stage's Newton-Schulz takes 64 ms and the second's 31 ms, and the
second stage waits the difference at every step's end.

Newton-Schulz of a stage of blocks [B, m, n] is independent per block. A rank with more work sends the last
k blocks of a shape class (already staged: u = G + mu M in `ns_dtype`, the same bytes it would iterate on)
to a rank with less; that rank orthogonalizes them first, before its own, and sends the result back; the
sender adds it to its weights as if it had computed it. The plan is a greedy balance of the summed block
flops per rank (largest blocks first), computed once from every rank's shape classes and the same on every
rank; a rank either sends or receives, never both. The update is the one each rank would compute alone.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from pretrain.optim.muon_staging import StagedBlock, apply_stage, fill_stage, newton_schulz_flops, stage_batches

log = logging.getLogger(__name__)

# a shape class: (ns dtype name, Newton-Schulz steps, m, n) with m <= n
ClassKey = Tuple[str, int, int, int]
# (source rank, destination rank, blocks), ranks as indices in the pipeline group
Move = Tuple[int, int, int]


def block_flops(key: ClassKey) -> float:
    """Newton-Schulz flops of one block of the class."""
    _, steps, m, n = key
    return newton_schulz_flops(m, n, steps)


def balance_plan(counts: Sequence[Dict[ClassKey, int]]) -> Dict[ClassKey, List[Move]]:
    """Which blocks move between ranks: `counts[r]` is rank r's blocks per shape class. Greedy: while moving
    at least one block from the busiest rank (summed `block_flops`) to the least busy one shortens the busiest,
    move as many of the busiest rank's largest blocks as halve the gap. Ranks that received never send and ranks
    that sent never receive (so no transfer waits on another). Deterministic: every rank computes the same plan."""
    left = [dict(c) for c in counts]  # blocks still on their own rank
    load = [sum(block_flops(k) * v for k, v in c.items()) for c in counts]
    sent, received = set(), set()
    moves: Dict[ClassKey, List[Move]] = {}
    for _ in range(4 * len(counts) * max(1, sum(len(c) for c in counts))):
        senders = [r for r in range(len(load)) if r not in received]
        takers = [r for r in range(len(load)) if r not in sent]
        if not senders or not takers:
            break
        src = max(senders, key=lambda r: (load[r], -r))
        dst = min(takers, key=lambda r: (load[r], r))
        gap = load[src] - load[dst]
        moved = False
        for key in sorted(left[src], key=lambda k: (-block_flops(k), k)):
            cost = block_flops(key)
            k = min(left[src][key], int(gap / (2 * cost)))
            if k <= 0:
                continue
            left[src][key] -= k
            load[src] -= k * cost
            load[dst] += k * cost
            moves.setdefault(key, []).append((src, dst, k))
            sent.add(src)
            received.add(dst)
            moved = True
            break
        if not moved:
            break
    return moves


class PipelineBalance:
    """The exchange of one Muon instance (a ChainedOptimizer's sub-optimizer `tag`) over the pipeline `group`."""

    def __init__(self, group, tag: int):
        self.group = group
        self.tag = tag
        self.rank = dist.get_rank(group)
        self.ranks = dist.get_process_group_ranks(group)
        self.moves: Optional[Dict[ClassKey, List[Move]]] = None
        self.counts: Optional[Dict[ClassKey, int]] = None

    def plan(self, counts: Dict[ClassKey, int]) -> Dict[ClassKey, List[Move]]:
        """The plan for this rank's `counts` (blocks per class), exchanged over the group at the first step;
        later steps must have the same counts (a parameter without a gradient in one step would change them)."""
        if self.moves is None:
            every: List = [None] * len(self.ranks)
            dist.all_gather_object(every, (self.tag, counts), group=self.group)
            if any(tag != self.tag for tag, _ in every):
                raise RuntimeError(f"optimizer.muon_pipeline_balance: the pipeline ranks' optimizers differ "
                                   f"(sub-optimizers {[tag for tag, _ in every]} met)")
            self.moves, self.counts = balance_plan([c for _, c in every]), dict(counts)
            loads = [sum(block_flops(k) * v for k, v in c.items()) / 1e12 for _, c in every]
            moved = sum(k * block_flops(key) for key, ms in self.moves.items() for _, _, k in ms) / 1e12
            if self.rank == 0:
                log.info("Muon pipeline balance (optimizer %d): Newton-Schulz %s TFLOP per pipeline rank, %.2f "
                         "TFLOP moved", self.tag, "/".join(f"{x:.2f}" for x in loads), moved)
        elif counts != self.counts:
            raise RuntimeError("optimizer.muon_pipeline_balance: this rank's Muon blocks changed between steps "
                               f"({self.counts} -> {counts}); every Muon parameter needs a gradient at every step")
        return self.moves

    def exchange(self, pairs: List[Tuple[str, int, torch.Tensor]]):
        """Post sends ("send", peer, tensor) and receives ("recv", peer, buffer), in this order, as one batch."""
        ops = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, self.ranks[peer], group=self.group)
               for kind, peer, t in pairs]
        return dist.batch_isend_irecv(ops) if ops else []


def wait(requests) -> None:
    for r in requests:
        r.wait()


def balanced_updates(staged: Dict[Tuple[torch.dtype, int], List[StagedBlock]], batch_elements: int,
                     balance: PipelineBalance, newton_schulz, device: torch.device) -> None:
    """Muon's batched Newton-Schulz and updates of `staged` (Muon's blocks by (ns dtype, steps)) with the plan's
    blocks orthogonalized on other pipeline ranks; `newton_schulz(stage, steps, dtype)` is Muon's iteration, `device`
    its parameters' (where blocks from other ranks are received)."""
    classes: Dict[ClassKey, List[List[StagedBlock]]] = {}
    for (dtype, steps), blocks in staged.items():
        shapes = [(b.grad.shape[0], *b.wide) for b in blocks]
        for batch in stage_batches(shapes, batch_elements):
            chosen = [blocks[i] for i in batch]
            classes.setdefault((str(dtype).replace("torch.", ""), steps, *chosen[0].wide), []).append(chosen)
    rows = {key: [sum(b.grad.shape[0] for b in batch) for batch in batches] for key, batches in classes.items()}
    moves = balance.plan({key: sum(r) for key, r in rows.items()})
    me = balance.rank

    # A sender stages the batches that hold its class's last K rows and sends those rows, split by destination.
    kept: Dict[ClassKey, List[Tuple[List[StagedBlock], torch.Tensor, int]]] = {}  # (batch, stage, local rows)
    first, hosted, back = [], [], []
    for key in sorted(moves):
        out = [(dst, k) for src, dst, k in moves[key] if src == me]
        if out:
            cut, start, parts = sum(rows[key]) - sum(k for _, k in out), 0, []
            for batch, count in zip(classes[key], rows[key]):
                local = min(max(cut - start, 0), count)
                if local < count:
                    stage = fill_stage(batch, dtype_of(key))
                    kept.setdefault(key, []).append((batch, stage, local))
                    parts.append(stage[local:])
                start += count
            moved = torch.cat(parts)
            offset = 0
            for dst, k in out:
                first.append(("send", dst, moved[offset : offset + k].contiguous()))
                back.append((key, dst, torch.empty_like(moved[offset : offset + k])))
                offset += k
        for src, dst, k in moves[key]:
            if dst == me:
                buf = torch.empty(k, key[2], key[3], dtype=dtype_of(key), device=device)
                first.append(("recv", src, buf))
                hosted.append((key, src, buf))
    posted = balance.exchange(first)
    if hosted:  # a receiver waits for its blocks; a sender's copies stay untouched, it waits at the end
        wait(posted)
    # Hosted blocks first: their sender needs them back to finish, and this rank's own work can wait.
    sent_back = balance.exchange([("send", src, newton_schulz(buf, key[1], dtype_of(key)).contiguous())
                                  for key, src, buf in hosted])
    local_x: Dict[int, torch.Tensor] = {}
    for key, batches in classes.items():
        partial = {id(batch): (stage, local) for batch, stage, local in kept.get(key, [])}
        for batch in batches:
            if id(batch) not in partial:
                apply_stage(batch, newton_schulz(fill_stage(batch, dtype_of(key)), key[1], dtype_of(key)))
            elif partial[id(batch)][1] > 0:
                stage, local = partial[id(batch)]
                local_x[id(batch)] = newton_schulz(stage[:local], key[1], dtype_of(key))
    wait(balance.exchange([("recv", dst, buf) for _, dst, buf in back]))
    for key in sorted(kept):
        returned = torch.cat([buf for k, _, buf in back if k == key])
        offset = 0
        for batch, stage, local in kept[key]:
            theirs = returned[offset : offset + stage.shape[0] - local]
            offset += stage.shape[0] - local
            apply_stage(batch, torch.cat([local_x[id(batch)], theirs]) if local > 0 else theirs)
    if not hosted:  # waited already on a receiver (a second wait on a gloo request does not return)
        wait(posted)
    wait(sent_back)


def dtype_of(key: ClassKey) -> torch.dtype:
    return getattr(torch, key[0])
