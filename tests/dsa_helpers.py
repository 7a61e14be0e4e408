"""Shared helpers of the DSA model and training tests: tiny HF checkpoints, LM steps, tolerances, trainer paths."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch

from pretrain.model.dsa import DSAMetrics, IndexerLossAutoScaler
from tests.hf_fixtures import tiny_hf_model

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs/models/glm5-tiny.yaml"
TOL = 1e-5  # fp32 vs fp32 (transformers, single rank)
INDEXER = ".core_attention.indexer."
# An index score is sum_j w_j ReLU(q_j . k): with few index heads all ReLUs of a key are often 0, and
# keys tied at 0 straddle the top-k boundary. torch.topk breaks such ties by position, so a document
# at an offset inside a packed row (or a float64 recomputation) may select other, equally scored keys.
# With 32 index heads an all-zero score has probability 2^-32 per key and ties do not occur.
NO_TIE_INDEX_HEADS = 32


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.abs().max().item()
    diff = (out - ref).abs().max().item()
    return diff / scale if scale > 0 else diff


def is_indexer(name: str) -> bool:
    return INDEXER in name


@pytest.fixture(autouse=True)
def clean_dsa_globals():
    """The indexer-loss scale and the metrics table are process-wide: reset them around each test."""
    IndexerLossAutoScaler.main_loss_backward_scale = None
    DSAMetrics.clear()
    yield
    IndexerLossAutoScaler.main_loss_backward_scale = None
    DSAMetrics.clear()


def hf_checkpoint(path, seed: int, **kw):
    """A random tiny `GlmMoeDsaForCausalLM` saved to `path`; returns the HF model (eval, fp32)."""
    hf = tiny_hf_model(seed, **kw)
    hf.save_pretrained(str(path))
    return hf


def tokens(seed: int, batch: int, seq: int, vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def positions(batch: int, seq: int) -> torch.Tensor:
    return torch.arange(seq).unsqueeze(0).expand(batch, -1)


def lm_step(model, ids: torch.Tensor, labels: torch.Tensor, scale: Optional[float] = None, mult: float = 1.0):
    """Forward + backward of mult * mean per-token LM loss with the indexer-loss scale `scale`.
    Returns (per-token loss, {name: grad or None}, {layer: recorded indexer loss})."""
    model.zero_grad(set_to_none=True)
    IndexerLossAutoScaler.main_loss_backward_scale = None
    if scale is not None:
        IndexerLossAutoScaler.set_loss_scale(torch.tensor(scale))
    DSAMetrics.clear()
    loss = model(ids, positions(*ids.shape), None, labels=labels)
    (loss.mean() * mult).backward()
    grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
    recorded = {layer: total / count for layer, (total, count) in DSAMetrics.values.get("indexer_loss", {}).items()}
    DSAMetrics.clear()
    return loss.detach(), grads, recorded


def document_mask(lengths_per_row: List[List[int]]) -> torch.Tensor:
    """megatron's bool mask [b, 1, s, s], True = masked: block-diagonal causal over documents."""
    rows = []
    for lengths in lengths_per_row:
        seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        s = seg.numel()
        visible = (seg[:, None] == seg[None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
        rows.append(~visible)
    return torch.stack(rows).unsqueeze(1)


def saved_tensors(ckpt_dir: Path, tmp: Path) -> Dict[str, torch.Tensor]:
    """The tensors of a torch_dist checkpoint, read by torch.distributed.checkpoint itself."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{ckpt_dir.name}.pt"
    dcp_to_torch_save(str(ckpt_dir), str(out))
    return {k: v for k, v in torch.load(out, weights_only=False).items() if torch.is_tensor(v)}


def convert(hf_dir, out_dir, **overrides) -> Path:
    """`hf_to_checkpoint` in this process."""
    from pretrain.convert.training_checkpoint import hf_to_checkpoint

    return Path(hf_to_checkpoint(str(hf_dir), str(out_dir), **overrides))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny GLM-5 HF directory with its MTP layer; returns (path, the HF model of the main layers).
    32 index heads: no index-score ties at the top-k boundary, where transformers' torch.topk and our
    documented rule (lowest key index) may pick different keys."""
    from tests.hf_fixtures import write_hf_checkpoint

    path = tmp_path_factory.mktemp("hf") / "glm5"
    return path, write_hf_checkpoint(str(path), 5, layers=2, dense=1, mtp=True, index_n_heads=32)


def single_rank_model(cfg):
    from parallel.initialize import ensure_single_rank
    from pretrain.model.builder import build_model

    ensure_single_rank()
    return build_model(cfg)
