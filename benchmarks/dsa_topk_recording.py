"""A DSA model's top-k selections recorded on real text or mock tokens, for the scripts that study them
(`benchmarks/dsa_indexer_fp8.py`; the selection-overlap study of the kernel lab): `dsa_model` loads a DSA checkpoint
or builds a config's model, `recorded_forwards` runs it on `sequences` and yields what a `TopkRecorder` recorded of
each DSA layer's top-k call."""

from __future__ import annotations

import sys
from typing import List

import torch


def _indices_on_cpu(q, k, w, topk, keys, indices):
    return indices.detach().to("cpu", torch.int64)


class TopkRecorder:
    """Records every DSA top-k call (both backends), per call in order: `record(q_I, k_I, w, topk, keys, indices)`
    of each, by default the indices (int64, on the CPU)."""

    def __init__(self, record=_indices_on_cpu):
        from pretrain.model.dsa.backend import ReferenceBackend, TritonBackend

        self.calls: List = []
        self.patched = []
        for cls in (ReferenceBackend, TritonBackend):
            original = cls.topk

            def topk(backend, q, k, w, top, keys, *args, _original=original, **kwargs):
                out = _original(backend, q, k, w, top, keys, *args, **kwargs)
                indices = out[0] if isinstance(out, tuple) else out  # (indices, lse) with_lse
                self.calls.append(record(q, k, w, top, keys, indices))
                return out

            self.patched.append((cls, original))
            cls.topk = topk

    def remove(self) -> None:
        for cls, original in self.patched:
            cls.topk = original


def sequences(cfg, data: str, count: int, seed: int) -> List[torch.Tensor]:
    """`count` token sequences of the model's seq_length: held-out documents of `data`, or random tokens."""
    s = cfg.data.seq_length
    if data:
        from pretrain.eval.checkpoint import held_out_documents

        docs = held_out_documents(data, s, count)
        return [torch.as_tensor(d[:s]) for d in docs]
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.model.vocab_size, (s,), generator=g) for _ in range(count)]


def dsa_model(checkpoint, config, overrides):
    """(cfg, model in eval mode) from a DSA checkpoint (trained weights) or a DSA model config (a fresh
    initialization); ValueError (one line) for a model without DSA."""
    from pretrain import compat
    from pretrain.eval.checkpoint import checkpoint_config, load_for_eval

    if checkpoint:
        _, cfg = checkpoint_config(checkpoint, overrides)
        if cfg.model.experimental_attention_variant != "dsa":
            raise ValueError(f"{checkpoint} is not a DSA model (experimental_attention_variant="
                             f"{cfg.model.experimental_attention_variant})")
        return load_for_eval(checkpoint, overrides)
    from parallel.initialize import ensure_single_rank
    from pretrain.config import load_config
    from pretrain.model.builder import build_model

    cfg = load_config(config, overrides)
    if cfg.model.experimental_attention_variant != "dsa":
        raise ValueError(f"{config} is not a DSA model")
    compat.install()
    ensure_single_rank(cfg.train.seed)
    model = build_model(cfg)
    if torch.cuda.is_available():
        model = model.cuda().bfloat16() if cfg.model.bf16 else model.cuda()
    return cfg, model.eval()


def recorded_forwards(cfg, model, recorder, data, count: int, seed: int):
    """Runs the model (no grad) on each of `sequences(...)` and yields the list of calls `recorder` recorded in that
    forward, one DSA layer with its own indexer after another; removes the recorder at the end."""
    from pretrain.eval.checkpoint import device_of

    device = device_of(model)
    try:
        with torch.no_grad():
            for i, tokens in enumerate(sequences(cfg, data, count, seed)):
                print(f"sequence {i + 1} / {count}: {tokens.numel()} tokens", file=sys.stderr, flush=True)
                recorder.calls.clear()
                ids = tokens.view(1, -1).to(device)
                model(ids, torch.arange(ids.shape[1], device=device).view(1, -1), None)
                calls, recorder.calls = recorder.calls, []
                yield calls
    finally:
        recorder.remove()
