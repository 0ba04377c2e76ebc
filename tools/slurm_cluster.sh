#!/usr/bin/env bash
# A real one-node Slurm on this machine, for the `slurm` tests and for trying shardlab's Slurm path without a cluster.
#
#   sudo tools/slurm_cluster.sh install # Debian/Ubuntu packages slurmctld slurmd slurm-client munge (CI does this)
#   sudo tools/slurm_cluster.sh up      # install if needed, start munge, slurmctld, slurmd
#   source "${SHARDLAB_SLURM_DIR:-/tmp/shardlab-slurm}/env.sh"   # SLURM_CONF, and the sacct stand-in on PATH
#   sudo tools/slurm_cluster.sh down    # cancel what is left and stop the daemons
#
# Needs root and no systemd: the daemons are started by hand. Everything the cluster writes (config, state, logs) is
# under $SHARDLAB_SLURM_DIR. There is no accounting database, so a small `sacct` stand-in answers from squeue:
# submitit asks sacct for job states, and without an answer would wait forever on a job that died.
set -euo pipefail
DIR=${SHARDLAB_SLURM_DIR:-/tmp/shardlab-slurm}
export SLURM_CONF=$DIR/etc/slurm.conf

die() { echo "slurm_cluster: $*" >&2; exit 1; }

install_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null &&
    command -v munged >/dev/null && return 0
  command -v apt-get >/dev/null || die "slurmctld/slurmd/munge are missing and there is no apt-get to install them"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge >/dev/null
}

start_munge() {
  # The package's postinst makes the key; the runtime directory is normally systemd-tmpfiles' job.
  [ -s /etc/munge/munge.key ] || mungekey --create --keyfile=/etc/munge/munge.key
  chown munge:munge /etc/munge /etc/munge/munge.key
  chmod 700 /etc/munge && chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge && chmod 755 /run/munge
  if ! { [ -f /run/munge/munged.pid ] && kill -0 "$(cat /run/munge/munged.pid)" 2>/dev/null; }; then
    runuser -u munge -- /usr/sbin/munged
  fi
  for _ in $(seq 50); do [ -S /run/munge/munge.socket.2 ] && break; sleep 0.1; done
  munge -n | unmunge >/dev/null || die "munge does not answer (see /var/log/munge/munged.log)"
}

write_config() {
  rm -rf "$DIR/state" "$DIR/log"
  mkdir -p "$DIR/etc" "$DIR/state/ctld" "$DIR/state/d" "$DIR/log" "$DIR/run" "$DIR/bin"
  local host mem topo
  host=$(hostname -s)
  mem=$(( $(free -m | awk '/^Mem:/{print $2}') * 9 / 10 ))
  topo=$(slurmd -C | head -1 | grep -o 'CPUs=.*ThreadsPerCore=[0-9]*')
  # linuxproc/none plugins: no cgroups needed; KillWait 5 s so cancelled jobs go quickly; MinJobAge keeps finished
  # jobs visible to squeue (and so to the sacct stand-in) for an hour.
  cat >"$SLURM_CONF" <<CONF
ClusterName=shardlab
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
ReturnToService=2
MailProg=/bin/true
KillWait=5
MinJobAge=3600
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$DIR/state/ctld
SlurmdSpoolDir=$DIR/state/d
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=$host NodeAddr=127.0.0.1 $topo RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
  cat >"$DIR/bin/sacct" <<'SACCT'
#!/bin/sh
# sacct stand-in for a cluster without accounting: answers `sacct -o JobID,State,NodeList --parsable2 -j ID ...`
# (what submitit asks) from slurmctld's memory of recent jobs.
ids=""
while [ $# -gt 0 ]; do
  case "$1" in
    -j|--jobs) ids="$ids${ids:+,}$2"; shift 2 ;;
    -j*) ids="$ids${ids:+,}${1#-j}"; shift ;;
    --jobs=*) ids="$ids${ids:+,}${1#--jobs=}"; shift ;;
    *) shift ;;
  esac
done
echo "JobID|State|NodeList"
[ -n "$ids" ] && squeue -h -t all -j "$ids" -o '%i|%T|%N' 2>/dev/null
exit 0
SACCT
  chmod +x "$DIR/bin/sacct"
  printf 'export SLURM_CONF=%s\nexport PATH=%s/bin:$PATH\n' "$SLURM_CONF" "$DIR" >"$DIR/env.sh"
}

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop_pid() {
  running "$1" || { rm -f "$1"; return 0; }
  local pid; pid=$(cat "$1")
  kill -TERM "$pid"
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
  rm -f "$1"
}

up() {
  [ "$(id -u)" = 0 ] || die "needs root (it installs packages and starts daemons)"
  install_packages
  start_munge
  running "$DIR/run/slurmctld.pid" && down_daemons
  write_config
  slurmctld
  slurmd
  for _ in $(seq 100); do
    [ "$(sinfo -h -o %T 2>/dev/null)" = "idle" ] && { echo "slurm up: $SLURM_CONF"; return 0; }
    sleep 0.2
  done
  die "the node did not become idle; see $DIR/log/slurmctld.log and slurmd.log"
}

down_daemons() {
  if running "$DIR/run/slurmctld.pid"; then
    local ids; ids=$(squeue -h -o %A 2>/dev/null | tr '\n' ' ')
    if [ -n "$ids" ]; then
      # shellcheck disable=SC2086
      scancel $ids || true
      for _ in $(seq 40); do [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break; sleep 0.5; done
    fi
  fi
  stop_pid "$DIR/run/slurmd.pid"
  stop_pid "$DIR/run/slurmctld.pid"
}

case "${1:-}" in
  install) [ "$(id -u)" = 0 ] || die "needs root to install packages"; install_packages ;;
  up) up ;;
  down) down_daemons; stop_pid /run/munge/munged.pid; echo "slurm down" ;;
  *) die "usage: $0 install|up|down" ;;
esac
