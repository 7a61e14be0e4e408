#!/usr/bin/env bash
# Run a context-curriculum plan (configs/curriculum/*.yaml): its stages in order, each one training
# run from the previous stage's final weights; run again, it skips finished stages and resumes the
# unfinished one from its checkpoints.
#
#   bash launch/curriculum.sh --plan configs/curriculum/glm5-proxy.yaml [KEY=VALUE ...] [section.key=value ...]
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=host0 bash launch/curriculum.sh --plan PLAN    # on each node (or RDZV_ENDPOINT)
#   SBATCH_ARGS="--nodes 4 --gpus-per-node 8" bash launch/curriculum.sh --slurm --plan PLAN
#   bash launch/curriculum.sh --validate-only --plan PLAN                             # build every stage's config
#
# KEY=VALUE sets a plan key (run_dir, name, optimizer_state, pretrained,
# prune_checkpoints); section.key=value applies
# to every stage's config. Each stage runs `launch/train.sh` (torchrun; environment as there:
# NPROC_PER_NODE, NNODES, NODE_RANK, MASTER_ADDR, RDZV_ENDPOINT, MAX_RESTARTS). With --slurm the
# plan is checked here, then one Slurm job (launch/curriculum.sbatch) runs the whole plan, each
# stage an `srun` over the job's nodes; submitting the same command again after a cancellation or
# failure skips the finished stages and resumes the running one. Extra sbatch options: SBATCH_ARGS.
# Then: python -m pretrain.tools.plan_report RUN_DIR (loss across stages, tokens/s, memory).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
plan="" slurm=0 validate=0 rest=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --plan) plan="$2"; shift 2 ;;
        --slurm) slurm=1; shift ;;
        --validate-only) validate=1; shift ;;
        -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
        *) rest+=("$1"); shift ;;
    esac
done
if [[ -z "$plan" ]]; then
    echo "usage: bash launch/curriculum.sh [--slurm] [--validate-only] --plan PLAN [KEY=VALUE ...] [section.key=value ...]" >&2
    exit 2
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [[ $validate == 1 ]]; then
    exec "$PY" -m pretrain.curriculum --plan "$plan" --validate-only "${rest[@]}"
fi
if [[ $slurm == 1 ]]; then
    "$PY" -m pretrain.curriculum --plan "$plan" --validate-only "${rest[@]}"   # a bad plan fails here, not in the queue
    # shellcheck disable=SC2086  # SBATCH_ARGS is a list of options
    exec sbatch ${SBATCH_ARGS:-} launch/curriculum.sbatch --plan "$plan" "${rest[@]}"
fi
exec "$PY" -m pretrain.curriculum --plan "$plan" --launcher torchrun "${rest[@]}"
