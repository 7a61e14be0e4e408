#!/usr/bin/env bash
# The DSA continued-pretraining recipe on the GLM-5 proxy model (one GPU), in two phases that fit the
# device tool's 10-minute commands (files under runs/ and data/ stay on a warm machine):
#
#   bash benchmarks/dsa_recipe_proxy.sh dense   # stdlib data + a dense proxy checkpoint (DENSE_ITERS)
#   bash benchmarks/dsa_recipe_proxy.sh recipe  # warm-up, sparse stage, dense baseline (STAGE_ITERS each)
#
# Results (metrics.jsonl of each stage, dsa_report.md / .png) are copied to $OUT when it is set.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DENSE_ITERS=${DENSE_ITERS:-120}
STAGE_ITERS=${STAGE_ITERS:-40}
run=runs/dsa-proxy
case "${1:-}" in
dense)
    mkdir -p data
    [[ -f data/tokenizer.json ]] || "$PY" -m data_pipeline.train_tokenizer --input @stdlib --vocab-size 32768 --output data/tokenizer.json
    [[ -f data/stdlib.meta.json ]] || "$PY" -m data_pipeline.preprocess --input @stdlib --tokenizer data/tokenizer.json \
        --output-prefix data/stdlib --append-eod --workers "$(nproc)"
    bash launch/train.sh --config configs/quickstart/glm5-proxy-stdlib.yaml train.train_iters="$DENSE_ITERS" \
        train.eval_interval=null checkpoint.save="$run/dense-pretrain/checkpoints" checkpoint.save_interval=null \
        checkpoint.keep_last=1 logging.run_dir="$run/dense-pretrain" logging.log_interval=10
    ;;
recipe)
    bash launch/dsa_continued_pretraining.sh --model glm5-proxy --from "$run/dense-pretrain/checkpoints" \
        --run-dir "$run" --baseline --discard-final train.train_iters="$STAGE_ITERS"
    ;;
*)
    echo "usage: bash benchmarks/dsa_recipe_proxy.sh dense|recipe" >&2
    exit 2
    ;;
esac
if [[ -n "${OUT:-}" ]]; then
    for d in "$run"/*/; do
        name=$(basename "$d")
        [[ -f "$d/metrics.jsonl" ]] && mkdir -p "$OUT/$name" && cp "$d/metrics.jsonl" "$OUT/$name/"
    done
    cp "$run"/dsa_report.* "$OUT/" 2>/dev/null || true
fi
