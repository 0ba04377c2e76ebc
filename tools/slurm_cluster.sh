#!/usr/bin/env bash
# A real Slurm on this machine, for the `slurm` tests and for trying shardlab's Slurm path without a cluster: this
# machine as node `debug`'s one node, and SHARDLAB_SLURM_NODES (default 2) more hosts in partition `multi`, each a
# network namespace with its own host name, address and slurmd (a multi-node cluster on one machine).
#
#   tools/slurm_cluster.sh install # Debian/Ubuntu packages slurmctld slurmd slurm-client munge (CI does this)
#   tools/slurm_cluster.sh up      # install if needed, start munge, slurmctld, the slurmds (and the hosts)
#   source "${SHARDLAB_SLURM_DIR:-/tmp/shardlab-slurm}/env.sh"   # SLURM_CONF, and the sacct stand-in on PATH
#   tools/slurm_cluster.sh down    # cancel what is left, stop the daemons, remove the hosts
#   tools/slurm_cluster.sh on shl-n2 CMD...    # run CMD on a host (its network, host name, /etc/hosts, scratch)
#   tools/slurm_cluster.sh kill-node shl-n2    # SIGKILL everything on a host, its slurmd included (a lost node)
#   tools/slurm_cluster.sh node-up shl-n2      # start a host's slurmd again
#
# The hosts (shl-n1, shl-n2, ...): namespace shl_nK, address 10.77.0.(10+K)/24 on bridge shlbr0 (10.77.0.1, where
# slurmctld listens); only these addresses are used. Each host sees its own /etc/hosts, as a cluster's DNS would
# answer, except that its own name resolves to 127.0.1.1 as Debian's installer writes it: the trap that makes gloo
# pick the loopback interface on real clusters (docs/distributed.md#multi-node). Each host also has a node-local
# tmpfs at $SHARDLAB_SLURM_DIR/scratch that the others (and this machine) do not see, like a node's local /tmp.
#
# Needs root and no systemd: the daemons are started by hand. Run by another user, it runs itself again through sudo
# where there is one (a root container has none and needs none). Everything the cluster writes (config, state, logs) is
# under $SHARDLAB_SLURM_DIR. There is no accounting database, so a small `sacct` stand-in answers from squeue:
# submitit asks sacct for job states, and without an answer would wait forever on a job that died.
set -euo pipefail
DIR=${SHARDLAB_SLURM_DIR:-/tmp/shardlab-slurm}
NODES=${SHARDLAB_SLURM_NODES:-2}
BRIDGE=shlbr0
CTLD_ADDR=10.77.0.1
export SLURM_CONF=$DIR/etc/slurm.conf

die() { echo "slurm_cluster: $*" >&2; exit 1; }

if [ "$(id -u)" != 0 ] && [ -n "${1:-}" ]; then
  command -v sudo >/dev/null || die "needs root (daemons, network namespaces) and there is no sudo here: run it as root"
  exec sudo --preserve-env=SHARDLAB_SLURM_DIR,SHARDLAB_SLURM_NODES,PATH bash "$0" "$@"
fi

install_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null && command -v ip >/dev/null &&
    command -v munged >/dev/null && return 0
  command -v apt-get >/dev/null || die "slurmctld/slurmd/munge are missing and there is no apt-get to install them"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge iproute2 util-linux >/dev/null
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

