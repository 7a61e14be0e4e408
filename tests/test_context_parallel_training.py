"""Training under context parallelism through the real loop (`pretrain.training.loop.Trainer`).

The tiny GLM-5 (2 MTP depths, MoE, fp32) on mock data, Muon with fp32 Newton-Schulz, 2 steps of a
global batch of 4 sequences of 32 tokens, all from one saved initial state:

* Muon + ZeRO-2 over DP = 2 x CP = 2 (4 ranks; gradients reduced to their owners over the
  data-parallel group with context parallelism) logs the single-rank run's loss, gradient norm, MTP
  and MoE auxiliary losses and ends with its weights (relative 1e-5);
* its step-1 checkpoint resumes under CP = 1 (one rank, no ZeRO), and the single-rank step-1
  checkpoint resumes under DP = 2 x CP = 2: both train step 2 to the uninterrupted run's loss and
  weights, so checkpoints carry nothing CP-specific and the data position resumes right.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List

import pytest
import torch

from tests.distributed import run_ranks
from tests.test_context_parallel import RANK_ENV, SEQ, TINY, TOL, VOCAB

STEPS = 2
TRAIN = [f"model.vocab_size={VOCAB}", f"data.seq_length={SEQ}", "model.mtp_num_layers=2",
         "model.moe_token_dispatcher_type=allgather", "train.micro_batch_size=2", "train.global_batch_size=4",
         f"train.train_iters={STEPS}", "train.eval_interval=null", "optimizer.lr_warmup_iters=1",
         "logging.log_interval=100", "optimizer.optimizer=muon", "optimizer.lr=0.01",
         "optimizer.muon_ns_dtype=float32", "optimizer.adam_eps=1e-4"]


def rank_train(rank: int, world_size: int, jobs: List[List[str]]) -> List[dict]:
    """Trainer runs in turn (overrides each); a job starting with "save-initial" only saves the initial state."""
    from megatron.core.utils import unwrap_model

    from pretrain.config import load_config
    from pretrain.training.loop import Trainer

    out = []
    for job in jobs:
        save_only = job[0] == "save-initial"
        trainer = Trainer(load_config(TINY, TRAIN + job[save_only:]))
        if save_only:
            trainer.save()
        else:
            trainer.train()
        out.append({n: p.detach().clone() for c in unwrap_model(trainer.model) for n, p in c.named_parameters()})
    return out


def _metrics(run_dir: Path) -> List[dict]:
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp_training")
    init = root / "init"
    ((_, single),) = run_ranks(rank_train, 1, [
        ["save-initial", f"checkpoint.save={init}", f"logging.run_dir={root / 'init_run'}"],
        [f"checkpoint.load={init}", f"checkpoint.save={root / 'single_ckpt'}", "checkpoint.save_interval=1",
         f"logging.run_dir={root / 'single'}"],
    ], env=RANK_ENV)
    _step1_only(root / "single_ckpt", root / "single_step1")
    zero, back = zip(*run_ranks(rank_train, 4, [
        [*ZERO2_CP2, f"checkpoint.load={init}", f"checkpoint.save={root / 'zero_ckpt'}", "checkpoint.save_interval=1",
         f"logging.run_dir={root / 'zero'}"],
        # the one-rank checkpoint after step 1, resumed under CP = 2 for step 2
        [*ZERO2_CP2, f"checkpoint.load={root / 'single_step1'}", f"logging.run_dir={root / 'back'}"],
    ], env=RANK_ENV))
    # The CP = 2 checkpoint after step 1, resumed on one rank (CP = 1, no ZeRO) for step 2.
    _step1_only(root / "zero_ckpt", root / "zero_step1")
    (resumed,) = run_ranks(rank_train, 1, [[f"checkpoint.load={root / 'zero_step1'}",
                                            f"logging.run_dir={root / 'resumed'}"]], env=RANK_ENV)
    return {"root": root, "single": single, "zero": list(zero), "back": list(back), "resumed": resumed[0]}


ZERO2_CP2 = ["parallel.context_parallel_size=2", "optimizer.use_distributed_optimizer=true"]


def _step1_only(save_dir: Path, out: Path) -> None:
    """A checkpoint directory holding only `save_dir`'s step-1 checkpoint (what a run stopped there left)."""
    import json
    import shutil

    shutil.copytree(save_dir / "iter_0000001", out / "iter_0000001")
    (out / "latest").write_text(json.dumps({"step_dir": "iter_0000001", "iteration": 1}))


def _close(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(want), what
    for name, w in want.items():
        err = (got[name] - w).abs().max().item() / max(1.0, w.abs().max().item())
        assert err <= TOL, f"{what} {name}: {err:.2e}"


def test_zero2_over_dp_x_cp_matches_single_rank(training):
    import json

    root = training["root"]
    ref, got = _metrics(root / "single"), _metrics(root / "zero")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert ref[-1]["loss"] != ref[0]["loss"]  # the first step moved the model
    layout = json.loads((root / "zero_ckpt" / "iter_0000001" / "complete.json").read_text())["layout"]
    assert (layout["context_parallel_size"], layout["data_parallel_size"]) == (2, 2)
    for x, y in zip(ref, got):
        for key in ("loss", "grad_norm", "mtp_loss_1", "mtp_loss_2", "aux_loss"):
            assert y[key] == pytest.approx(x[key], rel=TOL), key
    for rank, params in enumerate(training["zero"]):
        _close(params, training["single"], f"DP=2 x CP=2 ZeRO-2 rank {rank}")


@pytest.mark.parametrize("run", ["resumed", "back"])
def test_checkpoint_resumes_across_cp_sizes(training, run):
    """resumed: the CP=2 (ZeRO-2) checkpoint of step 1 trains step 2 on one rank; back: the one-rank
    checkpoint of step 1 trains step 2 under DP=2 x CP=2. Both end where the uninterrupted run does."""
    root = training["root"]
    ref, got = _metrics(root / "single"), _metrics(root / run)
    assert [r["step"] for r in got] == [STEPS]
    assert got[0]["loss"] == pytest.approx(ref[-1]["loss"], rel=TOL)
    for rank, params in enumerate(training[run] if run == "back" else [training[run]]):
        _close(params, training["single"], f"{run} rank {rank}")
