"""Run a sweep's training runs (and their evaluations) through the normal training entry.

Each run is one command: `bash launch/train.sh --config BASE OVERRIDES...` (torchrun), or
`python -m pretrain.train ...` (one process), or with `--slurm` one `sbatch launch/slurm.sbatch ...`
job per run (a run that starts from another's checkpoint waits for it with `--dependency=afterok`).
Commands run from the repository root, one after another, or up to N at a time with `parallel` (small
models that leave a GPU idle: several runs share it; a run that starts from another's checkpoint waits for
it); a run's output goes to `<run_dir>/train.log`. Each local run gets its own torchrun MASTER_PORT: one the
OS reports free when the run starts, so that two sweeps on one machine do not collide; with MASTER_PORT set,
runs take MASTER_PORT + 1, + 2, ... (one per concurrent run) instead.

A run is finished when its checkpoint directory's `latest` marker names its last iteration (the
trainer always saves at the end); a run with an earlier checkpoint is started again with the same
command, and the trainer resumes it exactly (`checkpoint.auto_resume`: model, optimizer, LR
schedule, RNG and data position). So a re-invoked sweep skips finished runs and resumes the others.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import threading
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Dict, List, Optional

from pretrain.ablate.sweep import ROOT, Run, Sweep, SweepError, rel
from pretrain.training.checkpoint_files import read_latest, step_dir_name

EVAL_FILE = "eval_{name}.json"  # in the run dir, written by `python -m pretrain.eval.<name> --json`
STEP_EVAL_FILE = "eval_{name}_step{step}.json"  # the same evaluation of the run's checkpoint at one step


def finished_iteration(run: Run) -> Optional[int]:
    """The iteration of the run's newest complete checkpoint, or None."""
    iteration, _ = read_latest(run.checkpoint_dir)
    return iteration


def is_finished(run: Run) -> bool:
    iteration = finished_iteration(run)
    return iteration is not None and iteration >= run.train_iters


def python() -> str:
    """`python` when that is the running interpreter (readable commands), else its full path."""
    found = shutil.which("python")
    return "python" if found and os.path.realpath(found) == os.path.realpath(sys.executable) else sys.executable


def train_command(sweep: Sweep, run: Run) -> List[str]:
    config = ["--config", rel(run.config_path), *run.overrides]
    if sweep.launcher == "python":
        return [python(), "-m", "pretrain.train", *config]
    env = [f"NPROC_PER_NODE={sweep.nproc_per_node}"] if sweep.nproc_per_node else []
    return [*env, "bash", "launch/train.sh", *config]


def sbatch_command(sweep: Sweep, run: Run, dependency: Optional[str]) -> List[str]:
    cmd = ["sbatch", "--parsable", "--nodes=1", f"--job-name=ablate-{run.variant}-s{run.seed}",
           f"--output={rel(run.run_dir)}/slurm-%j.out"]
    if sweep.nproc_per_node:
        cmd.append(f"--gpus-per-node={sweep.nproc_per_node}")
    if dependency:
        cmd.append(f"--dependency=afterok:{dependency}")
    return cmd + ["launch/slurm.sbatch", "--config", rel(run.config_path), *run.overrides]


def eval_commands(sweep: Sweep, run: Run, step: Optional[int] = None) -> Dict[str, List[str]]:
    """Evaluation name -> command, for the evaluations whose result file is missing (of the run's last
    checkpoint, or of its checkpoint at `step`)."""
    variant = next(v for v in sweep.variants if v.name == run.variant)
    if not variant.report:
        return {}
    out = {}
    for name, args in (sweep.evals if variant.evals is None else variant.evals).items():
        if step is None:
            result, checkpoint = run.run_dir / EVAL_FILE.format(name=name), run.checkpoint_dir
        else:
            result = run.run_dir / STEP_EVAL_FILE.format(name=name, step=step)
            checkpoint = run.checkpoint_dir / step_dir_name(step)
        if not result.is_file():
            out[name] = [python(), "-m", f"pretrain.eval.{name}", "--checkpoint", rel(checkpoint),
                         "--json", rel(result), *args]
    return out


