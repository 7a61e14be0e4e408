#!/usr/bin/env bash
# glm5-proxy on one host of 4 GPUs (NCCL, bf16): parallel layouts against one GPU, ZeRO-2 resume, weak scaling.
#
#   bash benchmarks/multi_gpu.sh equivalence OUT_DIR   # TP=2 (+SP), PP=2, CP=2, DP=4, EP=4, TP=2 x CP=2
#   bash benchmarks/multi_gpu.sh zero2 OUT_DIR         # ZeRO-2 fp32 / bf16 reductions, per micro-batch / step;
#                                                      # resume from its own checkpoint at DP=4 and at DP=2
#
# Throughput (weak scaling of every layout against one GPU, the EP dispatchers and overlaps, forced balance) is
# benchmarks/scaling.py's: `python benchmarks/scaling.py --out OUT_DIR` (2 or 4 GPUs).
#
# equivalence / zero2: a 4-layer cut of glm5-proxy (dense layer 0, 3 MoE layers, 3 MTP depths), Muon, 10 steps of
# 8 x 4,096 tokens, every run started from one checkpoint (`init`, one step on one GPU; `checkpoint.pretrained`
# reshards it). `ref` is one GPU; `floor` is one GPU with micro-batch 2, the same arithmetic in another order: the
# bf16 noise every layout is measured against. The table and its pass rule: benchmarks/multi_gpu_compare.py.
# Runs that need fewer GPUs share the host (CUDA_VISIBLE_DEVICES), so nothing here is a timing.
# EXTRA adds overrides to every run (EXTRA=model.moe_router_force_load_balancing=true: any mode with forced MoE
# balance). A CPU rehearsal on gloo (the tiny model trains with AdamW, whose ZeRO is
# megatron's CUDA-only distributed optimizer: hence Muon):
#   MODEL=configs/models/glm5-tiny.yaml CUT= SEQ=64 \
#   EXTRA="model.bf16=false model.params_dtype=float32 optimizer.optimizer=muon" \
#   bash benchmarks/multi_gpu.sh equivalence /tmp/mg
set -euo pipefail
mode=${1:?usage: multi_gpu.sh equivalence|zero2 OUT_DIR}
out=${2:?usage: multi_gpu.sh equivalence|zero2 OUT_DIR}
mkdir -p "$out"
MODEL=${MODEL:-configs/models/glm5-proxy.yaml}
CUT=${CUT-model.num_layers=4 model.moe_layer_freq=[0,1,1,1]}
SEQ=${SEQ:-4096}
EXTRA=${EXTRA:-}
read -r -a cut <<<"$CUT"
read -r -a extra <<<"$EXTRA"
port=29600
save=1  # every run keeps its checkpoint (the weights compared)

launch() {  # NAME GPU_LIST [overrides...]: one torchrun over the listed GPUs, log in OUT/NAME.log
    local name=$1 gpus=$2; shift 2
    local n=$(($(tr -cd , <<<"$gpus" | wc -c) + 1))
    port=$((port + 1))
    echo "[$(date +%T)] $name on GPUs $gpus"
    CUDA_VISIBLE_DEVICES=$gpus torchrun --nproc-per-node "$n" --master-port "$port" -m pretrain.train \
        --config "$MODEL" "${common[@]}" logging.run_dir="$out/$name" checkpoint.save="${save:+$out/$name/ckpt}" \
        data.data_cache_path="$out/$name/data_cache" "$@" >"$out/$name.log" 2>&1 \
        || { echo "$name failed:"; tail -20 "$out/$name.log"; return 1; }
}

together() {  # "NAME GPUS overrides..." ...: launches side by side; fails if any failed
    local pids=() spec status=0
    for spec in "$@"; do
        read -r -a words <<<"$spec"
        port=$((port + 10))  # launch's own increment happens in the background subshell
        launch "${words[@]}" &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || status=1; done
    return $status
}

rewind() {  # SRC DST STEP: a copy of SRC's checkpoints as they stood after STEP (a run stopped there)
    local src=$1 dst=$2 step
    step=$(printf "iter_%07d" "$3")
    mkdir -p "$out/$dst/ckpt"
    cp -r "$out/$src/ckpt/$step" "$out/$dst/ckpt/"
    printf '{"step_dir": "%s", "iteration": %d}\n' "$step" "$3" >"$out/$dst/ckpt/latest"
    head -n "$3" "$out/$src/metrics.jsonl" >"$out/$dst/metrics.jsonl"
}

# Liger's output loss is not vocab-parallel: under TP the chunked one (the same loss; preflight refuses Liger there).
tp2=(parallel.tensor_model_parallel_size=2 parallel.sequence_parallel=true model.output_loss_backend=chunked
     model.output_chunk_size=4096)
zero2=(optimizer.use_distributed_optimizer=true)
case $mode in
equivalence | zero2)
    common=("${cut[@]}" "${extra[@]}" data.seq_length="$SEQ" train.train_iters=10 train.micro_batch_size=1
            train.global_batch_size=8 train.eval_interval=null optimizer.lr_warmup_iters=2 logging.log_interval=1)
    launch init 0 train.train_iters=1 optimizer.lr_warmup_iters=0
    common+=(checkpoint.pretrained="$out/init/ckpt")
    if [ "$mode" = equivalence ]; then
        together "ref 0" "floor 1 train.micro_batch_size=2" "tp2 2,3 ${tp2[*]}"
        together "pp2 0,1 parallel.pipeline_model_parallel_size=2" "cp2 2,3 parallel.context_parallel_size=2"
        launch dp4 0,1,2,3
        launch ep4 0,1,2,3 parallel.expert_model_parallel_size=4
        launch tp2cp2 0,1,2,3 "${tp2[@]}" parallel.context_parallel_size=2
        runs=(floor tp2 pp2 cp2 dp4 ep4 tp2cp2)
    else
        together "ref 0" "floor 1 train.micro_batch_size=2" \
            "z2_bf16_micro 2,3 ${zero2[*]} parallel.grad_reduce_in_fp32=false"
        launch z2_fp32_micro 0,1,2,3 "${zero2[@]}" checkpoint.save_interval=5
        together "z2_fp32_step 0,1 ${zero2[*]} optimizer.zero2_grad_reduce=step" \
            "z2_bf16_step 2,3 ${zero2[*]} optimizer.zero2_grad_reduce=step parallel.grad_reduce_in_fp32=false"
        # The DP=4 run resumed from its own step-5 checkpoint, on 4 ranks and on 2 (resharded).
        rewind z2_fp32_micro z2_resume_dp4 5
        rewind z2_fp32_micro z2_resume_dp2 5
        launch z2_resume_dp4 0,1,2,3 "${zero2[@]}"
        launch z2_resume_dp2 0,1 "${zero2[@]}"
        runs=(floor z2_bf16_micro z2_fp32_micro z2_fp32_step z2_bf16_step z2_resume_dp4 z2_resume_dp2)
    fi
    python -m benchmarks.multi_gpu_compare "$out" --config "$MODEL" --overrides "${cut[*]} ${extra[*]}" \
        --runs "${runs[@]}"
    ;;
scaling | ep_dispatch)
    echo "multi_gpu.sh $mode moved to benchmarks/scaling.py: python benchmarks/scaling.py --out $out" >&2
    exit 2
    ;;
*)
    echo "unknown mode $mode (equivalence | zero2)" >&2
    exit 2
    ;;
esac
