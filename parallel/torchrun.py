"""torchrun for training runs that can be preempted: `launch/train.sh` starts every node's ranks with it.

    python -m parallel.torchrun --nproc-per-node 8 ... -m pretrain.train --config CONFIG [overrides]

The same arguments and behaviour as `python -m torch.distributed.run`, except for preemption
(`pretrain.training.preemption`: on SIGTERM or SIGUSR1 the ranks end their step, save a checkpoint
and exit with 75):

* SIGTERM and SIGUSR1 that reach the agent are passed on to its ranks, and the agent keeps waiting
  for them. torchrun's own handler sends the ranks SIGTERM too, but SIGKILLs them 30 s later, which a
  large checkpoint does not fit in; and SIGUSR1 (Slurm's `--signal=USR1@N` warning) would kill the
  agent outright. (Slurm signals every process of the job step, the ranks included, so they may see
  the signal twice: they act on it once.)
* A rank that exits with 75 stopped on purpose: the ranks are not restarted (torchrun restarts the
  whole group up to `--max-restarts` times after any failure), and the agent exits with 75 as well,
  where torchrun exits with 1 whatever its ranks returned. `launch/slurm.sbatch` requeues on 75.
"""

from __future__ import annotations

import os
import signal
import sys

from pretrain.exit_signals import PREEMPTED_EXIT_CODE

FORWARDED = (signal.SIGTERM, signal.SIGUSR1)
# The signals torchrun's agent still handles itself (its default list minus the forwarded ones).
AGENT_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"


def children(pid: int) -> list:
    """Process ids whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # the field after the command name's ")"
            found.append(int(entry))
    return found


def _forward(number, _frame) -> None:
    for pid in children(os.getpid()):
        try:
            os.kill(pid, number)
        except ProcessLookupError:
            pass


def _preempted(failures) -> bool:
    return any(getattr(f, "exitcode", None) == PREEMPTED_EXIT_CODE for f in failures.values())


def _no_restart_after_preemption() -> None:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monitor = LocalElasticAgent._monitor_workers

    def monitor_workers(self, worker_group):
        result = monitor(self, worker_group)
        if result.is_failed() and _preempted(result.failures):
            self._remaining_restarts = 0  # the group fails now, instead of being started again
        return result

    LocalElasticAgent._monitor_workers = monitor_workers


def main(argv=None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a.startswith(("--signals-to-handle", "--signals_to_handle")) for a in argv):
        argv = ["--signals-to-handle", AGENT_SIGNALS] + argv
    for number in FORWARDED:
        signal.signal(number, _forward)
    _no_restart_after_preemption()
    try:
        torchrun(argv)
    except ChildFailedError as err:
        if _preempted(err.failures):
            print(f"torchrun: the ranks stopped on a signal after saving a checkpoint; exit code "
                  f"{PREEMPTED_EXIT_CODE} (start the same command again to resume)", file=sys.stderr, flush=True)
            return PREEMPTED_EXIT_CODE
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
