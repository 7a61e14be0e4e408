"""ZeRO-2 with Muon (pretrain/optim/zero2_grads.py, pretrain/optim/zero2_owner.py), fp32 on CPU through gloo.

The reference is always a run that does not shard: one rank (megatron's DDP, Muon updating every
parameter) from the same initial checkpoint and global batches.

* DP=2 (reducing once per step, or per micro-batch by reduce-scatter) and DP=4 (per micro-batch) with
  ZeRO-2 end with the reference's parameters after 6 steps (1e-6) and see its last step's reduced
  gradients (1e-5), as do TP=2 x DP=2, PP=2 x DP=2 and EP=2 x DP=4 (experts sharded
  over the expert-data-parallel group);
* every trainable parameter has exactly one owner; a rank keeps fp32 gradients only for what it owns
  (about 1/dp of the model) and non-owned parameters hold no gradient and no optimizer state;
* a ZeRO-2 checkpoint written at DP=2 resumes exactly under DP=2, DP=4 and DP=1 without ZeRO;
* the ownership rule balances its two loads (unit test against brute force).
"""

from __future__ import annotations

import itertools

import pytest

from pretrain.training.metrics import allocated_grad_bytes
import torch

from tests.distributed import run_ranks_eager as run_ranks  # every comparison's sides run in ranks
from tests.test_training import ROOT, read_metrics, tiny_overrides

TINY = str(ROOT / "configs/models/glm5-tiny.yaml")
# adam_eps 1e-4: AdamW's first steps divide a gradient by its own magnitude, so an element whose
# gradient is ~0 (rows of tokens not in the batch, cancelling terms) would turn fp32 summation-order
# noise (DP sums in another order than one rank) into an O(lr) update in either run alike.
MUON = ["optimizer.optimizer=muon", "optimizer.lr=0.01", "optimizer.muon_ns_dtype=float32", "optimizer.adam_eps=1e-4"]
ZERO = ["optimizer.use_distributed_optimizer=true"]
STEPS = 6


def save_initial(rank, world_size, overrides):
    from pretrain.config import load_config
    from pretrain.training.loop import Trainer

    Trainer(load_config(TINY, overrides)).save()


def train_ranks(rank, world_size, overrides):
    """Train; return the final parameters by name (this rank's shards) and the gradient bookkeeping."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import unwrap_model

    from pretrain.config import load_config
    from pretrain.training.loop import Trainer
    from pretrain.optim import sub_optimizers

    trainer = Trainer(load_config(TINY, overrides))
    loaded = _state_summary(trainer)  # what a resumed run starts from
    grad_bytes, last_grads = [], {}
    original = trainer.optimizer_step

    def step(grad_norm):  # every gradient has arrived and been reduced: the most gradient memory of the step
        grad_bytes.append(allocated_grad_bytes(trainer.model))
        last_grads.clear()  # the reduced gradients the optimizer sees (this rank's owned ones with ZeRO-2)
        for c in trainer.model:
            owns = getattr(c, "owns", lambda p: True)
            last_grads.update({n: p.main_grad.detach().clone() for n, p in c.module.named_parameters()
                               if p.requires_grad and owns(p)})
        return original(grad_norm)

    trainer.optimizer_step = step
    trainer.train()
    out = {"loaded": loaded, "params": {n: p.detach().clone() for c in unwrap_model(trainer.model) for n, p in c.named_parameters()},
           "tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
           "ep": ps.get_expert_model_parallel_rank(), "dp": ps.get_data_parallel_rank(),
           "trainable": sorted(n for c in unwrap_model(trainer.model) for n, p in c.named_parameters() if p.requires_grad),
           "grad_bytes": max(grad_bytes), "last_grads": last_grads,
           "trainable_elements": sum(p.numel() for c in unwrap_model(trainer.model) for p in c.parameters() if p.requires_grad)}
    chunk = trainer.model[0]
    if hasattr(chunk, "param_owner"):
        owned = [p for p in chunk.param_owner if chunk.owns(p)]
        states = [s for sub in sub_optimizers(trainer.optimizer) for s in sub.optimizer.state.values() if s]
        out.update(
            owned_params=sum(p.numel() for p in owned),
            total=sum(p.numel() for p in chunk.param_owner),
            largest=max(p.numel() for p in chunk.param_owner),
            peak_transient=chunk.peak_transient_bytes // 4,  # fp32 elements
            bucket_elements=max(b.numel for b in chunk.buckets),
            owned_names=sorted(n for n, p in chunk.module.named_parameters() if p in chunk.param_owner and chunk.owns(p)),
            foreign_grads=sum(p.grad is not None or hasattr(p, "main_grad") for p in chunk.param_owner if not chunk.owns(p)),
            state_count=len(states),
            state_elements=sum(t.numel() for s in states for t in s.values() if torch.is_tensor(t) and t.ndim),
        )
    return out


@pytest.fixture(scope="module")
def zero_runs(stdlib_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("zero2")
    base = [f"train.train_iters={STEPS}", "train.eval_interval=null", "optimizer.lr_warmup_iters=1",
            "train.micro_batch_size=2", "train.global_batch_size=8", *MUON]
    init = root / "init"
    run_ranks(save_initial, 1, tiny_overrides(stdlib_data, root / "r0", *base, f"checkpoint.save={init}"))
    start = [*base, f"checkpoint.load={init}"]
    runs = {"single": run_ranks(train_ranks, 1, tiny_overrides(stdlib_data, root / "single", *start))}
    layouts = {
        "dp2_step": (2, ["optimizer.zero2_grad_reduce=step"]),
        "dp2_scatter": (2, ["optimizer.zero2_grad_reduce=microbatch_scatter"]),
        "dp4": (4, []),
        "tp2_dp2": (4, ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]),
        "pp2_dp2": (4, ["parallel.pipeline_model_parallel_size=2"]),
        "ep2_dp4": (4, ["parallel.expert_model_parallel_size=2"]),
    }
    for name, (world, extra) in layouts.items():
        runs[name] = run_ranks(train_ranks, world, tiny_overrides(stdlib_data, root / name, *start, *ZERO, *extra))
    return root, runs


def _tp_shards(ranks):
    """The results of data-parallel rank 0's TP ranks, in TP order."""
    return sorted((r for r in ranks if r["dp"] == 0), key=lambda r: r["tp"])


