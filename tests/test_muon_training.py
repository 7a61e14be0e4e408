"""Muon in the training loop (pretrain/optim/roles.py), fp32 on CPU through gloo.

* which update every parameter of the tiny GLM-5 gets (AdamW / Muon whole / Muon Split blocks);
* one Trainer step equals a naive float64 Muon / AdamW step computed here from the same gradients;
* tensor-, pipeline-, data- and expert-tensor-parallel runs give the single-rank losses step after
  step (starting from one checkpoint), so TP-sharded matrices and ETP-sharded expert blocks are
  orthogonalized whole and head blocks locally;
* a run resumed from its step-2 checkpoint continues exactly as the uninterrupted run.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.distributed import run_ranks_eager as run_ranks  # every comparison's sides run in ranks
from tests.test_training import ROOT, read_metrics, tiny_overrides

TINY = str(ROOT / "configs/models/glm5-tiny.yaml")
MUON = ["optimizer.optimizer=muon", "optimizer.lr=0.01", "optimizer.muon_ns_dtype=float32"]


def _roles(rank, world_size, overrides):
    from megatron.core.utils import unwrap_model

    from pretrain.config import load_config
    from pretrain.training.loop import Trainer
    from pretrain.optim import muon_roles

    trainer = Trainer(load_config(TINY, overrides))
    names = {id(p): n for chunk in unwrap_model(trainer.model) for n, p in chunk.named_parameters()}
    return {names[id(p)]: (role, None if split is None else (split.groups, split.sections, split.axis, split.cols), p.ndim)
            for p, role, split in muon_roles(trainer.optimizer)}


def _shapes(rank, world_size, overrides):
    from megatron.core.utils import unwrap_model

    from pretrain.config import load_config
    from pretrain.training.loop import Trainer

    trainer = Trainer(load_config(TINY, overrides))
    return {n: tuple(p.shape) for chunk in unwrap_model(trainer.model) for n, p in chunk.named_parameters()}


def test_parameter_roles(tmp_path):
    # the indexer trains (and so is in the optimizer) only with an indexer loss
    base = ["data.mock=true", f"logging.run_dir={tmp_path}", "model.dsa_indexer_loss_coeff=0.1", *MUON]
    roles = run_ranks(_roles, 1, [*base, "optimizer.muon_split_glu=true"])[0]
    shape = run_ranks(_shapes, 1, base)[0]
    cfg_heads, qk, rope, v = 4, 24, 8, 32  # glm5-tiny
    assert sum(n.endswith("linear_fc1.weight") for n in roles) >= 3  # dense MLP, shared experts, MTP
    for name, (role, split, ndim) in roles.items():
        if ndim == 1 or "word_embeddings" in name or "output_layer" in name or name.endswith("router.weight"):
            assert role == "adamw", name
        elif name.endswith("linear_q_up_proj.weight"):
            assert (role, split) == ("muon", (cfg_heads, (qk + rope,), 0, ())), name
        elif name.endswith("linear_kv_up_proj.weight"):
            assert (role, split) == ("muon", (cfg_heads, (qk, v), 0, ())), name
        elif name.endswith("experts.weight1"):  # the layer's view(E, hidden, 2 ffn), gate | up apart
            assert role == "muon" and split == (8, (64,), 2, (32, 32)), name
        elif name.endswith("experts.weight2"):
            assert role == "muon" and split[0] == 8 and split[2] == 0, name
        elif name.endswith("linear_fc1.weight") and ".indexer." not in name:  # SwiGLU [gate; up]
            assert role == "muon" and split[:3] == (1, (shape[name][0] // 2,) * 2, 0), name
        else:
            assert (role, split) == ("muon", None), name
    assert any(".indexer." in n and r == "muon" for n, (r, _, _) in roles.items())
    assert sum(r == "muon" for r, _, _ in roles.values()) >= 10
    # the ablation switch and the configurable placements (SwiGLU fc1 whole: the default)
    off = run_ranks(_roles, 1, [*base, "optimizer.muon_split=false", "optimizer.muon_router=muon",
                                "optimizer.muon_indexer=adamw"])[0]
    for name, (role, split, _) in off.items():
        if name.endswith(("linear_q_up_proj.weight", "linear_kv_up_proj.weight", "linear_fc1.weight")):
            assert split is None
        if name.endswith("experts.weight1"):
            assert split == (8, (64,), 2, ())
        if name.endswith("router.weight"):
            assert role == "muon"
        if ".indexer." in name:
            assert role == "adamw"


def test_gqa_qkv_is_split_per_query_group(tmp_path):
    """GQA (the attention ablation's arm): the fused QKV [groups x (q heads of the group + k + v) x d,
    hidden] gets one block per group and section, Q / K / V apart."""
    over = ["data.mock=true", f"logging.run_dir={tmp_path}", "model.multi_latent_attention=false",
            "model.experimental_attention_variant=null", "model.num_attention_heads=4", "model.num_query_groups=2",
            "model.kv_channels=16", *MUON]
    roles = run_ranks(_roles, 1, over)[0]
    qkv = [v for n, v in roles.items() if n.endswith("linear_qkv.weight")]
    assert qkv and all(v == ("muon", (2, (32, 16, 16), 0, ()), 2) for v in qkv), qkv


def _one_step(rank, world_size, overrides):
    """Parameters before and after one training step, and the gradients that step used."""
    from megatron.core.utils import unwrap_model

    from pretrain.config import load_config
    from pretrain.training.loop import Trainer
    from pretrain.optim import muon_roles

    trainer = Trainer(load_config(TINY, overrides))
    chunk = unwrap_model(trainer.model)[0]
    before = {n: p.detach().clone() for n, p in chunk.named_parameters()}
    grads, used = {}, {}
    original = trainer.optimizer_step

    def step(grad_norm):  # the gradients, learning rate and weight decay this update uses
        for n, p in chunk.named_parameters():
            if not p.requires_grad:
                continue
            g = getattr(p, "main_grad", None)
            grads[n] = (g if g is not None else p.grad).detach().clone()
        used["lr"] = trainer.optimizer.param_groups[0]["lr"]
        used["wd"] = {id(p): g["weight_decay"] for g in trainer.optimizer.param_groups for p in g["params"]}
        return original(grad_norm)

    trainer.optimizer_step = step
    trainer.train()
    names = {id(p): n for n, p in chunk.named_parameters()}
    roles = {names[id(p)]: (role, split) for p, role, split in muon_roles(trainer.optimizer)}
    after = {n: p.detach().clone() for n, p in chunk.named_parameters()}
    lr = used["lr"]
    wd = {names[i]: v for i, v in used["wd"].items()}
    return before, after, grads, roles, lr, wd


def _naive_polar_step(g: torch.Tensor, steps: int) -> torch.Tensor:
    """Quintic Newton-Schulz in float64, written out here (first Muon step: momentum buffer = g)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def test_first_trainer_step_equals_a_naive_step(tmp_path):
    over = ["data.mock=true", f"logging.run_dir={tmp_path}", "train.train_iters=1", "train.eval_interval=null",
            "optimizer.lr_warmup_iters=0", "optimizer.clip_grad=0.0", *MUON]
    before, after, grads, roles, lr, wd = run_ranks(_one_step, 1, over)[0]
    mu, checked = 0.95, 0
    for name, (role, split) in roles.items():
        g = grads[name].double()
        w = before[name].double()
        if role == "adamw":  # first AdamW step: m/(sqrt(v)+eps) = g / (|g| + eps)
            update = g / (g.abs() + 1e-8)
        else:
            u = g + mu * g  # Nesterov on the first step: g + mu * (mu * 0 + g)
            if split is None:
                update = _naive_polar_step(u, 5) * 0.2 * math.sqrt(max(u.shape))
            else:
                update = torch.zeros_like(u)
                if split.axis == 2:  # grouped experts' weight1: expert e = u.view(E, hidden, -1)[e], gate | up
                    experts = u.view(split.groups, split.sections[0], -1)
                    halves = [slice(0, experts.shape[-1] // 2), slice(experts.shape[-1] // 2, None)]
                    for k, expert in enumerate(experts):
                        for cols in halves if split.cols else [slice(None)]:
                            blk = expert[:, cols]
                            out = _naive_polar_step(blk, 5) * 0.2 * math.sqrt(max(blk.shape))
                            update.view(split.groups, split.sections[0], -1)[k][:, cols] = out
                    split = None
                per = 0 if split is None else sum(split.sections)
                for k in range(split.groups if split is not None else 0):
                    off = 0
                    for sec in split.sections:
                        idx = slice(k * per + off, k * per + off + sec)
                        blk = u[idx] if split.axis == 0 else u[:, idx]
                        out = _naive_polar_step(blk, 5) * 0.2 * math.sqrt(max(blk.shape))
                        if split.axis == 0:
                            update[idx] = out
                        else:
                            update[:, idx] = out
                        off += sec
        want = w * (1 - lr * wd[name]) - lr * update
        got = after[name].double()
        assert (got - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item()), (name, role)
        checked += role == "muon"
    assert checked >= 10


def _save_initial(rank, world_size, overrides):
    from pretrain.config import load_config
    from pretrain.training.loop import Trainer

    Trainer(load_config(TINY, overrides)).save()


def _train(rank, world_size, overrides, blockwise_tp: bool = False):
    from pretrain.config import load_config
    from pretrain.optim import roles
    from pretrain.training.loop import Trainer

    if blockwise_tp:  # the mistake the TP test must catch: orthogonalizing each TP shard on its own
        roles.tp_group_of = lambda name, p: None
    return Trainer(load_config(TINY, overrides)).train()


LAYOUTS = {
    "tp2": ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
    "pp2": ["parallel.pipeline_model_parallel_size=2"],
    "dp2": [],
}
# expert tensor parallelism across the 2 ranks, attention replicated (TP = 1)
ETP2 = ["parallel.expert_tensor_parallel_size=2"]


@pytest.fixture(scope="module")
def muon_runs(stdlib_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("muon")
    base = ["train.train_iters=4", "train.eval_interval=null", "optimizer.lr_warmup_iters=1", *MUON]
    init = root / "init"
    run_ranks(_save_initial, 1, tiny_overrides(stdlib_data, root / "r0", *base, f"checkpoint.save={init}"))
    start = [*base, f"checkpoint.load={init}"]
    run_ranks(_train, 1, tiny_overrides(stdlib_data, root / "single", *start))
    for name, extra in LAYOUTS.items():
        run_ranks(_train, 2, tiny_overrides(stdlib_data, root / name, *start, *extra))
    run_ranks(_train, 2, tiny_overrides(stdlib_data, root / "tp2_blockwise", *start, *LAYOUTS["tp2"]), True)
    run_ranks(_train, 2, tiny_overrides(stdlib_data, root / "etp2", *start, *ETP2))
    return root


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layouts_match_single_rank(muon_runs, layout):
    ref, got = read_metrics(muon_runs / "single"), read_metrics(muon_runs / layout)
    assert len(ref) == len(got) == 4
    assert ref[-1]["loss"] < ref[0]["loss"] - 0.05  # Muon steps moved the model
    for x, y in zip(ref, got):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), layout
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4), layout


def test_expert_tensor_parallel_matches_single_rank(muon_runs):
    """ETP = 2 cuts every expert's ffn dimension: each expert's update must be orthogonalized on the
    expert gathered over the expert-tensor-parallel group (orthogonalizing the slices on their own
    drifts by ~5e-4 in loss after 4 steps here)."""
    ref, got = read_metrics(muon_runs / "single"), read_metrics(muon_runs / "etp2")
    assert len(ref) == len(got) == 4
    for x, y in zip(ref, got):
        assert abs(y["loss"] - x["loss"]) <= 1e-5, (x["step"], x["loss"], y["loss"])
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)


