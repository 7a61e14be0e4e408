"""A one-tile Triton kernel around `pretrain.model.dsa.kernels.atomics.add_rows`, shared by the interpreter test
(tests/test_dsa_kernels.py) and the GPU test (tests/test_gpu_dsa_kernels.py), and the naive loop it is checked
against."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pretrain.model.dsa.kernels.atomics import add_rows


@triton.jit
def add_rows_kernel(x_ptr, idx_ptr, out_ptr, c0, limit, stride, MODE: tl.constexpr, BN: tl.constexpr,
                    W: tl.constexpr):
    n = tl.arange(0, BN)
    c = tl.arange(0, W)
    idx = tl.load(idx_ptr + n)
    x = tl.load(x_ptr + n[:, None] * W + c[None, :])
    add_rows(out_ptr + idx.to(tl.int64) * stride, c0, x, idx >= 0, limit, MODE)


def add_rows_naive(out: torch.Tensor, x: torch.Tensor, idx: torch.Tensor, c0: int, limit: int) -> torch.Tensor:
    """float64 out[idx[n], c0 + i] += x[n, i] for idx[n] >= 0 and c0 + i < limit, one value at a time."""
    out = out.double().clone()
    for n in range(x.shape[0]):
        for i in range(x.shape[1]):
            if idx[n] >= 0 and c0 + i < limit:
                out[idx[n], c0 + i] += float(x[n, i])
    return out


def add_rows_case(device: str):
    """Rows repeated (their adds must sum), empty slots (-1), a column offset, a limit that cuts the tile."""
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(16, 32, generator=gen)
    idx = torch.tensor([3, 1, -1, 3, 5, 7, 2, 1, 0, 3, -1, 6, 4, 4, 9, 3], dtype=torch.int32)
    out = torch.randn(10, 44, generator=gen)
    return x.to(device), idx.to(device), out.to(device), 8, 36


def run_add_rows(mode: int, device: str):
    """(the kernel's result, the naive one) for `add_rows_case`."""
    x, idx, out, c0, limit = add_rows_case(device)
    want = add_rows_naive(out.cpu(), x.cpu(), idx.cpu(), c0, limit)
    add_rows_kernel[(1,)](x, idx, out, c0, limit, out.shape[1], MODE=mode, BN=x.shape[0], W=x.shape[1])
    return out.cpu(), want
