"""Context curriculum: plan validation, the tiny plan end to end, kill -9 in stage 2 and restart, carried optimizer.

The plan runs in a subprocess with the inline launcher (every stage in one process, one rank), the
way `python -m pretrain.curriculum --launcher inline` runs it; tests/slurm/run.sh runs the same plan
through Slurm, srun and torchrun. The uninterrupted run is the reference for the interrupted one.
"""

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from pretrain.curriculum import PlanError, load_plan
from tests.distributed import run_command_line, run_ranks

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs/curriculum/tiny.yaml"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
STAGES = ["ctx256", "ctx512", "ctx1024", "dsa-warmup", "dsa-sparse"]


def run_plan_cmd(run_dir: Path):
    return [sys.executable, "-m", "pretrain.curriculum", "--plan", str(TINY), "--launcher", "inline", f"run_dir={run_dir}"]


def stage_metrics(run_dir: Path, stage: str):
    path = run_dir / stage / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _start(run_dir: Path, log: Path):
    with open(log, "w") as out:  # the child holds its own copy of the file
        return subprocess.Popen(run_plan_cmd(run_dir), cwd=ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)


def _run_forked(run_dir: Path) -> str:
    """The plan's command line as `pretrain.curriculum`'s main in a single-threaded process forked like a rank
    (`run_command_line`: torch and megatron-core already imported, ~9 s less than a new interpreter); its output."""
    got = run_command_line("pretrain.curriculum", run_plan_cmd(run_dir)[3:], {"OMP_NUM_THREADS": "1"}, cwd=str(ROOT),
                           timeout=900, threads=1)
    out = got["stdout"] + got["stderr"]
    assert got["code"] == 0, out[-6000:]
    return out


@pytest.fixture(scope="module")
def plan_runs(tmp_path_factory):
    """The tiny plan uninterrupted, and beside it (each plan is one single-threaded process: two share the 2 cores)
    the same plan killed (kill -9) at stage 2's first checkpoint, then restarted. Only the killed run is a new
    interpreter (it must die whole); the other two run forked (`_run_forked`)."""
    root = tmp_path_factory.mktemp("curriculum")
    reference, run_dir = root / "uninterrupted", root / "interrupted"
    with ThreadPoolExecutor(1) as pool:
        uninterrupted = pool.submit(_run_forked, reference)
        proc = _start(run_dir, root / "interrupted.log")
        latest = run_dir / "ctx512" / "checkpoints" / "latest"
        try:
            deadline = time.time() + 600
            while not latest.exists():  # stage 2's first checkpoint (step 2 of 6)
                assert proc.poll() is None, f"the plan exited ({proc.returncode}) before stage 2 saved a checkpoint"
                assert time.time() < deadline, "stage 2 saved no checkpoint in time"
                time.sleep(0.02)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        killed = {"stage1_complete": (run_dir / "ctx256" / "stage_complete.json").exists(),
                  "stage2_complete": (run_dir / "ctx512" / "stage_complete.json").exists(),
                  "saved": json.loads(latest.read_text())["iteration"]}
        resumed = _run_forked(run_dir)
        out = uninterrupted.result()
    return {"reference": reference, "out": out, "run_dir": run_dir, "killed": killed, "resumed": resumed}


@pytest.fixture(scope="module")
def uninterrupted(plan_runs):
    return plan_runs["reference"], plan_runs["out"]


def test_tiny_plan_runs_every_stage_from_the_previous_one(uninterrupted):
    run_dir, out = uninterrupted
    record = json.loads((run_dir / "plan.json").read_text())
    assert [s["name"] for s in record["stages"]] == STAGES
    for i, stage in enumerate(record["stages"]):
        name = stage["name"]
        assert json.loads((run_dir / name / "stage_complete.json").read_text())["train_iters"] == stage["train_iters"]
        rows = stage_metrics(run_dir, name)
        assert [r["step"] for r in rows] == list(range(1, stage["train_iters"] + 1))
        cfg = yaml.safe_load((run_dir / name / "checkpoints" / f"iter_{stage['train_iters']:07d}" / "config.yaml").read_text())
        assert cfg["data"]["seq_length"] == stage["seq_length"]
        assert cfg["train"]["global_batch_size"] * stage["seq_length"] == stage["tokens_per_step"]
        if i > 0:
            previous = str(run_dir / record["stages"][i - 1]["name"] / "checkpoints")
            assert cfg["checkpoint"]["pretrained"] == previous
            assert cfg["checkpoint"]["pretrained_optimizer"] == (stage["optimizer_state"] == "carry")
            what = "weights and optimizer state" if stage["optimizer_state"] == "carry" else "weights"
            assert f"started from the {what} of {previous}" in out
    # the RoPE base and the DSA switch reach the stages' configs
    assert [s["rotary_base"] for s in record["stages"]] == [1e4, 1e6, 1e6, 1e6, 1e6]
    assert [s["dsa_sparse_attention"] for s in record["stages"]] == [False, False, False, False, True]
    assert "indexer_loss" in stage_metrics(run_dir, "dsa-warmup")[0]

    from pretrain.tools.plan_report import write_report

    paths = write_report(run_dir)
    table = paths["table"].read_text()
    assert all(f"| {name} |" in table for name in STAGES) and paths["plot"].stat().st_size > 10_000


