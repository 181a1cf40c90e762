#!/usr/bin/env bash
# Stops the one-node Slurm that start.sh brought up: cancels its jobs, then slurmd, slurmctld and munged.
# Only the daemons named by their pid files are signalled. Exit codes: 0 stopped (or was not running); 2 not root.
set -uo pipefail
if [ "$(id -u)" != 0 ]; then
    echo "stop.sh: run as root" >&2
    exit 2
fi
if grep -qF "# Written by ScaleLab containers/slurm/start.sh" /etc/slurm/slurm.conf 2>/dev/null \
        && scontrol ping 2>/dev/null | grep -q "is UP"; then
    scancel --full --quiet --partition=debug 2>/dev/null || true
fi
# A process is alive if it exists and is not a zombie (PID 1 of a container may be slow to reap).
alive() { [ -n "$1" ] && [ -r "/proc/$1/stat" ] && ! grep -qE '^[0-9]+ \(.*\) Z' "/proc/$1/stat"; }
stop_daemon() {
    local pid_file="$1" name="$2" pid
    pid="$(cat "$pid_file" 2>/dev/null || true)"
    if alive "$pid"; then
        echo "==> Stopping $name"
        kill "$pid"
        for _ in $(seq 100); do alive "$pid" || break; sleep 0.1; done
        if alive "$pid"; then kill -KILL "$pid"; fi
    fi
    rm -f "$pid_file"
}
stop_daemon /run/slurmd.pid slurmd
stop_daemon /run/slurmctld.pid slurmctld
stop_daemon /run/munge/munged.pid munged
exit 0
