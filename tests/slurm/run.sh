#!/usr/bin/env bash
# The launch scripts against a real Slurm: a one-node cluster on this machine (slurm-wlm 22.05 on
# Debian 12: munged, slurmctld, slurmd; installed with apt-get when missing, which needs root).
#
#   bash tests/slurm/run.sh          # CI runs it after tests/run.sh (.ci/run); about 8 minutes on 2 cores
#
# 1. launch/slurm.sbatch trains the tiny model; the job is cancelled with scancel after its first
#    checkpoint and submitted again: the second job resumes from the newest checkpoint (its first
#    step is that checkpoint's step + 1) and finishes; metrics.jsonl then holds every step once.
# 2. Preemption: `scancel --signal=USR1` (what --signal=USR1@N sends before the time limit) makes the
#    ranks save at their next step boundary and exit with 75; launch/slurm.sbatch requeues the job,
#    which resumes at the next step and finishes: every step once, no step lost or repeated. (Slurm
#    holds a requeued job about 2 minutes before it is eligible again: most of this case's time.)
# 3. launch/curriculum.sh --slurm runs configs/curriculum/tiny.yaml as one job; every stage finishes.
# The daemons are stopped at the end, pass or fail. Work files: $SLURM_TEST_DIR (default: a temp dir).
# Every wait is bounded: a job that never ends fails the test with the logs of every job (the whole
# test gives up after $SLURM_TEST_LIMIT seconds, default 2400).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=${PYTHON:-python3}
WORK=${SLURM_TEST_DIR:-$(mktemp -d /tmp/glm5-slurm.XXXXXX)}
export OMP_NUM_THREADS=1
source tests/slurm/cluster.sh

