"""Graded runs on CPUs of their own (grader/classroom/server_limits.py, grader/cgroups.py): how the CPUs are split,
and the cpusets that hold a student's server and a graded run to their part, whatever affinity they ask for. The
cgroups are made for real, as root, as CI runs; the Hub's side is in tests/test_hub_origins.py."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import textwrap

import pytest

from scalelab.grader import cgroups
from scalelab.grader.classroom import server_limits
from scalelab.grader.classroom.server_limits import ServerLimits, format_cpus, parse_cpus, split_cpus


@pytest.mark.parametrize(("text", "cpus"), [("0", {0}), ("0-3", {0, 1, 2, 3}), ("0-1,4,6-7", {0, 1, 4, 6, 7}),
                                            (" 2,3 \n", {2, 3})])
def test_a_cpu_list_reads_and_writes_as_the_kernel_writes_it(text, cpus):
    assert parse_cpus(text) == cpus
    assert parse_cpus(format_cpus(cpus)) == cpus
    assert format_cpus({0, 1, 2, 3, 5, 7, 8}) == "0-3,5,7-8"


@pytest.mark.parametrize("text", ["", "two", "1-", "3-1", "1;2", "-1"])
def test_what_is_not_a_cpu_list_is_refused(text):
    with pytest.raises(ValueError, match="not a CPU list"):
        parse_cpus(text)


def test_auto_keeps_the_upper_half_for_grading_only_where_the_machine_has_cores_to_spare():
    assert split_cpus("auto", {0, 1}) is None, "a track is calibrated on 2 cores: nothing to spare on 2"
    assert split_cpus("", {0, 1, 2}) is None
    assert split_cpus("auto", {0, 1, 2, 3}) == ({2, 3}, {0, 1})
    assert split_cpus("AUTO", range(6)) == ({3, 4, 5}, {0, 1, 2})
    assert split_cpus("auto", {4, 5, 6, 7, 9}) == ({6, 7, 9}, {4, 5})
    assert split_cpus("none", range(8)) is None


def test_a_list_gives_grading_those_cpus_and_the_students_the_rest_or_says_why_not():
    assert split_cpus("1", {0, 1}) == ({1}, {0})
    assert split_cpus("0,2", range(4)) == ({0, 2}, {1, 3})
    with pytest.raises(ValueError, match="leaves no CPU for the students' servers"):
        split_cpus("0-1", {0, 1})
    with pytest.raises(ValueError, match="names CPUs this machine does not have: 2-3"):
        split_cpus("1-3", {0, 1})


def test_the_students_servers_get_the_cpus_grading_does_not_keep():
    limits = ServerLimits.from_environment({"SCALELAB_GRADING_CPUS": format_cpus({max(os.sched_getaffinity(0))})})
    assert limits.cpus == os.sched_getaffinity(0) - {max(os.sched_getaffinity(0))}
    assert ServerLimits.from_environment({"SCALELAB_GRADING_CPUS": "none"}).cpus is None


def cpus_allowed(pid: int) -> set[int]:
    status = open(f"/proc/{pid}/status").read()
    return set(parse_cpus(status.split("Cpus_allowed_list:")[1].splitlines()[0]))


WIDEN_AND_SAY = "import os; os.sched_setaffinity(0, range(os.cpu_count())); print(sorted(os.sched_getaffinity(0)))"


@pytest.fixture
def two_cpus():
    if os.geteuid() != 0:
        pytest.fail("cgroups are root's to make: run these tests as root (CI does)")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.fail("these tests split the CPUs: they need 2 at least")
    return sorted(os.sched_getaffinity(0))[:2]


def test_a_students_server_stays_on_its_cpus_whatever_affinity_it_asks_for(two_cpus):
    students_cpu = two_cpus[0]
    name = f"scalelab-test-{secrets.token_hex(4)}"
    limits = ServerLimits(memory_bytes=2**30, cpu_weight=100, tasks=64, cpus=frozenset({students_cpu}))
    # A "server" that, once confined, asks for every CPU, then says what it has (a cpuset binds root too).
    server = subprocess.Popen([sys.executable, "-c", f"import sys; sys.stdin.readline(); {WIDEN_AND_SAY}"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        server_limits.confine(name, server.pid, limits)
        assert server.pid in server_limits.members(name)
        said, _ = server.communicate("go\n", timeout=60)
        assert said.strip() == f"[{students_cpu}]", said
    finally:
        server.kill()
        server_limits.release(name)
    assert not any(group.exists() for group in server_limits.every_cgroup(name)), "its cgroups are gone"


def test_a_graded_run_keeps_to_the_cpus_of_the_grader_that_started_it(two_cpus):
    """The Hub's service keeps to the grading CPUs; a run it starts cannot take the others."""
    grading_cpu = two_cpus[1]
    grader = textwrap.dedent(f"""
        import os, subprocess, sys
        from scalelab.grader import cgroups
        os.sched_setaffinity(0, {{{grading_cpu}}})
        groups = cgroups.SandboxCgroups("scalelab-test-run", 2**30, enabled=True)
        try:
            assert groups.cpuset is not None, "a cpuset for the run"
            run = subprocess.run([sys.executable, "-c", {WIDEN_AND_SAY!r}], preexec_fn=groups.join,
                                 capture_output=True, text=True)
            print(run.stdout.strip() or run.stderr)
        finally:
            groups.remove()
        print(all(not path.exists() for path in (groups.memory, groups.cpuset)))
        """)
    ran = subprocess.run([sys.executable, "-c", grader], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == [f"[{grading_cpu}]", "True"], ran.stdout


def test_a_graded_run_of_a_grader_on_every_cpu_gets_no_cpuset(two_cpus):
    if os.sched_getaffinity(0) != parse_cpus(open("/sys/devices/system/cpu/online").read()):
        pytest.fail("this test runs on every online CPU")
    groups = cgroups.SandboxCgroups("scalelab-test-run", 2**30, enabled=True)
    try:
        assert groups.memory is not None and groups.cpuset is None
    finally:
        groups.remove()
