"""megatron-core's apex-free gradient norm, made sync-free by `pretrain.compat` (te_absent.sync_free_grad_norm).

The reference is the float64 norm of the same gradients; the host-sync check makes `Tensor.item` (what
`torch.tensor(list of 0-dim tensors)` and `float(tensor)` call) raise inside the norm.
"""

import pytest
import torch

from pretrain import compat


@pytest.fixture
def no_item(monkeypatch):
    def item(self):
        raise AssertionError("host sync (Tensor.item) inside the gradient norm")

    def to_float(self):
        raise AssertionError("host sync (float(tensor)) inside the gradient norm")

    def patch():
        monkeypatch.setattr(torch.Tensor, "item", item)
        monkeypatch.setattr(torch.Tensor, "__float__", to_float)

    return patch


def test_grad_norm_matches_float64_without_a_host_sync(no_item):
    compat.install()
    from megatron.core.optimizer import clip_grads

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(64, 48, generator=gen), torch.randn(333, generator=gen).to(torch.bfloat16),
             torch.randn(7, 5, 3, generator=gen) * 1e3, torch.zeros(4)]
    reference = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads]))
    no_item()
    norm, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, torch.zeros(1, dtype=torch.int),
                                              [grads], False)
    assert norm.shape == (1,) and norm.dtype == torch.float32
    torch.testing.assert_close(norm.double(), reference.reshape(1), rtol=1e-6, atol=0)
