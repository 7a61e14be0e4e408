#!/usr/bin/env bash
# PP=2 on 2 GPUs against one GPU: the bubble with VPP 1 and 2, even and balanced layouts
# (benchmarks/pipeline_bubble.py says what is measured). glm5-proxy, mock data, micro-batch 4 x 4096,
# 8 micro-batches per pipeline per step (weak scaling: the 1-GPU run does the same 8).
#   bash benchmarks/pipeline_bubble.sh OUT_DIR
# CPU rehearsal (gloo, the tiny model): MODEL=configs/models/glm5-tiny.yaml NPROC_GPU1=1 \
#   EXTRA="model.num_layers=4 model.moe_layer_freq=[0,1,1,1]" GLOBAL=8 bash benchmarks/pipeline_bubble.sh /tmp/pb
set -euo pipefail
out=${1:?usage: pipeline_bubble.sh OUT_DIR}
MODEL=${MODEL:-configs/models/glm5-proxy.yaml}
GLOBAL=${GLOBAL:-32}            # global batch: 8 micro-batches of 4 per pipeline
MICRO=${MICRO:-}                # micro-batches per pipeline for the split tool (default: GLOBAL / micro-batch size)
STEPS=${STEPS:-10}
EXTRA=${EXTRA:-}
# the split weighs its entries by the layout planner's calibration for this GPU kind (h100, h200; FLOPs if none)
GPU_KIND=${GPU_KIND:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE 'h100|h200' | tr A-Z a-z || true)}
read -r -a extra <<<"$EXTRA"
mkdir -p "$out"
port=29650
bench() {  # NAME NPROC overrides...
    local name=$1 n=$2; shift 2
    port=$((port + 1))
    echo "[$(date +%T)] $name"
    torchrun --nproc-per-node "$n" --master-port "$port" benchmarks/pipeline_bubble.py --config "$MODEL" \
        --name "$name" --out "$out" --steps "$STEPS" -- "train.global_batch_size=$GLOBAL" "${extra[@]}" "$@" \
        >"$out/$name.log" 2>&1 || { echo "$name failed:"; tail -20 "$out/$name.log"; return 1; }
}
layout() {  # PP VPP: the balanced layout string
    python -m pretrain.tools.pipeline_split --config "$MODEL" --pp "$1" --vpp "$2" ${MICRO:+--microbatches $MICRO} \
        ${GPU_KIND:+--gpu $GPU_KIND} \
        "${extra[@]}" 2>/dev/null | tee -a "$out/layouts.txt" | sed -n "s/.*pipeline_model_parallel_layout='\([^']*\)'.*/\1/p"
}
pp=(parallel.pipeline_model_parallel_size=2)
CUDA_VISIBLE_DEVICES=0 bench gpu1 1
bench pp2 2 "${pp[@]}"
bench pp2_balanced 2 "${pp[@]}" "parallel.pipeline_model_parallel_layout=$(layout 2 1)"
bench pp2_vpp2 2 "${pp[@]}" parallel.virtual_pipeline_model_parallel_size=2
bench pp2_vpp2_balanced 2 "${pp[@]}" parallel.virtual_pipeline_model_parallel_size=2 \
    "parallel.pipeline_model_parallel_layout=$(layout 2 2)"
python benchmarks/pipeline_bubble.py --summarize "$out"
