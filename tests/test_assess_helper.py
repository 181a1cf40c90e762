"""Root's helper that grades the Hub service's jobs (scalelab.grader.assess_helper), called as sudo calls it: as root
with $SUDO_UID naming the caller. It acts for the caller only within the caller's own rights, and a caller that
goes away stops its grading with nothing copied back. The whole path through the Hub is tests/test_hub_service.py.
As root, as CI runs."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from conftest import EDITION_TEST_TRACK, PROJECT_ROOT
from scalelab.grader import assess_helper
from scalelab.grader.sandbox import SANDBOX_UID_RANGE

CALLER = pwd.getpwnam("nobody")
SUBMISSIONS = PROJECT_ROOT / "tests" / "submissions"
TRACKS = SUBMISSIONS / "tracks.toml"
SOLUTION = PROJECT_ROOT / "assessment" / "solution" / "assessment.py"


@pytest.fixture
def scratch():
    """A folder every account may pass through (the caller reads what it names as itself), removed afterwards."""
    if os.geteuid() != 0:
        pytest.fail("the helper runs as root: run these tests as root (CI does)")
    folder = Path(tempfile.mkdtemp(prefix="scalelab-test-helper-", dir="/tmp"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def callers_job(scratch: Path, submission: Path | None = SUBMISSIONS / "syntax_error.py") -> Path:
    job = scratch / "job"
    job.mkdir(mode=0o700)
    if submission is not None:
        shutil.copyfile(submission, job / "assessment.py")
    for path in (job, *job.iterdir()):
        os.chown(path, CALLER.pw_uid, CALLER.pw_gid)
    return job


def start_helper(*arguments: str) -> subprocess.Popen:
    """The helper, its standard input held open as the service holds it (its end stops the grading)."""
    messages = tempfile.TemporaryFile()
    process = subprocess.Popen([sys.executable, "-I", "-m", "scalelab.grader.assess_helper", *arguments],
                               stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=messages,
                               env={**os.environ, "SUDO_UID": str(CALLER.pw_uid)})
    process.messages = messages
    return process


def said(process: subprocess.Popen) -> str:
    process.messages.seek(0)
    return process.messages.read().decode()


def helper(*arguments: str) -> tuple[int, str]:
    process = start_helper(*arguments)
    code = process.wait(timeout=300)
    process.stdin.close()
    return code, said(process)


def test_a_job_of_the_callers_is_graded_as_root_and_the_results_are_the_callers(scratch):
    job = callers_job(scratch)
    shutil.copyfile(TRACKS, scratch / "tracks.toml")
    code, err = helper("--job", str(job), "--track", EDITION_TEST_TRACK, "--track-file", str(scratch / "tracks.toml"))
    assert code == 1, err
    verdict = job / "grader" / "verdict.json"
    assert verdict.stat().st_uid == CALLER.pw_uid and "is not valid Python" in verdict.read_text()
    assert (job / "grader").stat().st_uid == CALLER.pw_uid


@pytest.mark.parametrize("what", ["someone else's", "open to others", "a link"])
def test_a_job_directory_that_is_not_the_callers_alone_is_refused(scratch, what):
    job = callers_job(scratch)
    if what == "someone else's":
        os.chown(job, 0, 0)
    elif what == "open to others":
        job.chmod(0o755)
    else:
        (scratch / "link").symlink_to(job)
        job = scratch / "link"
    code, err = helper("--job", str(job), "--track", EDITION_TEST_TRACK)
    assert code == assess_helper.EXIT_BAD_ARGUMENTS, err
    assert not (scratch / "job" / "grader").exists()


def test_a_submission_that_links_to_the_solution_is_refused_unread(scratch):
    job = callers_job(scratch, submission=None)
    (job / "assessment.py").symlink_to(SOLUTION)
    code, err = helper("--job", str(job), "--track", EDITION_TEST_TRACK)
    assert code == assess_helper.EXIT_BAD_ARGUMENTS and "symbolic link" in err, err
    assert not (job / "grader").exists()


@pytest.mark.parametrize("argument", ["--track-file", "--data"])
def test_root_reads_no_track_file_or_data_the_caller_could_not_read(scratch, argument):
    job = callers_job(scratch)
    secret_dir = scratch / "roots"
    secret_dir.mkdir(mode=0o700)
    shutil.copyfile(TRACKS, secret_dir / "tracks.toml")
    named = {"--track-file": str(secret_dir / "tracks.toml"), "--data": f"SCALELAB_FASHION_MNIST_DIR={secret_dir}"}
    code, err = helper("--job", str(job), "--track", EDITION_TEST_TRACK, argument, named[argument])
    assert code == assess_helper.EXIT_BAD_ARGUMENTS and "may read" in err, err
    assert not (job / "grader").exists()


def test_a_caller_that_closes_the_helpers_input_stops_the_run_and_gets_nothing_back(scratch):
    job = callers_job(scratch, SUBMISSIONS / "service" / "sleeps_then_fails.py")
    shutil.copyfile(TRACKS, scratch / "tracks.toml")
    process = start_helper("--job", str(job), "--track", EDITION_TEST_TRACK, "--track-file",
                           str(scratch / "tracks.toml"))
    deadline = time.monotonic() + 120
    while not sandboxed_processes():  # the run has started, as a throw-away uid
        assert process.poll() is None and time.monotonic() < deadline, said(process)
        time.sleep(0.2)
    process.stdin.close()
    assert process.wait(timeout=assess_helper.STOP_GRACE_S + 10) == assess_helper.EXIT_STOPPED
    assert "stopped by its caller" in said(process)
    assert not (job / "grader" / "verdict.json").exists()
    psutil.wait_procs(sandboxed_processes(), timeout=5)
    assert not sandboxed_processes()


def sandboxed_processes() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real in SANDBOX_UID_RANGE]
