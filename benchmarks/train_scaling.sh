#!/usr/bin/env bash
# glm5-proxy training throughput on 1 GPU and 4 GPUs (DP=4, EP=4 x DP=4, TP=2 x DP=2), same
# per-GPU work (8 micro-batches of 1 x 4096 tokens per data-parallel rank), mock data, AdamW bf16.
#   bash benchmarks/train_scaling.sh OUT_DIR
set -euo pipefail
out=${1:?usage: train_scaling.sh OUT_DIR}
common=(--config configs/models/glm5-proxy.yaml optimizer.optimizer=adam train.train_iters=12
        train.eval_interval=null optimizer.lr_warmup_iters=2 logging.log_interval=4
        data.data_cache_path=/tmp/glm5_data_cache)
run() {  # name nproc overrides...
    local name=$1 nproc=$2; shift 2
    torchrun --nproc-per-node "$nproc" --master-port 29511 -m pretrain.train "${common[@]}" \
        logging.run_dir="$out/$name" "$@" 2>&1 | grep -E "^step|error|Error" | tail -3
}
CUDA_VISIBLE_DEVICES=0 run gpu1 1 train.global_batch_size=8
run dp4 4 train.global_batch_size=32
run ep4 4 train.global_batch_size=32 parallel.expert_model_parallel_size=4
run tp2dp2 4 train.global_batch_size=16 parallel.tensor_model_parallel_size=2 parallel.sequence_parallel=true
python benchmarks/summarize_scaling.py "$out" gpu1 dp4 ep4 tp2dp2
