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
0.2 * sqrt(max(m_b, n_b)). A gated MLP's fc1 [gate; up] is two matrices, as models that keep
gate_proj and up_proj apart have them (`MuonSplit.cols` for grouped experts). Blocks of equal shape,
from every matrix of a step (all layers, all experts), go through one batched Newton-Schulz.

`Muon` is a `torch.optim.Optimizer` over plain tensors: parameter groups with `use_muon=False`,
parameters in `adamw_params`, and parameters that are not 2-D are updated with AdamW. A parameter's
split comes from `splits` (parameter -> `MuonSplit`). A tensor-parallel shard whose cut goes through
its matrix (or through every block of its split, as expert tensor parallelism cuts each expert's
matrix) is listed in `tp_shards` (parameter -> (partition dim, process group)): its update is
orthogonalized on the matrix (each block) gathered over the group, and each rank keeps its slice:
the update of a shard is the shard of the update of the whole matrix. Which weight of a GLM-5 model
gets which split and which gather is decided in `pretrain.optim.roles`. On CUDA the elementwise
passes (momentum, staging, decay, update) run as two fused Triton kernels (`pretrain.optim.muon_kernels`;
`fused_elementwise` False keeps the torch ops, True asks for the kernels, on CPU through Triton's
interpreter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from pretrain.model.dsa.kernels import triton_available
from pretrain.optim.muon_staging import StagedBlock, apply_stage, fill_stage, stage_batches, use_fused

# Quintic Newton-Schulz coefficients (Jordan et al., Muon): fast convergence of singular values
# into a band around 1 rather than exactly to 1.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
# Most elements of one batched Newton-Schulz call (2^28: a 512 MiB bf16 stage, ~1.5 GiB with the
# iteration's temporaries): bounds the optimizer step's transient memory on large models.
NS_BATCH_ELEMENTS = 1 << 28


def _dtype(dtype) -> torch.dtype:
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


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
    so expert e's matrix is the e-th chunk of memory, not the e-th block of columns. `cols`, when given,
    cuts every section again along the other dim of the group view (a grouped expert's [hidden, 2F]
    matrix into its gate and up halves): the blocks are then every (group, section, col) triple.
    """

    groups: int
    sections: Tuple[int, ...]
    axis: int = 0
    cols: Tuple[int, ...] = ()

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
        """Views of `w` grouped by section (and col section): one [groups, rows, cols] tensor each."""
        rows = torch.split(self.group_view(w), list(self.sections), dim=self.section_dim)
        if not self.cols:
            return list(rows)
        other = 3 - self.section_dim
        if rows[0].shape[other] != sum(self.cols):
            raise ValueError(f"MuonSplit cols {self.cols} do not fit a weight of shape {tuple(w.shape)}")
        return [b for r in rows for b in torch.split(r, list(self.cols), dim=other)]

    def shard_dim(self, partition_dim: int) -> int:
        """The dim of `group_view` (and of every block) that a tensor-parallel cut of the 2-D weight
        along `partition_dim` cuts. A cut may go through sections: every shard holds its slice of
        each block (megatron's column-parallel SwiGLU fc1 keeps [gate_r; up_r]), and the update
        gathers block by block."""
        if self.axis == 2 and partition_dim != 1:
            raise ValueError("a memory-chunk split (axis 2) can be sharded only along its columns (partition dim 1)")
        return 1 if partition_dim == 0 else 2


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

    Each block (with `split`; else the matrix) is gathered over the group, orthogonalized whole, and
    each rank keeps its own slice. A column-parallel SwiGLU weight gathered whole is a row
    permutation of [gate; up] ([gate_0; up_0; gate_1; up_1]); Newton-Schulz commutes with
    permutations (X P (X P)^T = X X^T), so the update is the same permuted back.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if split is None:
        return orthogonalized_update(_gather(u, dim, group), None, steps, dtype, scale_rms).chunk(world, dim)[rank]
    cut = split.shard_dim(dim)
    out = torch.empty_like(u)
    for src, dst in zip(split.blocks(u), split.blocks(out)):
        full = _gather(src, cut, group)
        update = torch.empty_like(full)
        _update_blocks([full], [update], steps, dtype, scale_rms)  # scaled by each block's own (rows, cols)
        dst.copy_(update.chunk(world, cut)[rank])
    return out


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """`x` of every rank of `group`, concatenated along `dim` in rank order."""
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim)


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
        ns_batch_elements: int = NS_BATCH_ELEMENTS,
        fused_elementwise: Optional[bool] = None,
    ):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if ns_steps < 1:
            raise ValueError(f"ns_steps must be >= 1, got {ns_steps}")
        if fused_elementwise and not triton_available():
            raise ValueError("fused_elementwise=True needs triton (the Muon kernels are Triton kernels)")
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
        # `pretrain.optim.muon_pipeline.PipelineBalance` when pipeline ranks share the Newton-Schulz work
        self.pipeline_balance = None
        self.ns_batch_elements = ns_batch_elements
        self.fused_elementwise = fused_elementwise

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
        matrices = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or id(p) in self._foreign or (only is not None and id(p) not in only):
                    continue
                if self.uses_muon(group, p):
                    matrices.append((group, p))
                else:
                    self._adamw_update(group, p)
        balanced = self.pipeline_balance is not None and only is None
        if matrices or balanced:  # a balanced rank exchanges at every step, even with nothing of its own
            self._muon_updates(matrices, balanced)
        return loss

    def _muon_updates(self, matrices: List[Tuple[dict, torch.Tensor]], balanced: bool = False) -> None:
        """Momentum, Newton-Schulz and the update of every Muon matrix in `matrices`.

        Blocks of one shape from all matrices (every layer's experts, every head) run through one
        batched Newton-Schulz, staged in `ns_dtype`: the Nesterov sum is written straight into the
        stage in its wide orientation, and the result is added to the weight from there, scaled,
        so no fp32 copy of u or of the update is made. TP-sharded matrices gather and go one by one.
        With the fused kernels (`muon_staging.use_fused`) the momentum step happens block by block
        while staging and the decoupled decay while adding; the torch path does both on the whole
        matrix first.
        """
        staged: Dict[Tuple, List[StagedBlock]] = {}
        for group, p in matrices:
            buf = self._momentum_buffer(p)
            mu = group["momentum"] if group["nesterov"] else None
            dtype = _dtype(group["ns_dtype"])
            split, shard = self._splits.get(id(p)), self._tp.get(id(p))
            decay = 1.0 - group["lr"] * group["weight_decay"]
            fused = None
            if shard is None and use_fused(p, dtype, self.fused_elementwise):
                fused = (group["momentum"], decay)
            if fused is None:
                torch.add(p.grad, buf, alpha=group["momentum"], out=buf)  # M <- mu M + G, one pass
                p.mul_(decay)  # decoupled decay; the update reads G and M only
            if shard is not None:  # orthogonalize the whole matrix (each whole block), keep this rank's slice
                u = p.grad.add(buf, alpha=mu) if mu is not None else buf
                update = sharded_orthogonalized_update(u, split, *shard, group["ns_steps"], dtype, group["scale_rms"])
                p.add_(update, alpha=-group["lr"])
                continue
            views = [split.blocks(t) if split is not None else [t[None]] for t in (p.grad, buf, p)]
            if sum(b.numel() for b in views[2]) != p.numel():  # every element is updated once, by one block
                raise RuntimeError(f"Muon blocks {[tuple(b.shape) for b in views[2]]} do not partition "
                                   f"a matrix of shape {tuple(p.shape)}")
            for grad, momentum, param in zip(*views):
                coef = -group["lr"] * group["scale_rms"] * math.sqrt(max(grad.shape[-2:]))
                block = StagedBlock(grad, momentum, param, mu, coef, fused)
                staged.setdefault((dtype, group["ns_steps"]), []).append(block)
        if balanced:
            from pretrain.optim.muon_pipeline import balanced_updates

            device = self.param_groups[0]["params"][0].device
            balanced_updates(staged, self.ns_batch_elements, self.pipeline_balance, newton_schulz_lowp, device)
            return
        for (dtype, steps), blocks in staged.items():
            shapes = [(b.grad.shape[0], *b.wide) for b in blocks]
            for batch in stage_batches(shapes, self.ns_batch_elements):
                self._orthogonalize_and_apply([blocks[i] for i in batch], dtype, steps)

    def _momentum_buffer(self, p: torch.Tensor) -> torch.Tensor:
        """The momentum buffer of `p` (zeros at first); counts the step."""
        state = self.state[p]
        # Muon's math has no step count, but megatron's checkpoints keep one step shared by every
        # parameter (and give it to all of them on load): count it here as AdamW does.
        state["step"] = state.get("step", 0) + 1
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["momentum_buffer"]

    @staticmethod
    def _orthogonalize_and_apply(blocks: List[StagedBlock], dtype: torch.dtype, steps: int) -> None:
        """One batched Newton-Schulz over `blocks` (all of one wide shape), each result added to its weight."""
        apply_stage(blocks, newton_schulz_lowp(fill_stage(blocks, dtype), steps, dtype))

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
