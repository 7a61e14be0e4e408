"""Muon's fused elementwise kernels (pretrain/optim/muon_kernels.py) on CPU through Triton's interpreter.

Each kernel against the float64 formula on the strided block views Muon hands it (head splits along
rows and columns, a grouped expert weight's memory chunks cut into GLU halves, a tall block whose stage
is a transposed view), with sizes that are no multiple of the 64 x 64 tile; then whole Muon steps with
the kernels against Muon's torch path on the same parameters and gradients. The same comparison at
real sizes runs compiled on the GPU in tests/test_gpu_training.py.
"""

from __future__ import annotations

import os

import pytest
import torch

import triton  # noqa: F401  (the dev extra installs it; the kernels run in its interpreter here)

from pretrain.optim.muon import Muon, MuonSplit

# (split, weight shape): blocks of every kind Muon stages, at ragged sizes
CASES = {
    "heads_rows": (MuonSplit(2, (3, 67), 0), (140, 9)),  # MLA-like [dk; dv] per head; 67 > one tile
    "heads_cols": (MuonSplit(3, (5,), 1), (70, 15)),  # axis 1: a permuted [groups, rows, cols] view
    "experts_glu": (MuonSplit(2, (66,), 2, cols=(5, 5)), (66, 20)),  # memory chunks, gate | up
    "tall_whole": (None, (70, 6)),
    "wide_whole": (None, (5, 131)),
}


@pytest.fixture(scope="module")
def kernels():
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set")
    from pretrain.optim import muon_kernels

    return muon_kernels


def _blocks(split, t):
    return split.blocks(t) if split is not None else [t[None]]


def _stage_view(block, dtype=torch.bfloat16):
    """A fresh stage span in the block's wide orientation, viewed in the block's own orientation."""
    g, r, c = block.shape
    return torch.full((g, min(r, c), max(r, c)), float("nan"), dtype=dtype).mT if r > c else \
        torch.full((g, r, c), float("nan"), dtype=dtype)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("nesterov_mu,stage_dtype", [(0.9, torch.bfloat16), (None, torch.bfloat16),
                                                     (0.9, torch.float32)])
def test_momentum_and_stage_matches_float64(kernels, case, nesterov_mu, stage_dtype):
    split, shape = CASES[case]
    gen = torch.Generator().manual_seed(0)
    grad, mom = (torch.randn(shape, generator=gen) for _ in range(2))
    mu = 0.95
    want = mom.double()  # block by block: a block's kernel must leave every other element alone
    bound = torch.zeros_like(want)  # untouched elements: exactly as they were
    for g, m, w, b in zip(*(_blocks(split, t) for t in (grad, mom, want, bound))):
        m_old = m.double()
        stage = _stage_view(g, stage_dtype)
        kernels.momentum_and_stage(g, m, stage, mu, nesterov_mu)
        w.copy_(g.double() + mu * m_old)
        # fp32 with mu rounded to fp32 and (in the interpreter) the multiply-add rounded twice
        b.copy_(2.0**-22 * (g.double().abs() + mu * m_old.abs()))
        assert ((mom.double() - want).abs() <= bound).all(), case
        u = w if nesterov_mu is None else g.double() + nesterov_mu * w
        # one rounding of the fp32 sum (which carries M's fp32 error) into the stage: within one ulp,
        # 2^-7 relative in bf16, since Triton 3.6's interpreter casts fp32 to bf16 by truncation (the
        # GPU rounds to nearest even: tests/test_gpu_training.py checks the bits against torch)
        ulp = 2.0**-7 if stage_dtype == torch.bfloat16 else 2.0**-23
        tol = ulp * u.abs() + 2.0**-20 * (g.double().abs() + m_old.abs())
        assert ((stage.double() - u).abs() <= tol).all(), case


@pytest.mark.parametrize("case", sorted(CASES))
def test_decay_and_add_matches_float64(kernels, case):
    split, shape = CASES[case]
    gen = torch.Generator().manual_seed(1)
    param = torch.randn(shape, generator=gen)
    want = param.double()
    bound = torch.zeros_like(want)
    decay, coef = 0.998, -0.03
    for w, ref, b in zip(*(_blocks(split, t) for t in (param, want, bound))):
        out = _stage_view(w)
        out.copy_(torch.randn(out.shape, generator=gen))
        w_old = w.double()
        kernels.decay_and_add(w, out, decay, coef)
        ref.copy_(w_old * decay + coef * out.double())
        b.copy_(2.0**-22 * (w_old.abs() + (coef * out.double()).abs()))
        assert ((param.double() - want).abs() <= bound).all(), case


def test_wrappers_reject_bad_inputs(kernels):
    g = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="stage must be"):
        kernels.momentum_and_stage(g, torch.zeros(2, 3, 4), torch.zeros(2, 4, 3, dtype=torch.bfloat16), 0.9, None)
    with pytest.raises(ValueError, match="momentum must be one of"):
        kernels.momentum_and_stage(g, torch.zeros(2, 3, 4, dtype=torch.float64), torch.zeros(2, 3, 4), 0.9, None)
    with pytest.raises(ValueError, match="param must be"):
        kernels.decay_and_add(torch.zeros(3, 4), torch.zeros(3, 4), 1.0, 0.1)


