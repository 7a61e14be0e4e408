#!/usr/bin/env bash
# The DSA continued-pretraining recipe on the GLM-5 proxy model (one GPU), in two phases that can run
# as separate jobs (each reads what the previous one left under runs/ and data/):
#
#   bash benchmarks/dsa_recipe_proxy.sh dense   # stdlib data + a dense proxy checkpoint (DENSE_ITERS)
#   bash benchmarks/dsa_recipe_proxy.sh recipe  # warm-up, sparse stage, dense baseline (STAGE_ITERS each)
#
# With RESULTS_DIR set, each stage's metrics.jsonl and dsa_report.md / .png are copied there.
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
if [[ -n "${RESULTS_DIR:-}" ]]; then
    for d in "$run"/*/; do
        name=$(basename "$d")
        [[ -f "$d/metrics.jsonl" ]] && mkdir -p "$RESULTS_DIR/$name" && cp "$d/metrics.jsonl" "$RESULTS_DIR/$name/"
    done
    cp "$run"/dsa_report.* "$RESULTS_DIR/" 2>/dev/null || true
fi
