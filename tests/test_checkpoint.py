"""Checkpoints: exact resume and TP/PP resharding (files on disk, damage and load errors: test_checkpoint_files).

Every rank body runs in processes spawned by `run_ranks` (no parallel state in the pytest process).
The tiny GLM-5 trains with megatron's DDP, fp32 AdamW (`get_megatron_optimizer`, a ChainedOptimizer
of dense and expert parameters), the LR scheduler and `get_forward_backward_func`, as the trainer
does. Training data is drawn from the global torch RNG and dropout is on, so a resume only
reproduces the uninterrupted run if the RNG states come back too.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from tests.distributed import EAGER_ENV as RANK_ENV, run_ranks  # RANK_ENV: jit_fuser functions eager
from tests.parallel_helpers import param_meta, rank_coords, shard_like

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "models" / "glm5-tiny.yaml"
SEQ, MBS, VOCAB, MICROBATCHES = 32, 2, 512, 2
BASE = [
    f"model.vocab_size={VOCAB}",
    f"data.seq_length={SEQ}",
    "model.dsa_indexer_topk=16",
    "model.moe_token_dispatcher_type=allgather",
    "checkpoint.keep_last=2",
]
DROPOUT = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"]
LAYOUTS = {
    # megatron's MoELayer trains with TP > 1 only with sequence parallelism
    "tp2": ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
    "pp2": ["parallel.pipeline_model_parallel_size=2"],
}


def config(save_dir: str, overrides: List[str] = ()):
    from pretrain.config import load_config

    return load_config(TINY, BASE + [f"checkpoint.save={save_dir}", *overrides])


# ------------------------------------------------------------------------------------------------
# a training setup as in the trainer (module level: spawned ranks import these)
# ------------------------------------------------------------------------------------------------


class Setup:
    def __init__(self, cfg, seed: int):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from parallel.initialize import initialize_parallel
        from pretrain.model.builder import build_model

        self.cfg = cfg
        initialize_parallel(cfg.parallel, seed=seed)
        self.model = build_model(cfg)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False)
        self.ddp = DistributedDataParallel(self.model.config, ddp_config, self.model)
        self.model.config.finalize_model_grads_func = finalize_model_grads
        self.model.config.no_sync_func = self.ddp.no_sync
        o = cfg.optimizer
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
                            clip_grad=o.clip_grad, bf16=False),
            [self.ddp],
        )
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=2, lr_decay_steps=20,
            lr_decay_style="cosine", start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=20,
            wd_incr_style="constant",
        )
        self.schedule = get_forward_backward_func()
        self.iteration = 0

    @property
    def chunks(self):
        return [self.ddp]

    def step(self) -> torch.Tensor:
        """One optimizer step on micro-batches drawn from the global torch RNG; the summed loss."""
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = self.schedule(
            forward_step_func=_forward_step, data_iterator=iter(_random_batches, None), model=[self.ddp],
            num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=MBS, forward_only=False,
        )
        ok, _, _ = self.optimizer.step()
        assert ok
        self.scheduler.step(increment=1)
        self.iteration += 1
        return torch.stack([m["lm loss"] for m in losses]) if losses else None  # None: not the last stage

    def save(self, extra: Dict = None) -> str:
        from pretrain.training.checkpoint import save_checkpoint, wait_for_pruning

        extra = {"consumed_samples": self.iteration * MBS * MICROBATCHES, **(extra or {})}
        path = save_checkpoint(self.cfg.checkpoint.save, self.iteration, self.chunks, self.optimizer,
                               self.scheduler, self.cfg, extra)
        wait_for_pruning()  # older step dirs are deleted in the background: the listings below see the result
        return path

    def load(self, load_dir=None):
        from pretrain.training.checkpoint import load_checkpoint

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            restored = load_checkpoint(load_dir or self.cfg.checkpoint.save, self.chunks, self.optimizer,
                                       self.scheduler)
        if restored is not None:
            self.iteration = restored[0]
        return restored, [str(w.message) for w in caught if w.category.__name__ == "CheckpointWarning"]

    def snapshot(self) -> dict:
        """Parameters, buffers, Adam state by parameter name, scheduler and RNG states (copies)."""
        from pretrain.training.checkpoint import capture_rng_state

        names = {p: n for n, p in self.model.named_parameters()}
        adam = {}
        for opt in self.optimizer.chained_optimizers:
            for param, state in opt.optimizer.state.items():
                adam[names[param]] = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
        return {
            "params": {n: p.detach().clone() for n, p in self.model.named_parameters()},
            "buffers": {n: b.detach().clone() for n, b in self.model.named_buffers()},
            "adam": adam,
            "trainable": sorted(n for n, p in self.model.named_parameters() if p.requires_grad),
            "scheduler": self.scheduler.state_dict(),
            "rng": capture_rng_state(),
        }


def _random_batches() -> torch.Tensor:
    return torch.randint(0, VOCAB, (MBS, SEQ + 1))


def _loss_func(mask, output):
    total = (output.float() * mask).sum()
    count = mask.sum()
    return total, count.to(torch.int), {"lm loss": torch.stack([total.detach(), count.detach()])}


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _forward_step(data_iterator, model):
    ids = next(data_iterator).to(_device())
    tokens, labels = ids[:, :-1], ids[:, 1:]
    positions = torch.arange(SEQ, device=ids.device).unsqueeze(0).expand(MBS, -1)
    output = model(tokens, positions, None, labels=labels)
    return output, functools.partial(_loss_func, torch.ones_like(labels, dtype=torch.float))


def _eval_loss(setup: Setup):
    """Forward-only summed loss of a fixed batch through the schedule; None except on the last stage."""
    ids = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=torch.Generator().manual_seed(7))
    setup.ddp.eval()
    losses = setup.schedule(
        forward_step_func=_forward_step, data_iterator=iter([ids]), model=[setup.ddp], num_microbatches=1,
        seq_length=SEQ, micro_batch_size=MBS, forward_only=True,
    )
    setup.ddp.train()
    return losses[0]["lm loss"][0] if losses else None


# ------------------------------------------------------------------------------------------------
# rank bodies
# ------------------------------------------------------------------------------------------------


def rank_uninterrupted(rank: int, world_size: int, save_dir: str) -> dict:
    setup = Setup(config(save_dir, DROPOUT), seed=1)
    setup.step(), setup.step()
    setup.save()
    setup.step()
    path = setup.save({"note": "resume here"})
    saved = setup.snapshot()
    loss = setup.step()
    return {"path": path, "saved": saved, "next_loss": loss, "next_params": setup.snapshot()["params"]}


def rank_resumed(rank: int, world_size: int, save_dir: str) -> dict:
    import random

    setup = Setup(config(save_dir, DROPOUT), seed=2)  # other weights and RNG streams than the saved run
    torch.manual_seed(99), random.seed(99)
    restored, caught = setup.load()
    loaded = setup.snapshot()
    loss = setup.step()
    return {"restored": restored, "warnings": caught, "loaded": loaded, "next_loss": loss,
            "next_params": setup.snapshot()["params"]}


def _local_view(setup: Setup) -> dict:
    """This rank's parameters and Adam moments under global names (pipeline stages number their
    decoder layers from 0), with what `shard_like` needs to cut a single-rank tensor like them."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(setup.model.config)
    prefix = "decoder.layers."

    def global_name(name: str) -> str:
        if not name.startswith(prefix):
            return name
        layer, rest = name[len(prefix):].split(".", 1)
        return f"{prefix}{int(layer) + offset}.{rest}"

    snap = setup.snapshot()
    return {
        "coords": dict(rank_coords(), num_experts=setup.cfg.model.num_moe_experts),
        "meta": {global_name(n): param_meta(p) for n, p in setup.model.named_parameters()},
        "params": {global_name(n): t for n, t in snap["params"].items()},
        "exp_avg": {global_name(n): s["exp_avg"] for n, s in snap["adam"].items()},
        "adam_step": {global_name(n): s["step"] for n, s in snap["adam"].items()},
        "scheduler": snap["scheduler"],
        "eval_loss": _eval_loss(setup),
    }


