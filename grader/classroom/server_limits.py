"""Each student's JupyterLab server in cgroups of its own (``make hub``'s spawner): a memory limit, a CPU weight and
a process limit. One student's busy kernel then takes at most its share of the cores from the others and from the
grader's runs, a memory hog is stopped at its own limit, and a fork bomb ends at its own process count.

Where the machine has the cores, graded runs get some of their own (``SCALELAB_GRADING_CPUS``, :func:`split_cpus`):
the students' servers are held to the others by a cpuset cgroup, which nothing they run can widen, and the grader
service keeps to the grading CPUs (``HubAssessService.grading_cpus``), its runs with it. On a machine too small to
split, the grader measures what others took from each run instead (``grader/contention.py``).

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
V1_CPUSET = CGROUP_ROOT / "cpuset"
# From this many CPUs, "auto" keeps the upper half for graded runs: a track is calibrated on 2 cores, so a
# machine with fewer than 4 has none to spare and shares them (the grader then measures the contention).
AUTO_SPLIT_FROM_CPUS = 4


def parse_cpus(text: str) -> frozenset[int]:
    """A CPU list as the kernel writes one ("0-3,6"); ValueError for anything else."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"not a CPU list: {text!r} (e.g. '2-3' or '1,3')")
        low, high = int(first), int(last or first)
        if high < low:
            raise ValueError(f"not a CPU list: {text!r} ({part} runs backwards)")
        cpus |= set(range(low, high + 1))
    return frozenset(cpus)


def format_cpus(cpus) -> str:
    """The kernel's CPU list format ("0-3,6")."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(low) if low == high else f"{low}-{high}" for low, high in runs)


def split_cpus(setting: str, online) -> tuple[frozenset[int], frozenset[int]] | None:
    """The CPUs of graded runs and those of the students' servers, from ``setting``: "auto" (the upper half, from
    AUTO_SPLIT_FROM_CPUS CPUs on), "none", or a CPU list. None: everything shares every CPU. ValueError with a
    sentence for a list that names a CPU not in ``online`` or leaves the students none."""
    online = frozenset(online)
    setting = (setting or "auto").strip().lower()
    if setting == "none":
        return None
    if setting == "auto":
        if len(online) < AUTO_SPLIT_FROM_CPUS:
            return None
        ordered = sorted(online)
        grading = frozenset(ordered[len(ordered) // 2:])
    else:
        grading = parse_cpus(setting)
        if not grading <= online:
            raise ValueError(f"SCALELAB_GRADING_CPUS={setting} names CPUs this machine does not have: "
                             f"{format_cpus(grading - online)} (it has {format_cpus(online)})")
    if grading == online:
        raise ValueError(f"SCALELAB_GRADING_CPUS={setting} leaves no CPU for the students' servers "
                         f"(the machine has {format_cpus(online)}); say 'none' to share them all")
    return grading, online - grading


@dataclass(frozen=True)
class ServerLimits:
    memory_bytes: int
    cpu_weight: int  # cgroup v2's scale, 1-10000, 100 the default: relative to the other students' servers
    tasks: int
    cpus: frozenset[int] | None = None  # the CPUs students' servers may use; None: every CPU

    @classmethod
    def from_environment(cls, environ: dict[str, str] | None = None) -> ServerLimits:
        """SCALELAB_STUDENT_MEMORY_MB (default: half the machine's memory, at least 2048), SCALELAB_STUDENT_CPU_WEIGHT
        (default 100), SCALELAB_STUDENT_TASKS (default 1024), and the CPUs left to them by SCALELAB_GRADING_CPUS
        (:func:`split_cpus`, default "auto")."""
        environ = os.environ if environ is None else environ
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        memory_mb = int(environ.get("SCALELAB_STUDENT_MEMORY_MB") or max(2048, total // 2 // 2**20))
        split = split_cpus(environ.get("SCALELAB_GRADING_CPUS", ""), os.sched_getaffinity(0))
        limits = cls(memory_bytes=memory_mb * 2**20, cpu_weight=int(environ.get("SCALELAB_STUDENT_CPU_WEIGHT") or 100),
                     tasks=int(environ.get("SCALELAB_STUDENT_TASKS") or 1024), cpus=split[1] if split else None)
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


def every_cgroup(name: str) -> list[Path]:
    """``name``'s cgroups, the v1 cpuset one included where there is one."""
    groups = server_cgroups(name)
    return groups + [V1_CPUSET / PARENT / name] if uses_v1() else groups


def _cpuset_v1(name: str, cpus: frozenset[int]) -> Path:
    """The v1 cpuset cgroup holding ``name``'s server to ``cpus``: a v1 cpuset takes tasks only once it has CPUs
    and memory nodes, its parent's included."""
    mems = (V1_CPUSET / "cpuset.mems").read_text().strip()
    group = V1_CPUSET / PARENT / name
    for level in (V1_CPUSET / PARENT, group):
        level.mkdir(exist_ok=True)
        (level / "cpuset.cpus").write_text(format_cpus(cpus))
        (level / "cpuset.mems").write_text(mems)
    return group


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
        if limits.cpus is not None:
            made.append(_cpuset_v1(name, limits.cpus))
    else:
        # Under the root cgroup, the one cgroup v2 lets hold processes beside controlled children.
        parent = CGROUP_ROOT / PARENT
        parent.mkdir(exist_ok=True)
        controllers = "+memory +cpu +pids" + (" +cpuset" if limits.cpus is not None else "")
        for level in (CGROUP_ROOT, parent):
            (level / "cgroup.subtree_control").write_text(controllers)
        group = parent / name
        group.mkdir(exist_ok=True)
        settings = {"memory.max": limits.memory_bytes, "cpu.weight": limits.cpu_weight, "pids.max": limits.tasks}
        if limits.cpus is not None:
            settings["cpuset.cpus"] = format_cpus(limits.cpus)
        for setting, value in settings.items():
            (group / setting).write_text(str(value))
        made.append(group)
    for group in made:
        (group / "cgroup.procs").write_text(str(pid))
    return made


def members(name: str) -> set[int]:
    found = set()
    for group in every_cgroup(name):
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
    for group in every_cgroup(name):
        for _attempt in range(50):
            try:
                group.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)


def main() -> int:
    """``make hub``'s check before it installs anything: SCALELAB_GRADING_CPUS in a sentence, or why it is wrong
    (exit 2)."""
    import sys

    try:
        split = split_cpus(os.environ.get("SCALELAB_GRADING_CPUS", ""), os.sched_getaffinity(0))
    except ValueError as wrong:
        print(f"hub.sh: {wrong}", file=sys.stderr)
        return 2
    if split is None:
        print(f"Graded runs share CPUs {format_cpus(os.sched_getaffinity(0))} with the students' servers; the grader "
              f"measures what others take from each run")
    else:
        print(f"Graded runs have CPUs {format_cpus(split[0])} to themselves; the students' servers have "
              f"{format_cpus(split[1])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
