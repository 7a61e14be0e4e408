"""Running a plan: the stages in order, each one training run, finished stages skipped on a restart.

For each stage the runner writes the stage's resolved config to `<run_dir>/<stage>/config.yaml`
and trains it with one launch:

* `torchrun`: `bash launch/train.sh --config <stage>/config.yaml` (one node or many: every node runs
  the plan with the usual NNODES / NODE_RANK / MASTER_ADDR or RDZV_ENDPOINT environment; a c10d
  rendezvous gets one RDZV_ID per stage);
* `srun`: the same under `srun` inside a Slurm allocation (`launch/curriculum.sbatch`);
* `inline`: in this process, one rank (CPU tests, debugging).

A stage that exits successfully with its last checkpoint at its last step gets
`<run_dir>/<stage>/stage_complete.json`; a restarted plan skips those stages. On several nodes (every
node runs the plan), node 0 alone decides: it checks the stage's final checkpoint and writes either
`stage_complete.json` or `stage_failed.json` (why); the other nodes wait for that verdict
(`VERDICT_TIMEOUT_S`) and go on or stop with it, so no node marks a stage done on its own. The first unfinished
stage then resumes from its own checkpoints (the loop prefers `checkpoint.save` over
`checkpoint.pretrained`), continuing the same losses as an uninterrupted run, and later stages
start from its final weights. With `prune_checkpoints: true` a stage's checkpoints are deleted once
the stage after it has finished (nothing needs them then; the last stage's stay), so the disk holds
at most two stages' checkpoints. `<run_dir>/plan.json` records the stages for the report
(`python -m pretrain.tools.plan_report RUN_DIR`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable, Dict, List, Literal, Optional

from pretrain.atomic_io import atomic_write_text
from pretrain.config import save_config
from pretrain.curriculum.plan import Plan, PlanError, Stage
from pretrain.training import checkpoint_files
from pretrain.training.preemption import PREEMPTED_EXIT_CODE

Launcher = Literal["torchrun", "srun", "inline"]
LAUNCHERS = ("torchrun", "srun", "inline")
DONE_FILE = "stage_complete.json"
FAILED_FILE = "stage_failed.json"  # node 0's verdict that a stage's run did not finish it
VERDICT_TIMEOUT_S = 600.0  # how long other nodes wait for node 0's verdict after their run ended
PLAN_FILE = "plan.json"
STAGE_CONFIG = "config.yaml"
REPO_ROOT = Path(__file__).resolve().parents[2]


class StageFailed(RuntimeError):
    """A stage's training run did not finish; running the plan again resumes it."""


class StagePreempted(StageFailed):
    """A stage's run stopped on a signal after saving a checkpoint (exit code 75): run the plan again."""


def plan_record(plan: Plan) -> Dict[str, object]:
    """What the report needs to know about the plan, stage by stage."""
    return {"name": plan.name, "plan": plan.path, "optimizer_state": plan.optimizer_state, "stages": [
        {"name": s.name, "seq_length": s.seq_length, "train_iters": s.train_iters,
         "global_batch_size": s.global_batch_size, "tokens_per_step": s.global_batch_size * s.seq_length,
         "tokens": s.trained_tokens, "optimizer_state": s.optimizer_state, "dir": s.name,
         "rotary_base": s.cfg.model.rotary_base, "lr": [s.cfg.optimizer.lr, s.cfg.optimizer.min_lr],
         "context_parallel_size": s.cfg.parallel.context_parallel_size,
         "dsa_sparse_attention": s.cfg.model.dsa_sparse_attention,
         "trainable_params": s.cfg.train.trainable_params} for s in plan.stages]}


def finished_iterations(stage: Stage) -> Optional[int]:
    """The step count a finished stage recorded, or None when it has not finished."""
    path = stage.directory / DONE_FILE
    if not path.is_file():
        return None
    return int(json.loads(path.read_text())["train_iters"])


def stage_command(launcher: Launcher, config_path: str) -> List[str]:
    train = [str(REPO_ROOT / "launch" / "train.sh"), "--config", config_path]
    if launcher == "srun":
        return ["srun", "--kill-on-bad-exit=1", "bash", *train]
    return ["bash", *train]


def _launch(stage: Stage, launcher: Launcher, config_path: str) -> int:
    if launcher == "inline":
        import gc

        import torch

        from pretrain.train import main

        code = main(["--config", config_path])
        # One process runs every stage: the finished stage's model and optimizer must not stay
        # allocated under the next one (torchrun and srun start a fresh process per stage instead).
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            left = torch.cuda.memory_allocated() / 2**30
            if left > 1:
                print(f"inline launcher: {left:.1f} GiB still allocated after stage {stage.name}; the next stage "
                      "runs beside it (use --launcher torchrun for a fresh process per stage)", flush=True)
        return code
    env = dict(os.environ)
    if env.get("RDZV_ENDPOINT"):  # a fresh c10d rendezvous per stage, not the previous stage's
        env["RDZV_ID"] = f"{env.get('RDZV_ID', 'glm5')}-{stage.name}"
    return subprocess.run(stage_command(launcher, config_path), env=env).returncode


def _last_checkpoint(stage: Stage) -> Optional[int]:
    candidates, _ = checkpoint_files.loadable_candidates(stage.checkpoints)
    return candidates[0].iteration if candidates else None