def test_tp_shards_orthogonalized_separately_would_be_caught(muon_runs):
    """Sensitivity of the TP comparison: Muon on each rank's shard alone drifts from single rank."""
    ref, got = read_metrics(muon_runs / "single"), read_metrics(muon_runs / "tp2_blockwise")
    assert abs(got[-1]["loss"] - ref[-1]["loss"]) > 1e-4 * abs(ref[-1]["loss"])


def test_resume_continues_exactly(stdlib_data, tmp_path):
    """Momentum buffers and AdamW moments come back from the checkpoint: steps 3-4 of a run resumed at
    step 2 equal those of the uninterrupted run (same schedule: lr_decay_iters fixed), and the resumed
    run saves again (megatron keeps one step count shared by all parameters, Muon's included)."""
    base = ["train.eval_interval=null", "optimizer.lr_warmup_iters=1", "optimizer.lr_decay_iters=4", *MUON]
    ckpt = tmp_path / "ckpt"
    run_ranks(_train, 1, tiny_overrides(stdlib_data, tmp_path / "full", *base, "train.train_iters=4"))
    run_ranks(_train, 1, tiny_overrides(stdlib_data, tmp_path / "a", *base, "train.train_iters=2", f"checkpoint.save={ckpt}"))
    run_ranks(_train, 1, tiny_overrides(stdlib_data, tmp_path / "b", *base, "train.train_iters=4", f"checkpoint.load={ckpt}",
                                        f"checkpoint.save={tmp_path / 'ckpt_b'}"))
    assert (tmp_path / "ckpt_b" / "latest").exists() or any((tmp_path / "ckpt_b").iterdir())
    full, resumed = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "b")
    assert [r["step"] for r in resumed] == [3, 4]
    for x, y in zip(full[2:], resumed):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-6)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-6)
    # the same checkpoint loaded into TP=2 (momentum and moments resharded) continues alike
    run_ranks(_train, 2, tiny_overrides(stdlib_data, tmp_path / "tp2", *base, "train.train_iters=4",
                                        f"checkpoint.load={ckpt}", *LAYOUTS["tp2"]))
    for x, y in zip(full[2:], read_metrics(tmp_path / "tp2")):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)
    momentum = run_ranks(_loaded_momentum, 1, tiny_overrides(stdlib_data, tmp_path / "c", *base, "train.train_iters=4",
                                                              f"checkpoint.load={ckpt}"))
    assert momentum[0] > 0  # the buffers came back (a fresh optimizer starts at zero)


def _loaded_momentum(rank, world_size, overrides):
    from pretrain.config import load_config
    from pretrain.training.loop import Trainer

    trainer = Trainer(load_config(TINY, overrides))
    assert trainer.iteration == 2
    total = 0.0
    for sub in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        for state in sub.optimizer.state.values():
            if "momentum_buffer" in state:
                total += float(state["momentum_buffer"].abs().sum())
    return total
