"""ZeRO-2's gradient wrapper on its own (pretrain/optim/zero2_grads.py, pretrain/optim/zero2_copy_engine.py), on CPU
through gloo: a small module's owned main_grads after three micro-batches against the float64 mean over ranks.

* every reduce mode (per micro-batch, per step, per micro-batch by reduce-scatter), in fp32 and bf16;
* the copy-engine transport's protocol over shared files (tests/file_fabric.py) at DP = 2 and 3;
* parameters without a gradient end at zero on their owner (the per-micro-batch buffer is written, not zeroed);
* the config's bucket size reaches both data-parallel wrappers.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.distributed import run_ranks_eager as run_ranks


def _wrapper_grads(rank, world_size, dtype, grad_reduce_in_fp32, reduce_per):
    """Three micro-batches through a small bf16/fp32 module wrapped in Zero2DataParallel; returns the
    owned main_grads by name (what the optimizer of this rank would see)."""
    from megatron.core.transformer import TransformerConfig

    from parallel.initialize import initialize_parallel
    from pretrain.optim.zero2_grads import Zero2DataParallel
    from pretrain.config.schema import ParallelConfig

    initialize_parallel(ParallelConfig(), seed=0)
    module = _small_module(dtype)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    # small buckets, and no bound on the reduces in flight: each bucket is launched again before
    # anything else waits for its previous reduce (scatter buckets: windows of several parameters)
    model = Zero2DataParallel(config, module, lambda n, p: float(p.numel()), reduce_per, grad_reduce_in_fp32,
                              bucket_elements=300 if reduce_per == "microbatch_scatter" else 40, max_inflight=1000)
    if reduce_per == "microbatch_scatter":  # the layout under test: buckets shared by both ranks
        assert sum(type(b).__name__ == "ScatterBucket" for b in model.buckets) >= 2
    model.zero_grad_buffer()
    for m in range(3):
        ctx = model.no_sync() if m == 0 else contextlib.nullcontext()
        with ctx:
            _small_loss(model, rank, m, dtype).backward()
    model.finish_grad_sync()
    return {n: p.main_grad.clone() for n, p in module.named_parameters() if model.owns(p)}


def _small_module(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4)).to(dtype)


def _small_loss(model, rank, micro, dtype):
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(100 * rank + micro)).to(dtype)
    return model(x).float().pow(2).mean()


def _float64_mean(world):
    """The reference: (1/world) x the sum over ranks and 3 micro-batches of `_small_module`'s float64 gradients."""
    ref_module = _small_module(torch.float64)
    ref = {n: torch.zeros_like(p) for n, p in ref_module.named_parameters()}
    for r in range(world):
        for m in range(3):
            grads = torch.autograd.grad(_small_loss(ref_module, r, m, torch.float64), list(ref_module.parameters()))
            for (n, _), g in zip(ref_module.named_parameters(), grads):
                ref[n] += g / world
    return ref


@pytest.mark.parametrize("reduce_per", ["microbatch", "step", "microbatch_scatter"])
def test_reduced_gradients_equal_the_mean_over_ranks(reduce_per):
    """The owner's main_grad = (1/dp) * sum over ranks and micro-batches of the float64 gradients;
    in fp32 to 1e-6, with parameters and the reduction in bf16 to bf16 accuracy."""
    world = 2
    ref = _float64_mean(world)
    for dtype, fp32, tol in [(torch.float32, True, 1e-6), (torch.bfloat16, True, 2e-2), (torch.bfloat16, False, 3e-2)]:
        ranks = run_ranks(_wrapper_grads, world, dtype, fp32, reduce_per)
        got = {}
        for r in ranks:
            assert not set(r) & set(got)  # one owner per parameter
            got.update(r)
        assert set(got) == set(ref)
        for n, g in got.items():
            assert g.dtype == torch.float32
            err = (g.double() - ref[n]).norm() / ref[n].norm()
            assert err < tol, (dtype, fp32, n, err.item())