def prune_finished_checkpoints(plan: Plan, log: Callable[[str], None] = print) -> List[str]:
    """Delete the checkpoints of every stage whose next stage has finished; return the folders deleted."""
    deleted = []
    for stage, after in zip(plan.stages, plan.stages[1:]):
        if finished_iterations(after) is not None and Path(stage.checkpoints).exists():
            shutil.rmtree(stage.checkpoints)
            log(f"deleted the checkpoints of stage {stage.name} ({stage.checkpoints}): stage {after.name} has finished")
            deleted.append(stage.checkpoints)
    return deleted


def _verdict(stage: Stage, node_rank: int, code: int) -> None:
    """Node 0 checks the stage's final checkpoint and records the outcome; other nodes wait for it.
    Raises StageFailed on every node when the stage did not finish."""
    done, failed = stage.directory / DONE_FILE, stage.directory / FAILED_FILE
    if node_rank != 0:
        deadline = time.monotonic() + VERDICT_TIMEOUT_S
        while not done.is_file() and not failed.is_file():
            if code != 0:
                break  # this node's run failed: nothing to wait for
            if time.monotonic() > deadline:
                raise StageFailed(f"stage {stage.name}: node 0 wrote no verdict ({DONE_FILE} or {FAILED_FILE} in "
                                  f"{stage.directory}) within {VERDICT_TIMEOUT_S:.0f} s after the run ended")
            time.sleep(0.2)
        if failed.is_file():
            reason = json.loads(failed.read_text())["reason"]
            raise (StagePreempted if code == PREEMPTED_EXIT_CODE else StageFailed)(reason)
        if code == PREEMPTED_EXIT_CODE:
            raise StagePreempted(f"stage {stage.name} was preempted on node {node_rank}; run the plan again")
        if code != 0:
            raise StageFailed(f"stage {stage.name} failed on node {node_rank} (exit code {code}); run the plan again "
                              f"to resume it from {stage.checkpoints}")
        return
    reason = None
    if code == PREEMPTED_EXIT_CODE:
        reason = (f"stage {stage.name} was preempted (a signal; exit code {code}) after saving a checkpoint; run the "
                  f"plan again to resume it from {stage.checkpoints}")
        atomic_write_text(failed, json.dumps({"reason": reason}) + "\n")
        raise StagePreempted(reason)
    if code != 0:
        reason = (f"stage {stage.name} failed (exit code {code}); run the plan again to resume it from "
                  f"{stage.checkpoints}")
    else:
        last = _last_checkpoint(stage)
        if last != stage.train_iters:
            reason = (f"stage {stage.name} exited without a checkpoint of its last step {stage.train_iters} in "
                      f"{stage.checkpoints} (newest: {last})")
    if reason is not None:
        atomic_write_text(failed, json.dumps({"reason": reason}) + "\n")
        raise StageFailed(reason)


def run_plan(plan: Plan, launcher: Launcher = "torchrun", log: Callable[[str], None] = print,
             node_rank: Optional[int] = None) -> None:
    """Train the plan's unfinished stages in order. Raises StageFailed when a stage's run fails.
    `node_rank`: this node's rank (default: $NODE_RANK, else 0); node 0 decides each stage's completion."""
    if node_rank is None:
        node_rank = int(os.environ.get("NODE_RANK", "0"))
    if launcher not in LAUNCHERS:
        raise PlanError(f"launcher {launcher!r} is not one of {', '.join(LAUNCHERS)}")
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(plan.run_dir / PLAN_FILE, json.dumps(plan_record(plan), indent=1) + "\n")
    for index, stage in enumerate(plan.stages):
        title = f"stage {index + 1}/{len(plan.stages)} {stage.name} (seq {stage.seq_length:,}, {stage.train_iters} steps)"
        done = finished_iterations(stage)
        if done is not None:
            if done != stage.train_iters:
                raise PlanError(f"plan {plan.path}, stage {stage.name}: finished with {done} steps but the plan now "
                                f"asks for {stage.train_iters}; use a new run_dir or restore the plan")
            log(f"=== {title}: finished earlier, skipped")
            continue
        stage.directory.mkdir(parents=True, exist_ok=True)
        config_path = str(stage.directory / STAGE_CONFIG)
        save_config(stage.cfg, config_path)
        resume = _last_checkpoint(stage)
        start = f"resuming its checkpoint at step {resume}" if resume else (
            f"from {stage.cfg.checkpoint.pretrained}" if stage.cfg.checkpoint.pretrained else "from fresh weights")
        log(f"=== {title}: {start}, optimizer state {stage.optimizer_state}")
        if node_rank == 0:  # a verdict of an earlier attempt; the other nodes read one only after this run
            (stage.directory / FAILED_FILE).unlink(missing_ok=True)
        began = time.time()
        code = _launch(stage, launcher, config_path)
        _verdict(stage, node_rank, code)
        if node_rank == 0:
            record = {"train_iters": stage.train_iters, "tokens": stage.trained_tokens,
                      "seconds": time.time() - began, "launcher": launcher}
            atomic_write_text(stage.directory / DONE_FILE, json.dumps(record) + "\n")
        if plan.prune_checkpoints and node_rank == 0:
            prune_finished_checkpoints(plan, log)
    log(f"plan {plan.name} finished: {len(plan.stages)} stages in {plan.run_dir}")
