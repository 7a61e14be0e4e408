#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for tests/slurm/run.sh: sourced, it defines
#   slurm_install   apt-get install slurm-wlm and munge when missing (Debian; needs root)
#   slurm_start DIR write DIR/slurm.conf for this host, start munged, slurmctld and slurmd, wait for the node
#   slurm_stop      cancel every job and stop the daemons this script started
# and exports SLURM_CONF so sbatch / squeue / scontrol talk to this cluster.

slurm_install() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
        return
    fi
    echo "installing slurm-wlm and munge (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq slurm-wlm munge >/dev/null
}

_slurm_conf() {  # _slurm_conf DIR HOST CPUS MEMORY_MB
    cat <<CONF
ClusterName=glm5test
SlurmctldHost=$2
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=5
UnkillableStepTimeout=180
MinJobAge=600
SlurmctldPort=$((16817 + RANDOM % 1000))
SlurmdPort=$((17817 + RANDOM % 1000))
StateSaveLocation=$1/state
SlurmdSpoolDir=$1/spool
SlurmctldPidFile=$1/slurmctld.pid
SlurmdPidFile=$1/slurmd.pid
SlurmctldLogFile=$1/slurmctld.log
SlurmdLogFile=$1/slurmd.log
NodeName=$2 CPUs=$3 RealMemory=$4 State=UNKNOWN
PartitionName=test Nodes=$2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
}

slurm_start() {
    local dir=$1 host cpus mem
    mkdir -p "$dir/state" "$dir/spool"
    host=$(hostname -s)
    cpus=$(slurmd -C | sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' | head -n 1)
    mem=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | head -n 1)
    _slurm_conf "$dir" "$host" "$cpus" "$mem" >"$dir/slurm.conf"
    export SLURM_CONF=$dir/slurm.conf
    _SLURM_DIR=$dir
    if ! pgrep -x munged >/dev/null; then
        mkdir -p /run/munge /var/log/munge /var/lib/munge
        chown munge:munge /run/munge /var/log/munge /var/lib/munge
        [[ -f /etc/munge/munge.key ]] || { mungekey --create 2>/dev/null || create-munge-key; }
        runuser -u munge -- /usr/sbin/munged
        _SLURM_MUNGE_STARTED=1
    fi
    slurmctld
    slurmd
    local state=""
    for _ in $(seq 60); do
        state=$(sinfo -h -N -o %t 2>/dev/null | head -n 1)
        [[ $state == idle ]] && { echo "slurm: node $host idle ($cpus CPUs), SLURM_CONF=$SLURM_CONF"; return 0; }
        sleep 1
    done
    echo "slurm: node $host did not come up (state '$state'); logs:" >&2
    tail -n 20 "$dir/slurmctld.log" "$dir/slurmd.log" >&2
    return 1
}

slurm_stop() {
    [[ -n "${_SLURM_DIR:-}" ]] || return 0
    scancel --user "$(id -un)" 2>/dev/null || true
    local f
    for f in "$_SLURM_DIR/slurmd.pid" "$_SLURM_DIR/slurmctld.pid"; do
        if [[ -f $f ]]; then kill "$(cat "$f")" 2>/dev/null || true; fi
    done
    if [[ -n "${_SLURM_MUNGE_STARTED:-}" && -f /run/munge/munged.pid ]]; then
        kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true
    fi
    _SLURM_DIR=""
}
