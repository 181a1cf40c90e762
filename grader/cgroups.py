"""Cgroups of a sandbox's own, where root may make them here: memory (a limit for everything the sandbox runs, and
whether the kernel had to kill for it), freezer (stops every process of the sandbox at once, which no fork bomb
can outrun) and, where its creator keeps to some of the CPUs (the Hub's grading CPUs), cpuset: the sandbox keeps
to them too, whatever affinity it asks for. cgroup v1's controllers, else cgroup v2's. Used for a graded run and
for a grading kernel.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

from .classroom.server_limits import format_cpus, parse_cpus

CGROUP_V1_MEMORY = Path("/sys/fs/cgroup/memory")
CGROUP_V1_FREEZER = Path("/sys/fs/cgroup/freezer")
CGROUP_V1_CPUSET = Path("/sys/fs/cgroup/cpuset")
CGROUP_V2 = Path("/sys/fs/cgroup")


class SandboxCgroups:
    """Made at once (``enabled``: only root can); ``join`` is called in the child before it starts the sandbox.
    Without a memory cgroup the sandbox has no memory limit of its own, and ``memory`` is None (the creator says
    so on standard error)."""

    def __init__(self, prefix: str, limit_bytes: int, enabled: bool):
        self.memory: Path | None = None
        self.freezer: Path | None = None
        self.cpuset: Path | None = None
        self.v2 = False
        if not enabled:
            return
        name = f"{prefix}-{os.getpid()}-{time.monotonic_ns()}"
        kept_to = _kept_to_cpus()
        if (CGROUP_V1_MEMORY / "memory.limit_in_bytes").exists():
            # Swap counts too where the kernel accounts it, or the limit only moves the excess to swap.
            self.memory = _make(CGROUP_V1_MEMORY / name, {"memory.limit_in_bytes": str(limit_bytes)},
                                {"memory.memsw.limit_in_bytes": str(limit_bytes)})
            if (CGROUP_V1_FREEZER / "tasks").exists():
                self.freezer = _make(CGROUP_V1_FREEZER / name, {})
            if kept_to and (CGROUP_V1_CPUSET / "cpuset.cpus").exists():
                self.cpuset = _make(CGROUP_V1_CPUSET / name, {
                    "cpuset.cpus": kept_to, "cpuset.mems": _read(CGROUP_V1_CPUSET / "cpuset.mems").strip()})
        elif "memory" in _read(CGROUP_V2 / "cgroup.subtree_control").split():
            cpuset = {"cpuset.cpus": kept_to} if kept_to and "cpuset" in _read(
                CGROUP_V2 / "cgroup.subtree_control").split() else {}
            self.memory = self.freezer = _make(CGROUP_V2 / name, {"memory.max": str(limit_bytes), **cpuset},
                                               {"memory.swap.max": "0"})
            self.cpuset = self.memory if cpuset else None
            self.v2 = True
        if self.memory is None:
            print(f"{prefix}: no memory cgroup can be made here; the sandbox runs without a memory limit of its own",
                  file=sys.stderr)

    @staticmethod
    def available() -> bool:
        return (CGROUP_V1_MEMORY / "memory.limit_in_bytes").exists() or \
            "memory" in _read(CGROUP_V2 / "cgroup.subtree_control").split()

    def join(self) -> None:
        """Called in the child before it runs the sandbox: everything the sandbox starts stays in the cgroups."""
        for path in {self.memory, self.freezer, self.cpuset} - {None}:
            (path / "cgroup.procs").write_text(str(os.getpid()))

    def out_of_memory_kills(self) -> int:
        """How many processes the kernel killed because the sandbox reached its memory limit."""
        if self.memory is None:
            return 0
        events = _read(self.memory / ("memory.events" if self.v2 else "memory.oom_control"))
        counts = dict(line.split()[:2] for line in events.splitlines() if len(line.split()) >= 2)
        return int(counts.get("oom_kill", "0"))

    def peak_memory_bytes(self) -> int | None:
        """The most memory the sandbox's processes used together (None: no memory cgroup, or not recorded here)."""
        if self.memory is None:
            return None
        peak = _read(self.memory / ("memory.peak" if self.v2 else "memory.max_usage_in_bytes")).strip()
        return int(peak) if peak.isdigit() else None

    def freeze(self, frozen: bool) -> bool:
        """Freeze (or thaw) every process of the sandbox; whether it took effect within a second."""
        if self.freezer is None:
            return False
        try:
            if self.v2:
                (self.freezer / "cgroup.freeze").write_text("1" if frozen else "0")
            else:
                (self.freezer / "freezer.state").write_text("FROZEN" if frozen else "THAWED")
        except OSError:
            return False
        for _ in range(100):
            state = _read(self.freezer / ("cgroup.events" if self.v2 else "freezer.state"))
            if (("frozen 1" in state) if self.v2 else ("FROZEN" in state)) == frozen:
                return True
            time.sleep(0.01)
        return False

    def pids(self) -> list[int]:
        return [int(pid) for pid in _read(self.freezer / "cgroup.procs").split()] if self.freezer else []

    def remove(self) -> None:
        for path in {self.memory, self.freezer, self.cpuset} - {None}:
            for _ in range(50):
                try:
                    path.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)


def _kept_to_cpus() -> str | None:
    """This process's CPUs as a cpuset list where they are fewer than the machine's online CPUs; else None."""
    kept_to = os.sched_getaffinity(0)
    try:
        online = parse_cpus(_read(Path("/sys/devices/system/cpu/online")))
    except ValueError:
        return None
    return format_cpus(kept_to) if kept_to < online else None


def _make(path: Path, settings: dict[str, str], where_accounted: dict[str, str] | None = None) -> Path | None:
    """A new cgroup with ``settings``, and ``where_accounted`` where this kernel has those files (swap)."""
    try:
        path.mkdir()
        for name, value in settings.items():
            (path / name).write_text(value)
        for name, value in (where_accounted or {}).items():
            if (path / name).exists():
                (path / name).write_text(value)
        return path
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
        return None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
