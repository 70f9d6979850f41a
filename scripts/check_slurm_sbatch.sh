#!/usr/bin/env bash
# Opt-in, outside CI: ask Slurm's own sbatch whether it accepts megapipe's launch_slurm.sbatch files.
#
#   scripts/check_slurm_sbatch.sh outputs/plan/DATE outputs/pack/DATE ...   (plan dirs, pack dirs or .sbatch files)
#
# Each file must pass `bash -n`, and `sbatch --test-only` against a private Slurm controller (slurmctld) whose
# partition has as many nodes as the largest file asks for, each with that many GPUs (gres gpu): sbatch parses
# the #SBATCH lines and the controller places the job ("Job N to start at ... on nodes node[0001-0016]"). The
# nodes are power-saving cloud nodes, so no slurmd has to run and nothing is started on them; two controls ask
# for one node, or one GPU per node, more than the partition has and must be refused. Needs Debian's Slurm and MUNGE:
#
#   apt-get install -y slurmctld slurm-client munge
#
# It starts munged when no MUNGE daemon answers (and stops it again), and a slurmctld of its own on
# SLURM_TEST_PORT (16817) and the port above it, with its state in a temporary directory that it removes.
set -euo pipefail

for tool in sbatch sinfo slurmctld munge munged; do
  command -v "$tool" >/dev/null || { echo "needs $tool: apt-get install -y slurmctld slurm-client munge" >&2; exit 2; }
done
[ "$#" -gt 0 ] || { echo "usage: $0 PLAN_DIR|PACK_DIR|FILE.sbatch ..." >&2; exit 2; }

files=()
for arg in "$@"; do
  if [ -f "$arg" ]; then files+=("$arg"); continue; fi
  [ -f "$arg/launch_slurm.sbatch" ] && files+=("$arg/launch_slurm.sbatch")
  for job in "$arg"/jobs/*/launch_slurm.sbatch; do [ -f "$job" ] && files+=("$job"); done
done
[ "${#files[@]}" -gt 0 ] || { echo "no launch_slurm.sbatch in $*" >&2; exit 2; }

directive() {  # directive FILE NAME: the value of '#SBATCH --NAME=value'
  sed -n "s/^#SBATCH --$2=\([0-9]*\).*/\1/p" "$1" | head -n 1
}
nodes=1 gpus=1
for file in "${files[@]}"; do
  bash -n "$file"
  n=$(directive "$file" nodes); g=$(directive "$file" gpus-per-node)
  [ -n "$n" ] && [ "$n" -gt "$nodes" ] && nodes=$n
  [ -n "$g" ] && [ "$g" -gt "$gpus" ] && gpus=$g
done

work=$(mktemp -d)
port=${SLURM_TEST_PORT:-16817}
started_munge=""
controller=""
cleanup() {
  [ -n "$controller" ] && kill "$controller" 2>/dev/null && wait "$controller" 2>/dev/null || true
  [ -n "$started_munge" ] && kill "$(cat "$work/munged.pid")" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
  mkdir -p /run/munge "$work/munge"
  munged --force --pid-file="$work/munged.pid" --socket=/run/munge/munge.socket.2 \
         --log-file="$work/munge/munged.log" --seed-file="$work/munge/munged.seed"
  started_munge=1
fi

mkdir -p "$work/state" "$work/spool"
export SLURM_CONF="$work/slurm.conf"
cat > "$SLURM_CONF" <<EOF
ClusterName=megapipe-check
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmUser=$(id -un)
AuthType=auth/munge
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmctldLogFile=$work/slurmctld.log
SlurmctldPort=$port
SlurmdPort=$((port + 1))
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
GresTypes=gpu
SuspendProgram=/bin/true
ResumeProgram=/bin/true
SuspendTime=600
ResumeTimeout=600
NodeName=node[0001-$(printf %04d "$nodes")] NodeAddr=127.0.0.1 CPUs=64 RealMemory=1000000 Gres=gpu:$gpus State=CLOUD
PartitionName=gpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
slurmctld -D -c -i >"$work/slurmctld.out" 2>&1 &
controller=$!
for _ in $(seq 60); do sinfo >/dev/null 2>&1 && break; sleep 0.5; done
sinfo >/dev/null 2>&1 || { echo "slurmctld did not answer:" >&2; tail -n 5 "$work/slurmctld.log" >&2; exit 1; }
echo "slurmctld $(slurmctld -V | cut -d' ' -f2): partition gpu, $nodes nodes x $gpus GPUs (cloud nodes)"

failed=0
for file in "${files[@]}"; do
  answer=$(MEGATRON_LM=/nonexistent sbatch --test-only "$file" 2>&1) || true
  if [[ "$answer" == *"to start at"* ]]; then
    echo "accepted: $file (--nodes=$(directive "$file" nodes) --gpus-per-node=$(directive "$file" gpus-per-node)): ${answer##*to start at * using }"
  else
    echo "REFUSED: $file: $answer"; failed=1
  fi
done
control=$(sbatch --test-only --nodes=$((nodes + 1)) "${files[0]}" 2>&1) || true
if [[ "$control" == *"to start at"* ]]; then
  echo "the control (--nodes=$((nodes + 1)) on $nodes nodes) was accepted: this controller checks nothing"; failed=1
else
  echo "control: --nodes=$((nodes + 1)) on $nodes nodes refused ($control)"
fi
control=$(sbatch --test-only --gpus-per-node=$((gpus + 1)) "${files[0]}" 2>&1) || true
if [[ "$control" == *"to start at"* ]]; then
  echo "the control (--gpus-per-node=$((gpus + 1)) on $gpus-GPU nodes) was accepted: GPUs are not checked"; failed=1
else
  echo "control: --gpus-per-node=$((gpus + 1)) on $gpus-GPU nodes refused ($control)"
fi
exit "$failed"
