"""Activation offloading's hook logic on CPU: gradients equal the plain run, tensors really take the round trip."""

import pytest
import torch

from parallel.activation_offload import ActivationOffloader


class Block(torch.nn.Module):
    def __init__(self, width, index):
        super().__init__()
        self.index = index
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def _model(seed=0, width=32, layers=4):
    torch.manual_seed(seed)
    return torch.nn.ModuleList(Block(width, i) for i in range(layers))


def _forward(model, x, offloader=None):
    for block in model:
        if offloader is None:
            x = block(x)
        else:
            with offloader.layer(block.index):
                x = block(x)
    return x.square().mean()


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointed", [False, True])
def test_gradients_equal_the_plain_run_and_tensors_go_through_host(checkpointed):
    x = torch.randn(2, 64, 32)
    plain, offloaded = _model(), _model()
    _forward(plain, x).backward()
    off = ActivationOffloader(min_bytes=1024)
    off.exclude_parameters(offloaded)
    if checkpointed:  # recompute: the saved tensors are the layer inputs; the re-run in backward is not offloaded
        from torch.utils.checkpoint import checkpoint

        h = x
        for block in offloaded:
            with off.layer(block.index):
                h = checkpoint(block, h, use_reentrant=False)
        h.square().mean().backward()
    else:
        _forward(offloaded, x, off).backward()
    for name, grad in _grads(plain).items():
        assert torch.equal(grad, dict(offloaded.named_parameters())[name].grad), name
    assert off.offloaded_bytes >= 4 * 2 * 64 * 32 * 4  # at least each layer's input went to the host
    assert off.prefetched_groups == 3  # layers 2, 1, 0 fetched one layer ahead of their backward


def test_interleaved_microbatches_keep_their_own_chains():
    """1F1B-like order: forward mb0, forward mb1, backward mb0, backward mb1."""
    model_a, model_b = _model(), _model()
    xs = [torch.randn(2, 64, 32), torch.randn(2, 64, 32)]
    for x in xs:
        _forward(model_a, x).backward()
    off = ActivationOffloader(min_bytes=1024)
    off.exclude_parameters(model_b)
    losses = [_forward(model_b, x, off) for x in xs]
    for loss in losses:
        loss.backward()
    for name, grad in _grads(model_a).items():
        torch.testing.assert_close(dict(model_b.named_parameters())[name].grad, grad, rtol=0, atol=1e-6)
    assert off.prefetched_groups == 6


def _saved_tensors(model, x):
    """(every saved (address, bytes), bytes of those that are weights) of the layers' plain forward: a weight is a saved
    tensor whose memory lies inside a parameter's, by address, found independently of the offloader."""
    spans = [(p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in model.parameters()]
    saved = []

    def pack(t):
        saved.append((t.data_ptr(), t.numel() * t.element_size()))
        return t

    for block in model:  # what the layers save (the loss after them is not offloaded)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            x = block(x)
    weights = [n for ptr, n in saved if any(a <= ptr < b for a, b in spans)]
    return saved, weights


def _flat_buffer(model):
    """What ZeRO-2 / DDP do: every parameter becomes a view of one contiguous buffer (new storage)."""
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:
        p.data = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return model


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("repoint", ["bfloat16", "flat_buffer", "wrapped_detached"])
def test_weights_stay_when_parameters_are_repointed_after_exclusion(repoint, device):
    """Excluded at build time, then given new storage (Float16Module's bf16 cast, ZeRO-2's flat buffer) or used
    through detached aliases: the saved weights (64 KiB and more) stay, every activation above min_bytes goes."""
    model = _model(layers=2, width=64)
    off = ActivationOffloader(min_bytes=4096)
    off.exclude_parameters(model)
    x = torch.randn(2, 64, 64, device=device)
    model.to(device)  # on a GPU host the offloader copies through pinned host buffers on its side streams
    if repoint == "bfloat16":
        model, x = model.bfloat16(), x.bfloat16()
    elif repoint == "flat_buffer":
        _flat_buffer(model)
    else:  # a saved alias that is neither a parameter nor a view of one: caught by the live storage lookup
        _flat_buffer(model)

        def linear(self, h):
            return torch.nn.functional.linear(h, self.weight.detach().requires_grad_(), self.bias)

        for block in model:
            for lin in (block.up, block.down):
                lin.forward = linear.__get__(lin)
    saved, weights = _saved_tensors(model, x)
    # 3 saved weights of 4 linears (layer 0's first one has an input without gradient, so saves no weight)
    assert weights == [64 * 256 * x.element_size()] * 3
    big = sum(n for _, n in saved if n >= 4096)
    weight_bytes = sum(weights)
    _forward(model, x, off).backward()
    assert off.offloaded_bytes == big - weight_bytes and off.offloaded_bytes > 0


def test_small_tensors_stay():
    model = _model(layers=1)
    off = ActivationOffloader(min_bytes=1 << 30)
    off.exclude_parameters(model)
    _forward(model, torch.randn(2, 8, 32), off).backward()
    assert off.offloaded_bytes == 0


def test_forward_hooks_wrap_existing_layers():
    from parallel.activation_offload import offload_layers

    x = torch.randn(2, 64, 32)
    plain, hooked = _model(), _model()
    _forward(plain, x).backward()
    for i, block in enumerate(hooked):
        block.layer_number = i + 1  # megatron numbers layers from 1
    off = ActivationOffloader(min_bytes=1024)
    off.exclude_parameters(hooked)
    handles = offload_layers(hooked, off)
    _forward(hooked, x).backward()
    for name, grad in _grads(plain).items():
        assert torch.equal(grad, dict(hooked.named_parameters())[name].grad), name
    assert off.offloaded_bytes > 0 and off.prefetched_groups == 3
    for h in handles:
        h.remove()
