"""Hugging Face GLM-5 checkpoints <-> our model and checkpoints, on CPU or GPU.

* `load_hf_model(hf_dir, **overrides)` -> (config, GLM5Model) with the HF weights loaded.
* `import_hf(hf_dir, out_dir)` / `export_hf(ckpt_dir, out_dir)`: streaming conversion between an
  HF directory and our model checkpoint directory (config.yaml, hf_config.json and sharded
  safetensors under megatron-core parameter names), one tensor in memory at a time.
* `training_checkpoint.hf_to_checkpoint(hf_dir, out_dir)`: HF directory -> a weights-only training
  checkpoint (dist_checkpointing) that `checkpoint.pretrained` reads at any parallel layout.
"""

from __future__ import annotations

import json
import os
from typing import Any, Tuple

import torch
from tqdm import tqdm

from pretrain.config import load_config, save_config, validate_config
from pretrain.config.schema import GLM5Config
from pretrain.convert.hf_config import ConversionError, hf_config_from_model, model_config_from_hf
from pretrain.convert.hf_mapping import Rule, rules
from pretrain.convert.safetensors_io import MissingTensorError, SafetensorsDir, ShardedWriter

__all__ = ["ConversionError", "load_hf_model", "import_hf", "export_hf"]

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: expected a Hugging Face model directory with config.json")
    with open(path) as f:
        return json.load(f)


def _converted(rule: Rule, get, direction: str):
    try:
        return rule.to_ours(get) if direction == "in" else rule.to_theirs(get(rule.ours))
    except MissingTensorError as err:
        raise ConversionError(f"missing tensor while converting {rule.ours}: {err.args[0]}") from None


def _check_shape(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if tuple(got.shape) != tuple(want.shape):
        raise ConversionError(
            f"tensor {name}: checkpoint shape {tuple(got.shape)} does not match the model's "
            f"{tuple(want.shape)}; does config.json describe this checkpoint?"
        )


def load_state(model: torch.nn.Module, cfg: GLM5Config, get) -> None:
    """Fill `model` (whole model on one rank) from a tensor getter in HF naming."""
    target = model.state_dict()
    state = {}
    for rule in tqdm(rules(cfg.model), desc="loading weights", unit="tensor", leave=False):
        tensor = _converted(rule, get, "in")
        if rule.ours not in target:
            raise ConversionError(f"model has no tensor {rule.ours}; is this rank holding the whole model?")
        _check_shape(rule.ours, tensor, target[rule.ours])
        state[rule.ours] = tensor.to(target[rule.ours].dtype)
    missing = [k for k in target if k not in state and not k.endswith("_extra_state")]
    if missing:
        raise ConversionError(f"no checkpoint tensor for model parameters {missing[:5]} ({len(missing)} in all)")
    model.load_state_dict(state, strict=False)


def load_hf_model(hf_dir: str, **overrides: Any) -> Tuple[GLM5Config, torch.nn.Module]:
    """Build our model from an HF GLM-5 directory (sets up a 1-rank process group if needed).

    `overrides` are `ModelConfig` fields (e.g. `mtp_num_layers=None`, `params_dtype="float32"`).
    The returned model is in eval mode; `model(input_ids, position_ids, None)` gives logits
    [batch, seq, vocab].
    """
    from parallel.initialize import ensure_single_rank
    from pretrain import compat
    from pretrain.model.builder import build_model

    compat.install()  # an entry point of the library: a plain process before its 1-rank group
    hf = _read_json(os.path.join(hf_dir, "config.json"))
    overrides.setdefault("params_dtype", "bfloat16" if hf.get("dtype", hf.get("torch_dtype")) == "bfloat16" else "float32")
    cfg = GLM5Config(model=model_config_from_hf(hf, **overrides))
    validate_config(cfg, world_size=1)
    source = SafetensorsDir(hf_dir)
    ensure_single_rank()
    model = build_model(cfg)
    load_state(model, cfg, source.get)
    return cfg, model.eval()


def import_hf(hf_dir: str, out_dir: str, max_shard_bytes: int = 5 * 2**30, **overrides: Any) -> str:
    """HF directory -> our checkpoint directory (atomic: out_dir appears only when complete)."""
    hf = _read_json(os.path.join(hf_dir, "config.json"))
    cfg = GLM5Config(model=model_config_from_hf(hf, **overrides))
    validate_config(cfg)
    source = SafetensorsDir(hf_dir)
    with ShardedWriter(out_dir, max_shard_bytes) as writer:
        for rule in tqdm(rules(cfg.model), desc="import-hf", unit="tensor"):
            writer.add(rule.ours, _converted(rule, source.get, "in"))
        save_config(cfg, os.path.join(writer.tmp, "config.yaml"))
        writer.write_json("hf_config.json", hf)
    return out_dir


def export_hf(ckpt_dir: str, out_dir: str, max_shard_bytes: int = 5 * 2**30) -> str:
    """Our checkpoint directory -> HF directory loadable by `GlmMoeDsaForCausalLM`."""
    cfg = load_config(os.path.join(ckpt_dir, "config.yaml"))
    hf_path = os.path.join(ckpt_dir, "hf_config.json")
    hf = _read_json(hf_path) if os.path.exists(hf_path) else hf_config_from_model(cfg.model)
    source = SafetensorsDir(ckpt_dir)
    with ShardedWriter(out_dir, max_shard_bytes) as writer:
        for rule in tqdm(rules(cfg.model), desc="export-hf", unit="tensor"):
            for name, tensor in _converted(rule, source.get, "out").items():
                writer.add(name, tensor)
        writer.write_json("config.json", hf)
    return out_dir