def _optimizer_tensors(rank, world_size, config_path, save_dir, step_dir):
    """(the optimizer state of a stage just after its start (no step taken), keyed like the checkpoint;
    every tensor of the checkpoint `step_dir` as read from disk by megatron's plain reader)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from pretrain.config import load_config
    from pretrain.training.checkpoint_state import model_sharded_state, optimizer_sharded_state
    from pretrain.training.loop import Trainer

    # its own save dir and run dir: the stage's checkpoints and metrics stay untouched
    trainer = Trainer(load_config(config_path, [f"checkpoint.save={save_dir}/ckpt", f"logging.run_dir={save_dir}"]))
    _, tensors = optimizer_sharded_state(trainer.optimizer, dict(model_sharded_state(trainer.model)), is_loading=False)
    out = {}

    def walk(value):
        if isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, ShardedTensor):
            out[value.key] = value.data.detach().clone().cpu()

    walk(tensors)
    return out, dist_checkpointing.load_plain_tensors(step_dir)


def test_carried_optimizer_state_is_the_previous_stages_last(uninterrupted, tmp_path):
    run_dir, _ = uninterrupted
    started, saved = run_ranks(_optimizer_tensors, 1, str(run_dir / "ctx512" / "config.yaml"), str(tmp_path / "fresh"),
                               str(run_dir / "ctx256" / "checkpoints" / "iter_0000004"))[0]
    moments = [k for k in started if "exp_avg" in k]
    assert moments and set(started) <= set(saved)
    for key in started:
        assert (started[key] == saved[key]).all(), key
    assert any(started[k].abs().sum() > 0 for k in moments)


def test_killed_in_stage_2_restarts_and_matches_the_uninterrupted_losses(plan_runs):
    reference, run_dir, killed = plan_runs["reference"], plan_runs["run_dir"], plan_runs["killed"]
    assert killed["stage1_complete"]
    assert not killed["stage2_complete"], "stage 2 finished before the kill"
    saved, resumed = killed["saved"], plan_runs["resumed"]
    assert "stage 1/5 ctx256 (seq 256, 4 steps): finished earlier, skipped" in resumed
    assert f"stage 2/5 ctx512 (seq 512, 6 steps): resuming its checkpoint at step {saved}" in resumed
    for stage in STAGES:
        got, want = stage_metrics(run_dir, stage), stage_metrics(reference, stage)
        assert [r["step"] for r in got] == [r["step"] for r in want]
        for key in ("loss", "grad_norm", "lr"):
            assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=0, abs=1e-6), (stage, key)


# ------------------------------------------------------------------------------------- validation
def write_plan(tmp_path, stages, **plan):
    plan.setdefault("defaults", {}).setdefault("train", {"micro_batch_size": 1})
    plan["defaults"].setdefault("optimizer", {"lr_warmup_iters": 0})
    doc = {"run_dir": str(tmp_path / "run"), "optimizer_state": "carry", **plan, "stages": stages}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def stage(name="s1", seq=128, tokens=1024, batch=256, config="configs/models/glm5-tiny.yaml", **extra):
    return {"name": name, "config": str(ROOT / config), "seq_length": seq, "tokens": tokens, "batch_tokens": batch,
            **extra}


BAD_PLANS = {
    "unknown plan key": ({"stage": []}, [stage()], "unknown key 'stage'"),
    "unknown stage key": ({}, [stage(seqlen=5)], "stage s1: unknown key 'seqlen'"),
    "batch not whole sequences": ({}, [stage(batch=300)], "batch_tokens (300) must be a multiple of seq_length (128)"),
    "budget below one step": ({}, [stage(tokens=100)], "tokens (100) is less than one step"),
    "runner-owned key": ({}, [stage(overrides={"train": {"train_iters": 5}})], "train.train_iters is set by the"),
    "runner-owned default": ({"defaults": {"checkpoint": {"save": "x"}}}, [stage()], "checkpoint.save is set by the"),
    "bad config key": ({}, [stage(overrides={"model": {"hiden_size": 8}})], "stage s1 ("),
    "context beyond the model": ({}, [stage(seq=8192, batch=8192, tokens=8192)], "exceeds model.max_position_embeddings"),
    "carry into stage 1": ({}, [stage(optimizer_state="carry")], "the first stage has no previous stage"),
    "bad optimizer_state": ({"optimizer_state": "keep"}, [stage()], "optimizer_state must be 'fresh' or 'carry'"),
    "duplicate names": ({}, [stage(), stage()], "two stages are named 's1'"),
    "architecture change": ({}, [stage(), stage("s2", overrides={"model": {"hidden_size": 128}})],
                            "stage s2: model.hidden_size changes from 64 to 128"),
    "carry into a new trainable set": ({}, [stage(), stage("s2", config="configs/dsa/glm5-tiny-dsa-warmup.yaml",
                                                           overrides={"data": {"mock": True, "data_path": []}})],
                                       "optimizer_state carry needs the same train.trainable_params"),
    "no stages": ({}, [], "'stages' must be a non-empty list"),
}


@pytest.mark.parametrize("case", list(BAD_PLANS), ids=list(BAD_PLANS))
def test_bad_plan_is_one_line_naming_the_problem(tmp_path, case):
    plan_keys, stages, message = BAD_PLANS[case]
    with pytest.raises(PlanError) as err:
        load_plan(write_plan(tmp_path, stages, **plan_keys))
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "run").exists()  # nothing ran, nothing was written


def test_bad_command_line_overrides(tmp_path):
    path = write_plan(tmp_path, [stage()])
    with pytest.raises(PlanError, match="data.seq_length is set by the curriculum runner"):
        load_plan(path, ["data.seq_length=64"])
    with pytest.raises(PlanError, match="bad override 'stages=3'"):
        load_plan(path, ["stages=3"])
    plan = load_plan(path, ["optimizer_state=fresh", "train.micro_batch_size=1", f"run_dir={tmp_path / 'b'}"])
    assert plan.optimizer_state == "fresh" and plan.run_dir == tmp_path / "b"
    assert plan.stages[0].cfg.train.micro_batch_size == 1 and plan.stages[0].cfg.train.global_batch_size == 2


def test_cli_reports_a_bad_plan_in_one_line(tmp_path):
    path = write_plan(tmp_path, [stage(batch=300)])
    done = subprocess.run([sys.executable, "-m", "pretrain.curriculum", "--plan", path], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("plan error: ") and done.stderr.count("\n") == 1


def test_shipped_small_plans_validate():
    proxy = load_plan(str(ROOT / "configs/curriculum/glm5-proxy.yaml"))
    assert [s.seq_length for s in proxy.stages] == [4096, 32768, 131072, 202752]
    tiny = load_plan(str(TINY))
    assert [s.seq_length for s in tiny.stages] == [256, 512, 1024, 1024, 1024]
    assert all(s.cfg.model.transformer_impl == "local" for s in proxy.stages + tiny.stages)


def test_glm5_744b_plan_follows_the_report():
    """GLM-5: 4K pretraining (27T tokens); mid-training 32K (1T tokens), 128K (500B), 200K (50B) with the LR linear
    4e-5 -> 1e-5 over mid-training; then DSA: 1000 warm-up steps of 14 x 202,752 tokens, 20B sparse.
    Context parallelism grows with the context (every stage's layout validates as written).
    """
    path = str(ROOT / "configs/curriculum/glm5-744b.yaml")
    raw = yaml.safe_load(Path(path).read_text())
    cp = {s["name"]: s["overrides"]["parallel"]["context_parallel_size"] for s in raw["stages"]}
    plan = load_plan(path)
    assert [s.cfg.parallel.context_parallel_size for s in plan.stages[2:5]] == [cp[n] for n in ("mid-32k", "mid-128k", "mid-200k")]
    by_name = {s.name: s for s in plan.stages}
    assert [s.seq_length for s in plan.stages] == [4096, 4096, 32768, 131072, 202752, 202752, 202752]
    assert cp["mid-32k"] <= cp["mid-128k"] <= cp["mid-200k"] and cp["mid-200k"] > 1
    mid = [by_name[n] for n in ("mid-32k", "mid-128k", "mid-200k")]
    for s, budget in zip(mid, (1e12, 500e9, 50e9)):
        assert budget <= s.trained_tokens < budget + s.batch_tokens
    # one linear schedule over mid-training: continuous at the boundaries, the same slope per token
    assert mid[0].cfg.optimizer.lr == 4e-5 and mid[-1].cfg.optimizer.min_lr == pytest.approx(1e-5)
    slopes = []
    for a, b in zip(mid, mid[1:]):
        assert a.cfg.optimizer.min_lr == pytest.approx(b.cfg.optimizer.lr, rel=1e-3)
    for s in mid:
        o = s.cfg.optimizer
        assert o.lr_decay_style == "linear" and o.lr_warmup_iters == 0
        slopes.append((o.lr - o.min_lr) / s.trained_tokens)
    assert max(slopes) == pytest.approx(min(slopes), rel=1e-2)
    warmup, sparse = by_name["dsa-warmup"], by_name["dsa-sparse"]
    assert warmup.train_iters == 1000 and warmup.global_batch_size == 14
    assert warmup.cfg.train.trainable_params == "dsa_indexer" and not warmup.cfg.model.dsa_sparse_attention
    assert sparse.cfg.model.dsa_sparse_attention and 20e9 <= sparse.trained_tokens < 20e9 + sparse.batch_tokens
    assert warmup.optimizer_state == sparse.optimizer_state == "fresh"
    assert all(s.cfg.model.rotary_base == 1e6 for s in plan.stages[2:])
    assert sum(s.trained_tokens for s in plan.stages[:2]) == pytest.approx(27e12, rel=1e-4)
    assert all(not s.cfg.model.dsa_sparse_attention and s.cfg.model.dsa_indexer_loss_coeff == 0 for s in plan.stages[:5])


def test_pruning_deletes_a_stages_checkpoints_only_once_the_next_stage_finished(tmp_path):
    from pretrain.curriculum.runner import DONE_FILE, prune_finished_checkpoints

    plan = load_plan(write_plan(tmp_path, [stage("a"), stage("b"), stage("c")], prune_checkpoints=True))
    for s in plan.stages:
        Path(s.checkpoints).mkdir(parents=True)
    (plan.stages[0].directory / DONE_FILE).write_text(json.dumps({"train_iters": 4}))
    assert prune_finished_checkpoints(plan, log=lambda _: None) == []  # b, which starts from a, has not finished
    (plan.stages[1].directory / DONE_FILE).write_text(json.dumps({"train_iters": 4}))
    (plan.stages[2].directory / DONE_FILE).write_text(json.dumps({"train_iters": 4}))
    assert prune_finished_checkpoints(plan, log=lambda _: None) == [plan.stages[0].checkpoints,
                                                                    plan.stages[1].checkpoints]
    assert [Path(s.checkpoints).exists() for s in plan.stages] == [False, False, True]  # the last stage's stay
    with pytest.raises(PlanError, match="prune_checkpoints must be true or false"):
        load_plan(write_plan(tmp_path, [stage()], prune_checkpoints="yes"))


def test_validate_with_gpus_runs_the_layout_planner_on_every_stage(capsys):
    """`--gpus N`: each stage's layout goes through the planner's memory and bubble checks (and each pipelined stage's
    simulated bubble is printed); the 744B plan, laid out for 1,792 H100, passes there; on 5,376 GPUs (3 x) its
    main pretraining stage's pipeline gets a third of the micro-batches and idles over the bound (one line, exit 2)."""
    from pretrain.curriculum.__main__ import main

    assert main(["--plan", str(ROOT / "configs/curriculum/tiny.yaml"), "--validate-only", "--skip-data-check",
                 "--gpus", "1"]) == 0
    assert "layouts: every stage fits 1 x h100-nvl-ib400" in capsys.readouterr().out
    assert main(["--plan", str(ROOT / "configs/curriculum/glm5-744b.yaml"), "--validate-only", "--skip-data-check",
                 "--gpus", "1792", "--cluster", "h100-nvl-ib400"]) == 0
    out = capsys.readouterr().out
    assert "layouts: every stage fits 1792 x h100-nvl-ib400" in out
    # and each pipelined stage's bubble, megatron's schedule simulated with its virtual stages (docs/layout.md)
    assert ("stage 2 (pretrain-4k): PP 16 x VPP 2, 144 micro-batches: pipeline bubble 5.7% of the busiest rank's "
            "time (megatron's schedule simulated; the textbook (PP - 1) / (VPP m) says 5.2%)") in out
    assert main(["--plan", str(ROOT / "configs/curriculum/glm5-744b.yaml"), "--validate-only", "--skip-data-check",
                 "--gpus", "5376"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("plan error: stage 2 (pretrain-4k): tp2 pp16 vpp2")
    assert "bubble: (PP - 1) / (VPP x m) = 15 / (2 x 48) = 16% over 10%" in err[0]
    # the same plan on too few GPUs for its layout: the divisibility rule, not a traceback
    assert main(["--plan", str(ROOT / "configs/curriculum/glm5-744b.yaml"), "--validate-only", "--skip-data-check",
                 "--gpus", "48"]) == 2
    assert capsys.readouterr().err.startswith("plan error: stage 1 (pretrain-ramp): ")
