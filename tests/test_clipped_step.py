"""The training loop's optimizer step (`pretrain.optim.step_with_norm`: the gradient norm computed once, by the
loop) against megatron-core's own `optimizer.step()` (which prepares the gradients and computes the norm again
itself): the same weights after steps that clip, with AdamW and with Muon (fp32 on CPU, one rank)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.test_training import RANK_ENV, ROOT, tiny_overrides

# clip_grad far below the tiny model's gradient norm (about 1-10 on its first steps): every step clips
BASE = ["train.train_iters=3", "train.eval_interval=null", "optimizer.lr_warmup_iters=0", "optimizer.clip_grad=0.05"]
OPTIMIZERS = {"adam": [], "muon": ["optimizer.optimizer=muon", "optimizer.lr=0.01", "optimizer.muon_ns_dtype=float32"]}


def _train(rank, world_size, overrides, megatron_step: bool):
    from megatron.core.utils import unwrap_model

    from pretrain.config import load_config
    from pretrain.training.loop import Trainer

    trainer = Trainer(load_config(str(ROOT / "configs/models/glm5-tiny.yaml"), overrides))
    norms = []
    if megatron_step:
        def step(grad_norm):  # megatron's whole step: prepare_grads, its own norm, clip, update
            updated, norm, _ = trainer.optimizer.step()
            norms.append((grad_norm, norm))
            return bool(updated)

        trainer.optimizer_step = step
    trainer.train()
    params = {n: p.detach().clone() for c in unwrap_model(trainer.model) for n, p in c.named_parameters()}
    return {"params": params, "norms": norms}


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_step_with_the_loops_norm_equals_megatrons_step(stdlib_data, tmp_path, optimizer):
    over = [*BASE, *OPTIMIZERS[optimizer]]
    ours = run_ranks(_train, 1, tiny_overrides(stdlib_data, tmp_path / "ours", *over), False, env=RANK_ENV)[0]
    ref = run_ranks(_train, 1, tiny_overrides(stdlib_data, tmp_path / "ref", *over), True, env=RANK_ENV)[0]
    assert len(ref["norms"]) == 3 and all(ours_norm == pytest.approx(theirs, rel=1e-12) and theirs > 0.5
                                          for ours_norm, theirs in ref["norms"]), ref["norms"]
    moved = 0
    for name, want in ref["params"].items():
        got = ours["params"][name]
        assert torch.equal(got, want), (name, (got - want).abs().max().item())
        moved += 1
    assert moved > 10
