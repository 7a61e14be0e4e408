"""Named profiler ranges for the parts of a training step, pushed only while a profile window records.

`python -m pretrain.tools.step_breakdown` attributes every GPU kernel (or, in a CPU-only trace,
every operator's own time) to a part of the step by the innermost `part:<name>` range around the
operator that launched it; backward kernels get the part of the forward operator that created their
autograd node. The ranges come from one place:

- `ModelScopes(model_chunks)` registers forward pre/post hooks on the model's modules (embedding,
  MLA projections, core attention, DSA indexer, router, experts, shared expert, dense MLP, norms,
  MTP layers, output layer), wraps the MoE token dispatcher's permute/unpermute methods, the
  model's loss and Muon's Newton-Schulz / AdamW updates; `remove()` undoes all of it;
- `scope(name)` marks the training step's own parts (gradient zeroing and reduction, optimizer).

Outside a window nothing is registered and `scope` returns a shared no-op context, so unprofiled
steps pay nothing but a flag check.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Dict, List, Optional, Tuple

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer

PREFIX = "part:"
# name -> row label of the step breakdown table, in table order.
PARTS: Dict[str, str] = {
    "embedding": "embedding",
    "mla_proj": "MLA projections (q down/up, kv down/up*, output)",
    "core_attn": "core attention",
    "indexer": "DSA indexer",
    "router": "router (gate, top-k, aux loss)",
    "dispatch": "token permute/unpermute (dispatch)",
    "experts": "expert GEMMs (incl. SwiGLU)",
    "shared_expert": "shared expert (incl. SwiGLU)",
    "dense_mlp": "dense MLP (layer 0, incl. SwiGLU)",
    "glue": "norms, RoPE, residuals, layer glue",
    "mtp": "MTP eh_proj + glue",
    "output": "output layer + loss (main and MTP heads)",
    "grad_reduce": "gradient zero/accumulate/reduce",
    "muon_ns": "optimizer: Muon Newton-Schulz",
    "muon": "optimizer: Muon momentum + update",
    "adamw": "optimizer: AdamW",
    "optimizer": "optimizer: grad norm, clip, copies",
}
MODEL_PARTS = ("embedding", "mla_proj", "core_attn", "indexer", "router", "dispatch", "experts", "shared_expert",
               "dense_mlp", "glue", "mtp", "output")

_active = False
_NULL = contextlib.nullcontext()


def scope(name: str):
    """A `part:<name>` profiler range while a window records, else a no-op context."""
    if not _active:
        return _NULL
    return torch.profiler.record_function(PREFIX + name)


# A submodule's part from its attribute name in its parent (after the class rules of `_child_part`).
ATTRIBUTE_PARTS = {
    **dict.fromkeys(("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                     "linear_kv_up_proj", "linear_qkv", "linear_proj"), "mla_proj"),
    "eh_proj": "mtp",
    "core_attention": "core_attn",
    "router": "router",
    "experts": "experts",
    "shared_experts": "shared_expert",
    "mlp": "dense_mlp",  # a MoE layer's `mlp` is a MoELayer, matched by class first
    "output_layer": "output",
}


def _child_part(attr: str, module) -> Optional[str]:
    """The part a module is, from its attribute name in its parent and its class (megatron's and ours)."""
    cls = type(module).__name__
    if cls == "LanguageModelEmbedding":
        return "embedding"
    if cls == "LightningIndexer":
        return "indexer"
    if isinstance(module, MultiTokenPredictionLayer):  # megatron's, and ours that subclass it
        return "mtp"
    if cls in ("TransformerLayer", "GPTModel", "GLM5Model", "TransformerBlock", "MultiTokenPredictionBlock",
               "SharedDepthMTPBlock") or isinstance(module, MoELayer) or attr in ("self_attention", "rotary_pos_emb"):
        return "glue"
    if attr in ATTRIBUTE_PARTS:
        return ATTRIBUTE_PARTS[attr]
    if "norm" in attr:  # input_layernorm, pre_mlp_layernorm, q/kv_layernorm, enorm, hnorm, final_layernorm
        return "glue"
    return None


def module_parts(root: torch.nn.Module) -> List[Tuple[torch.nn.Module, str]]:
    """(module, part) for every module of `root` that opens a part range."""
    out, whole = [], []  # parts whose submodules all belong to them (the indexer's norm is the indexer's)
    for name, module in root.named_modules():
        if type(module).__name__ in ("IdentityOp", "IdentityFuncOp") or any(name.startswith(w) for w in whole):
            continue
        attr = name.rsplit(".", 1)[-1] if name else ""
        part = _child_part(attr, module)
        if part is not None:
            out.append((module, part))
            if part in ("indexer", "experts", "shared_expert", "dense_mlp", "router", "embedding", "output"):
                whole.append(name + ".")
    return out


DISPATCH_METHODS = ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess", "combine_preprocess",
                    "token_combine", "combine_postprocess")


def _scoped(fn: Callable, name: str) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(PREFIX + name):
            return fn(*args, **kwargs)

    return wrapper


class ModelScopes:
    """Part ranges over `model_chunks` (DDP / Float16Module wrappers are looked through) until `remove()`."""

    def __init__(self, model_chunks):
        global _active
        self._handles: list = []
        self._patched: List[Tuple[object, str, object, bool]] = []  # (owner, attribute, original, was own attr)
        for chunk in model_chunks:
            for module, part in module_parts(chunk):
                self._hook(module, part)
                dispatcher = getattr(module, "token_dispatcher", None)
                if dispatcher is not None:
                    for method in DISPATCH_METHODS:
                        if hasattr(dispatcher, method):
                            self._patch(dispatcher, method, "dispatch")
                for method in ("compute_language_model_loss", "_head_loss"):
                    if type(module).__name__ in ("GLM5Model", "GPTModel") and hasattr(module, method):
                        self._patch(module, method, "output")
        from pretrain.optim import muon

        self._patch(muon, "newton_schulz_lowp", "muon_ns")
        self._patch(muon.Muon, "_muon_updates", "muon")
        self._patch(muon.Muon, "_adamw_update", "adamw")
        _active = True

    def _hook(self, module: torch.nn.Module, part: str) -> None:
        stack: list = []

        def enter(_module, _args):
            rf = torch.profiler.record_function(PREFIX + part)
            rf.__enter__()
            stack.append(rf)

        def leave(_module, _args, _output):
            if stack:
                stack.pop().__exit__(None, None, None)

        self._handles.append(module.register_forward_pre_hook(enter))
        self._handles.append(module.register_forward_hook(leave, always_call=True))

    def _patch(self, owner, attr: str, part: str) -> None:
        own = attr in vars(owner)
        original = getattr(owner, attr)
        if own and isinstance(owner, type):
            original = vars(owner)[attr]  # the plain function, so the wrapper binds as a method
        self._patched.append((owner, attr, original, own))
        setattr(owner, attr, _scoped(original, part))

    def remove(self) -> None:
        global _active
        _active = False
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for owner, attr, original, own in reversed(self._patched):
            if own:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)
        self._patched = []