def _shell(cmd: List[str]) -> str:
    env = []
    while cmd and "=" in cmd[0] and not cmd[0].startswith("-"):
        env.append(cmd[0])
        cmd = cmd[1:]
    return " ".join(env + [shlex.join(cmd)])


def _execute(cmd: List[str], log: Path, extra_env: Optional[Dict[str, str]] = None) -> int:
    env = dict(os.environ, **(extra_env or {}))
    while cmd and "=" in cmd[0] and not cmd[0].startswith("-"):
        key, _, value = cmd[0].partition("=")
        env[key] = value
        cmd = cmd[1:]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a", encoding="utf-8") as out:
        out.write(f"$ {_shell(cmd)}\n")
        out.flush()
        return subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT).returncode


def source_run(sweep: Sweep, run: Run) -> Optional[Run]:
    """The run whose checkpoint `run` starts from (same seed), or None."""
    if run.depends_on is None:
        return None
    return next(r for r in sweep.runs if r.variant == run.depends_on and r.seed == run.seed)


def _check_dependency(sweep: Sweep, run: Run, selected: List[Run]) -> None:
    dep = source_run(sweep, run)
    if dep is None:
        return
    if dep not in selected and not is_finished(dep):
        raise SweepError(f"{run.name} starts from {dep.name}, which is not finished and not selected (add "
                         f"--only {dep.variant})")


def _run_one(sweep: Sweep, run: Run, dry_run: bool, say, extra_env: Optional[Dict[str, str]] = None) -> int:
    """Train `run` unless finished, then its missing evaluations; 0, or 1 after saying why it stopped."""
    done = finished_iteration(run)
    if done is not None and done >= run.train_iters:
        say(f"# {run.name}: finished ({run.train_iters} iterations), skipped")
    else:
        note = f"resumes from iteration {done}" if done is not None else f"{run.train_iters} iterations"
        cmd = train_command(sweep, run)
        say(f"# {run.name}: {note}; log {rel(run.run_dir / 'train.log')}")
        say(_shell(cmd))
        if not dry_run:
            rc = _execute(cmd, run.run_dir / "train.log", extra_env)
            if rc != 0 or not is_finished(run):
                say(f"sweep stopped: {run.name} exited with code {rc} before its last checkpoint; see "
                    f"{rel(run.run_dir / 'train.log')}")
                return 1
    for name, cmd in eval_commands(sweep, run).items():
        say(_shell(cmd))
        if not dry_run and _execute(cmd, run.run_dir / f"eval_{name}.log", extra_env) != 0:
            say(f"sweep stopped: evaluation {name} of {run.name} failed; see "
                f"{rel(run.run_dir / f'eval_{name}.log')}")
            return 1
    return 0


def free_local_port(taken=()) -> int:
    """A TCP port that the OS reports free on this machine now (torch elastic's `get_free_port`, as torchrun
    --standalone picks its own) and that is not in `taken` (the ports of runs this sweep started, which their
    torchrun may not have bound yet)."""
    from torch.distributed.elastic.utils.distributed import get_free_port

    while True:
        port = get_free_port()
        if port not in taken:
            return port


def _port_env(slot: int, taken) -> Dict[str, str]:
    """MASTER_PORT for a run in concurrency slot `slot`: MASTER_PORT + 1 + slot when the user set MASTER_PORT
    (torchrun's own port stays free), else a port free now."""
    if "MASTER_PORT" in os.environ:
        return {"MASTER_PORT": str(int(os.environ["MASTER_PORT"]) + 1 + slot)}
    return {"MASTER_PORT": str(free_local_port(taken))}


