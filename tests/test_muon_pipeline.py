"""Muon's Newton-Schulz shared between pipeline ranks (`optimizer.muon_pipeline_balance`,
pretrain/optim/muon_pipeline.py).

* the plan against brute force: on small random class counts for 2 ranks, the busiest rank's load after the greedy
  plan is within one block of the best split any moves could reach, never above the load before, counts conserved,
  and with 3 ranks no rank both sends and receives;
* training: PP=2 with Muon (fp32 on gloo, 3 steps, 4 micro-batches) ends with the same weights with the balance as
  without it (1e-6), and the balance moved blocks (the tiny model cut to 3 layers with all decoder layers on the
  first stage, which then holds most of the Muon matrices);
* the key is refused in one line without PP, with ZeRO-2, or with AdamW.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from pretrain.config import ConfigError
from pretrain.optim.muon_pipeline import balance_plan, block_flops
from tests.config_helpers import tiny
from tests.distributed import run_ranks
from tests.test_training import RANK_ENV, ROOT, tiny_overrides

KEY = "optimizer.muon_pipeline_balance"


def _loads(counts, moves):
    load = [sum(block_flops(k) * v for k, v in c.items()) for c in counts]
    for key, ms in moves.items():
        for src, dst, k in ms:
            load[src] -= k * block_flops(key)
            load[dst] += k * block_flops(key)
    return load


def test_plan_is_within_one_block_of_the_best_split():
    rng = random.Random(0)
    keys = [("bfloat16", 5, 64, 128), ("bfloat16", 5, 32, 32), ("bfloat16", 5, 128, 256)]
    for _ in range(40):
        counts = [{k: rng.randint(0, 5) for k in keys} for _ in range(2)]
        moves = balance_plan(counts)
        after = _loads(counts, moves)
        before = _loads(counts, {})
        for key, ms in moves.items():
            for src, dst, k in ms:
                assert 0 < k and src != dst
            assert sum(k for src, _, k in ms if src == 0) <= counts[0].get(key, 0)
            assert sum(k for src, _, k in ms if src == 1) <= counts[1].get(key, 0)
        best = min(  # brute force: every number of blocks of every class moved either way
            max(_loads(counts, {k: [(0, 1, a)] if a > 0 else [(1, 0, -a)] if a < 0 else [] for k, a in zip(keys, amounts)}))
            for amounts in itertools.product(*[range(-counts[1][k], counts[0][k] + 1) for k in keys]))
        assert max(after) <= max(before) + 1e-6
        assert max(after) <= best + max(block_flops(k) for k in keys) + 1e-6, (counts, moves)


def test_plan_never_makes_a_rank_both_send_and_receive():
    rng = random.Random(1)
    keys = [("bfloat16", 5, 64, 128), ("float32", 5, 32, 64)]
    for _ in range(30):
        counts = [{k: rng.randint(0, 8) for k in keys} for _ in range(3)]
        moves = balance_plan(counts)
        senders = {src for ms in moves.values() for src, _, _ in ms}
        takers = {dst for ms in moves.values() for _, dst, _ in ms}
        assert not senders & takers
        assert moves == balance_plan(counts)  # deterministic


LAYOUT = ["model.num_layers=3", "model.moe_layer_freq=[0,1,1]", "parallel.pipeline_model_parallel_size=2",
          "parallel.pipeline_model_parallel_layout=Et*3|m*3L"]
BASE = ["train.train_iters=3", "train.eval_interval=null", "optimizer.lr_warmup_iters=0", "optimizer.optimizer=muon",
        "optimizer.lr=0.01", "optimizer.muon_ns_dtype=float32", "train.micro_batch_size=1",
        "train.global_batch_size=4"]


def _train(rank, world_size, overrides):
    from megatron.core.utils import unwrap_model

    from pretrain.config import load_config
    from pretrain.optim import sub_optimizers
    from pretrain.training.loop import Trainer

    trainer = Trainer(load_config(str(ROOT / "configs/models/glm5-tiny.yaml"), overrides))
    trainer.train()
    moves = [sub.optimizer.pipeline_balance.moves for sub in sub_optimizers(trainer.optimizer)
             if sub.optimizer.pipeline_balance is not None]
    params = {n: p.detach().clone() for c in unwrap_model(trainer.model) for n, p in c.named_parameters()}
    return {"params": params, "moves": moves}


def test_balanced_pipeline_trains_to_the_same_weights(stdlib_data, tmp_path):
    over = [*BASE, *LAYOUT]
    plain = run_ranks(_train, 2, tiny_overrides(stdlib_data, tmp_path / "plain", *over), env=RANK_ENV)
    balanced = run_ranks(_train, 2, tiny_overrides(stdlib_data, tmp_path / "balanced", *over, f"{KEY}=true"),
                         env=RANK_ENV)
    assert all(not r["moves"] for r in plain)
    moved = [k for r in balanced[:1] for plan in r["moves"] for ms in plan.values() for _, _, k in ms]
    assert balanced[0]["moves"] and sum(moved) > 0, balanced[0]["moves"]
    assert balanced[0]["moves"] == balanced[1]["moves"]
    for rank in range(2):
        for name, want in plain[rank]["params"].items():
            got = balanced[rank]["params"][name]
            err = (got - want).abs().max().item()
            assert err <= 1e-6 * max(1.0, want.abs().max().item()), (rank, name, err)


@pytest.mark.parametrize("extra, says", [
    ([], "pipeline_model_parallel_size=1"),
    (["parallel.pipeline_model_parallel_size=2", "optimizer.optimizer=adam"], "optimizer=adam"),
    (["parallel.pipeline_model_parallel_size=2", "optimizer.optimizer=muon", "optimizer.use_distributed_optimizer=true"],
     "use_distributed_optimizer=True"),
])
def test_key_is_refused_where_it_would_not_be_read(extra, says):
    with pytest.raises(ConfigError) as e:
        tiny(f"{KEY}=true", *extra)
    message = str(e.value)
    assert message.startswith(KEY) and says in message and "\n" not in message
