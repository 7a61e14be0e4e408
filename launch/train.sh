#!/usr/bin/env bash
# Launch pretrain.train with torchrun on one node or many.
#
#   bash launch/train.sh --config configs/models/glm5-proxy.yaml [dotted.overrides ...]
#
# Environment (all optional):
#   NPROC_PER_NODE  processes per node (default: number of GPUs, or 1 on a CPU host)
#   NNODES          number of nodes (default 1)
#   NODE_RANK       this node's rank (default 0)
#   MASTER_ADDR / MASTER_PORT     static rendezvous (default 127.0.0.1:29500)
#   RDZV_ENDPOINT   host:port of a c10d rendezvous instead (elastic; RDZV_ID names the job)
#   MAX_RESTARTS    torchrun --max-restarts (default 0); restarted ranks resume from the
#                   latest checkpoint (checkpoint.save with checkpoint.auto_resume=true)
#
# Preemption: SIGTERM or SIGUSR1 sent to this process (torchrun's agent) or to the ranks makes every
# rank end its step, save a checkpoint and exit; the exit code is then 75 (no restart). Run the same
# command again to resume at the next step (parallel/torchrun.py, pretrain/training/preemption.py).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        NPROC_PER_NODE=$(nvidia-smi --list-gpus | wc -l)
    else
        NPROC_PER_NODE=1
    fi
fi
args=(--nproc-per-node "$NPROC_PER_NODE" --nnodes "${NNODES:-1}" --max-restarts "${MAX_RESTARTS:-0}")
if [[ -n "${RDZV_ENDPOINT:-}" ]]; then
    args+=(--rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "${RDZV_ID:-glm5}")
else
    args+=(--node-rank "${NODE_RANK:-0}" --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}")
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "${PYTHON:-python3}" -m parallel.torchrun "${args[@]}" -m pretrain.train "$@"