def mps_running() -> bool:
    """Whether NVIDIA's MPS control daemon has its pipe on this machine (`$CUDA_MPS_PIPE_DIRECTORY`, by
    default /tmp/nvidia-mps): under MPS the kernels of several processes run on one GPU side by side;
    without it the GPU time-slices between processes."""
    return os.path.exists(os.path.join(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"), "control"))


def run_local(sweep: Sweep, runs: List[Run], dry_run: bool, say=print, parallel: int = 1) -> int:
    """Train (then evaluate) each run, one at a time or up to `parallel` at once; returns 1 if a run
    failed (no new run starts after a failure; those running finish), else 0."""
    if parallel < 1:
        raise SweepError(f"parallel must be >= 1, got {parallel}")
    for run in runs:
        _check_dependency(sweep, run, runs)
    if parallel == 1 or dry_run:
        for run in runs:
            if _run_one(sweep, run, dry_run, say, None if dry_run else _port_env(0, ())):
                return 1
        return 0
    if not mps_running():
        say(f"note: no NVIDIA MPS daemon found, so the GPU takes turns between the {parallel} runs; start it "
            "first (nvidia-cuda-mps-control -d) for their kernels to share it (about 1.5x the throughput of "
            "eight glm5-ablate runs on an H200)")
    lock = threading.Lock()

    def locked_say(text: str) -> None:
        with lock:
            say(text)

    pending, running, free, failed = list(runs), {}, list(range(parallel)), False
    busy = lambda r: r in pending or any(r is other for other, _, _ in running.values())  # noqa: E731
    with ThreadPoolExecutor(parallel) as pool:
        while running or (pending and not failed):
            for run in list(pending) if not failed else []:
                source = source_run(sweep, run)
                if not free or (source is not None and busy(source)):
                    continue  # a dependent run waits for its source run
                slot = free.pop(0)
                pending.remove(run)
                env = _port_env(slot, {int(e["MASTER_PORT"]) for _, _, e in running.values()})
                running[pool.submit(_run_one, sweep, run, False, locked_say, env)] = (run, slot, env)
            if not running:
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                _, slot, _ = running.pop(future)
                free.append(slot)
                failed = failed or future.result() != 0
    if failed and pending:
        say(f"not started after the failure: {', '.join(r.name for r in pending)}")
    return 1 if failed else 0


def evaluate_at(sweep: Sweep, runs: List[Run], step: int, dry_run: bool, say=print) -> int:
    """Run the missing evaluations of each run's checkpoint at `step` (a sweep compared before it finished:
    the report `--at-step` reads them); runs without a checkpoint at that step are named and skipped."""
    for run in runs:
        if not (run.checkpoint_dir / step_dir_name(step)).is_dir():
            say(f"# {run.name}: no checkpoint at step {step}, not evaluated")
            continue
        for name, cmd in eval_commands(sweep, run, step).items():
            say(_shell(cmd))
            log = run.run_dir / f"eval_{name}_step{step}.log"
            if not dry_run and _execute(cmd, log) != 0:
                say(f"evaluation {name} of {run.name} at step {step} failed; see {rel(log)}")
                return 1
    return 0


def run_slurm(sweep: Sweep, runs: List[Run], dry_run: bool, say=print) -> int:
    """Submit one job per unfinished run; dependent runs wait for their source run's job."""
    for run in runs:
        _check_dependency(sweep, run, runs)
    jobs: Dict[str, str] = {}
    for run in runs:
        if is_finished(run):
            say(f"# {run.name}: finished, skipped")
            continue
        dep = None
        if run.depends_on is not None:
            dep = jobs.get(f"{run.depends_on}/seed{run.seed}")
        cmd = sbatch_command(sweep, run, dep)
        say(_shell(cmd))
        if dry_run:
            jobs[run.name] = f"<job id of {run.name}>"
            continue
        run.run_dir.mkdir(parents=True, exist_ok=True)  # sbatch --output needs it
        result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if result.returncode != 0:
            say(f"sbatch failed for {run.name}: {result.stderr.strip()}")
            return 1
        jobs[run.name] = result.stdout.strip().split(";")[0]
        say(f"# {run.name}: job {jobs[run.name]}")
    say(f"# when the jobs are done: python -m pretrain.ablate {rel(sweep.path)} --report --output-dir "
        f"{rel(sweep.output_dir)}")
    return 0
