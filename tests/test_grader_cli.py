"""`scalelab assess` exit codes: 2 for bad input (one line on stderr), 3 with an error verdict when the grader
itself fails, 1 for a syntax error (the submission's problem), 143 after SIGTERM once its run is stopped and its
job directory removed."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import (EDITION_HANG_SUBMISSION, EDITION_HANG_TRACK, EDITION_HONEST_SUBMISSION, EDITION_TEST_TRACK,
                      HAS_TENSORFLOW, leftover_processes, subprocess_env)

SCALELAB = [sys.executable, "-m", "scalelab.cli"]
SUBMISSIONS = Path(__file__).parent / "submissions"
TEST_TRACKS = SUBMISSIONS / "tracks.toml"
HONEST = SUBMISSIONS / EDITION_HONEST_SUBMISSION


def scalelab(*args, env=None, timeout=300):
    return subprocess.run([*SCALELAB, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=env or subprocess_env())


def bad_inputs(tmp_path):
    empty = tmp_path / "empty.py"
    empty.write_text("")
    blank = tmp_path / "blank.py"
    blank.write_text("\n   \n")
    binary = tmp_path / "binary.py"
    binary.write_bytes(Path(sys.executable).resolve().read_bytes()[:4096])
    large = tmp_path / "large.py"
    large.write_text("# padding\n" * 200_000)
    text = tmp_path / "assessment.txt"
    text.write_text("print('hello')\n")
    return {"missing": (tmp_path / "missing.py", "does not exist"), "directory": (tmp_path, "is a directory"),
            "empty": (empty, "is empty"), "blank": (blank, "only white space"),
            "binary": (binary, "binary"), "too large": (large, "over the"), "not .py": (text, "not a Python file")}


@pytest.mark.parametrize("case", ["missing", "directory", "empty", "blank", "binary", "too large", "not .py"])
def test_bad_input_exits_2_with_one_line_on_stderr(tmp_path, case):
    path, message = bad_inputs(tmp_path)[case]
    done = scalelab("assess", path, "--json")
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and message in done.stderr


def test_unknown_track_exits_2_naming_the_known_tracks(tmp_path):
    submission = tmp_path / "assessment.py"
    submission.write_text("print('hi')\n")
    done = scalelab("assess", submission, "--track", "gpu-please")
    known = "cifar10, cifar10-cpu, cifar10-ddp, cifar10-ddp-cpu, cifar10-horovod-torch-cpu, fashion-mnist-cpu"
    assert done.returncode == 2 and f"known tracks: {known}" in done.stderr


def test_syntax_error_is_a_failing_submission_with_the_line_in_the_reasons(tmp_path):
    out = tmp_path / "out"
    done = scalelab("assess", SUBMISSIONS / "syntax_error.py", "--json", "--out", out,
                    "--track", EDITION_TEST_TRACK, "--track-file", TEST_TRACKS,
                    env=subprocess_env(SCALELAB_HOME=str(tmp_path / "home")))
    assert done.returncode == 1, done.stderr
    verdict = json.loads(done.stdout)
    assert verdict["verdict"] == "fail"
    assert "SyntaxError at line 4" in verdict["reasons"][0]
    assert json.loads((out / "verdict.json").read_text())["submission_sha256"] == verdict["submission_sha256"]


def test_grader_failure_still_writes_an_error_verdict_and_exits_3(tmp_path):
    # SCALELAB_HOME is a file, so the grader cannot make its job directory: its own failure, not the student's.
    home = tmp_path / "home"
    home.write_text("not a directory")
    out = tmp_path / "out"
    done = scalelab("assess", HONEST, "--json", "--out", out, "--track", EDITION_TEST_TRACK,
                    "--track-file", TEST_TRACKS, env=subprocess_env(SCALELAB_HOME=str(home)))
    assert done.returncode == 3, done.stderr
    printed = json.loads(done.stdout)
    written = json.loads((out / "verdict.json").read_text())
    assert printed["verdict"] == written["verdict"] == "error"
    assert written["reasons"][0].startswith("internal error in the grader")
    for key in ("verdict", "reasons", "heldout_accuracy", "target_accuracy", "wall_time_s", "time_budget_s", "np",
                "ranks_seen", "allreduce_count", "track", "submission_sha256", "started_at", "finished_at",
                "logs_dir", "environment"):
        assert key in written, key
    assert written["environment"]["tensorflow"] == ("2.15.1" if HAS_TENSORFLOW else None)
    assert written["environment"]["torch"].startswith("2.13.0")  # both editions have PyTorch
    assert (out / "grader-error.log").read_text().startswith("Traceback")
    assert json.loads((out / "progress.json").read_text())["state"] == "done"


def test_missing_sandbox_refuses_unless_unsandboxed_is_allowed(tmp_path):
    # A PATH without bwrap: the grader must refuse (exit 3, error verdict that says how to proceed).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    env = subprocess_env(SCALELAB_HOME=str(tmp_path / "home"))
    env["PATH"] = f"{Path(sys.executable).parent}:{bin_dir}"
    out = tmp_path / "out"
    done = scalelab("assess", HONEST, "--json", "--out", out, "--track", EDITION_TEST_TRACK,
                    "--track-file", TEST_TRACKS, env=env)
    assert done.returncode == 3
    verdict = json.loads(done.stdout)
    assert "bubblewrap (bwrap) is not installed" in verdict["reasons"][0]
    assert "--allow-unsandboxed" in verdict["reasons"][0]


def test_gradebook_opens_when_the_venv_is_not_on_path(tmp_path, monkeypatch):
    # nbgrader migrates its gradebook with the `alembic` command; `make` and cron jobs do not activate the venv.
    from scalelab.grader import grading
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    gradebook = grading.NbgraderGradebook(tmp_path / "gradebook.db")
    assert (tmp_path / "gradebook.db").is_file()
    gradebook.close()


def is_rank(process: psutil.Process) -> bool:
    # horovodrun starts each rank as `python assessment.py`, torchrun as `python -u assessment.py`
    return process.cmdline()[1:] in (["assessment.py"], ["-u", "assessment.py"])


def still_running(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those not ended yet (a zombie has ended: only its parent has not collected it)."""
    running = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                running.append(process)
        except psutil.Error:
            pass
    return running


