"""Restart safety: kill -9 the server with one job running and three queued, start it again, lose nothing.

The running job is a submission that only sleeps (a real horovodrun, or torchrun on the PyTorch edition, in the
real sandbox); the queued ones are fast. After the restart the running job's first grader and ranks must be gone,
and the job graded again from scratch before the queued ones (its history and verdict saying why), then the queued
jobs graded. Then a clean stop (SIGTERM) with a job running must put that job back in the queue, at the front, with
its processes ended.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).parent / "submissions" / "service"))
from conftest import EDITION_HANG_TRACK  # noqa: E402
from jupyter_process import TEST_TRACKS, JupyterServer  # noqa: E402

from scalelab.grader import spec  # noqa: E402
from scalelab.grader.queue import AssessQueue, sqlite_url  # noqa: E402

SERVICE_TESTS = Path(__file__).parent / "submissions" / "service"
QUEUED_STUDENTS = ["queued1", "queued2", "queued3"]
TOKENS = {f"{name}-token": name for name in ["sleeper", *QUEUED_STUDENTS]}
# The file the installed edition's students submit (assessment.py, or assessment_pytorch.py on the PyTorch edition).
SUBMITTED = spec.load_track(EDITION_HANG_TRACK, TEST_TRACKS).submission_file
LAUNCHERS = ("horovodrun", "torchrun")

pytestmark = pytest.mark.slow


def _course(root: Path) -> None:
    for student in TOKENS.values():
        folder = root / student / "assessment"
        folder.mkdir(parents=True)
        submission = "sleeps.py" if student == "sleeper" else "syntax_error_fast.py"
        shutil.copy(SERVICE_TESTS / submission, folder / SUBMITTED)


def _server(root: Path, home: Path) -> JupyterServer:
    return JupyterServer(root, home, user_tokens=TOKENS, service={
        "slots": 1, "track": EDITION_HANG_TRACK, "tracks_file": str(TEST_TRACKS),
        "submission_path": f"{{student}}/assessment/{SUBMITTED}", "poll_interval_s": 0.5,
        "min_seconds_between_submissions": 0})  # the sleeper submits twice, however fast the restart went


def _wait_until_running_with_ranks(server: JupyterServer, job_id: int, timeout_s: float = 90) -> psutil.Process:
    """The job's grader process, once its launcher runs under it (so the kill lands mid-run)."""
    queue = AssessQueue(sqlite_url(server.database))
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            job = queue.get(job_id)
            if job["state"] == "running" and job["grader_pid"]:
                grader = psutil.Process(job["grader_pid"])
                commands = [" ".join(child.cmdline()) for child in grader.children(recursive=True)]
                if any(launcher in command for command in commands for launcher in LAUNCHERS):
                    return grader
            time.sleep(0.3)
    finally:
        queue.close()
    raise AssertionError(f"job {job_id} never reached its launcher:\n{server.log_tail()}")


def test_kill_9_mid_queue_then_restart_loses_nothing_and_passes_nothing(tmp_path):
    root, home = tmp_path / "course", tmp_path / "home"
    _course(root)
    first = _server(root, home).start()
    second = None
    try:
        sleeper = first.api("POST", "assessments", token="sleeper-token").json()["job"]["id"]
        grader = _wait_until_running_with_ranks(first, sleeper)
        queued = {student: first.api("POST", "assessments", token=f"{student}-token").json()["job"]
                  for student in QUEUED_STUDENTS}
        assert all(job["state"] == "queued" for job in queued.values())
        assert [job["position"] for job in queued.values()] == [1, 2, 3]
        family = [grader, *grader.children(recursive=True)]

        first.kill_hard()
        assert grader.is_running(), "the grader runs in its own session and outlives the killed server"

        second = _server(root, home)
        second.port, second.url = first.port, first.url  # same address, as a restarted service would have
        second.start()
        gone, alive = psutil.wait_procs(family, timeout=15)
        assert not alive, f"processes of the stopped run survived: {alive}"
        rerun = second.wait_for_job(sleeper, "sleeper-token", timeout_s=180)
        finished = {student: second.wait_for_job(job["id"], f"{student}-token", timeout_s=180)
                    for student, job in queued.items()}

        # Graded again from scratch, to the end of the track's budget (it only sleeps): a verdict, not a pass.
        assert rerun["state"] == "done" and rerun["verdict"]["verdict"] == "timeout", rerun
        [again_because] = rerun["reruns"]
        assert "stopped while this assessment was running" in again_because["reason"]
        assert any(note.startswith("Re-run on ") for note in rerun["verdict"]["notes"])
        for student, job in finished.items():
            assert job["state"] == "done", job
            assert job["verdict"]["verdict"] == "fail"
            assert job["started_at"] > rerun["started_at"], "the re-run job goes first: it had been waiting longest"
        history = second.api("GET", "assessments", token="sleeper-token").json()["assessments"]
        assert [entry["state"] for entry in history] == ["done"]

        # A clean stop with a job running: the job goes back to the front of the queue, its processes end.
        again = second.api("POST", "assessments", token="sleeper-token").json()["job"]["id"]
        grader = _wait_until_running_with_ranks(second, again)
        family = [grader, *grader.children(recursive=True)]
        second.stop()
        _gone, alive = psutil.wait_procs(family, timeout=15)
        assert not alive, f"processes survived a clean stop: {alive}"
        queue = AssessQueue(sqlite_url(second.database))
        stored = {job["id"]: job for job in queue.all_jobs()}
        queue.close()
        assert stored[again]["state"] == "queued", stored[again]
        assert "was stopped while this assessment was running" in stored[again]["reruns"][0]["reason"]
        assert not any(job["verdict"] == "pass" for job in stored.values())
        assert len(stored) == 5
    finally:
        first.stop()
        if second is not None:
            second.stop()
