#!/usr/bin/env bash
# The main job on a fresh machine: install, build the default dataset (the Python standard
# library's source, tokenized with a BPE trained on it), train the tiny GLM-5 for 300 steps on
# CPU (or the proxy model on a GPU), checkpoint, and print a summary. Run it again to resume.
#
#   bash launch/quickstart.sh [dotted.config=overrides ...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install -q "torch==2.13.0"   # CPU build; keeps pip from pulling a CUDA torch
fi
extras=plot
if command -v nvidia-smi >/dev/null 2>&1; then
    extras=plot,liger   # glm5-proxy's output loss is Liger's fused linear cross-entropy
fi
"$PY" -m pip install -q -e ".[$extras]"

config=configs/quickstart/glm5-tiny-stdlib.yaml
vocab=8192
if command -v nvidia-smi >/dev/null 2>&1; then
    config=configs/quickstart/glm5-proxy-stdlib.yaml
    vocab=32768
fi
mkdir -p data
if [[ ! -f data/tokenizer.json ]]; then
    "$PY" -m data_pipeline.train_tokenizer --input @stdlib --vocab-size "$vocab" --output data/tokenizer.json
fi
if [[ ! -f data/stdlib.meta.json ]]; then
    "$PY" -m data_pipeline.preprocess --input @stdlib --tokenizer data/tokenizer.json \
        --output-prefix data/stdlib --append-eod --workers "$(nproc)"
fi
"$PY" -m pretrain.model.summary --config "$config" | tail -n 4
bash launch/train.sh --config "$config" "$@"
"$PY" -m pretrain.tools.report runs/quickstart
