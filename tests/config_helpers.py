"""Shared by the config tests: the shipped configs' paths and `tiny`, the tiny config with overrides."""

from __future__ import annotations

from pathlib import Path

from pretrain.config import GLM5Config, load_config

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "configs" / "models"
ABLATIONS = ROOT / "configs" / "ablations"
TINY = MODELS / "glm5-tiny.yaml"
PROXY = MODELS / "glm5-proxy.yaml"
GLM5 = MODELS / "glm5-744b.yaml"


def tiny(*overrides: str) -> GLM5Config:
    return load_config(TINY, list(overrides))