fail() { echo "FAIL: $*" >&2; exit 1; }
job_state() { scontrol show job "$1" | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p'; }
latest_step() { [[ -f "$1/latest" ]] && "$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["iteration"])' "$1/latest" || echo 0; }
show_logs() { for f in "$WORK"/*.out; do echo "--- $f"; tail -n 30 "$f"; done; }

wait_job() {  # sbatch --wait, bounded: wait_job SECONDS sbatch-args...
    local limit=$1; shift
    timeout "$limit" sbatch --parsable --wait "$@" || { local rc=$?; [[ $rc == 124 ]] && echo "FAIL: a job did not end within ${limit}s" >&2; return $rc; }
}

slurm_install
watchdog=""
trap 'status=$?; [[ -z $watchdog ]] || kill "$watchdog" 2>/dev/null || true; [[ $status == 0 ]] || { show_logs; squeue 2>/dev/null; }
      slurm_stop; exit $status' EXIT
trap 'exit 124' TERM
slurm_start "$WORK/cluster"
started=$(date +%s)
( sleep "${SLURM_TEST_LIMIT:-2400}" </dev/null >/dev/null 2>&1; echo "FAIL: the Slurm test did not finish within ${SLURM_TEST_LIMIT:-2400}s" >&2
  kill -TERM $$ ) &
watchdog=$!

# ---- 1. sbatch launch/slurm.sbatch, scancel mid-run, resubmit, resume --------------------------------
iters=30
ckpt=$WORK/train/checkpoints
train=(--config configs/models/glm5-tiny.yaml "train.train_iters=$iters" train.eval_interval=null
       optimizer.lr_warmup_iters=0 data.seq_length=128 logging.log_interval=1 "logging.run_dir=$WORK/train"
       "checkpoint.save=$ckpt" checkpoint.save_interval=3 checkpoint.keep_last=2)
first=$(sbatch --parsable --output="$WORK/%x-%j.out" launch/slurm.sbatch "${train[@]}")
echo "job $first: training $iters steps; cancelling it after its first checkpoint"
for _ in $(seq 600); do
    [[ $(latest_step "$ckpt") -ge 3 ]] && break
    [[ $(job_state "$first") =~ ^(PENDING|RUNNING|CONFIGURING)$ ]] || fail "job $first ended ($(job_state "$first")) before its first checkpoint"
    sleep 0.5
done
scancel "$first"
for _ in $(seq 120); do
    [[ $(job_state "$first") =~ ^(RUNNING|COMPLETING|CONFIGURING)$ ]] || break
    sleep 0.5
done
[[ $(job_state "$first") == CANCELLED ]] || fail "job $first is $(job_state "$first") after scancel, expected CANCELLED"
saved=$(latest_step "$ckpt")
(( saved >= 3 && saved < iters )) || fail "job $first saved step $saved; expected a checkpoint before the end ($iters)"
echo "job $first cancelled with its newest checkpoint at step $saved; submitting again"
second=$(wait_job 900 --output="$WORK/%x-%j.out" launch/slurm.sbatch "${train[@]}") \
    || fail "the resubmitted job failed"
log=$WORK/glm5-pretrain-$second.out
grep -q "resumed from $ckpt at iteration $saved" "$log" || fail "job $second did not resume from step $saved"
resumed_first=$(sed -n 's/^step *\([0-9]*\) .*/\1/p' "$log" | head -n 1)
[[ $resumed_first == $((saved + 1)) ]] || fail "job $second's first step is $resumed_first, expected $((saved + 1))"
"$PY" - "$WORK/train/metrics.jsonl" "$iters" <<'PY' || fail "metrics.jsonl does not hold steps 1..$iters once each"
import json, sys
steps = [json.loads(line)["step"] for line in open(sys.argv[1]) if line.strip()]
sys.exit(0 if steps == list(range(1, int(sys.argv[2]) + 1)) else 1)
PY
echo "ok: job $second resumed at step $((saved + 1)) and finished $iters steps"

# ---- 2. scancel --signal=USR1: checkpoint at the next step, requeue, resume ---------------------------
ckpt=$WORK/preempt/checkpoints
preempt=(--config configs/models/glm5-tiny.yaml "train.train_iters=$iters" train.eval_interval=null
         optimizer.lr_warmup_iters=0 data.seq_length=128 logging.log_interval=1 "logging.run_dir=$WORK/preempt"
         "checkpoint.save=$ckpt" checkpoint.save_interval=100)
job=$(sbatch --parsable --output="$WORK/%x-%j.out" launch/slurm.sbatch "${preempt[@]}")
log=$WORK/glm5-pretrain-$job.out
for _ in $(seq 600); do
    [[ -f $WORK/preempt/metrics.jsonl && $(wc -l <"$WORK/preempt/metrics.jsonl") -ge 3 ]] && break
    [[ $(job_state "$job") =~ ^(PENDING|RUNNING|CONFIGURING)$ ]] || fail "job $job ended ($(job_state "$job")) before step 3"
    sleep 0.5
done
scancel --signal=USR1 "$job"
echo "job $job: sent SIGUSR1 after step 3"
for _ in $(seq 1200); do
    [[ $(job_state "$job") =~ ^(COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL)$ ]] && break
    sleep 0.5
done
[[ $(job_state "$job") == COMPLETED ]] || fail "job $job is $(job_state "$job"), expected COMPLETED after its requeue"
stopped=$(sed -n 's/.*preempted: stopped by SIGUSR1 after step \([0-9]*\):.*/\1/p' "$log" | head -n 1)
[[ -n $stopped ]] || fail "job $job did not stop on SIGUSR1"
grep -q "requeueing job $job" "$log" || fail "job $job was not requeued"
grep -q "resumed from $ckpt at iteration $stopped" "$log" || fail "requeued job $job did not resume from step $stopped"
"$PY" - "$WORK/preempt/metrics.jsonl" "$iters" <<'PY' || fail "metrics.jsonl of the preempted run does not hold steps 1..$iters once each"
import json, sys
steps = [json.loads(line)["step"] for line in open(sys.argv[1]) if line.strip()]
sys.exit(0 if steps == list(range(1, int(sys.argv[2]) + 1)) else 1)
PY
echo "ok: job $job saved at step $stopped on SIGUSR1, was requeued and finished $iters steps"

# A node that a job left drained (a step that did not die within UnkillableStepTimeout) would hold the
# next job pending for ever: say so here, with Slurm's reason.
node=$(sinfo -h -N -o '%t|%E' | head -n 1)
[[ ${node%%|*} =~ ^(idle|mix|alloc)$ ]] || fail "the node is '${node%%|*}' after the preemption case (reason: ${node#*|})"

# ---- 3. the tiny curriculum as one Slurm job -------------------------------------------------------
plan_dir=$WORK/plan
SBATCH_ARGS="--wait --output=$WORK/%x-%j.out" timeout 1200 bash launch/curriculum.sh --slurm --plan configs/curriculum/tiny.yaml \
    "run_dir=$plan_dir" >"$WORK/submit.log" 2>&1 || { cat "$WORK/submit.log"; fail "the curriculum job failed"; }
job=$(sed -n 's/^Submitted batch job \([0-9]*\).*/\1/p' "$WORK/submit.log")
[[ $(job_state "$job") == COMPLETED ]] || fail "curriculum job $job is $(job_state "$job")"
for stage in ctx256 ctx512 ctx1024 dsa-warmup dsa-sparse; do
    [[ -f "$plan_dir/$stage/stage_complete.json" ]] || fail "stage $stage did not finish"
done
echo "ok: curriculum job $job ran the 5 stages of configs/curriculum/tiny.yaml"
echo "slurm tests passed in $(( $(date +%s) - started ))s"