def rank_save_then_view(rank: int, world_size: int, save_dir: str, layout: List[str]) -> dict:
    setup = Setup(config(save_dir, layout), seed=1)
    setup.step()
    setup.save()
    return _local_view(setup)


def rank_load_single(rank: int, world_size: int, save_dir: str) -> dict:
    setup = Setup(config(save_dir), seed=2)  # other weights: every value must come from the checkpoint
    restored, caught = setup.load()
    return {"restored": restored, "warnings": caught, **_local_view(setup)}


# ------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------


def _assert_equal_tree(a, b, where=""):
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {set(a) ^ set(b)}"
        for k in a:
            _assert_equal_tree(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory):
    save_dir = str(tmp_path_factory.mktemp("resume") / "ckpt")
    uninterrupted = run_ranks(rank_uninterrupted, 1, save_dir, env=RANK_ENV)[0]
    resumed = run_ranks(rank_resumed, 1, save_dir, env=RANK_ENV)[0]
    return save_dir, uninterrupted, resumed


def test_resume_restores_every_state_bitwise(resume_runs):
    save_dir, uninterrupted, resumed = resume_runs
    iteration, extra = resumed["restored"]
    assert iteration == 3 and uninterrupted["path"].endswith("iter_0000003")
    assert extra == {"consumed_samples": 3 * MBS * MICROBATCHES, "note": "resume here"}
    assert resumed["warnings"] == []
    saved, loaded = uninterrupted["saved"], resumed["loaded"]
    assert all(s["step"] == 3 for s in loaded["adam"].values())
    assert set(loaded["adam"]) == set(loaded["trainable"])  # every trained parameter has its Adam moments back
    for part in ["params", "buffers", "adam", "scheduler", "rng"]:
        _assert_equal_tree(saved[part], loaded[part], part)


