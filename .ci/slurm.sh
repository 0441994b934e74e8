#!/usr/bin/env bash
# A single-node SLURM for the tests that need a real scheduler (tests/test_slurm.py), on this
# machine, without systemd:
#   .ci/slurm.sh start   installs Debian's packages if missing, writes /etc/slurm/slurm.conf for
#                        this host, starts munged, slurmctld and slurmd, waits for the node idle
#   .ci/slurm.sh stop    stops the daemons it started, by the PIDs it recorded
# Needs root. The daemons' PIDs, logs and state live in $SLURM_CI_DIR (default /tmp/olora-slurm).
set -euo pipefail
DIR="${SLURM_CI_DIR:-/tmp/olora-slurm}"
CONF=/etc/slurm/slurm.conf

start() {
  if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      slurmctld slurmd slurm-client munge >/dev/null
  fi
  mkdir -p "$DIR/state" "$DIR/spool" /etc/slurm /run/munge
  local host cpus mem
  host="$(hostname -s)"
  cpus="$(nproc)"
  mem="$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))"  # MB, 1 GB spare
  # The settings measured to work on one node (issue 40); cred_expire=5 (the least SLURM takes;
  # it also bounds how long a step's credential may take from slurmctld to slurmd, under a
  # second here): `scontrol requeue` holds a task about 5 s instead of 120 s. sched_interval=2:
  # the main scheduler passes over the queue every 2 s instead of 60, so a held task starts soon
  # after its hold ends even when no other job's event starts a pass: measured on an idle node, a
  # job requeuing itself started again 11-13 s after `scontrol requeue` instead of 30-33 s with
  # cred_expire=10, and 6-7 s with cred_expire=5 (2-core AMD EPYC, loaded, 3 tries each; issue
  # 77: tests/test_slurm.py requeues three tasks).
  cat > "$CONF" <<CONF
ClusterName=olora
SlurmctldHost=${host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=5
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/jobcomp.txt
JobRequeue=1
ReturnToService=2
MinJobAge=30
KillWait=30
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
DefMemPerCPU=$(( mem / cpus ))
NodeName=${host} NodeAddr=127.0.0.1 CPUs=${cpus} RealMemory=${mem} State=UNKNOWN
PartitionName=debug Nodes=${host} Default=YES MaxTime=INFINITE State=UP
CONF
  chown munge:munge /run/munge
  [ -s /etc/munge/munge.key ] || { mungekey --create 2>/dev/null || \
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; }
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  mkdir -p "$DIR/munge" && chown munge:munge "$DIR/munge"
  runuser -u munge -- munged --pid-file="$DIR/munge/munged.pid"
  # A fresh controller state each start (-c): no job of an earlier session comes back.
  slurmctld -c
  slurmd
  for _ in $(seq 60); do
    if sinfo -h -N -o %T 2>/dev/null | grep -qx idle; then
      echo "slurm: node $host idle ($cpus CPUs, ${mem} MB)"
      return 0
    fi
    sleep 1
  done
  echo "slurm: node $host not idle after 60 s; see $DIR/slurmctld.log and $DIR/slurmd.log" >&2
  return 1
}

stop() {
  local name pidfile
  for name in slurmd slurmctld munge/munged; do
    pidfile="$DIR/$name.pid"
    if [ -s "$pidfile" ]; then
      kill -TERM "$(cat "$pidfile")" 2>/dev/null || true
      rm -f "$pidfile"
    fi
  done
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
