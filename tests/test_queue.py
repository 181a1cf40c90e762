"""The Assess service's persistent queue (grader/queue.py) on a real SQLite file, and its workers' recovery."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from scalelab.grader.queue import (DONE, INTERRUPTED, QUEUED, RUNNING, AssessQueue, GraderSettings, GradingWorkers,
                                   QueueFull, sqlite_url)

FAST_SUBMISSION = Path(__file__).parent / "submissions" / "service" / "syntax_error_fast.py"
TEST_TRACKS = Path(__file__).parent / "submissions" / "tracks.toml"


@pytest.fixture
def database(tmp_path) -> str:
    return sqlite_url(tmp_path / "queue.db")


@pytest.fixture
def queue(database):
    opened = AssessQueue(database)
    yield opened
    opened.close()


def submit(queue: AssessQueue, student: str, job_dir: Path, max_queued: int = 100):
    job_dir.mkdir(parents=True, exist_ok=True)
    return queue.submit(student=student, track="fashion-mnist-test", backend="local", job_dir=job_dir,
                        submission_path=f"/course/{student}/assessment.py", submission_sha256="0" * 64,
                        max_queued=max_queued)


def dead_pid() -> int:
    finished = subprocess.Popen(["true"])
    finished.wait()
    return finished.pid


def test_a_second_submit_while_queued_or_running_returns_the_same_job(queue, tmp_path):
    first, created = submit(queue, "ana", tmp_path / "a1")
    assert created and first["state"] == QUEUED
    again, created = submit(queue, "ana", tmp_path / "a2")
    assert not created and again["id"] == first["id"]
    queue.claim_next("host", os.getpid())
    again, created = submit(queue, "ana", tmp_path / "a3")
    assert not created and again["id"] == first["id"] and again["state"] == RUNNING
    queue.finish(first["id"], {"verdict": "fail", "reasons": []})
    after, created = submit(queue, "ana", tmp_path / "a4")
    assert created and after["id"] != first["id"]


def test_jobs_are_claimed_first_in_first_out_with_positions(queue, tmp_path):
    ids = [submit(queue, student, tmp_path / student)[0]["id"] for student in ("c", "a", "b")]
    assert [queue.position(job_id) for job_id in ids] == [1, 2, 3]
    claimed = [queue.claim_next("host", os.getpid())["id"] for _ in ids]
    assert claimed == ids
    assert queue.claim_next("host", os.getpid()) is None
    assert all(queue.position(job_id) is None for job_id in ids)
    assert queue.counts() == {QUEUED: 0, RUNNING: 3, DONE: 0, INTERRUPTED: 0}


def test_a_full_queue_refuses_new_submissions(queue, tmp_path):
    submit(queue, "a", tmp_path / "a", max_queued=2)
    submit(queue, "b", tmp_path / "b", max_queued=2)
    with pytest.raises(QueueFull):
        submit(queue, "c", tmp_path / "c", max_queued=2)
    assert submit(queue, "a", tmp_path / "a2", max_queued=2)[1] is False  # a's own job is still returned


def test_finish_and_interrupt_apply_only_to_running_jobs(queue, tmp_path):
    job, _ = submit(queue, "a", tmp_path / "a")
    assert not queue.finish(job["id"], {"verdict": "pass"})  # not running yet
    queue.claim_next("host", os.getpid())
    assert queue.interrupt(job["id"], "stopped")
    assert not queue.finish(job["id"], {"verdict": "pass"})  # a late verdict cannot overwrite the interruption
    stored = queue.get(job["id"])
    assert stored["state"] == INTERRUPTED and stored["verdict"] is None and stored["reason"] == "stopped"


def _submit_from_another_process(database: str, student: str, job_dir: str, results) -> None:
    queue = AssessQueue(database)
    job, created = submit(queue, student, Path(job_dir))
    results.put((student, job["id"], created))
    queue.close()


def test_simultaneous_submits_from_separate_processes_keep_one_job_per_student(database, tmp_path):
    AssessQueue(database).close()  # the schema exists before the race
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    students = ["same"] * 6 + [f"other{number}" for number in range(6)]
    processes = [context.Process(target=_submit_from_another_process,
                                 args=(database, student, str(tmp_path / f"dir{index}"), results))
                 for index, student in enumerate(students)]
    for process in processes:
        process.start()
    outcomes = [results.get(timeout=120) for _ in processes]
    for process in processes:
        process.join(timeout=60)
    same = [outcome for outcome in outcomes if outcome[0] == "same"]
    assert sum(created for _, _, created in same) == 1 and len({job_id for _, job_id, _ in same}) == 1
    others = [outcome for outcome in outcomes if outcome[0] != "same"]
    assert all(created for _, _, created in others) and len({job_id for _, job_id, _ in others}) == 6
    queue = AssessQueue(database)
    assert len(queue.all_jobs()) == 7
    queue.close()


def workers_for(queue: AssessQueue, slots: int = 1) -> GradingWorkers:
    return GradingWorkers(queue, GraderSettings(track="fashion-mnist-test", track_file=str(TEST_TRACKS),
                                                poll_interval_s=0.2), slots=slots)


def test_recovery_marks_the_running_job_of_a_dead_server_interrupted_and_leaves_queued_jobs(queue, tmp_path):
    running, _ = submit(queue, "a", tmp_path / "a")
    queued, _ = submit(queue, "b", tmp_path / "b")
    queue.claim_next(socket.gethostname(), dead_pid())
    settled = workers_for(queue).recover()
    assert [job["id"] for job in settled] == [running["id"]]
    stored = queue.get(running["id"])
    assert stored["state"] == INTERRUPTED and stored["verdict"] is None
    assert "Interrupted: the Jupyter server stopped" in stored["reason"] and "click Assess" in stored["reason"]
    assert queue.get(queued["id"])["state"] == QUEUED


def test_recovery_kills_a_grader_the_dead_server_left_running(queue, tmp_path):
    job, _ = submit(queue, "a", tmp_path / "a")
    queue.claim_next(socket.gethostname(), dead_pid())
    grader = subprocess.Popen(["sleep", "120"], start_new_session=True)
    queue.set_grader_process(job["id"], grader.pid, psutil.Process(grader.pid).create_time())
    workers_for(queue).recover()
    assert grader.wait(timeout=15) is not None
    assert queue.get(job["id"])["state"] == INTERRUPTED


def test_recovery_keeps_a_verdict_the_grader_had_written_before_the_server_died(queue, tmp_path):
    job, _ = submit(queue, "a", tmp_path / "a")
    queue.claim_next(socket.gethostname(), dead_pid())
    (tmp_path / "a" / "grader").mkdir()
    (tmp_path / "a" / "grader" / "verdict.json").write_text(json.dumps(
        {"verdict": "fail", "reasons": ["below target"], "finished_at": "2026-01-01T00:00:00+00:00"}))
    workers_for(queue).recover()
    stored = queue.get(job["id"])
    assert stored["state"] == DONE and stored["verdict"]["verdict"] == "fail"
    assert any("server restarted" in note for note in stored["verdict"]["notes"])


def test_recovery_leaves_the_jobs_of_a_live_server_alone(queue, tmp_path):
    other_server = subprocess.Popen(["sleep", "120"])
    try:
        time.sleep(0.05)
        job, _ = submit(queue, "a", tmp_path / "a")
        queue.claim_next(socket.gethostname(), other_server.pid)
        assert workers_for(queue).recover() == []
        assert queue.get(job["id"])["state"] == RUNNING
    finally:
        other_server.kill()
        other_server.wait()


def test_workers_grade_with_the_real_grader_and_store_its_verdict(queue, tmp_path, monkeypatch):
    monkeypatch.setenv("SCALELAB_HOME", str(tmp_path / "home"))
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "assessment.py").write_bytes(FAST_SUBMISSION.read_bytes())
    job, _ = submit(queue, "ana", tmp_path / "job")
    workers = workers_for(queue)
    assert workers.grader_argv(job)[1:4] == ["assess", str(tmp_path / "job" / "assessment.py"), "--track"]
    workers.start()
    try:
        deadline = time.monotonic() + 60
        while queue.get(job["id"])["state"] != DONE and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        workers.stop()
    stored = queue.get(job["id"])
    assert stored["state"] == DONE, stored
    assert stored["verdict"]["verdict"] == "fail" and stored["verdict"]["student"] == "ana"
    assert stored["progress"]["state"] == "done"
    assert (tmp_path / "job" / "grader" / "verdict.json").exists()
