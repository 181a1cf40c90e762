"""Each student's JupyterLab server in cgroups of its own (``make hub``'s spawner): a memory limit, a CPU weight and
a process limit. One student's busy kernel then takes at most its share of the cores from the others and from the
grader's runs, a memory hog is stopped at its own limit, and a fork bomb ends at its own process count.

The Hub (root) makes the cgroups, moves the server into them as soon as it has started (what the server starts
later inherits them) and, when the server stops, kills whatever is left in them and removes them. cgroup v1's
controllers (memory, cpu, pids) where they are mounted, as on a machine whose PID 1 is not systemd; else cgroup
v2's, under the root cgroup. Where neither can be made the Hub logs why and the server runs without them.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PARENT = "scalelab-students"
V1_CONTROLLERS = ("memory", "cpu", "pids")


@dataclass(frozen=True)
class ServerLimits:
    memory_bytes: int
    cpu_weight: int  # cgroup v2's scale, 1-10000, 100 the default: relative to the other students' servers
    tasks: int

    @classmethod
    def from_environment(cls, environ: dict[str, str] | None = None) -> ServerLimits:
        """SCALELAB_STUDENT_MEMORY_MB (default: half the machine's memory, at least 2048), SCALELAB_STUDENT_CPU_WEIGHT
        (default 100) and SCALELAB_STUDENT_TASKS (default 1024)."""
        environ = os.environ if environ is None else environ
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        memory_mb = int(environ.get("SCALELAB_STUDENT_MEMORY_MB") or max(2048, total // 2 // 2**20))
        limits = cls(memory_bytes=memory_mb * 2**20, cpu_weight=int(environ.get("SCALELAB_STUDENT_CPU_WEIGHT") or 100),
                     tasks=int(environ.get("SCALELAB_STUDENT_TASKS") or 1024))
        if limits.memory_bytes <= 0 or not 1 <= limits.cpu_weight <= 10000 or limits.tasks < 16:
            raise ValueError(f"student server limits out of range: {limits} (memory > 0, CPU weight 1-10000, "
                             f"at least 16 tasks)")
        return limits


def uses_v1() -> bool:
    return all((CGROUP_ROOT / controller / "cgroup.procs").exists() for controller in V1_CONTROLLERS)


def server_cgroups(name: str) -> list[Path]:
    if uses_v1():
        return [CGROUP_ROOT / controller / PARENT / name for controller in V1_CONTROLLERS]
    return [CGROUP_ROOT / PARENT / name]


def confine(name: str, pid: int, limits: ServerLimits) -> list[Path]:
    """Make ``name``'s cgroups with ``limits`` and move ``pid`` (their server) into them; the cgroups made."""
    made = []
    if uses_v1():
        settings = {"memory": {"memory.limit_in_bytes": str(limits.memory_bytes)},
                    # v1's shares: 1024 is v2's weight 100.
                    "cpu": {"cpu.shares": str(max(2, limits.cpu_weight * 1024 // 100))},
                    "pids": {"pids.max": str(limits.tasks)}}
        for controller in V1_CONTROLLERS:
            group = CGROUP_ROOT / controller / PARENT / name
            group.mkdir(parents=True, exist_ok=True)
            for setting, value in settings[controller].items():
                (group / setting).write_text(value)
            made.append(group)
    else:
        # Under the root cgroup, the one cgroup v2 lets hold processes beside controlled children.
        parent = CGROUP_ROOT / PARENT
        parent.mkdir(exist_ok=True)
        for level in (CGROUP_ROOT, parent):
            (level / "cgroup.subtree_control").write_text("+memory +cpu +pids")
        group = parent / name
        group.mkdir(exist_ok=True)
        for setting, value in {"memory.max": limits.memory_bytes, "cpu.weight": limits.cpu_weight,
                               "pids.max": limits.tasks}.items():
            (group / setting).write_text(str(value))
        made.append(group)
    for group in made:
        (group / "cgroup.procs").write_text(str(pid))
    return made


def members(name: str) -> set[int]:
    found = set()
    for group in server_cgroups(name):
        try:
            found |= {int(pid) for pid in (group / "cgroup.procs").read_text().split()}
        except OSError:
            continue
    return found


def release(name: str, grace_s: float = 5.0) -> None:
    """Kill what is left of ``name``'s server (a kernel it left, a process in the background) and remove the
    cgroups. Killed again and again until none is left: a fork bomb cannot outrun it at its process limit."""
    deadline = time.monotonic() + grace_s
    while (left := members(name)) and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    for group in server_cgroups(name):
        for _attempt in range(50):
            try:
                group.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)
