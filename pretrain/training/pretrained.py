"""Starting a run from another run's weights: continued pretraining and the DSA recipe.

`checkpoint.pretrained` names the weights a fresh run starts from (iteration 0, new optimizer,
scheduler and data order): a training checkpoint directory of ours (its newest valid step dir),
one step dir, or a weights-only checkpoint written by `glm5-convert hf-to-checkpoint`
(`pretrain/convert/training_checkpoint.py`) from a Hugging Face GLM-5 directory.
dist_checkpointing reshards the weights to this run's TP / PP / EP.

Parameters of the DSA lightning indexer that the source lacks (a dense MLA model, or a model
trained without DSA) keep their fresh initialization; any other missing tensor is an error. The
run's own checkpoints (`checkpoint.save`, then `checkpoint.load`) take precedence when they exist,
so a restarted stage resumes instead of starting over.

`checkpoint.pretrained_optimizer: true` also takes the optimizer state from the training checkpoint
(`load_pretrained_with_optimizer`): a context-curriculum stage that continues the previous stage's
Adam moments / Muon momentum under its own LR schedule. Weights-only checkpoints have none.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Sequence

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.utils import unwrap_model

from pretrain.model.dsa import is_indexer_parameter
from pretrain.training import checkpoint_files as files
from pretrain.training.checkpoint_state import SHARDED_STATE_METADATA, model_keys, model_sharded_state

WEIGHTS_MARKER = "weights_only.json"  # a checkpoint that holds only model weights


def resolve_weights_dir(path: str) -> str:
    """The dist_checkpointing directory to read under `path` (a run dir, a step dir, or weights)."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"checkpoint.pretrained: {path} does not exist")
    if (p / WEIGHTS_MARKER).is_file():
        return str(p)
    if files.check_step_dir(p) is None:
        return str(p)
    candidates, problems = files.loadable_candidates(p)
    if not candidates:
        detail = "; ".join(problems) or "no step dirs"
        raise FileNotFoundError(f"checkpoint.pretrained: no usable checkpoint in {path} ({detail})")
    return str(candidates[0].path)


def load_pretrained_weights(path: str, model_chunks: Sequence[torch.nn.Module]) -> List[str]:
    """Load model weights from `path` into `model_chunks` (collective); return the parameter names
    that were absent from it and kept their initialization (DSA indexer parameters only)."""
    source = resolve_weights_dir(path)
    metadata = dist_checkpointing.load_content_metadata(source) or dict(SHARDED_STATE_METADATA)
    request = model_sharded_state(model_chunks, metadata)
    available = set(dist_checkpointing.load_tensors_metadata(source).keys())
    fresh: List[str] = []
    for key in model_keys(model_chunks):
        state = request[key]
        absent = [n for n, v in state.items() if getattr(v, "key", None) not in available]
        for name in [n for n in absent if not n.endswith("_extra_state")]:
            if not is_indexer_parameter(name):
                raise RuntimeError(
                    f"checkpoint.pretrained={path}: the checkpoint has no tensor for model parameter {name}; "
                    "only DSA indexer parameters may be missing (they are initialized fresh)"
                )
            fresh.append(name)
            del state[name]
    loaded = dist_checkpointing.load(request, source)
    for key, chunk in zip(model_keys(model_chunks), unwrap_model(list(model_chunks))):
        result = chunk.load_state_dict(loaded[key], strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state") and k not in fresh]
        if missing or result.unexpected_keys:
            raise RuntimeError(f"checkpoint.pretrained={path}: missing {missing[:5]}, unexpected "
                               f"{result.unexpected_keys[:5]}")
    dist.barrier()
    return fresh


def load_pretrained_with_optimizer(path: str, model_chunks: Sequence[torch.nn.Module], optimizer) -> str:
    """Load model weights and optimizer state from the training checkpoint `path` (collective);
    return the step dir read. Every parameter must be present (no fresh DSA indexer here)."""
    source = resolve_weights_dir(path)
    if (Path(source) / WEIGHTS_MARKER).is_file():
        raise RuntimeError(f"checkpoint.pretrained_optimizer=true but {path} holds weights only (no optimizer "
                           "state); set checkpoint.pretrained_optimizer=false")
    from pretrain.training.checkpoint import load_weights_and_optimizer

    load_weights_and_optimizer(source, model_chunks, optimizer)
    return source