def test_resumed_step_equals_uninterrupted_step(resume_runs):
    _, uninterrupted, resumed = resume_runs
    assert torch.equal(uninterrupted["next_loss"], resumed["next_loss"])
    _assert_equal_tree(uninterrupted["next_params"], resumed["next_params"], "params after the next step")


def test_saved_config_loads_back(resume_runs):
    from pretrain.config import config_to_dict, load_config

    save_dir, _, _ = resume_runs
    step_dir = Path(save_dir) / "iter_0000003"
    assert config_to_dict(load_config(step_dir / "config.yaml")) == config_to_dict(config(save_dir, DROPOUT))
    record = json.loads((step_dir / "complete.json").read_text())
    assert record["iteration"] == 3 and "config.yaml" in record["files"]
    assert sorted(os.listdir(save_dir)) == ["iter_0000002", "iter_0000003", "latest"]


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_load_checkpoint_into_another_layout(tmp_path, layout):
    """Saved on 2 ranks (TP=2 with sequence parallelism, or 2 pipeline stages: the first without MoE,
    so the ranks' optimizers differ in structure), loaded on 1: weights and Adam state reshard."""
    save_dir = str(tmp_path / "ckpt")
    saved = run_ranks(rank_save_then_view, 2, save_dir, LAYOUTS[layout], env=RANK_ENV)
    single = run_ranks(rank_load_single, 1, save_dir, env=RANK_ENV)[0]
    assert single["restored"][0] == 1
    assert any("resharded" in w for w in single["warnings"])
    assert single["scheduler"] == saved[0]["scheduler"]
    held = set()
    for rank_view in saved:
        for name, local in rank_view["params"].items():
            # what this rank holds of the single-rank tensor must be exactly its own shard
            meta, coords = rank_view["meta"][name], rank_view["coords"]
            assert torch.equal(shard_like(name, single["params"][name], meta, coords), local), name
            held.add(name)
            if name not in single["exp_avg"]:  # a frozen parameter (the DSA indexer) has no Adam state
                assert name not in rank_view["exp_avg"] and "indexer" in name, name
                continue
            exp_avg = shard_like(name, single["exp_avg"][name], meta, coords)
            assert torch.equal(exp_avg, rank_view["exp_avg"][name]), name
            assert single["adam_step"][name] == rank_view["adam_step"][name] == 1
    assert held == set(single["params"])
    ref = [v["eval_loss"] for v in saved if v["eval_loss"] is not None][0]
    assert torch.allclose(single["eval_loss"], ref, rtol=1e-5), (single["eval_loss"], ref)
