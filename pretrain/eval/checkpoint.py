"""A trained model for evaluation: the config a checkpoint was saved with, its weights, one rank.

    cfg, model = load_for_eval("runs/x/checkpoints")   # a save dir (newest complete step) or a step dir

The model is built as training builds it (`pretrain.model.builder.build_model`) with no
parallelism, loaded with `pretrain.training.pretrained.load_pretrained_weights`, put in eval mode,
and cast to bf16 on a GPU when the config trained in bf16.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import List, Sequence, Tuple

import numpy as np
import torch

from pretrain.config import load_config
from pretrain.config.schema import DataConfig, GLM5Config, ParallelConfig


def checkpoint_config(checkpoint: str, overrides: Sequence[str] = ()) -> Tuple[Path, GLM5Config]:
    """(step dir, the config it was saved with, single-rank): cheap, so arguments can be checked first."""
    from pretrain.training.pretrained import resolve_weights_dir

    if not Path(checkpoint).is_dir():
        raise FileNotFoundError(f"--checkpoint {checkpoint} is not a directory")
    step_dir = Path(resolve_weights_dir(checkpoint))
    config = step_dir / "config.yaml"
    if not config.is_file():
        raise FileNotFoundError(f"{step_dir} has no config.yaml (not a training checkpoint of this project)")
    cfg = load_config(config, list(overrides))
    return step_dir, dataclasses.replace(cfg, parallel=ParallelConfig())


def load_for_eval(checkpoint: str, overrides: Sequence[str] = ()) -> Tuple[GLM5Config, torch.nn.Module]:
    from parallel.initialize import ensure_single_rank
    from pretrain import compat
    from pretrain.model.builder import build_model
    from pretrain.training.pretrained import load_pretrained_weights

    step_dir, cfg = checkpoint_config(checkpoint, overrides)
    compat.install()
    ensure_single_rank(cfg.train.seed)
    model = build_model(cfg)
    load_pretrained_weights(str(step_dir), [model])
    if cfg.model.bf16 and torch.cuda.is_available():
        model = model.bfloat16()
    return cfg, model.eval()


def device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def held_out_documents(prefix: str, min_tokens: int, count: int, split: str = DataConfig.split) -> List[np.ndarray]:
    """Up to `count` documents of at least `min_tokens` tokens, from the end of the dataset and only from
    the documents `split` (the run's `data.split`) keeps out of training: megatron's split gives the last
    documents to validation and test. Never a training document; none in the held-out range is an error."""
    from data_pipeline.datasets import held_out_document_range
    from data_pipeline.indexed import megatron_indexed_dataset

    begin, end = held_out_document_range(prefix, split)
    dataset = megatron_indexed_dataset().IndexedDataset(prefix)
    docs = []
    for i in range(end - 1, begin - 1, -1):
        if len(docs) == count:
            break
        if dataset.sequence_lengths[i] >= min_tokens:
            docs.append(np.asarray(dataset.get(i), dtype=np.int64))
    if not docs:
        raise ValueError(f"{prefix} has no held-out document of {min_tokens} tokens or more (documents {begin}.."
                         f"{end - 1} of {end} are outside the train share of data.split={split!r})")
    return docs


def default_data_prefix(cfg: GLM5Config) -> str:
    """The (first) dataset the checkpoint was trained on."""
    from data_pipeline.datasets import parse_blend

    prefixes, _ = parse_blend(cfg.data.data_path)
    if cfg.data.mock or not prefixes:
        raise ValueError("the checkpoint trained on mock data: pass --data PREFIX")
    return prefixes[0]