node_name() { echo "shl-n$1"; }
node_ns() { echo "shl_n$1"; }
node_addr() { echo "10.77.0.$((10 + $1))"; }
node_index() {  # shl-n2 -> 2
  local k=${1#shl-n}
  [[ "$k" =~ ^[0-9]+$ ]] && [ "$k" -ge 1 ] && [ "$k" -le "$NODES" ] || die "no host $1 (hosts: shl-n1..shl-n$NODES)"
  echo "$k"
}

hosts_up() {
  # The bridge and one namespace per host, joined by veth pairs. Returns non-zero where namespaces cannot be made
  # (no CAP_NET_ADMIN, a container without them): the cluster then has the one local node only.
  [ "$NODES" -gt 0 ] || return 1
  ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge || return 1
  ip addr show dev "$BRIDGE" | grep -q "$CTLD_ADDR/" || ip addr add "$CTLD_ADDR/24" dev "$BRIDGE" || return 1
  ip link set "$BRIDGE" up || return 1
  local k ns
  for k in $(seq "$NODES"); do
    ns=$(node_ns "$k")
    ip netns list | grep -qw "$ns" && continue
    ip netns add "$ns" || return 1
    ip link add "shlv$k" type veth peer name "shlv${k}p" && ip link set "shlv${k}p" netns "$ns" &&
      ip link set "shlv$k" master "$BRIDGE" && ip link set "shlv$k" up &&
      ip netns exec "$ns" ip addr add "$(node_addr "$k")/24" dev "shlv${k}p" &&
      ip netns exec "$ns" ip link set "shlv${k}p" up && ip netns exec "$ns" ip link set lo up || return 1
  done
  mkdir -p "$DIR/etc" "$DIR/scratch"
  for k in $(seq "$NODES"); do
    {
      echo "127.0.0.1 localhost"
      echo "127.0.1.1 $(node_name "$k")"  # Debian's line for a host's own name: loopback, not its cluster address
      echo "$CTLD_ADDR $(hostname -s)"
      local j
      for j in $(seq "$NODES"); do [ "$j" = "$k" ] || echo "$(node_addr "$j") $(node_name "$j")"; done
    } >"$DIR/etc/hosts.$(node_name "$k")"
  done
}

hosts_down() {
  local k
  for k in $(seq "$NODES"); do
    kill_node_processes "$k"
    ip netns del "$(node_ns "$k")" 2>/dev/null || true
    ip link del "shlv$k" 2>/dev/null || true
  done
  ip link del "$BRIDGE" 2>/dev/null || true
}

kill_node_processes() {
  local pids
  pids=$(ip netns pids "$(node_ns "$1")" 2>/dev/null | tr '\n' ' ')
  # shellcheck disable=SC2086
  [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
  for _ in $(seq 50); do [ -z "$(ip netns pids "$(node_ns "$1")" 2>/dev/null)" ] && break; sleep 0.1; done
}

on_node() {
  # Run "$@" on host k: its network namespace, a UTS namespace with its host name, and a private mount namespace in
  # which /etc/hosts is its own and $DIR/scratch is a tmpfs only it sees (made once per command: a host's slurmd and
  # everything it starts share one).
  # nsenter, not `ip netns exec`: that remounts /sys, hiding /sys/fs/cgroup, without which slurmd will not start.
  local k=$1; shift
  nsenter --net="/run/netns/$(node_ns "$k")" unshare --uts --mount --propagation private -- sh -c '
    hostname "$1" && mount --bind "$2" /etc/hosts && mount -t tmpfs -o size=256m shardlab-scratch "$3" || exit 1
    shift 3; exec "$@"' sh "$(node_name "$k")" "$DIR/etc/hosts.$(node_name "$k")" "$DIR/scratch" "$@"
}

node_slurmd_up() {
  mkdir -p "$DIR/state/d/$(node_name "$1")"
  on_node "$1" slurmd -N "$(node_name "$1")"
}

write_config() {
  local multi=$1
  rm -rf "$DIR/state" "$DIR/log"
  mkdir -p "$DIR/etc" "$DIR/state/ctld" "$DIR/state/d" "$DIR/log" "$DIR/run" "$DIR/bin"
  local host mem topo ctld_addr=127.0.0.1
  host=$(hostname -s)
  mem=$(( $(free -m | awk '/^Mem:/{print $2}') * 9 / 10 ))
  topo=$(slurmd -C | head -1 | grep -o 'CPUs=.*ThreadsPerCore=[0-9]*')
  # The hosts reach slurmctld on the bridge; this machine's own slurmd reaches it there too.
  [ "$multi" = 1 ] && ctld_addr=$CTLD_ADDR
  # linuxproc/none plugins: no cgroups needed; KillWait 5 s so cancelled jobs go quickly; MinJobAge keeps finished
  # jobs visible to squeue (and so to the sacct stand-in) for an hour.
  cat >"$SLURM_CONF" <<CONF
ClusterName=shardlab
SlurmctldHost=$host($ctld_addr)
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
SlurmdSpoolDir=$DIR/state/d/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.%n.log
# A lost host is noticed in seconds (the default is 5 minutes), so the node-loss tests see Slurm react.
SlurmdTimeout=10
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=$host NodeAddr=127.0.0.1 $topo RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
  if [ "$multi" = 1 ]; then
    local k names=""
    for k in $(seq "$NODES"); do
      echo "NodeName=$(node_name "$k") NodeAddr=$(node_addr "$k") $topo RealMemory=$((mem / 4)) State=UNKNOWN"
      names="$names${names:+,}$(node_name "$k")"
    done >>"$SLURM_CONF"
    echo "PartitionName=multi Nodes=$names MaxTime=INFINITE State=UP" >>"$SLURM_CONF"
  fi
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
  local multi=0 want
  if hosts_up; then multi=1; else
    echo "slurm_cluster: no network namespaces here: one node only (partition multi is missing)" >&2
    hosts_down
  fi
  write_config "$multi"
  slurmctld
  mkdir -p "$DIR/state/d/$(hostname -s)"
  slurmd -N "$(hostname -s)"
  want=$((1 + multi * NODES))
  for k in $(seq $((multi * NODES))); do node_slurmd_up "$k"; done
  for _ in $(seq 150); do
    [ "$(sinfo -h -N -t idle -o %N 2>/dev/null | wc -l)" -ge "$want" ] && {
      echo "slurm up: $SLURM_CONF ($want nodes)"
      return 0
    }
    sleep 0.2
  done
  sinfo -N >&2 || true
  die "the nodes did not become idle; see $DIR/log/slurmctld.log and slurmd.*.log"
}

node_up() {
  local k; k=$(node_index "$1")
  running "$DIR/run/slurmd.$1.pid" && return 0
  node_slurmd_up "$k"
  for _ in $(seq 150); do
    case "$(sinfo -h -n "$1" -o %T 2>/dev/null)" in idle | mixed | allocated) return 0 ;; esac
    sleep 0.2
  done
  die "$1 did not come back; see $DIR/log/slurmd.$1.log"
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
  local f
  for f in "$DIR"/run/slurmd.*.pid; do [ -e "$f" ] && stop_pid "$f"; done
  stop_pid "$DIR/run/slurmctld.pid"
  hosts_down
}

case "${1:-}" in
  install) [ "$(id -u)" = 0 ] || die "needs root to install packages"; install_packages ;;
  up) up ;;
  down) down_daemons; stop_pid /run/munge/munged.pid; echo "slurm down" ;;
  on) [ $# -ge 3 ] || die "usage: $0 on HOST CMD..."; k=$(node_index "$2"); shift 2; on_node "$k" "$@" ;;
  kill-node) [ $# = 2 ] || die "usage: $0 kill-node HOST"; kill_node_processes "$(node_index "$2")"; rm -f "$DIR/run/slurmd.$2.pid" ;;
  node-up) [ $# = 2 ] || die "usage: $0 node-up HOST"; node_up "$2" ;;
  *) die "usage: $0 install|up|down|on HOST CMD...|kill-node HOST|node-up HOST" ;;
esac
