"""How much CPU other work used during a run (grader/contention.py), and what the verdict makes of it
(grader/pipeline.py's decide, the command line's summary and exit code)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import needs_tensorflow
from scalelab.grader import commands, contention, launch, pipeline, spec, verify, witness
from scalelab.grader.verdict import new_verdict

# The Keras edition's (its track trains with Keras): skipped, with the reason, on the PyTorch edition.
needs_tensorflow()
TRACK = spec.load_track("fashion-mnist-test", Path(__file__).parent / "submissions" / "tracks.toml")
SPIN = "while True: pass"
MEASURED_S = 1.5


def spinners(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(count)]


def stop(processes) -> None:
    for process in processes:
        process.kill()
        process.wait()


def measure_while(run_pid: int, seconds: float = MEASURED_S) -> contention.CpuContention:
    meter = contention.ContentionMeter(root_pid=run_pid)
    meter.start()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        meter.sample()
        time.sleep(0.05)
    return meter.finish()


@pytest.fixture
def quiet_run():
    """A process that stands for the run: it uses no CPU itself."""
    run = subprocess.Popen(["sleep", "600"])
    yield run
    stop([run])


def test_other_work_spinning_on_every_core_is_a_high_share_and_an_idle_machine_a_low_one(quiet_run):
    cores = len(os.sched_getaffinity(0))
    busy = spinners(cores)
    try:
        time.sleep(0.2)  # every spinner started
        crowded = measure_while(quiet_run.pid)
    finally:
        stop(busy)
    idle = measure_while(quiet_run.pid)
    assert crowded.share > 0.6 and crowded.others_cpu_s > 0.6 * MEASURED_S * cores, crowded
    assert idle.share < 0.3, idle
    assert crowded.cpus == idle.cpus == cores
    assert crowded.capacity_cpu_s == pytest.approx(MEASURED_S * cores, rel=0.2)


def test_the_runs_own_processes_and_those_they_reaped_are_not_other_work():
    cores = len(os.sched_getaffinity(0))
    # A run whose children spin on every core, and which starts and reaps spinners of a second each meanwhile.
    script = (f"import subprocess, sys\n"
              f"spin = [subprocess.Popen([sys.executable, '-c', {SPIN!r}]) for _ in range({cores})]\n"
              f"while True:\n"
              f"    subprocess.run([sys.executable, '-c', 'import time\\nt = time.process_time()\\n"
              f"while time.process_time() - t < 1: pass'])\n")
    run = subprocess.Popen([sys.executable, "-c", script])
    try:
        time.sleep(0.3)
        measured = measure_while(run.pid, seconds=2.5)
    finally:
        children = psutil.Process(run.pid).children(recursive=True)
        stop([run])
        for child in children:
            child.kill()
        psutil.wait_procs(children, timeout=10)
    assert measured.share < 0.3, measured
    assert measured.own_cpu_s > 0.6 * 2.5 * cores, measured


# --- the verdict ------------------------------------------------------------------------------------------------

def run_result(*, timed_out: bool, wall_time_s: float, share: float, exit_code: int | None = 0,
               own_share: float | None = None) -> launch.RunResult:
    capacity = 2 * wall_time_s
    own = 1 - share if own_share is None else own_share  # by default the run used all the others left it
    busy = contention.CpuContention(others_cpu_s=share * capacity, own_cpu_s=own * capacity,
                                    capacity_cpu_s=capacity, share=share, cpus=2)
    return launch.RunResult(exit_code=None if timed_out else exit_code, wall_time_s=wall_time_s, timed_out=timed_out,
                            started_at="", finished_at="", rank_logs={}, launcher_log="", rank_tracebacks={},
                            truncated_logs=[], epochs_seen=3, survivors_killed=0, cpu_contention=busy.as_dict())


def decided(run: launch.RunResult, accuracy: float | None = 0.5) -> dict:
    verdict = new_verdict(np=2, cpu_contention=run.cpu_contention)
    model = verify.ModelCheck(accuracy, None, 4, trainable_parameters=1000)
    timeline = witness.TimelineEvidence(ranks_seen=[0, 1], allreduce_count=400, allreduced_tensors=4,
                                        active_deciles=10, span_s=30.0, events=2000)
    traffic = witness.TrafficEvidence(loopback_bytes=10**8, expected_bytes=10**8, steps=100, ratio=1.0)
    pipeline.decide(verdict, TRACK, run, model, timeline, traffic, Path("/nonexistent"))
    return verdict


def test_a_run_out_of_time_while_others_crowded_the_machine_is_not_graded_and_says_why():
    budget = TRACK.time_budget_s
    for run in (run_result(timed_out=True, wall_time_s=budget + TRACK.grace_s, share=0.41),
                run_result(timed_out=False, wall_time_s=budget + 1, share=0.41)):
        verdict = decided(run)
        assert verdict["verdict"] == "error" and verdict["contended"] is True, verdict
        [reason] = verdict["reasons"]
        assert reason.startswith("other work on the grading machine used 41 % of its CPU during your run")
        assert "not held against your submission" in reason and "graded again" in reason
        assert any(f"{budget:.0f} s time budget" in note for note in verdict["notes"])
        assert any("held-out accuracy 0.5000" in note for note in verdict["notes"])


def test_a_run_out_of_time_on_a_quiet_enough_machine_stays_a_timeout():
    below = contention.CONTENDED_SHARE - 0.05
    verdict = decided(run_result(timed_out=True, wall_time_s=TRACK.time_budget_s + TRACK.grace_s, share=below))
    assert verdict["verdict"] == "timeout" and verdict["contended"] is False
    assert "make training faster" in verdict["reasons"][0] and verdict["notes"] == []


def test_a_run_that_left_the_cpus_idle_was_not_crowded_out_and_its_timeout_stands():
    # Measured through Slurm on a slow CI machine: a run hung in an allreduce, others 21 % of the CPU (13 of 61
    # CPU-seconds; 15 % on a quiet one, where the run itself used 35 %). The CPUs idled half the time: others did
    # not keep the run from a CPU, its hang did.
    full = TRACK.time_budget_s + TRACK.grace_s
    hung = decided(run_result(timed_out=True, wall_time_s=full, share=0.21, own_share=0.35))
    assert hung["verdict"] == "timeout" and hung["contended"] is False, hung
    assert "make training faster" in hung["reasons"][0]
    crowded = decided(run_result(timed_out=True, wall_time_s=full, share=0.21, own_share=0.75))
    assert crowded["verdict"] == "error" and crowded["contended"] is True, crowded


def test_a_pass_or_a_fail_under_contention_stands_with_a_note():
    crowded = run_result(timed_out=False, wall_time_s=TRACK.time_budget_s / 2, share=0.5)
    passed = decided(crowded, accuracy=0.9)
    failed = decided(crowded, accuracy=0.5)
    assert passed["verdict"] == "pass" and failed["verdict"] == "fail"
    for verdict in (passed, failed):
        assert verdict["contended"] is False
        assert any(note.startswith("other work on the grading machine used 50 % of its CPU") for note in
                   verdict["notes"])


def test_the_command_line_prints_the_contention_and_exits_with_its_own_code(tmp_path, monkeypatch, capsys):
    submission = tmp_path / "assessment.py"
    submission.write_text("print('hello')\n")
    contended = decided(run_result(timed_out=True, wall_time_s=TRACK.time_budget_s + TRACK.grace_s, share=0.41))
    monkeypatch.setattr(pipeline, "assess", lambda *args, **kwargs: contended)
    code = commands.assess_command(argparse.Namespace(
        file=str(submission), track="fashion-mnist-test", track_file=str(Path(__file__).parent / "submissions" /
                                                                          "tracks.toml"),
        np=None, out=None, json=False, backend="local", allow_unsandboxed=False))
    printed = capsys.readouterr().out
    assert code == commands.EXIT_CONTENDED == 4
    assert "not graded: other work on the machine used too much of its CPU" in printed
    assert "machine      other work used 41 % of the CPU during the run" in printed
    assert "other work on the grading machine used 41 % of its CPU during your run" in printed