@pytest.mark.parametrize("layout", ["dp2_step", "dp2_scatter", "dp4", "tp2_dp2", "pp2_dp2", "ep2_dp4"])
def test_zero2_matches_single_rank_after_6_steps(zero_runs, layout):
    root, runs = zero_runs
    ref, got = read_metrics(root / "single"), read_metrics(root / layout)
    assert len(ref) == len(got) == STEPS
    assert ref[-1]["loss"] < ref[0]["loss"] - 0.1  # the steps moved the model
    for x, y in zip(ref, got):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-6, abs=1e-6), layout
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5), layout
    single = runs["single"][0]["params"]

    def close(got, want, what):
        assert (got - want).abs().max() <= 1e-6 * max(1.0, want.abs().max().item()), what

    if layout in ("dp2_step", "dp2_scatter", "dp4"):  # every rank ends with the single-rank parameters
        seen = set()
        for r in runs[layout]:
            for n, want in single.items():
                close(r["params"][n], want, (layout, n))
            for n, g in r["last_grads"].items():  # the last step's reduced gradients, each from its owner
                want = runs["single"][0]["last_grads"][n]
                assert (g - want).abs().max() <= 1e-5 * max(1e-3, want.abs().max().item()), (layout, n)
                seen.add(n)
        assert seen == set(runs["single"][0]["trainable"]), layout
    if layout == "tp2_dp2":  # the TP shards put together are the single-rank parameters
        shards = _tp_shards(runs[layout])
        for n, want in single.items():
            if "linear_fc1" in n or "experts.weight" in n:
                continue  # SwiGLU / grouped-expert shards interleave (gate, up): not a plain concatenation
            parts = [r["params"][n] for r in shards]
            if parts[0].shape != want.shape:
                dim = next(d for d in range(want.ndim) if parts[0].shape[d] != want.shape[d])
                parts = [torch.cat(parts, dim)]
            for part in parts:
                close(part, want, (layout, n))


def test_every_parameter_has_one_owner_and_gradients_are_sharded(zero_runs):
    _, runs = zero_runs
    single = runs["single"][0]
    assert single["grad_bytes"] >= 4 * single["trainable_elements"]  # DDP: a full-size buffer (the walk sees it)
    for layout in ("dp2_step", "dp2_scatter", "dp4"):
        ranks = runs[layout]
        dp = len(ranks)
        names = [set(r["owned_names"]) for r in ranks]
        assert set().union(*names) == set(runs["single"][0]["trainable"])  # all trainable ones owned ...
        assert sum(len(n) for n in names) == len(set().union(*names))  # ... exactly once
        total = ranks[0]["total"]
        assert sum(r["owned_params"] for r in ranks) == total
        for r in ranks:
            # fp32 gradient storage actually allocated: this rank's owned parameters only (whole
            # matrices: up to one more than 1/dp), every gradient of the model held exactly once
            assert r["grad_bytes"] == 4 * r["owned_params"], layout
            assert r["grad_bytes"] <= 4 * (total / dp + r["largest"]), layout
            assert r["foreign_grads"] == 0
            assert r["state_elements"] <= 2 * r["owned_params"]  # momentum or AdamW moments, owned only
            if layout in ("dp4", "dp2_scatter"):  # per micro-batch: a bounded number of buckets in flight
                assert r["peak_transient"] <= 3 * r["bucket_elements"]
            else:  # per step: every non-owned gradient until the last micro-batch, then freed
                assert r["peak_transient"] == r["total"] - r["owned_params"]