def run_processes_of(grader: subprocess.Popen, jobs_root: Path, timeout_s: float = 240) -> list[psutil.Process]:
    """Once the run's ranks are up (the job directory exists, both ranks started): everything the grader started."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert grader.poll() is None, grader.communicate()
        try:
            family = psutil.Process(grader.pid).children(recursive=True)
            ranks = [p for p in family if is_rank(p)]
        except psutil.Error:
            family, ranks = [], []
        if jobs_root.is_dir() and any(jobs_root.iterdir()) and len(ranks) >= 2:
            return family
        time.sleep(0.5)
    raise AssertionError(f"the run did not start within {timeout_s} s")


@pytest.mark.slow
def test_sigterm_stops_the_run_and_removes_its_job_directory(tmp_path):
    # The Assess service stops a grader with SIGTERM (server stop, recovery after a crash): the grader's own
    # clean-up must still run, or the run goes on unwatched and its job directory (up to 200 MiB) stays.
    home = tmp_path / "home"
    grader = subprocess.Popen([*SCALELAB, "assess", str(SUBMISSIONS / EDITION_HANG_SUBMISSION), "--json",
                               "--out", str(tmp_path / "out"), "--track", EDITION_HANG_TRACK,
                               "--track-file", str(TEST_TRACKS)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=subprocess_env(SCALELAB_HOME=str(home)))
    family = []
    try:
        family = run_processes_of(grader, home / "jobs")
        rank_uids = {p.uids().real for p in family if is_rank(p)}
        grader.send_signal(signal.SIGTERM)
        _stdout, stderr = grader.communicate(timeout=30)
        assert list((home / "jobs").iterdir()) == []
        assert still_running(family) == []
        for uid in [*(rank_uids - {os.getuid()}), None]:  # the sandbox's own uid, where the grader runs as root
            deadline = time.monotonic() + 10  # dead processes (zombies) may wait a moment for init to collect them
            while leftover_processes(str(home), uid) and time.monotonic() < deadline:
                time.sleep(0.5)
            assert leftover_processes(str(home), uid) == []
        assert grader.returncode == 128 + signal.SIGTERM, stderr
        assert "stopped by SIGTERM" in stderr
    finally:
        for process in [psutil.Process(grader.pid), *family] if grader.poll() is None else family:
            try:
                process.kill()
            except psutil.Error:
                pass
