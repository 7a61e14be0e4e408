"""The training loop: loss falls on real data, bad launches fail early, NaN steps are skipped."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import EAGER_ENV, run_command_lines, run_ranks

ROOT = Path(__file__).resolve().parents[1]
# the comparisons below run their ranks with megatron's jit_fuser functions eager (tests.distributed.EAGER_ENV);
# test_loss_falls_on_stdlib_code trains as users run it, compiled.
RANK_ENV = EAGER_ENV


def tiny_overrides(data: Path, run_dir: Path, *extra: str):
    return [
        "model.vocab_size=1024", "data.seq_length=64", "data.mock=false", f"data.data_path=[{data / 'json'}]",
        f"data.tokenizer={data / 'tokenizer.json'}", "data.split=90,10,0", "train.micro_batch_size=4",
        "train.global_batch_size=8", "train.eval_interval=20", "optimizer.lr_warmup_iters=5",
        f"logging.run_dir={run_dir}", "logging.log_interval=100", *extra,
    ]


def read_metrics(run_dir: Path):
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _train(rank, world_size, overrides):
    from pretrain.config import load_config
    from pretrain.training.loop import Trainer

    trainer = Trainer(load_config(str(ROOT / "configs/models/glm5-tiny.yaml"), overrides))
    return trainer.train()


def test_loss_falls_on_stdlib_code(stdlib_data, tmp_path):
    run_ranks(_train, 1, tiny_overrides(stdlib_data, tmp_path, "train.train_iters=40"))
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 41))
    first = sum(r["loss"] for r in rows[:5]) / 5
    last = sum(r["loss"] for r in rows[-5:]) / 5
    assert last < first - 1.0, (first, last)
    valid = [r["valid_loss"] for r in rows if r.get("valid_loss") is not None]
    assert len(valid) == 2 and valid[1] < valid[0]
    for key in ("lr", "grad_norm", "tokens_per_sec", "tflops_per_gpu", "mem_peak_gb", "mtp_loss_1", "mtp_loss_3", "aux_loss"):
        assert rows[-1][key] is not None, key
    assert not any(r["skipped"] for r in rows)


def _train_with_nan(rank, world_size, overrides, poison_steps):
    """Poison the loss on given steps (as a numerical blow-up would) and train on."""
    import torch

    from pretrain.config import load_config
    from pretrain.training import loop
    from pretrain.training.loop import Trainer

    original = loop.Trainer._loss_total
    calls = {"n": 0}

    def loss_total(self, losses):
        calls["n"] += 1
        if calls["n"] in poison_steps:
            for item in losses:
                item["lm loss"][0] = torch.nan
        return original(self, losses)

    loop.Trainer._loss_total = loss_total
    trainer = Trainer(load_config(str(ROOT / "configs/models/glm5-tiny.yaml"), overrides))
    before = {n: p.detach().clone() for n, p in trainer.model[0].named_parameters()}
    try:
        trainer.train()
    except loop.TrainingStopped as err:
        return {"stopped": str(err), "iteration": trainer.iteration}
    after = {n: p.detach() for n, p in trainer.model[0].named_parameters()}
    return {"stopped": None, "iteration": trainer.iteration, "finite": all(torch.isfinite(p).all() for p in after.values()),
            "changed": any(not torch.equal(before[n], after[n]) for n in before)}


def test_nan_steps_are_skipped_then_stop(stdlib_data, tmp_path):
    result = run_ranks(_train_with_nan, 1, tiny_overrides(stdlib_data, tmp_path / "a", "train.train_iters=6",
                                                           "train.eval_interval=null"), {2, 4}, env=RANK_ENV)[0]
    assert result["stopped"] is None and result["finite"] and result["changed"]
    rows = read_metrics(tmp_path / "a")
    assert [r["skipped"] for r in rows] == [False, True, False, True, False, False]
    result = run_ranks(_train_with_nan, 1, tiny_overrides(stdlib_data, tmp_path / "b", "train.train_iters=10",
                                                           "train.eval_interval=null", "train.max_consecutive_nan_steps=3"),
                       {3, 4, 5, 6}, env=RANK_ENV)[0]
    assert result["stopped"] and "3 consecutive steps" in result["stopped"] and result["iteration"] == 5


BAD_LAUNCHES = {  # overrides, environment, the key the one-line error names
    "tp_world": (["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"], {"WORLD_SIZE": "3"},
                 "parallel.tensor_model_parallel_size"),
    "batch": (["train.global_batch_size=12"], {"WORLD_SIZE": "2"}, "train.global_batch_size"),
    "tokenizer": (["data.mock=false", "data.data_path=[/nonexistent/prefix]", "data.tokenizer=/nonexistent/tokenizer.json"],
                  {}, "data.tokenizer"),
    "seq_length": (["data.seq_length=8192"], {}, "data.seq_length"),
    "bf16": (["model.bf16=true", "model.params_dtype=bfloat16"], {}, "model.bf16"),
    "load": (["checkpoint.load=/nonexistent/ckpt"], {}, "checkpoint.load"),
}


@pytest.fixture(scope="module")
def bad_launches(tmp_path_factory):
    import torch

    run_dir = tmp_path_factory.mktemp("bad_launches")
    calls = {name: ("pretrain.train", ["--config", "configs/models/glm5-tiny.yaml", f"logging.run_dir={run_dir / name}",
                                       *overrides], env)
             for name, (overrides, env, _) in BAD_LAUNCHES.items()}
    if torch.cuda.is_available():
        del calls["bf16"]  # bf16 is allowed on a GPU
    # one process for all (torch and megatron-core imported once, not ~9 s per launch)
    return run_dir, run_command_lines(calls, cwd=str(ROOT))


@pytest.mark.parametrize("case", list(BAD_LAUNCHES))
def test_bad_launch_fails_before_any_process_group(bad_launches, case):
    run_dir, results = bad_launches
    if case not in results:
        pytest.skip("bf16 is allowed on a GPU")
    got, message = results[case], BAD_LAUNCHES[case][2]
    assert got["code"] == 2, got["stderr"][-2000:]
    assert message in got["stderr"]
    assert "Traceback" not in got["stderr"]
    assert not got["process_group"]
    assert not (run_dir / case / "metrics.jsonl").exists()


def test_bad_launch_command_line_exits_2_with_one_line(tmp_path):
    """The command line itself (a misspelt key fails before torch is imported, so this process is cheap)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pretrain.train", "--config", "configs/models/glm5-tiny.yaml",
         f"logging.run_dir={tmp_path}", "model.num_layer=3"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "model.num_layers" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def _save_initial(rank, world_size, overrides):
    from pretrain.config import load_config
    from pretrain.training.loop import Trainer

    Trainer(load_config(str(ROOT / "configs/models/glm5-tiny.yaml"), overrides)).save()


