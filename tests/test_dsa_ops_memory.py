"""Peak live tensor memory of the DSA reference path (top-k, sparse MLA, KL losses) is linear in the sequence length."""

# Measured with a TorchDispatchMode that tracks live storages; a dense attention control shows the
# tracker sees quadratic growth.

from __future__ import annotations

import itertools
import math
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pretrain.model.dsa.indexer import VisibleKeys, indexer_topk
from pretrain.model.dsa.indexer_loss import dense_target, indexer_kl_dense, indexer_kl_sparse, sparse_target
from pretrain.model.dsa.sparse_mla import sparse_mla_attention
from tests.dsa_references import F64, NEG_INF


# --------------------------------------------------------------------------------------------
# Peak live memory is linear in the sequence length
# --------------------------------------------------------------------------------------------


class PeakLiveBytes(TorchDispatchMode):
    """Tracks the bytes of live storages produced by ops run under the mode (each untyped storage
    counted once, by data pointer; released when the storage is freed) and their peak."""

    def __init__(self):
        super().__init__()
        self.live = {}
        self.current = 0
        self.peak = 0
        self._token = itertools.count()

    def _release(self, key, token):
        entry = self.live.get(key)
        if entry is not None and entry[1] == token:
            del self.live[key]
            self.current -= entry[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key, nbytes = st.data_ptr(), st.nbytes()
            if key == 0 or nbytes == 0 or key in self.live:
                continue
            token = next(self._token)
            self.live[key] = (nbytes, token)
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            weakref.finalize(st, self._release, key, token)
        return out


def _peak(fn, *inputs):
    with PeakLiveBytes() as mode:
        fn(*inputs)
    return mode.peak


def _naive_dense_attention(q, k, v):
    """Control: materializes the [S, S] score and probability matrices."""
    S = q.shape[0]
    scores = q @ k.T / math.sqrt(q.shape[-1])
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    p = torch.softmax(scores.masked_fill(~causal, NEG_INF), dim=-1)
    (p @ v).sum().backward()


def _ratios(peaks):
    return [b / a for a, b in zip(peaks, peaks[1:])]


SEQS = (256, 512, 1024, 2048)
CHUNK, H_IDX = 128, 2  # fixed query-row chunk and index heads of the memory runs


def test_peak_tracker_sees_quadratic_control():
    gen = torch.Generator().manual_seed(0)
    peaks = []
    for S in SEQS:
        q, k, v = (torch.randn(S, 16, generator=gen, dtype=F64).requires_grad_() for _ in range(3))
        peaks.append(_peak(_naive_dense_attention, q, k, v))
    # the tracker must see at least one [S, S] float64 block, and its growth
    assert peaks[-1] >= SEQS[-1] ** 2 * 8
    assert all(r >= 3.5 for r in _ratios(peaks)), (peaks, _ratios(peaks))

    # and it releases freed storages: a loop of allocations keeps a flat peak
    def loop():
        for _ in range(50):
            torch.ones(1 << 16, dtype=F64).mul(2.0)

    assert _peak(loop) <= 3 * (1 << 16) * 8


def _sparse_path(S, gen):
    b, H_I, d_I, h, dc, dr, topk, chunk = 1, H_IDX, 8, 2, 16, 4, 16, CHUNK
    qi = torch.randn(b, S, H_I, d_I, generator=gen, dtype=F64)
    ki = torch.randn(b, S, d_I, generator=gen, dtype=F64)
    wi = torch.randn(b, S, H_I, generator=gen, dtype=F64)
    q_abs = torch.randn(b, S, h, dc + dr, generator=gen, dtype=F64)
    kv = torch.randn(b, S, dc + dr, generator=gen, dtype=F64)
    g = torch.randn(b, S, h, dc, generator=gen, dtype=F64)
    leaves = [t.requires_grad_() for t in (qi, ki, wi, q_abs, kv)]

    def run(qi, ki, wi, q_abs, kv):
        keys = VisibleKeys(S, S, "cpu")
        idx = indexer_topk(qi.detach(), ki.detach(), wi.detach(), topk, keys, chunk)
        out, _ = sparse_mla_attention(q_abs, kv, idx, (dc + dr) ** -0.5, dc, chunk)
        target = sparse_target(q_abs.detach(), kv.detach(), (dc + dr) ** -0.5)
        loss, _ = indexer_kl_sparse(qi, ki, wi, idx, target, chunk)
        torch.autograd.backward([out, loss], [g, torch.ones((), dtype=F64)])

    return run, leaves


def _dense_kl_path(S, gen):
    b, H_I, d_I, h, dq, topk, chunk = 1, H_IDX, 8, 2, 8, 16, CHUNK
    qi = torch.randn(b, S, H_I, d_I, generator=gen, dtype=F64)
    ki = torch.randn(b, S, d_I, generator=gen, dtype=F64)
    wi = torch.randn(b, S, H_I, generator=gen, dtype=F64)
    query = torch.randn(b, S, h, dq, generator=gen, dtype=F64)
    key = torch.randn(b, S, h, dq, generator=gen, dtype=F64)
    leaves = [t.requires_grad_() for t in (qi, ki, wi)]

    def run(qi, ki, wi):
        keys = VisibleKeys(S, S, "cpu")
        target = dense_target(query, key, dq**-0.5)
        loss, _ = indexer_kl_dense(qi, ki, wi, keys, target, topk, chunk)
        loss.backward()

    return run, leaves


@pytest.mark.parametrize("path", [_sparse_path, _dense_kl_path], ids=["sparse", "dense_kl"])
def test_reference_path_memory_is_linear(path):
    gen = torch.Generator().manual_seed(0)
    peaks = []
    for S in SEQS:
        run, leaves = path(S, gen)
        peaks.append(_peak(run, *leaves))
        assert all(t.grad is not None for t in leaves)
    ratios = _ratios(peaks)
    assert all(r <= 2.6 for r in ratios), (peaks, ratios)
    # the tracker saw real work: at least the [chunk, heads, S] float64 score block of the last run
    assert peaks[-1] >= CHUNK * H_IDX * SEQS[-1] * 8
