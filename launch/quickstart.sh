#!/usr/bin/env bash
# The main job on a fresh machine: install, show the tiny GLM-5's parameter summary, train it on
# byte tokens of the Python standard library (CPU, or one GPU when present) and report.
#   bash launch/quickstart.sh [--steps N] [dotted.config=overrides ...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install -q "torch==2.13.0"   # CPU build; keeps pip from pulling a CUDA torch
fi
"$PY" -m pip install -q -e .
"$PY" -m pretrain.model.summary --config configs/models/glm5-tiny.yaml
"$PY" launch/quickstart.py --config configs/models/glm5-tiny.yaml "$@"
