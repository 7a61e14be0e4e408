#!/usr/bin/env bash
# GLM-5's DSA continued-pretraining recipe: adapt a dense MLA checkpoint to DeepSeek Sparse Attention.
#
#   bash launch/dsa_continued_pretraining.sh --model glm5-tiny|glm5-proxy|glm5-744b \
#        --from CKPT_DIR_OR_HF_DIR [--run-dir runs/dsa-NAME] [--baseline] [--discard-final]
#        [dotted.overrides ...]
#
#   1. dsa_warmup  configs/dsa/<model>-dsa-warmup.yaml: dense attention, only the indexer trains
#                  (dense KL to the main attention); starts from --from
#   2. dsa_sparse  configs/dsa/<model>-dsa-sparse.yaml: top-k attention, LM loss + sparse KL;
#                  starts from the warm-up's weights
#   3. --baseline  configs/dsa/<model>-dense-continue.yaml: dense attention for the same steps from
#                  the same weights, to compare LM losses with stage 2
#   then a report (markdown table + plot) in <run-dir>/dsa_report.{md,png}. --discard-final saves no
#   checkpoints in stages 2 and 3 (when only the comparison is wanted).
#
# --from is a checkpoint directory of ours (a dense MLA model without indexer weights is fine: they
# are initialized fresh) or a Hugging Face GLM-5 directory (converted once with
# `glm5-convert hf-to-checkpoint`). Each stage resumes from its own checkpoints when re-run.
# Environment: as launch/train.sh (NPROC_PER_NODE, NNODES, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
model="" src="" run_dir="" baseline=0 discard=0 overrides=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --model) model="$2"; shift 2 ;;
        --from) src="$2"; shift 2 ;;
        --run-dir) run_dir="$2"; shift 2 ;;
        --baseline) baseline=1; shift ;;
        --discard-final) discard=1; shift ;;
        -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
        *) overrides+=("$1"); shift ;;
    esac
done
if [[ -z "$model" || -z "$src" ]]; then
    echo "usage: bash launch/dsa_continued_pretraining.sh --model glm5-tiny|glm5-proxy|glm5-744b --from DIR [--run-dir DIR] [--baseline] [overrides ...]" >&2
    exit 2
fi
for stage in dsa-warmup dsa-sparse; do
    if [[ ! -f "configs/dsa/$model-$stage.yaml" ]]; then
        echo "error: configs/dsa/$model-$stage.yaml not found (models: $(ls configs/dsa | sed -n 's/-dsa-warmup.yaml//p' | tr '\n' ' '))" >&2
        exit 2
    fi
done
if [[ ! -d "$src" ]]; then
    echo "error: --from $src is not a directory (a checkpoint directory of ours or a Hugging Face GLM-5 directory)" >&2
    exit 2
fi
run_dir=${run_dir:-runs/dsa-${model#glm5-}}
mkdir -p "$run_dir"

weights="$src"
if [[ -f "$src/config.json" ]]; then            # a Hugging Face directory
    weights="$run_dir/hf-weights"
    if [[ ! -d "$weights" ]]; then
        "$PY" -m pretrain.convert.cli hf-to-checkpoint "$src" "$weights"
    fi
fi

stage() {  # stage NAME CONFIG PRETRAINED
    echo "=== $1 ($2) ==="
    local save="$run_dir/$1/checkpoints"
    if [[ $discard == 1 && $1 != warmup ]]; then save=null; fi
    bash launch/train.sh --config "$2" checkpoint.pretrained="$3" checkpoint.load=null \
        checkpoint.save="$save" logging.run_dir="$run_dir/$1" "${overrides[@]}"
}
stage warmup "configs/dsa/$model-dsa-warmup.yaml" "$weights"
stage sparse "configs/dsa/$model-dsa-sparse.yaml" "$run_dir/warmup/checkpoints"
if [[ $baseline == 1 ]]; then
    stage dense "configs/dsa/$model-dense-continue.yaml" "$run_dir/warmup/checkpoints"
fi
"$PY" -m pretrain.tools.dsa_report "$run_dir"
