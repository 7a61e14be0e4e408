"""How Muon (`pretrain.optim.muon`) stages its blocks for the batched Newton-Schulz.

Every block (a [groups, rows, cols] view of a Muon matrix: the whole matrix, or its heads, experts or
GLU halves) is written into a stage in `ns_dtype` in its wide orientation; blocks of one wide shape,
from all matrices of a step, share one batched Newton-Schulz (`stage_batches`, under an element cap).
The momentum step, the staging, the decoupled decay and the scaled add are elementwise passes:
`use_fused` decides whether they run as the two fused Triton kernels of `pretrain.optim.muon_kernels`
(block by block, momentum inside the staging and decay inside the add) or as torch ops.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from pretrain.model.dsa.kernels import interpreting, triton_available
from pretrain.notices import say_once

log = logging.getLogger(__name__)


@dataclass
class StagedBlock:
    """One [groups, rows, cols] block of a Muon matrix, staged for a batched Newton-Schulz."""

    grad: torch.Tensor
    momentum: torch.Tensor
    param: torch.Tensor
    nesterov_mu: Optional[float]  # u = grad + mu * momentum; None: u = momentum
    coef: float  # -lr * scale_rms * sqrt(max(rows, cols))
    # with the fused kernels, (momentum mu, decay 1 - lr wd): the momentum step is taken while staging
    # and the decay while adding; None on the torch path, where the whole matrix took both before
    fused: Optional[Tuple[float, float]] = None

    @property
    def wide(self) -> Tuple[int, int]:
        """(m, n) with m <= n: the orientation Newton-Schulz iterates on."""
        return tuple(sorted(self.grad.shape[-2:]))

    @property
    def transposed(self) -> bool:
        return self.grad.shape[-2] > self.grad.shape[-1]


def newton_schulz_flops(rows: int, cols: int, steps: int) -> float:
    """Flops of `steps` quintic iterations on one [rows, cols] matrix: 4 m^2 n + 2 m^3 each (m <= n)."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4.0 * m * m * n + 2.0 * m**3)


def stage_batches(shapes: List[Tuple[int, int, int]], max_elements: int) -> List[List[int]]:
    """Indices of `shapes` ([groups, m, n] in the wide orientation) batched for Newton-Schulz: equal
    (m, n) together, in order, each batch at most `max_elements` (a larger block goes alone)."""
    by_shape: Dict[Tuple[int, int], List[int]] = {}
    for i, (_, m, n) in enumerate(shapes):
        by_shape.setdefault((m, n), []).append(i)
    batches = []
    for (m, n), idx in by_shape.items():
        current, size = [], 0
        for i in idx:
            count = shapes[i][0] * m * n
            if current and size + count > max_elements:
                batches.append(current)
                current, size = [], 0
            current.append(i)
            size += count
        batches.append(current)
    return batches


def use_fused(p: torch.Tensor, stage_dtype: torch.dtype, requested: Optional[bool]) -> bool:
    """Whether `p`'s momentum, staging, decay and update run as the fused kernels.

    `requested` (Muon's `fused_elementwise`) None: on CUDA tensors when triton is installed and the
    dtypes are the kernels' (else the torch ops, each reason logged once); CPU tensors
    take the torch ops (Triton's CPU interpreter is for tests: slow, and its unfused multiply-adds
    would move CPU runs off their bits). True: the kernels, on CPU through the interpreter
    (TRITON_INTERPRET=1); an error where they cannot run. False: the torch ops."""
    if requested is False:
        return False
    why = None
    if not triton_available():
        why = "triton is not installed"
    elif not p.is_cuda and not interpreting():
        why = "CPU tensors need TRITON_INTERPRET=1"
    else:
        from pretrain.optim.muon_kernels import STAGE_DTYPES, STATE_DTYPES

        if not (p.dtype in STATE_DTYPES and p.grad.dtype in STATE_DTYPES and stage_dtype in STAGE_DTYPES):
            why = f"the kernels do not take weight {p.dtype}, grad {p.grad.dtype}, stage {stage_dtype}"
    if why is None:
        return bool(requested) or p.is_cuda
    if requested:
        raise ValueError(f"Muon's fused elementwise kernels cannot run: {why}")
    if p.is_cuda:  # each reason said once per process
        say_once(log, "Muon takes the unfused torch elementwise path: %s", why, level=logging.WARNING)
    return False


def fill_stage(blocks: List[StagedBlock], dtype: torch.dtype) -> torch.Tensor:
    """The stage [sum of groups, m, n] in `dtype` of `blocks` (all of one wide shape (m, n)): each block's u
    (G + mu M, or M), written in the wide orientation; with the fused kernels the momentum step happens here."""
    if any(b.fused is not None for b in blocks):
        from pretrain.optim import muon_kernels
    m, n = blocks[0].wide
    stage = torch.empty(sum(b.grad.shape[0] for b in blocks), m, n, dtype=dtype, device=blocks[0].grad.device)
    start = 0
    for b in blocks:
        span = stage[start : start + b.grad.shape[0]]
        start += b.grad.shape[0]
        span = span.mT if b.transposed else span
        if b.fused is not None:  # M <- mu M + G and the stage in one pass
            muon_kernels.momentum_and_stage(b.grad, b.momentum, span, b.fused[0], b.nesterov_mu)
        elif b.nesterov_mu is None:
            span.copy_(b.momentum)
        else:  # u = G + mu M, rounded once into the stage
            torch.add(b.grad, b.momentum, alpha=b.nesterov_mu, out=span)
    return stage


def apply_stage(blocks: List[StagedBlock], x: torch.Tensor) -> None:
    """Add each block's orthogonalized slice of `x` (the Newton-Schulz of `fill_stage`'s stage) to its weight,
    scaled by its coefficient (with the fused kernels, after the decoupled decay in the same pass)."""
    if any(b.fused is not None for b in blocks):
        from pretrain.optim import muon_kernels
    start = 0
    for b in blocks:
        out = x[start : start + b.grad.shape[0]]
        start += b.grad.shape[0]
        out = out.mT if b.transposed else out
        if b.fused is not None:  # W <- W (1 - lr wd) + coef O in one pass
            muon_kernels.decay_and_add(b.param, out, b.fused[1], b.coef)
        else:
            b.param.add_(out, alpha=b.coef)
