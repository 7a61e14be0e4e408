"""A Hugging Face GLM-5 directory -> a weights-only training checkpoint (`glm5-convert hf-to-checkpoint`).

The output is a megatron-core dist_checkpointing directory holding only the model's sharded state
(plus `config.yaml` and the `weights_only.json` marker), so `checkpoint.pretrained` can read it at
any TP / PP / EP layout: dist_checkpointing reshards on load. The conversion runs in one process on
the whole model; the directory appears only when complete (written under a `.partial` name, then
renamed).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from megatron.core import dist_checkpointing

from pretrain import compat
from pretrain.config.loader import save_config
from pretrain.convert import load_hf_model
from pretrain.training.checkpoint_files import PARTIAL_SUFFIX
from pretrain.training.checkpoint_state import SHARDED_STATE_METADATA
from pretrain.training.pretrained import WEIGHTS_MARKER


def hf_to_checkpoint(hf_dir: str, out_dir: str, **overrides: Any) -> str:
    """A Hugging Face GLM-5 directory -> a weights-only checkpoint `checkpoint.pretrained` can read
    at any parallel layout (one process; the directory appears only when complete).

    `overrides` are `ModelConfig` fields (e.g. `mtp_num_layers=None` to leave out the MTP layer)."""
    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out_dir} exists; choose a new directory")
    cfg, model = load_hf_model(hf_dir, **overrides)
    compat.install()  # an entry point (the torch_dist writer among its fixes)
    staging = out.with_name(out.name + PARTIAL_SUFFIX)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    state = {"model": model.sharded_state_dict(metadata=dict(SHARDED_STATE_METADATA))}
    dist_checkpointing.save(state, str(staging), content_metadata=dict(SHARDED_STATE_METADATA))
    save_config(cfg, staging / "config.yaml")
    (staging / WEIGHTS_MARKER).write_text(json.dumps({"source": os.path.abspath(hf_dir)}) + "\n")
    os.replace(staging, out)
    return str(out)