def _copy_engine_grads(rank, world_size, dtype, grad_reduce_in_fp32, directory):
    """`_wrapper_grads` with the copy-engine transport over shared files (tests/file_fabric.py): slots of 7
    elements in a ring of 2, so buckets go in several pieces and every slot is reused many times."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    from parallel.initialize import initialize_parallel
    from pretrain.config.schema import ParallelConfig
    from pretrain.optim.zero2_copy_engine import make_reducers
    from pretrain.optim.zero2_grads import Zero2DataParallel
    from tests.file_fabric import FileFabric

    initialize_parallel(ParallelConfig(), seed=0)
    fabrics = []

    def fabric(group, nbytes):
        fabrics.append(FileFabric(directory, group, nbytes))
        return fabrics[-1]

    groups = {"dense": ps.get_data_parallel_group(with_context_parallel=True),
              "expert": ps.get_expert_data_parallel_group()}
    transports = make_reducers(groups, torch.device("cpu"), fabric, slot_elements=7, ring=2)
    module = _small_module(dtype)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    model = Zero2DataParallel(config, module, lambda n, p: float(p.numel()), "microbatch", grad_reduce_in_fp32,
                              bucket_elements=40, max_inflight=2, reduce_transport="copy_engine",
                              transports=transports)
    assert all(b.transport is transports["dense"] for b in model.buckets)
    model.zero_grad_buffer()
    for m in range(3):
        _small_loss(model, rank, m, dtype).backward()
    model.finish_grad_sync()
    grads = {n: p.main_grad.clone() for n, p in module.named_parameters() if model.owns(p)}
    return grads, sum(f.peer_views for f in fabrics), transports["dense"].sent


@pytest.mark.parametrize("world", [2, 3])
def test_copy_engine_transport_reduces_to_the_mean_over_ranks(world, tmp_path):
    """`optimizer.zero2_reduce_transport: copy_engine`'s protocol (pieces, a reused ring of slots, signals; several
    sources per owner at DP = 3) run over shared files: the owner's main_grad = (1/dp) * the float64 sum over
    ranks and micro-batches, in fp32 to 1e-6 and in bf16 to bf16 accuracy."""
    ref = _float64_mean(world)
    for i, (dtype, fp32, tol) in enumerate([(torch.float32, True, 1e-6), (torch.bfloat16, False, 3e-2)]):
        directory = tmp_path / f"case{i}"
        directory.mkdir()
        ranks = run_ranks(_copy_engine_grads, world, dtype, fp32, str(directory))
        got = {}
        for grads, peer_views, sent in ranks:
            assert not set(grads) & set(got)
            got.update(grads)
            assert peer_views > 0 and max(sent) > 2  # the transport wrote into peers' areas, slots were reused
        assert [r[2] for r in ranks] == [ranks[0][2]] * world  # every rank counted the same pieces per owner
        assert set(got) == set(ref)
        for n, g in got.items():
            err = (g.double() - ref[n]).norm() / ref[n].norm()
            assert err < tol, (world, dtype, n, err.item())


class _WithUnused(torch.nn.Module):
    """`_small_module` and a layer the forward never calls: its parameters get no gradient."""

    def __init__(self):
        super().__init__()
        self.body = _small_module(torch.float32)
        self.unused = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.body(x)


def _grads_with_unused(rank, world_size, reduce_per, bucket_elements, directory):
    """Owned main_grads of `_WithUnused` after 3 micro-batches (NCCL's reduce over gloo, or the copy-engine
    transport over shared files when `directory` is given)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    from parallel.initialize import initialize_parallel
    from pretrain.config.schema import ParallelConfig
    from pretrain.optim.zero2_copy_engine import make_reducers
    from pretrain.optim.zero2_grads import Zero2DataParallel
    from tests.file_fabric import FileFabric

    initialize_parallel(ParallelConfig(), seed=0)
    transports, transport = None, "nccl"
    if directory:
        groups = {"dense": ps.get_data_parallel_group(with_context_parallel=True),
                  "expert": ps.get_expert_data_parallel_group()}
        transports = make_reducers(groups, torch.device("cpu"), lambda g, n: FileFabric(directory, g, n),
                                   slot_elements=64, ring=2)
        transport = "copy_engine"
    module = _WithUnused()
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    model = Zero2DataParallel(config, module, lambda n, p: float(p.numel()), reduce_per, True,
                              bucket_elements=bucket_elements, max_inflight=2, reduce_transport=transport,
                              transports=transports)
    model.zero_grad_buffer()
    for m in range(3):
        _small_loss(model, rank, m, torch.float32).backward()
    model.finish_grad_sync()
    return {n: p.main_grad.clone() for n, p in module.named_parameters() if model.owns(p)}