DSA_SPARSE = ["model.dsa_sparse_attention=true", "model.dsa_indexer_topk=16", "model.dsa_indexer_loss_coeff=0.5",
              "model.dsa_indexer_use_sparse_loss=true"]


@pytest.mark.parametrize("extra", [[], DSA_SPARSE], ids=["dense", "dsa_sparse"])
def test_pipeline_parallel_matches_single_stage(stdlib_data, tmp_path, extra):
    """1F1B over 2 pipeline stages (MTP and the MoE layer on the last) gives the 1-stage losses,
    starting from the same weights (a 1-stage checkpoint of step 0, resharded on load); with DSA
    sparse attention, also each stage's indexer losses (reduced over the pipeline). Over 4 steps of the
    trainer it compares losses and the gradient norm; every parameter's gradient of one step is
    compared in test_pipeline_equivalence.py."""
    init = tmp_path / "init"
    base = ["train.train_iters=4", "train.eval_interval=null", "optimizer.lr_warmup_iters=2", *extra]
    run_ranks(_save_initial, 1, tiny_overrides(stdlib_data, tmp_path / "init_run", *base, f"checkpoint.save={init}"),
              env=RANK_ENV)
    start = [*base, f"checkpoint.load={init}"]
    run_ranks(_train, 1, tiny_overrides(stdlib_data, tmp_path / "pp1", *start), env=RANK_ENV)
    run_ranks(_train, 2, tiny_overrides(stdlib_data, tmp_path / "pp2", *start, "parallel.pipeline_model_parallel_size=2"),
              env=RANK_ENV)
    a, b = read_metrics(tmp_path / "pp1"), read_metrics(tmp_path / "pp2")
    assert len(a) == len(b) == 4
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
        assert y["mtp_loss_3"] == pytest.approx(x["mtp_loss_3"], rel=1e-5)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)
        if extra:
            for key in ("indexer_loss", "indexer_loss/layer_01", "indexer_loss/layer_02", "indexer_loss/mtp"):
                # KL values near 0 are differences of nearly equal sums: an absolute tolerance too
                assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-8)


def _resumed_iteration(rank, world_size, overrides):
    from pretrain.config import load_config
    from pretrain.training.loop import Trainer

    return Trainer(load_config(str(ROOT / "configs/models/glm5-tiny.yaml"), overrides)).iteration


def test_restart_prefers_its_own_checkpoints_over_the_starting_one(stdlib_data, tmp_path):
    init, own = tmp_path / "init", tmp_path / "own"
    base = ["train.train_iters=4", "train.eval_interval=null", "optimizer.lr_warmup_iters=2"]
    run_ranks(_save_initial, 1, tiny_overrides(stdlib_data, tmp_path / "r0", *base, f"checkpoint.save={init}"), env=RANK_ENV)
    run_args = [*base, f"checkpoint.load={init}", f"checkpoint.save={own}", "checkpoint.save_interval=2"]
    run_ranks(_train, 1, tiny_overrides(stdlib_data, tmp_path / "r1", *run_args), env=RANK_ENV)
    assert run_ranks(_resumed_iteration, 1, tiny_overrides(stdlib_data, tmp_path / "r2", *run_args), env=RANK_ENV)[0] == 4
    no_auto = [*run_args, "checkpoint.auto_resume=false"]
    assert run_ranks(_resumed_iteration, 1, tiny_overrides(stdlib_data, tmp_path / "r3", *no_auto), env=RANK_ENV)[0] == 0


def test_overlapped_gradient_reduction_matches_plain(stdlib_data, tmp_path):
    """DP=2 with megatron's bucketed all-reduce overlapped with backward gives the same losses."""
    base = ["train.train_iters=3", "train.eval_interval=null", "optimizer.lr_warmup_iters=2"]
    run_ranks(_train, 2, tiny_overrides(stdlib_data, tmp_path / "a", *base, "parallel.overlap_grad_reduce=true"), env=RANK_ENV)
    run_ranks(_train, 2, tiny_overrides(stdlib_data, tmp_path / "b", *base, "parallel.overlap_grad_reduce=false"), env=RANK_ENV)
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert len(a) == 3
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5)