def _muon_run(fused, nesterov, ns_dtype, wd=0.1, steps=3):
    torch.manual_seed(3)
    specs = [(k, CASES[k]) for k in sorted(CASES)]
    params = [torch.nn.Parameter(torch.randn(shape)) for _, (_, shape) in specs]
    splits = {p: s for p, (_, (s, _)) in zip(params, specs) if s is not None}
    opt = Muon([{"params": params[:3], "lr": 0.02, "weight_decay": wd},
                {"params": params[3:], "lr": 0.01, "weight_decay": wd / 2}], momentum=0.95, nesterov=nesterov,
               ns_dtype=ns_dtype, splits=splits, fused_elementwise=fused)
    gen = torch.Generator().manual_seed(4)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach() for p in params], [opt.state[p]["momentum_buffer"] for p in params], opt


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32])
def test_muon_step_with_kernels_matches_torch_path(nesterov, ns_dtype):
    """Three steps over every kind of block, kernels vs torch ops on the same weights and gradients.

    Momentum: fp32 sums that differ only where the interpreter rounds a multiply-add twice (an ulp):
    1e-6 relative. Weights with an fp32 stage: the same few ulps, 1e-6 absolute. With a bf16 stage the
    kernels' stage differs from torch's by up to a bf16 ulp (Triton 3.6's interpreter truncates fp32 to
    bf16; torch rounds to nearest), and bf16 Newton-Schulz, which amplifies small singular directions,
    turns that into its own bf16-level noise on O (entries below 1): |dW| <= steps * |coef| * 2^-5 with
    coef = lr * 0.2 * sqrt(max(rows, cols)). Leaving out the decay (lr * wd * |W| a step) would land
    outside both: checked below."""
    w_fused, m_fused, opt = _muon_run(True, nesterov, ns_dtype)
    w_torch, m_torch, _ = _muon_run(False, nesterov, ns_dtype)
    w_no_decay, _, _ = _muon_run(False, nesterov, ns_dtype, wd=0.0)
    lrs = [0.02] * 3 + [0.01] * 2
    for (name, (_, shape)), lr, wf, wt, w0, mf, mt in zip(sorted(CASES.items()), lrs, w_fused, w_torch, w_no_decay,
                                                          m_fused, m_torch):
        assert ((mf - mt).norm() / mt.norm()).item() < 1e-6, name
        tol = 1e-6 if ns_dtype == torch.float32 else 3 * lr * 0.2 * max(shape) ** 0.5 * 2.0**-5
        assert (wf - wt).abs().max().item() < tol, name
        assert (w0 - wt).abs().max().item() > 2 * max(tol, 1e-3), name
    assert all(opt.state[p]["step"] == 3 for group in opt.param_groups for p in group["params"])


def test_blocks_must_partition_the_matrix():
    class Partial:  # a split whose blocks leave rows out
        def blocks(self, t):
            return [t[None, :2]]

    p = torch.nn.Parameter(torch.randn(4, 6))
    p.grad = torch.randn(4, 6)
    opt = Muon([p], splits={p: Partial()}, fused_elementwise=True)
    with pytest.raises(RuntimeError, match="do not partition"):
        opt.step()


def test_fused_flag_errors_where_kernels_cannot_run():
    p = torch.nn.Parameter(torch.randn(4, 6, dtype=torch.float64))
    p.grad = torch.randn(4, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match="do not take weight torch.float64"):
        Muon([p], fused_elementwise=True).step()


def test_path_choice_and_the_unfused_warning(monkeypatch, caplog):
    """CPU tensors take the torch ops unless the kernels are asked for; a CUDA matrix that cannot use the
    kernels (here: no triton) takes the torch ops with one warning per reason, or fails when asked for."""
    from types import SimpleNamespace

    from pretrain.notices import forget_said
    from pretrain.optim import muon_staging

    cpu = torch.zeros(2, 3)
    cpu.grad = torch.zeros(2, 3)
    assert not muon_staging.use_fused(cpu, torch.bfloat16, None)
    assert muon_staging.use_fused(cpu, torch.bfloat16, True)  # through the interpreter (conftest sets it)
    assert not muon_staging.use_fused(cpu, torch.bfloat16, False)
    monkeypatch.setattr(muon_staging, "triton_available", lambda: False)
    forget_said()  # the notice may have been said earlier in this process
    cuda = SimpleNamespace(is_cuda=True, dtype=torch.float32, grad=SimpleNamespace(dtype=torch.float32))
    with caplog.at_level("WARNING", logger="pretrain.optim.muon_staging"):
        assert not muon_staging.use_fused(cuda, torch.bfloat16, None)
        assert not muon_staging.use_fused(cuda, torch.bfloat16, None)
    assert [r.getMessage() for r in caplog.records] == [
        "Muon takes the unfused torch elementwise path: triton is not installed"]
    with pytest.raises(ValueError, match="triton is not installed"):
        muon_staging.use_fused(cuda, torch.bfloat16, True)
