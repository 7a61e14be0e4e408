"""Muon with Muon Split (GLM-5 report, section on MLA-256 and Muon Split; GLM-4.5's optimizer settings).

For a matrix parameter W (m x n) with gradient G, momentum mu and learning rate lr:

    M <- mu M + G                                   (momentum buffer)
    U <- G + mu M  (Nesterov)   or   U <- M
    O <- NS_5(U) ~ U (U^T U)^(-1/2)                  (quintic Newton-Schulz, 5 steps, bf16 by default)
    W <- W (1 - lr wd) - lr * 0.2 * sqrt(max(m, n)) * O

0.2 * sqrt(max(m, n)) gives the update about AdamW's RMS (Moonlight), so AdamW's learning rate and
weight decay carry over. Muon Split: instead of orthogonalizing a whole up-projection, cut it into
blocks (one per attention head of MLA's W_UQ; W_UK and W_UV of every head separately; one per
expert of a grouped expert weight) and orthogonalize each block on its own, scaled by its own
0.2 * sqrt(max(m_b, n_b)). Blocks of equal shape go through one batched Newton-Schulz.

`Muon` is a `torch.optim.Optimizer` over plain tensors: parameter groups with `use_muon=False`,
parameters in `adamw_params`, and parameters that are not 2-D are updated with AdamW. A parameter's
split comes from `splits` (parameter -> `MuonSplit`). A tensor-parallel shard whose cut goes through
its matrix (or through every block of its split, as expert tensor parallelism cuts each expert's
matrix) is listed in `tp_shards` (parameter -> (partition dim, process group)): its update is
orthogonalized on the matrix (each block) gathered over the group, and each rank keeps its slice:
the update of a shard is the shard of the update of the whole matrix. Which weight of a GLM-5 model
gets which split and which gather is decided in `pretrain.optim.roles`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

# Quintic Newton-Schulz coefficients (Jordan et al., Muon): fast convergence of singular values
# into a band around 1 rather than exactly to 1.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz_lowp(g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16,
                       eps: float = 1e-7) -> torch.Tensor:
    """Approximate orthogonalization of the last two dims of `g` ([..., m, n]), batched, returned in
    the iteration's `dtype` (possibly a transposed view: callers write it where it goes in one pass).

    Each step is X <- a X + (b A + c A^2) X with A = X X^T, written as two fused multiply-adds
    (`baddbmm` / `addmm`: B = b A + c A A, X = a X + B X), so the scalings and sums ride in the
    GEMMs' epilogues instead of separate elementwise passes; X is kept contiguous in its wide
    orientation (a transposed view would send every elementwise op down the strided slow path)."""
    a, b, c = NS_COEFFICIENTS
    transposed = g.shape[-2] > g.shape[-1]
    # iterate on the wide orientation: X X^T is the smaller Gram matrix
    x = (g.mT if transposed else g).to(dtype, memory_format=torch.contiguous_format)
    x = x / (torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True) + eps)
    lead = x.shape[:-2]
    x = x.reshape(-1, *x.shape[-2:])  # [batch, m, n]: one batched GEMM per product
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a, alpha=1.0)
    x = x.reshape(*lead, *x.shape[-2:])
    return x.mT if transposed else x


def newton_schulz(g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16, eps: float = 1e-7) -> torch.Tensor:
    """Approximate orthogonalization of the last two dims of `g` ([..., m, n]), batched, in `g`'s dtype."""
    return newton_schulz_lowp(g, steps, dtype, eps).to(g.dtype)


