"""Preemption: a signal ends the run at a step boundary, with a checkpoint, on every rank at once.

A scheduler that takes the nodes back warns first: Slurm's `--signal=USR1@120` sends SIGUSR1 120 s
before the end of the time limit, `scancel` and most preemption policies send SIGTERM (then SIGKILL
after the cluster's grace time), a spot reclaim sends SIGTERM. On any of `train.exit_signals` the
handler only sets a flag: the step in flight finishes untouched. After each step the ranks take the
maximum of their flags (one all-reduce of one integer), so a signal seen by any rank stops all of them
after the same step; they save a checkpoint of that step, log one line and the process exits with
`PREEMPTED_EXIT_CODE` (75, EX_TEMPFAIL of sysexits.h: "try again later"). Started again with the same
`checkpoint.save`, the run resumes from that checkpoint at the next step, so no step is lost or
repeated. `launch/slurm.sbatch` asks for the warning signal and requeues the job on this exit code.
"""

from __future__ import annotations

import signal
from typing import Dict, Optional, Sequence

from pretrain.exit_signals import PREEMPTED_EXIT_CODE


class Preempted(RuntimeError):
    """The run stopped on a signal after saving a checkpoint of `iteration`; start it again to resume."""

    def __init__(self, signal_name: str, iteration: int, checkpoint: Optional[str]):
        self.signal_name, self.iteration, self.checkpoint = signal_name, iteration, checkpoint
        where = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (checkpoint.save is not set)"
        super().__init__(f"stopped by {signal_name} after step {iteration}: saved {where}; start the same command "
                         f"again to resume at step {iteration + 1} (exit code {PREEMPTED_EXIT_CODE})")


class ExitSignals:
    """Flags the signals named in `names` while installed; `agreed()` is the ranks' common verdict.

    Only the main thread can install signal handlers; elsewhere (a test calling the trainer from a
    thread) nothing is installed and `agreed()` is always False on that rank unless another rank saw one.
    """

    def __init__(self, names: Sequence[str]):
        self.names = list(names)
        self.received: Optional[str] = None
        self._previous: Dict[int, object] = {}

    def install(self) -> "ExitSignals":
        import threading

        if threading.current_thread() is not threading.main_thread():
            return self
        for name in self.names:
            number = getattr(signal, name)
            self._previous[number] = signal.signal(number, self._handle)
        return self

    def _handle(self, number, _frame) -> None:
        # A handler must not run collectives or I/O: the step in flight may be inside one.
        if self.received is None:
            self.received = signal.Signals(number).name

    def uninstall(self) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous.clear()

    def agreed(self, device) -> Optional[str]:
        """The signal's name if any rank received one (collective over the world), else None."""
        import torch
        import torch.distributed as dist

        if not self.names:
            return None
        local = self.names.index(self.received) + 1 if self.received in self.names else 0
        flag = torch.tensor([local], dtype=torch.int32, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        value = int(flag.item())
        if value and self.received is None:
            self.received = self.names[value - 1]
        return self.names[value - 1] if value else None