@pytest.mark.parametrize("reduce", ["microbatch", "microbatch_scatter"])
def test_gradient_memory_is_one_over_dp_without_a_dominant_matrix(stdlib_data, tmp_path, reduce):
    """With the embedding tables small next to the layers, the owned share is close to 1/dp."""
    over = tiny_overrides(stdlib_data, tmp_path, "train.train_iters=1", "train.eval_interval=null", *MUON, *ZERO,
                          f"optimizer.zero2_grad_reduce={reduce}",
                          "optimizer.lr_warmup_iters=0",
                          "model.num_layers=4", "model.moe_layer_freq=[0,1,1,1]",
                          "train.micro_batch_size=1", "train.global_batch_size=4")
    ranks = run_ranks(train_ranks, 4, over)
    total = ranks[0]["total"]
    shares = [r["grad_bytes"] / (4 * total) for r in ranks]  # allocated fp32 gradient storage
    assert sum(shares) == pytest.approx(1.0)
    assert max(shares) <= 1.15 / 4, shares


def test_ownership_balances_both_loads():
    from pretrain.optim.zero2_buckets import assign_owners

    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        n, world = 7, 3
        costs = (torch.rand(n, generator=gen) ** 3 * 100).tolist()
        sizes = (torch.rand(n, generator=gen) * 50 + 1).tolist()
        got = assign_owners(costs, sizes, world)

        def worst(owners):
            loads = [(sum(c for c, o in zip(costs, owners) if o == r) / sum(costs),
                      sum(s for s, o in zip(sizes, owners) if o == r) / sum(sizes)) for r in range(world)]
            return max(max(a, b) for a, b in loads)

        best = min(worst(o) for o in itertools.product(range(world), repeat=n))
        assert worst(got) <= 4 / 3 * best + 1e-9  # LPT's bound, against the exhaustive optimum
    assert assign_owners([1.0, 2.0], [1, 1], 1) == [0, 0]


def test_checkpoint_resumes_exactly_across_dp_sizes(stdlib_data, tmp_path):
    """A ZeRO-2 checkpoint (each owner saves its momentum / moments / main weights) written at DP=2
    continues like the uninterrupted single-rank run under DP=2, DP=4 and DP=1 without ZeRO-2."""
    base = ["train.eval_interval=null", "optimizer.lr_warmup_iters=1", "optimizer.lr_decay_iters=4",
            "train.micro_batch_size=2", *MUON]
    init, ckpt = tmp_path / "init", tmp_path / "ckpt"
    run_ranks(save_initial, 1, tiny_overrides(stdlib_data, tmp_path / "i", *base, "train.train_iters=4",
                                               f"checkpoint.save={init}"))
    start = [*base, f"checkpoint.load={init}"]
    run_ranks(train_ranks, 1, tiny_overrides(stdlib_data, tmp_path / "full", *start, "train.train_iters=4"))
    run_ranks(train_ranks, 2, tiny_overrides(stdlib_data, tmp_path / "a", *start, *ZERO, "train.train_iters=2",
                                        f"checkpoint.save={ckpt}"))
    full = read_metrics(tmp_path / "full")
    resumed = [*base, "train.train_iters=4", f"checkpoint.load={ckpt}"]
    for name, world, extra in [("dp2", 2, ZERO), ("dp4", 4, ZERO), ("dp1", 1, [])]:
        ranks = run_ranks(train_ranks, world, tiny_overrides(stdlib_data, tmp_path / name, *resumed, *extra))
        rows = read_metrics(tmp_path / name)
        assert [r["step"] for r in rows] == [3, 4], name
        for x, y in zip(full[2:], rows):
            assert y["loss"] == pytest.approx(x["loss"], rel=1e-6), name
            assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-5), name
        if name == "dp4":  # each rank loaded the state of what it owns now, and only that
            assert all(r["loaded"]["momentum"] > 0 for r in ranks)
            assert all(r["loaded"]["state_params"] == r["loaded"]["owned_in_optimizer"] for r in ranks)


def _state_summary(trainer):
    from pretrain.optim import sub_optimizers

    chunk = trainer.model[0]
    if not hasattr(chunk, "param_owner"):
        return None
    momentum, with_state, owned = 0.0, 0, 0
    for sub in sub_optimizers(trainer.optimizer):
        for group in sub.optimizer.param_groups:
            for p in group["params"]:
                state = sub.optimizer.state.get(p, {})
                with_state += bool(state)
                owned += not sub.optimizer.is_foreign(p)
                if "momentum_buffer" in state:
                    momentum += float(state["momentum_buffer"].abs().sum())
    assert sum(chunk.owns(p) for p in chunk.param_owner) == owned
    return {"momentum": momentum, "state_params": with_state, "owned_in_optimizer": owned}