@pytest.mark.parametrize("reduce_per,bucket_elements,transport", [
    ("microbatch", 40, "nccl"), ("microbatch", 1000, "nccl"), ("microbatch", 1000, "copy_engine"),
    ("microbatch_scatter", 300, "nccl")])
def test_parameters_without_a_gradient_reduce_to_zero(reduce_per, bucket_elements, transport, tmp_path):
    """A rank's per-micro-batch gradient buffer is not zeroed before the gradients are written into it; what no
    gradient wrote is zeroed at the launch. Parameters the forward never uses end with main_grad = 0 on their
    owner, whether alone in a bucket (40) or beside used ones (1000), and the used ones equal the float64 mean."""
    ref = _float64_mean(2)
    ranks = run_ranks(_grads_with_unused, 2, reduce_per, bucket_elements,
                      str(tmp_path) if transport == "copy_engine" else "")
    got = {}
    for r in ranks:
        got.update(r)
    assert set(got) == {f"body.{n}" for n in ref} | {"unused.weight", "unused.bias"}
    for n in ("unused.weight", "unused.bias"):
        assert torch.count_nonzero(got[n]) == 0, n
    for n, g in ref.items():
        err = (got[f"body.{n}"].double() - g).norm() / g.norm()
        assert err < 1e-6, (n, err.item())


def _wrapped_bucket_sizes(rank, world_size):
    """The config's parallel.bucket_size in each data-parallel wrapper: ZeRO-2's buckets on one rank, megatron DDP's
    bucket size at DP = 2 (at DP = 1 there is no overlapped reduce and megatron drops the size)."""
    from megatron.core.transformer import TransformerConfig

    from parallel.initialize import initialize_parallel
    from pretrain.config.schema import ModelConfig, OptimizerConfig, ParallelConfig
    from pretrain.optim.build import wrap_model_chunks

    initialize_parallel(ParallelConfig(), seed=0)
    got = {}
    for size in (None, 100):
        parallel = ParallelConfig(bucket_size=size)
        for name, optimizer in (("zero2", OptimizerConfig(optimizer="muon", use_distributed_optimizer=True)),
                                ("ddp", OptimizerConfig(optimizer="adam"))):
            if (name == "zero2") != (world_size == 1):
                continue
            module = _small_module(torch.float32)
            module.config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
            wrapped = wrap_model_chunks([module], parallel, optimizer, ModelConfig())[0]
            got[f"{name} {size}"] = ([[p.numel() for p in b.params] for b in wrapped.buckets] if name == "zero2"
                                     else (wrapped.ddp_config.bucket_size, len(wrapped.buffers[0].buckets)))
    return got


def test_bucket_size_reaches_both_wrappers():
    """parallel.bucket_size (megatron DDP's field) sizes ZeRO-2's buckets and megatron's. The small module's
    parameters in backward order are 4, 64, 16, 256, 16, 128 elements: a ZeRO-2 bucket closes once it holds >= 100."""
    zero2 = run_ranks(_wrapped_bucket_sizes, 1)[0]
    assert zero2["zero2 100"] == [[4, 64, 16, 256], [16, 128]]
    assert zero2["zero2 None"] == [[4, 64, 16, 256, 16, 128]]  # ZeRO-2's default, 40M elements: one bucket
    ddp = run_ranks(_wrapped_bucket_sizes, 2)[0]
    assert ddp["ddp None"] == (40_000_000, 1)  # megatron's default at DP = 2: max(40M, 1M x DP)
    assert ddp["ddp 100"][0] == 100 and ddp["ddp 100"][1] > 1
