"""ZeRO-2's copy-engine transport on 2 GPUs (marker `gpu`; `optimizer.zero2_reduce_transport: copy_engine`,
pretrain/optim/zero2_copy_engine.py over torch symmetric memory).

* Small module, slots of 7 elements in a ring of 2 (many pieces, every slot reused): the owners' main_grads equal
  (1/dp) x the float64 sum over ranks and micro-batches (fp32 1e-6; bf16 weights reducing in bf16 3e-2).
* fp32, at DP = 2 a reduce is one addition whichever way the bytes move: the copy-engine transport gives NCCL's
  reduce's gradients bit for bit, on the small module and on 3 x [4096 x 4096] with the default slots.
* Training the tiny GLM-5 for 6 steps in bf16: the same losses and weights as ZeRO-2 over NCCL within the bf16 noise.
"""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


def _module(big, dtype):
    torch.manual_seed(0)
    if big:
        layers = [torch.nn.Linear(4096, 4096), torch.nn.Tanh(), torch.nn.Linear(4096, 4096), torch.nn.Tanh(),
                  torch.nn.Linear(4096, 4096)]
    else:
        layers = [torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                  torch.nn.Linear(16, 4)]
    return torch.nn.Sequential(*layers).to(dtype)


def _loss(model, rank, micro, dtype, width, device):
    x = torch.randn(5, width, generator=torch.Generator().manual_seed(100 * rank + micro)).to(device, dtype)
    return model(x).float().pow(2).mean()


def _grads(rank, world_size, transport, dtype, fp32, big):
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    from parallel.initialize import initialize_parallel
    from pretrain.config.schema import ParallelConfig
    from pretrain.optim.zero2_copy_engine import make_reducers
    from pretrain.optim.zero2_grads import Zero2DataParallel

    initialize_parallel(ParallelConfig(), seed=0)
    device = torch.device("cuda", torch.cuda.current_device())
    module = _module(big, dtype).to(device)
    transports = None
    if transport == "copy_engine" and not big:
        groups = {"dense": ps.get_data_parallel_group(with_context_parallel=True),
                  "expert": ps.get_expert_data_parallel_group()}
        transports = make_reducers(groups, device, slot_elements=7, ring=2)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    model = Zero2DataParallel(config, module, lambda n, p: float(p.numel()), "microbatch", fp32,
                              **({} if big else {"bucket_elements": 40}), reduce_transport=transport,
                              transports=transports)
    model.zero_grad_buffer()
    for m in range(3):
        _loss(model, rank, m, dtype, 4096 if big else 8, device).backward()
    model.finish_grad_sync()
    torch.cuda.synchronize()
    return {n: p.main_grad.cpu() for n, p in module.named_parameters() if model.owns(p)}


def _merged(ranks):
    out = {}
    for r in ranks:
        assert not set(r) & set(out)
        out.update(r)
    return out


def test_copy_engine_reduces_to_the_mean_and_equals_nccl_bitwise():
    from tests.distributed import run_ranks_eager as run_ranks

    ref_module = _module(False, torch.float64)
    ref = {n: torch.zeros_like(p) for n, p in ref_module.named_parameters()}
    for r in range(2):
        for m in range(3):
            grads = torch.autograd.grad(_loss(ref_module, r, m, torch.float64, 8, "cpu"), list(ref_module.parameters()))
            for (n, _), g in zip(ref_module.named_parameters(), grads):
                ref[n] += g / 2
    for dtype, fp32, tol in [(torch.float32, True, 1e-6), (torch.bfloat16, False, 3e-2)]:
        got = _merged(run_ranks(_grads, 2, "copy_engine", dtype, fp32, False))
        assert set(got) == set(ref)
        for n, g in got.items():
            err = (g.double() - ref[n]).norm() / ref[n].norm()
            assert err < tol, (dtype, n, err.item())
    for big in (False, True):
        ce = _merged(run_ranks(_grads, 2, "copy_engine", torch.float32, True, big))
        nccl = _merged(run_ranks(_grads, 2, "nccl", torch.float32, True, big))
        assert set(ce) == set(nccl)
        for n in ce:
            assert torch.equal(ce[n], nccl[n]), (big, n, (ce[n] - nccl[n]).abs().max().item())


def test_training_with_the_copy_engine_follows_nccl(tmp_path):
    from tests.distributed import run_ranks
    from tests.test_gpu_training import BF16
    from tests.test_training import read_metrics
    from tests.test_zero2 import save_initial, train_ranks

    init = tmp_path / "init"
    run_ranks(save_initial, 1, [*BF16, f"logging.run_dir={tmp_path / 'i'}", f"checkpoint.save={init}"])
    common = [*BF16, f"checkpoint.load={init}", "train.train_iters=6", "optimizer.use_distributed_optimizer=true"]
    nccl = run_ranks(train_ranks, 2, [*common, f"logging.run_dir={tmp_path / 'nccl'}"])
    ce = run_ranks(train_ranks, 2, [*common, f"logging.run_dir={tmp_path / 'ce'}",
                                    "optimizer.zero2_reduce_transport=copy_engine"])
    want = [r["loss"] for r in read_metrics(tmp_path / "nccl")]
    got = [r["loss"] for r in read_metrics(tmp_path / "ce")]
    print("losses nccl", want, "copy_engine", got)
    assert got == pytest.approx(want, rel=2e-3)
    for r_ce, r_nccl in zip(ce, nccl):
        assert r_ce["owned_params"] == r_nccl["owned_params"]
        for n, w in r_nccl["params"].items():
            err = (r_ce["params"][n].float() - w.float()).norm() / max(w.float().norm(), 1e-3)
            assert err <= 1e-2, (n, err.item())
