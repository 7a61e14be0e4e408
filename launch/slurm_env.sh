#!/usr/bin/env bash
# Sourced inside a Slurm job (launch/slurm.sbatch, launch/curriculum.sbatch): the environment that
# launch/train.sh turns into one torchrun per node with a c10d rendezvous on the job's first node.
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export RDZV_ENDPOINT="${head_node}:${MASTER_PORT:-29500}"
export RDZV_ID="${SLURM_JOB_ID}"
export NNODES="${SLURM_JOB_NUM_NODES}"
# One process per GPU the job was given (--gpus-per-node); without a GPU request launch/train.sh
# counts the node's GPUs (nvidia-smi), or runs one process on a CPU node.
if [[ -n "${SLURM_GPUS_ON_NODE:-}" && "${SLURM_GPUS_ON_NODE}" != 0 ]]; then
    export NPROC_PER_NODE="${SLURM_GPUS_ON_NODE}"
fi
export MAX_RESTARTS="${MAX_RESTARTS:-3}"