@dataclass(frozen=True)
class MuonSplit:
    """How a 2-D weight is cut into independently orthogonalized blocks.

    The weight is viewed along `axis` (0: rows, 1: columns) as `groups` equal slices (heads or
    experts); each slice is cut along the same axis into `sections` (e.g. [d_nope, d_v] for MLA's
    kv up-projection: W_UK and W_UV). Every (group, section) pair is one block. `axis=2` reads the
    weight's memory as `groups` consecutive [sum(sections), rest] matrices, cut into row sections:
    megatron's GroupedMLP keeps `weight1` as [H, E * 2F] but its forward uses `weight1.view(E, H, 2F)`,
    so expert e's matrix is the e-th chunk of memory, not the e-th block of columns.
    """

    groups: int
    sections: Tuple[int, ...]
    axis: int = 0

    @property
    def section_dim(self) -> int:
        """The dim of `group_view` that `sections` cut."""
        return 2 if self.axis == 1 else 1

    def group_view(self, w: torch.Tensor) -> torch.Tensor:
        """A [groups, rows, cols] view of `w`: each group's (head's, expert's) matrix."""
        per_group = sum(self.sections)
        if self.axis == 2:
            fits = w.is_contiguous() and w.numel() % (self.groups * per_group) == 0
        else:
            fits = w.shape[self.axis] == self.groups * per_group
        if not fits:
            raise ValueError(f"MuonSplit({self.groups} x {self.sections}, axis {self.axis}) does not fit a weight of "
                             f"shape {tuple(w.shape)}")
        if self.axis == 2:
            return w.view(self.groups, per_group, -1)
        if self.axis == 0:
            return w.view(self.groups, per_group, w.shape[1])
        return w.view(w.shape[0], self.groups, per_group).permute(1, 0, 2)

    def blocks(self, w: torch.Tensor) -> List[torch.Tensor]:
        """Views of `w` grouped by section: one [groups, rows, cols] tensor per section."""
        return list(torch.split(self.group_view(w), list(self.sections), dim=self.section_dim))

    def shard_dim(self, partition_dim: int) -> int:
        """The dim of `group_view` that a tensor-parallel cut of the 2-D weight along `partition_dim`
        cuts. It must not cut between sections (concatenating the shards would interleave them)."""
        if self.axis == 2 and partition_dim != 1:
            raise ValueError("a memory-chunk split (axis 2) can be sharded only along its columns (partition dim 1)")
        dim = 1 if partition_dim == 0 else 2
        if dim == self.section_dim and len(self.sections) > 1:
            raise ValueError(f"MuonSplit with sections {self.sections}: a tensor-parallel cut along dim "
                             f"{partition_dim} would cut through its sections")
        return dim


def orthogonalized_update(u: torch.Tensor, split: Optional[MuonSplit], steps: int, dtype: torch.dtype,
                          scale_rms: float) -> torch.Tensor:
    """The scaled Newton-Schulz update of one matrix (whole, or block by block with `split`)."""
    if split is None:  # scaled while written back in u's dtype: one pass
        return torch.mul(newton_schulz_lowp(u, steps, dtype), scale_rms * math.sqrt(max(u.shape)),
                         out=torch.empty_like(u))
    out = torch.empty_like(u)
    _update_blocks(split.blocks(u), split.blocks(out), steps, dtype, scale_rms)
    return out


def _update_blocks(sources, targets, steps: int, dtype: torch.dtype, scale_rms: float) -> None:
    """Each [groups, rows, cols] source orthogonalized group by group (one batched call), scaled by
    its own 0.2 * sqrt(max(rows, cols)), into the matching target."""
    for src, dst in zip(sources, targets):
        torch.mul(newton_schulz_lowp(src, steps, dtype), scale_rms * math.sqrt(max(src.shape[-2:])), out=dst)


