"""Checks that a run can start, made before any process group or GPU memory is touched.

Each failure names what to change. The world size comes from the launcher's environment
(torchrun's WORLD_SIZE), so a layout that cannot fit is refused on every rank at once.
"""

from __future__ import annotations

import os
from typing import Tuple

import torch

from pretrain.config import ConfigError, validate_config
from pretrain.config.schema import GLM5Config


def launch_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def preflight(cfg: GLM5Config, world_size: int | None = None) -> None:
    world_size = world_size or launch_world_size()
    validate_config(cfg, world_size=world_size)
    if cfg.model.bf16 and not torch.cuda.is_available():
        raise ConfigError("model.bf16=true needs a GPU (megatron-core's bf16 optimizer is CUDA-only); "
                          "set model.bf16=false model.params_dtype=float32 to train on CPU")
    if cfg.model.params_dtype == "bfloat16" and not cfg.model.bf16:
        raise ConfigError("model.params_dtype=bfloat16 needs model.bf16=true (bf16 weights train with fp32 main "
                          "weights in the bf16 optimizer)")
    if cfg.model.experimental_attention_variant == "dsa" and cfg.model.dsa_kernel_backend == "triton":
        from pretrain.model.dsa.backend import select_backend  # the one place that knows what Triton needs

        try:
            select_backend("triton", "cuda" if torch.cuda.is_available() else "cpu")
        except RuntimeError as err:
            raise ConfigError(str(err)) from None
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if local > torch.cuda.device_count():
            raise ConfigError(f"{local} processes per node but only {torch.cuda.device_count()} GPUs are visible; "
                              "start one process per GPU (torchrun --nproc-per-node)")
    check_copy_engine_transport(cfg, world_size)
    check_data(cfg)
    _check_checkpoint(cfg)


def check_copy_engine_transport(cfg: GLM5Config, world_size: int) -> None:
    """`optimizer.zero2_reduce_transport=copy_engine` maps peers' GPU memory: GPUs, and every data-parallel group
    inside one node. megatron's rank order puts pipeline stages outermost, so the tp x cp x dp ranks of one stage
    are consecutive and must fall within one node's LOCAL_WORLD_SIZE."""
    if cfg.optimizer.zero2_reduce_transport != "copy_engine":
        return
    if not torch.cuda.is_available():
        raise ConfigError("optimizer.zero2_reduce_transport=copy_engine needs GPUs (it maps peer GPU memory); "
                          "set it to nccl")
    span = world_size // cfg.parallel.pipeline_model_parallel_size
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if span > 1 and (span > local or local % span):
        raise ConfigError(f"optimizer.zero2_reduce_transport=copy_engine needs each pipeline stage's {span} ranks "
                          f"(tp x cp x dp) inside one node of {local} processes; set it to nccl")


def sample_counts(cfg: GLM5Config) -> Tuple[int, int, int]:
    """(train, valid, test) samples a run draws: `train_iters` global batches, and `eval_iters` global
    batches per evaluation (every `eval_interval` steps and once more)."""
    t, gbs = cfg.train, cfg.train.global_batch_size
    evals = (t.train_iters // t.eval_interval + 1) * t.eval_iters * gbs if t.eval_interval else 0
    return t.train_iters * gbs, evals, 0


def check_data(cfg: GLM5Config) -> None:
    """Every check the dataset build makes on the data files (`data_pipeline.datasets.blend_paths`:
    prefixes, vocabulary, tokenizer, documents per split after `data.min_document_length`), made from
    the index files alone, so a bad path or filter is one line before any process group or model."""
    d = cfg.data
    if d.mock:
        return
    if not d.data_path:
        raise ConfigError("data.data_path is empty; give preprocessed dataset prefixes (data.data_path=[PREFIX]) "
                          "or set data.mock=true for synthetic tokens")
    if not d.tokenizer or not os.path.exists(d.tokenizer):
        raise ConfigError(f"data.tokenizer ({d.tokenizer!r}) does not exist; give the tokenizer.json the data "
                          "was preprocessed with")
    from data_pipeline.datasets import DataError, blend_paths
    from data_pipeline.tokenizer import load_tokenizer

    try:
        blend_paths(d, cfg.model.vocab_size, load_tokenizer(d.tokenizer), sample_counts(cfg))
    except (DataError, ValueError, FileNotFoundError) as err:
        raise ConfigError(f"data: {err}") from None


def _check_checkpoint(cfg: GLM5Config) -> None:
    c = cfg.checkpoint
    if c.pretrained and not os.path.isdir(c.pretrained):
        raise ConfigError(
            f"checkpoint.pretrained={c.pretrained!r} does not exist; give a checkpoint directory of ours or convert "
            "a Hugging Face model with `glm5-convert hf-to-checkpoint HF_DIR OUT_DIR`"
        )
    if c.load and not os.path.isdir(c.load) and c.load != c.save:
        raise ConfigError(f"checkpoint.load={c.load!r} does not exist; fix the path or unset checkpoint.load")
