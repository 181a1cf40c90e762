#!/usr/bin/env bash
# Brings up a one-node Slurm on this machine for the grader's Slurm backend and its tests:
# Debian's slurm-wlm and munge (installed when missing), a slurm.conf for localhost with this machine's CPUs and
# memory, then munged, slurmctld and slurmd. Idempotent: when the cluster is already up with this configuration it
# only checks it. Needs root. Exit codes: 0 the cluster runs jobs; 1 it could not be started (the reason is
# printed, with the end of the daemon's log); 2 bad usage or not root.
#
#   containers/slurm/start.sh [--skip-apt]
#
# The configuration is written to /etc/slurm/slurm.conf (where Debian's commands look) only when that file is
# absent or was written by this script; a site's own slurm.conf is never replaced.
set -euo pipefail

do_apt=1
case "${1:-}" in
    "") ;;
    --skip-apt) do_apt=0 ;;
    *) echo "start.sh: unknown option '$1' (usage: start.sh [--skip-apt])" >&2; exit 2 ;;
esac
if [ "$(id -u)" != 0 ]; then
    echo "start.sh: run as root (it installs packages and starts munged, slurmctld and slurmd)" >&2
    exit 2
fi

conf=/etc/slurm/slurm.conf
marker="# Written by ScaleLab containers/slurm/start.sh"
log_dir=/var/log/slurm
state_dir=/var/lib/slurm
node=localhost   # slurmd is started with -N localhost, so the machine's own host name does not matter

say() { printf '==> %s\n' "$*"; }
fail() {
    echo "start.sh: $1" >&2
    [ -n "${2:-}" ] && [ -f "$2" ] && { echo "--- last lines of $2:" >&2; tail -n 20 "$2" >&2; }
    exit 1
}

if [ "$do_apt" = 1 ]; then
    missing=()
    for package in slurm-wlm slurm-client munge; do
        dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        say "Installing ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
fi
for program in munged slurmctld slurmd scontrol sinfo; do
    command -v "$program" >/dev/null || fail "$program is not installed (apt-get install slurm-wlm munge)"
done

# --- munge: every Slurm message is authenticated with the shared key --------------------------------------------
if [ ! -s /etc/munge/munge.key ]; then
    say "Creating the munge key"
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
fi
chown -R munge:munge /etc/munge && chmod 0700 /etc/munge && chmod 0400 /etc/munge/munge.key
install -d -o munge -g munge -m 0755 /run/munge /var/lib/munge /var/log/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    say "Starting munged"
    runuser -u munge -- /usr/sbin/munged || fail "munged did not start" /var/log/munge/munged.log
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    munge -n | unmunge >/dev/null 2>&1 || fail "munge cannot encode and decode a credential" /var/log/munge/munged.log
fi

# --- slurm.conf: one node, this machine's hardware as slurmd itself reports it ----------------------------------
hardware="$(slurmd -C | head -n 1 | sed -E "s/^NodeName=[^ ]+ //")"
[ -n "$hardware" ] || fail "slurmd -C did not report this machine's hardware"
wanted="$(cat <<CONF
$marker; it is rewritten on each start, edit that script instead.
ClusterName=scalelab
SlurmctldHost=$node
SlurmUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
StateSaveLocation=$state_dir/slurmctld
SlurmdSpoolDir=$state_dir/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$log_dir/slurmctld.log
SlurmdLogFile=$log_dir/slurmd.log
# No cgroups needed (containers and VMs often lack writable ones): processes are tracked by parentage.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# No slurmdbd here: sacct has no records, so finished jobs are read with scontrol while slurmctld remembers them.
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=600
# scancel and time limits: SIGTERM first, SIGKILL 5 s later.
KillWait=5
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
NodeName=$node NodeAddr=127.0.0.1 $hardware State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
)"
if [ -f "$conf" ] && ! grep -qF "$marker" "$conf"; then
    fail "$conf exists and was not written by this script; not replacing a site's configuration"
fi
changed=0
if [ ! -f "$conf" ] || [ "$(cat "$conf")" != "$wanted" ]; then
    say "Writing $conf ($hardware)"
    mkdir -p /etc/slurm
    printf '%s\n' "$wanted" > "$conf"
    changed=1
fi
mkdir -p "$log_dir" "$state_dir/slurmctld" "$state_dir/slurmd"

# A process is alive if it exists and is not a zombie (PID 1 of a container may be slow to reap).
alive() { [ -n "$1" ] && [ -r "/proc/$1/stat" ] && ! grep -qE '^[0-9]+ \(.*\) Z' "/proc/$1/stat"; }
running() { [ -f "$1" ] && alive "$(cat "$1" 2>/dev/null)"; }
stop_daemon() {  # only the daemon named by its pid file
    local pid
    pid="$(cat "$1" 2>/dev/null || true)"
    if alive "$pid"; then
        kill "$pid"
        for _ in $(seq 100); do alive "$pid" || break; sleep 0.1; done
    fi
}
if [ "$changed" = 1 ]; then
    stop_daemon /run/slurmd.pid
    stop_daemon /run/slurmctld.pid
fi
if ! running /run/slurmctld.pid; then
    say "Starting slurmctld"
    slurmctld || fail "slurmctld did not start" "$log_dir/slurmctld.log"
fi
for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q "is UP" && break; sleep 0.2; done
scontrol ping 2>/dev/null | grep -q "is UP" || fail "slurmctld does not answer (scontrol ping)" "$log_dir/slurmctld.log"
if ! running /run/slurmd.pid; then
    say "Starting slurmd"
    slurmd -N "$node" || fail "slurmd did not start" "$log_dir/slurmd.log"
fi

# --- ready: the node takes jobs ---------------------------------------------------------------------------------
state=""
for _ in $(seq 150); do
    state="$(sinfo -h -n "$node" -o %T 2>/dev/null | head -n 1)"
    case "$state" in
        idle|mixed|allocated|completing) break ;;
        down*|drain*|fail*) scontrol update NodeName="$node" State=RESUME 2>/dev/null || true ;;
    esac
    sleep 0.2
done
case "$state" in
    idle|mixed|allocated|completing) ;;
    *) fail "node $node is '${state:-unknown}', not ready for jobs" "$log_dir/slurmd.log" ;;
esac
say "Slurm is up: partition $(sinfo -h -o %P | head -n 1), node $node ($state), $hardware"