def sharded_orthogonalized_update(u: torch.Tensor, split: Optional[MuonSplit], dim: int, group, steps: int,
                                  dtype: torch.dtype, scale_rms: float) -> torch.Tensor:
    """This rank's slice of the update of a matrix cut along `dim` over process group `group`.

    The shards are gathered (per block with `split`), orthogonalized as one matrix, and each rank
    keeps its own slice. A column-parallel SwiGLU weight gathers as a column permutation of the whole
    ([gate_0; up_0; gate_1; up_1] instead of [gate; up]); Newton-Schulz commutes with permutations
    (X P (X P)^T = X X^T), so the update is the same permuted back.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    local = u if split is None else split.group_view(u)
    cut = dim if split is None else split.shard_dim(dim)
    parts = [torch.empty_like(local, memory_format=torch.contiguous_format) for _ in range(world)]
    dist.all_gather(parts, local.contiguous(), group=group)
    full = torch.cat(parts, cut)
    if split is None:
        return orthogonalized_update(full, None, steps, dtype, scale_rms).chunk(world, cut)[rank]
    sections = [s * world for s in split.sections] if cut == split.section_dim else list(split.sections)
    update = torch.empty_like(full)
    d = split.section_dim
    _update_blocks(torch.split(full, sections, d), torch.split(update, sections, d), steps, dtype, scale_rms)
    out = torch.empty_like(u)
    split.group_view(out).copy_(update.chunk(world, cut)[rank])
    return out


class Muon(torch.optim.Optimizer):
    """Muon for matrices, AdamW for everything else (see the module docstring)."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 2e-4,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_dtype: torch.dtype = torch.bfloat16,
        scale_rms: float = 0.2,
        adam_betas: Tuple[float, float] = (0.9, 0.95),
        adam_eps: float = 1e-8,
        splits: Optional[Dict[torch.Tensor, MuonSplit]] = None,
        adamw_params: Iterable[torch.Tensor] = (),
        tp_shards: Optional[Dict[torch.Tensor, Tuple[int, object]]] = None,
    ):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if ns_steps < 1:
            raise ValueError(f"ns_steps must be >= 1, got {ns_steps}")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        ns_dtype=ns_dtype, scale_rms=scale_rms, adam_betas=adam_betas, adam_eps=adam_eps,
                        use_muon=True)
        super().__init__(params, defaults)
        self._splits = {id(p): s for p, s in (splits or {}).items()}
        self._adamw = {id(p) for p in adamw_params}
        self._tp = {id(p): v for p, v in (tp_shards or {}).items()}
        for p, (dim, _) in (tp_shards or {}).items():  # a shard its split cannot be gathered for fails here
            if id(p) in self._splits:
                self._splits[id(p)].shard_dim(dim)
        self._foreign: set = set()

    def set_foreign(self, params: Iterable[torch.Tensor]) -> None:
        """Parameters another data-parallel rank updates (ZeRO-2, `pretrain.optim.zero2_grads`): skipped here,
        and no state is kept for them."""
        self._foreign = {id(p) for p in params}

    def is_foreign(self, p: torch.Tensor) -> bool:
        return id(p) in self._foreign

    def uses_muon(self, group: dict, p: torch.Tensor) -> bool:
        return bool(group["use_muon"]) and p.ndim == 2 and id(p) not in self._adamw

    def split_of(self, p: torch.Tensor) -> Optional[MuonSplit]:
        """The Muon Split blocks of `p`, or None (the whole matrix)."""
        return self._splits.get(id(p))

    def tp_shard_of(self, p: torch.Tensor) -> Optional[Tuple[int, object]]:
        """(partition dim, process group) when `p`'s update is orthogonalized gathered, else None."""
        return self._tp.get(id(p))

    @torch.no_grad()
    def step(self, closure=None, params: Optional[Iterable[torch.Tensor]] = None):
        """Update every parameter with a gradient, or only those in `params` (ZeRO-2 steps bucket by
        bucket)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        only = None if params is None else {id(p) for p in params}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or id(p) in self._foreign or (only is not None and id(p) not in only):
                    continue
                if self.uses_muon(group, p):
                    self._muon_update(group, p)
                else:
                    self._adamw_update(group, p)
        return loss

    def _muon_update(self, group: dict, p: torch.Tensor) -> None:
        state = self.state[p]
        grad = p.grad
        # Muon's math has no step count, but megatron's checkpoints keep one step shared by every
        # parameter (and give it to all of them on load): count it here as AdamW does.
        state["step"] = state.get("step", 0) + 1
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        torch.add(grad, buf, alpha=group["momentum"], out=buf)  # M <- mu M + G in one pass
        u = grad.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf
        dtype = group["ns_dtype"]
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        shard = self._tp.get(id(p))
        split = self._splits.get(id(p))
        if shard is None:
            update = orthogonalized_update(u, split, group["ns_steps"], dtype, group["scale_rms"])
        else:  # orthogonalize the whole matrix (each whole block), keep this rank's slice
            update = sharded_orthogonalized_update(u, split, *shard, group["ns_steps"], dtype, group["scale_rms"])
        p.mul_(1.0 - group["lr"] * group["weight_decay"])
        p.add_(update, alpha=-group["lr"])

    def _adamw_update(self, group: dict, p: torch.Tensor) -> None:
        state = self.state[p]
        if "step" not in state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        beta1, beta2 = group["adam_betas"]
        state["step"] += 1
        t = state["step"]
        state["exp_avg"].lerp_(p.grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        denom = (state["exp_avg_sq"] / (1 - beta2**t)).sqrt_().add_(group["adam_eps"])
        p.mul_(1.0 - group["lr"] * group["weight_decay"])
        p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1**t))
