"""How much CPU other work on the machine used while a run went on, measured by the grader from the kernel's
counters; nothing the run writes or prints enters it.

The kernel counts the busy time of each CPU (``/proc/stat``) and the CPU time of each process and of the children
it has reaped (``/proc/<pid>/stat``). Over the run, the busy time of the CPUs the run may use, less the CPU time of
the grader's own process tree (the grader, the run it started, the held-out check it prepares meanwhile), is what
other work used; as a share of the capacity (wall seconds × those CPUs) it says how much of the machine the run
did not have.

The tree is sampled while the run goes, and the largest total counts: a process's time reaches its ancestors only
when they reap it, and the sandbox's CPU time never reaches the grader's (bubblewrap's outer process does not wait
for the init of the run's PID namespace: ``getrusage(RUSAGE_CHILDREN)`` shows none of the run). Inside the sandbox
everything is reaped into that init, so what sampling misses is the CPU the run used in its last interval: at most
``SAMPLE_INTERVAL_S`` / wall time of the share.

Not used: ``/proc/pressure/cpu`` says how long tasks waited for a CPU, the run's own ranks waiting for each other
included, so it cannot tell a run that oversubscribes the cores from one that others crowd out; a cgroup of the
run's own would count its CPU exactly, but needs the right to create cgroups (root) and differs between cgroup v1
and v2 hosts. The process tree's counters need neither.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from .spec import BUDGET_SHARE

# Tracks are calibrated so that the reference uses at most 80 % of the budget on an otherwise idle machine
# (spec.BUDGET_SHARE): once others take the remaining fifth of the CPU, an honest run can be pushed past its budget.
CONTENDED_SHARE = round(1 - BUDGET_SHARE[1], 2)
# Others take CPU from a run only while more is runnable than there are CPUs, so a crowded run leaves the CPUs no
# time to spare. Where the run and the others together kept them busy less than this share of the time, the run was
# waiting on itself (a hang, a sleep, a rank waiting for a message), not for a CPU.
SATURATED_SHARE = 0.8
SAMPLE_INTERVAL_S = 0.5
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
PROC = Path("/proc")


@dataclasses.dataclass
class CpuContention:
    """CPU seconds over one run: ``others_cpu_s`` used by work outside the grader's process tree,
    ``own_cpu_s`` by the tree, ``capacity_cpu_s`` = wall seconds × ``cpus``; ``share`` = others / capacity."""

    others_cpu_s: float
    own_cpu_s: float
    capacity_cpu_s: float
    share: float
    cpus: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def is_contended(contention: dict | None) -> bool:
    """Whether others used so much of the machine that a run out of time is not the submission's fault: they took
    at least ``CONTENDED_SHARE`` of it, and with the run's own use the CPUs were saturated."""
    if not contention or not contention["capacity_cpu_s"]:
        return False
    busy = (contention["others_cpu_s"] + contention["own_cpu_s"]) / contention["capacity_cpu_s"]
    return contention["share"] >= CONTENDED_SHARE and busy >= SATURATED_SHARE


def busy_machine_sentence(contention: dict) -> str:
    """The contention in a student's terms."""
    return (f"other work on the grading machine used {contention['share'] * 100:.0f} % of its CPU during your run "
            f"({contention['others_cpu_s']:.0f} of {contention['capacity_cpu_s']:.0f} CPU-seconds)")


def busy_cpu_seconds(cpus: set[int]) -> float:
    """Seconds the given CPUs spent running anything (not idle, not waiting for I/O) since boot."""
    busy_ticks = 0
    for line in (PROC / "stat").read_text().splitlines():
        name, *fields = line.split()
        if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus):
            continue
        # user nice system idle iowait irq softirq steal (guest time is already inside user and nice); time stolen
        # by a hypervisor for other machines starves the run as much as a process here does, so it counts as busy.
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(value) for value in fields[:8])
        busy_ticks += user + nice + system + irq + softirq + steal
    return busy_ticks / CLOCK_TICKS_PER_S


def _process_table() -> dict[int, tuple[int, int]]:
    """pid → (parent pid, CPU ticks of the process and of the children it reaped), for every process."""
    table = {}
    for entry in os.scandir(PROC):
        if not entry.name.isdigit():
            continue
        try:
            text = (PROC / entry.name / "stat").read_bytes()
        except OSError:  # ended meanwhile
            continue
        fields = text[text.rindex(b")") + 2:].split()  # after the command name, which may hold anything
        # state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime cutime cstime
        table[int(entry.name)] = (int(fields[1]), sum(int(value) for value in fields[11:15]))
    return table


def tree_cpu_seconds(root_pid: int) -> float:
    """CPU seconds of ``root_pid`` and its live descendants, each with the children it has reaped."""
    table = _process_table()
    children: dict[int, list[int]] = {}
    for pid, (parent, _ticks) in table.items():
        children.setdefault(parent, []).append(pid)
    total_ticks, pending = 0, [root_pid] if root_pid in table else []
    while pending:
        pid = pending.pop()
        total_ticks += table[pid][1]
        pending += children.get(pid, [])
    return total_ticks / CLOCK_TICKS_PER_S


class ContentionMeter:
    """Measures one run: ``start()`` before it, ``sample()`` as often as convenient while it goes (it reads the
    counters at most every ``interval_s``), ``finish()`` once it has ended and been reaped.

    ``root_pid`` is the process whose tree is the run's side (default: this process); ``cpus`` the CPUs the run
    may use (default: this process's affinity, which a batch system's allocation narrows)."""

    def __init__(self, root_pid: int | None = None, cpus=None, interval_s: float = SAMPLE_INTERVAL_S):
        self.root_pid = root_pid if root_pid is not None else os.getpid()
        self.cpus = set(cpus) if cpus is not None else set(os.sched_getaffinity(0))
        self.interval_s = interval_s
        self.started = self.last_sample = None
        self.busy_at_start = self.own_at_start = self.own_most = 0.0

    def start(self) -> None:
        self.started = self.last_sample = time.monotonic()
        self.busy_at_start = busy_cpu_seconds(self.cpus)
        self.own_at_start = self.own_most = tree_cpu_seconds(self.root_pid)

    def sample(self) -> None:
        now = time.monotonic()
        if self.started is not None and now - self.last_sample >= self.interval_s:
            self.last_sample = now
            self.own_most = max(self.own_most, tree_cpu_seconds(self.root_pid))

    def finish(self) -> CpuContention:
        self.own_most = max(self.own_most, tree_cpu_seconds(self.root_pid))
        busy = busy_cpu_seconds(self.cpus) - self.busy_at_start
        capacity = (time.monotonic() - self.started) * len(self.cpus)
        own = self.own_most - self.own_at_start
        others = min(max(busy - own, 0.0), capacity)
        return CpuContention(others_cpu_s=round(others, 2), own_cpu_s=round(own, 2),
                             capacity_cpu_s=round(capacity, 2), share=round(others / capacity, 3) if capacity else 0.0,
                             cpus=len(self.cpus))
