"""The Assess service's persistent queue (grader/queue.py) on a real SQLite file, and its workers
(grader/workers.py): grading, recovery and retention."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from sqlalchemy import update

from conftest import EDITION_TEST_TRACK, keras_only
from scalelab.grader import panel
from scalelab.grader.contention import CONTENDED_SHARE
from scalelab.grader.queue import (DONE, INTERRUPTED, QUEUED, RERUN_MACHINE_BUSY, RUNNING, AssessJob, AssessQueue,
                                   QueueFull, TooSoon, sqlite_url)
from scalelab.grader.workers import GraderSettings, GradingWorkers, JobRetention

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


def submit(queue: AssessQueue, student: str, job_dir: Path, max_queued: int = 100, track: str = EDITION_TEST_TRACK):
    job_dir.mkdir(parents=True, exist_ok=True)
    return queue.submit(student=student, track=track, backend="local", job_dir=job_dir,
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
    return GradingWorkers(queue, GraderSettings(track=EDITION_TEST_TRACK, track_file=str(TEST_TRACKS),
                                                poll_interval_s=0.2), slots=slots)


def mark_running(queue: AssessQueue, job_id: int, server_pid: int) -> None:
    with queue.sessions.begin() as session:
        session.execute(update(AssessJob).where(AssessJob.id == job_id).values(
            state=RUNNING, started_at=time.time(), worker_host=socket.gethostname(), worker_pid=server_pid))


def test_recovery_requeues_the_running_job_of_a_dead_server_at_the_front(queue, tmp_path):
    """Graded again from scratch before the jobs that were already waiting, with the reason in its reruns."""
    waiting, _ = submit(queue, "a", tmp_path / "a")
    running, _ = submit(queue, "b", tmp_path / "b")
    mark_running(queue, running["id"], dead_pid())
    settled = workers_for(queue).recover()
    assert [job["id"] for job in settled] == [running["id"]]
    stored = queue.get(running["id"])
    assert stored["state"] == QUEUED and stored["verdict"] is None and stored["started_at"] is None
    [rerun] = stored["reruns"]
    assert "the Jupyter server stopped while this assessment was running" in rerun["reason"]
    assert "graded again from scratch" in rerun["reason"]
    assert [queue.position(running["id"]), queue.position(waiting["id"])] == [1, 2]
    assert "queued again (the grader stopped while it ran" in panel.status_text({**stored, "position": 1})
    assert queue.claim_next("host", os.getpid())["id"] == running["id"]
    assert queue.get(waiting["id"])["state"] == QUEUED


def test_a_job_whose_server_keeps_stopping_ends_interrupted_after_its_reruns(queue, tmp_path):
    job, _ = submit(queue, "a", tmp_path / "a")
    workers = workers_for(queue)
    for rerun in range(workers.max_reruns):
        mark_running(queue, job["id"], dead_pid())
        workers.recover()
        assert queue.get(job["id"])["state"] == QUEUED and len(queue.get(job["id"])["reruns"]) == rerun + 1
    mark_running(queue, job["id"], dead_pid())
    workers.recover()
    stored = queue.get(job["id"])
    assert stored["state"] == INTERRUPTED and stored["verdict"] is None
    assert "not re-run once more" in stored["reason"] and "click Assess" in stored["reason"]


def test_recovery_kills_a_grader_the_dead_server_left_running(queue, tmp_path):
    job, _ = submit(queue, "a", tmp_path / "a")
    queue.claim_next(socket.gethostname(), dead_pid())
    grader = subprocess.Popen(["sleep", "120"], start_new_session=True)
    queue.set_grader_process(job["id"], grader.pid, psutil.Process(grader.pid).create_time())
    workers_for(queue).recover()
    assert grader.wait(timeout=15) is not None
    assert queue.get(job["id"])["state"] == QUEUED and queue.get(job["id"])["grader_pid"] is None


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


def test_recovery_settles_a_job_claimed_by_an_earlier_server_with_this_servers_pid(queue, tmp_path):
    """In a container the server is pid 1 at every start: the pid alone does not make a job this server's."""
    earlier, _ = submit(queue, "a", tmp_path / "a")
    queue.claim_next(socket.gethostname(), os.getpid())
    before_this_process = psutil.Process().create_time() - 60
    with queue.sessions.begin() as session:
        session.execute(update(AssessJob).where(AssessJob.id == earlier["id"]).values(started_at=before_this_process))
    own, _ = submit(queue, "b", tmp_path / "b")
    queue.claim_next(socket.gethostname(), os.getpid())  # claimed by this very process: left alone
    settled = workers_for(queue).recover()
    assert [job["id"] for job in settled] == [earlier["id"]]
    assert queue.get(earlier["id"])["state"] == QUEUED and queue.get(own["id"])["state"] == RUNNING


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


def grade_until_done(workers: GradingWorkers, queue: AssessQueue, job_id: int, timeout_s: float = 60) -> None:
    """Run the workers until the job is done (or the timeout), then stop them (joined: their tidying is done too)."""
    workers.start()
    try:
        deadline = time.monotonic() + timeout_s
        while queue.get(job_id)["state"] != DONE and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        workers.stop()


def test_workers_grade_with_the_real_grader_and_store_its_verdict(queue, tmp_path, monkeypatch):
    monkeypatch.setenv("SCALELAB_HOME", str(tmp_path / "home"))
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "assessment.py").write_bytes(FAST_SUBMISSION.read_bytes())
    job, _ = submit(queue, "ana", tmp_path / "job")
    workers = workers_for(queue)
    assert workers.grader_argv(job)[1:4] == ["assess", str(tmp_path / "job" / "assessment.py"), "--track"]
    grade_until_done(workers, queue, job["id"])
    stored = queue.get(job["id"])
    assert stored["state"] == DONE, stored
    assert stored["verdict"]["verdict"] == "fail" and stored["verdict"]["student"] == "ana"
    assert stored["progress"]["state"] == "done"
    assert (tmp_path / "job" / "grader" / "verdict.json").exists()


def test_a_new_sqlite_databases_directory_is_private_to_the_server_account(tmp_path):
    opened = AssessQueue(sqlite_url(tmp_path / "state" / "queue.db"))
    opened.close()
    assert stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o700  # every student's verdicts


def test_an_id_beyond_the_databases_integer_range_is_no_job(queue, tmp_path):
    job, _ = submit(queue, "a", tmp_path / "a")
    for job_id in (99999999999999999999, 2**63, 2**31, 0, -1):
        assert queue.get(job_id) is None and queue.position(job_id) is None
    assert queue.get(job["id"])["student"] == "a"


def test_a_new_submit_sooner_than_the_minimum_interval_is_refused_with_the_seconds_left(queue, tmp_path):
    first, _ = submit(queue, "ana", tmp_path / "a1")
    # While the job is active a click still shows it: the interval does not apply.
    again, created = queue.submit(student="ana", track="t", backend="local", job_dir=tmp_path / "a2",
                                  submission_path="x", submission_sha256="0" * 64, max_queued=10,
                                  min_seconds_between_submissions=3600)
    assert not created and again["id"] == first["id"]
    queue.claim_next("host", os.getpid())
    queue.finish(first["id"], {"verdict": "fail"})
    with pytest.raises(TooSoon) as too_soon:
        queue.submit(student="ana", track="t", backend="local", job_dir=tmp_path / "a3", submission_path="x",
                     submission_sha256="0" * 64, max_queued=10, min_seconds_between_submissions=3600)
    assert 3500 < too_soon.value.wait_s <= 3600
    assert [job["id"] for job in queue.all_jobs()] == [first["id"]]
    _other, created = queue.submit(student="ben", track="t", backend="local", job_dir=tmp_path / "b1",
                                  submission_path="x", submission_sha256="0" * 64, max_queued=10,
                                  min_seconds_between_submissions=3600)
    assert created, "the interval is per student"


FAKE_GRADER = '''
import json, sys
from pathlib import Path
submission, out = Path(sys.argv[2]), Path(sys.argv[sys.argv.index("--out") + 1])
out.mkdir(parents=True)
(out / "model.keras").write_bytes(b"model" * 1000)
verdict = "pass" if "passes" in submission.read_text() else "fail"
(out / "verdict.json").write_text(json.dumps({"verdict": verdict, "reasons": [], "notes": []}))
'''


def test_workers_keep_the_model_only_for_a_pass_and_write_private_logs(queue, tmp_path):
    fake_grader = tmp_path / "fake_grader.py"
    fake_grader.write_text(FAKE_GRADER)
    jobs = {}
    for student, source in (("ana", "# fails\n"), ("ben", "# passes\n")):
        job_dir = tmp_path / "jobs" / student
        job_dir.mkdir(parents=True)
        (job_dir / "assessment.py").write_text(source)
        jobs[student] = submit(queue, student, job_dir)[0]
    workers = GradingWorkers(queue, GraderSettings(track=EDITION_TEST_TRACK, poll_interval_s=0.1,
                                                   command=[sys.executable, str(fake_grader)]), slots=1)
    workers.start()
    try:
        deadline = time.monotonic() + 60
        while any(queue.get(job["id"])["state"] != DONE for job in jobs.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        workers.stop()  # joins the worker, so its tidying after the last verdict is done too
    assert [queue.get(job["id"])["verdict"]["verdict"] for job in jobs.values()] == ["fail", "pass"]
    assert not (tmp_path / "jobs" / "ana" / "grader" / "model.keras").exists()
    assert (tmp_path / "jobs" / "ana" / "grader" / "verdict.json").exists()
    assert (tmp_path / "jobs" / "ben" / "grader" / "model.keras").exists()
    for student in jobs:
        for log in ("grader.stdout", "grader.stderr"):
            assert stat.S_IMODE((tmp_path / "jobs" / student / log).stat().st_mode) == 0o600


def test_a_requeued_job_is_graded_from_scratch_and_its_verdict_says_why(queue, tmp_path):
    """What the stopped grader had written is gone before the new run (the fake grader refuses an existing
    output folder), and the verdict's notes name the re-run; a clean stop re-queues the running job too."""
    fake_grader = tmp_path / "fake_grader.py"
    fake_grader.write_text(FAKE_GRADER)
    job_dir = tmp_path / "jobs" / "ana"
    job_dir.mkdir(parents=True)
    (job_dir / "assessment.py").write_text("# passes\n")
    job, _ = submit(queue, "ana", job_dir)
    mark_running(queue, job["id"], dead_pid())
    (job_dir / "grader").mkdir()
    (job_dir / "grader" / "progress.json").write_text('{"state": "running"}')  # no verdict: the run was cut off
    workers = GradingWorkers(queue, GraderSettings(track=EDITION_TEST_TRACK, poll_interval_s=0.1,
                                                   command=[sys.executable, str(fake_grader)]), slots=1)
    workers.recover()
    grade_until_done(workers, queue, job["id"])
    stored = queue.get(job["id"])
    assert stored["state"] == DONE and stored["verdict"]["verdict"] == "pass", stored
    assert any(note.startswith("Re-run on ") and "graded again from scratch" in note
               for note in stored["verdict"]["notes"])


def test_a_clean_stop_requeues_its_running_job(queue, tmp_path):
    job_dir = tmp_path / "jobs" / "ana"
    job_dir.mkdir(parents=True)
    (job_dir / "assessment.py").write_text("# sleeps\n")
    job, _ = submit(queue, "ana", job_dir)
    workers = GradingWorkers(queue, GraderSettings(track=EDITION_TEST_TRACK, poll_interval_s=0.1,
                                                   command=[sys.executable, "-c", "import time; time.sleep(600)"]),
                             slots=1, server_name="the server")
    workers.start()
    deadline = time.monotonic() + 30
    while queue.get(job["id"])["grader_pid"] is None and time.monotonic() < deadline:
        time.sleep(0.1)
    grader = psutil.Process(queue.get(job["id"])["grader_pid"])
    workers.stop()
    stored = queue.get(job["id"])
    assert stored["state"] == QUEUED and queue.position(job["id"]) == 1
    assert stored["reruns"][0]["reason"].startswith("the server was stopped while this assessment was running")
    gone, _alive = psutil.wait_procs([grader], timeout=15)
    assert gone, "the stopped grader still runs"


CPU_SPENDING_SUBMISSION = Path(__file__).parent / "submissions" / "service" / "spends_cpu_seconds.py"
# The submission's CPU-seconds fit in its budget only on a quiet machine. A Keras track: the tests that run on it are
# skipped, with the reason, where `make setup` installed the PyTorch edition alone.
SHORT_TRACK = "fashion-mnist-short"
SPINNERS_PER_CORE = 4
BUSY_SENTENCE = re.compile(r"other work on the grading machine used (\d+) % of its CPU during your run")


def keep_every_core_busy() -> list[subprocess.Popen]:
    """Other work on the machine: several spinning processes per core, so that a run gets a small part of each.
    Each in a session of its own, as the grader's run is: Linux's autogroup shares the CPU between sessions."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            for _ in range(SPINNERS_PER_CORE * len(os.sched_getaffinity(0)))]


def stop_spinning(spinners: list[subprocess.Popen]) -> None:
    for spinner in spinners:
        spinner.kill()
    for spinner in spinners:
        spinner.wait()


def cpu_spending_job(queue: AssessQueue, tmp_path: Path, student: str) -> dict:
    job_dir = tmp_path / "jobs" / student
    job_dir.mkdir(parents=True)
    (job_dir / "assessment.py").write_bytes(CPU_SPENDING_SUBMISSION.read_bytes())
    return submit(queue, student, job_dir, track=SHORT_TRACK)[0]


@pytest.mark.slow
@keras_only
def test_a_run_starved_by_other_work_is_graded_again_first_and_its_rerun_on_a_quiet_machine_counts(
        queue, tmp_path, monkeypatch):
    """Crowded off the CPU, the first run runs out of time: the job goes back to the front of the queue, ahead of
    a job that was waiting; the other work stops once it is re-queued, and the re-run ends with the submission's
    honest verdict (it saves no model), whose notes say why it was graded again."""
    monkeypatch.setenv("SCALELAB_HOME", str(tmp_path / "home"))
    job = cpu_spending_job(queue, tmp_path, "ana")
    (tmp_path / "jobs" / "ben").mkdir(parents=True)
    (tmp_path / "jobs" / "ben" / "assessment.py").write_bytes(FAST_SUBMISSION.read_bytes())
    waiting, _ = submit(queue, "ben", tmp_path / "jobs" / "ben", track=SHORT_TRACK)
    workers = workers_for(queue)
    spinners = keep_every_core_busy()
    try:
        workers.start()
        deadline = time.monotonic() + 90
        while queue.get(job["id"])["rerun_count"] == 0 and queue.get(job["id"])["state"] != DONE \
                and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop_spinning(spinners)
    requeued = queue.get(job["id"])
    try:
        deadline = time.monotonic() + 90
        while any(queue.get(each["id"])["state"] != DONE for each in (job, waiting)) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        workers.stop()
    stored = queue.get(job["id"])
    assert stored["state"] == DONE, stored
    [rerun] = stored["reruns"]
    assert rerun["cause"] == RERUN_MACHINE_BUSY and "it was graded again from scratch" in rerun["reason"], rerun
    assert int(BUSY_SENTENCE.match(rerun["reason"]).group(1)) >= CONTENDED_SHARE * 100
    assert "other work crowded the grading machine" in panel.status_text({**requeued, "state": QUEUED, "position": 1})
    verdict = stored["verdict"]
    assert verdict["verdict"] == "fail" and verdict["contended"] is False, verdict
    assert "no model was saved" in verdict["reasons"][0]
    assert verdict["cpu_contention"]["capacity_cpu_s"] > 0
    assert any(note.startswith("Re-run on ") and BUSY_SENTENCE.search(note) for note in verdict["notes"])
    assert queue.get(waiting["id"])["started_at"] > stored["started_at"], "the re-run went first"


@pytest.mark.slow
@keras_only
def test_a_run_starved_at_every_try_ends_with_the_machine_too_busy_never_a_timeout(queue, tmp_path, monkeypatch):
    monkeypatch.setenv("SCALELAB_HOME", str(tmp_path / "home"))
    job = cpu_spending_job(queue, tmp_path, "ana")
    workers = GradingWorkers(queue, GraderSettings(track=SHORT_TRACK, track_file=str(TEST_TRACKS),
                                                   poll_interval_s=0.2), slots=1, max_reruns=1)
    spinners = keep_every_core_busy()
    try:
        grade_until_done(workers, queue, job["id"], timeout_s=150)
    finally:
        stop_spinning(spinners)
    stored = queue.get(job["id"])
    assert stored["state"] == DONE and stored["rerun_count"] == 1, stored
    assert stored["reruns"][0]["cause"] == RERUN_MACHINE_BUSY
    verdict = stored["verdict"]
    assert verdict["verdict"] == "error" and verdict["contended"] is True, verdict
    [reason] = verdict["reasons"]
    assert reason.startswith("Not graded: the grading machine was too busy. Other work on the grading machine used")
    assert "graded again 1 time(s)" in reason and "Nothing was recorded against you" in reason
    assert verdict["cpu_contention"]["share"] >= CONTENDED_SHARE
    assert any(note.startswith("Re-run on ") for note in verdict["notes"])


def test_a_database_of_an_earlier_version_gains_the_rerun_columns(database, tmp_path):
    import sqlite3
    first = AssessQueue(database)
    job, _ = submit(first, "ana", tmp_path / "a")
    first.close()
    connection = sqlite3.connect(database.removeprefix("sqlite:///"))
    connection.execute("DROP INDEX one_active_job_per_student")  # SQLite drops no column an index names
    for column in ("rerun_count", "reruns_json"):
        connection.execute(f"ALTER TABLE assess_jobs DROP COLUMN {column}")
    connection.commit()
    connection.close()
    reopened = AssessQueue(database)
    try:
        assert reopened.get(job["id"])["reruns"] == [] and reopened.get(job["id"])["rerun_count"] == 0
        mark_running(reopened, job["id"], dead_pid())
        assert reopened.requeue(job["id"], "the server stopped")
        assert reopened.get(job["id"])["reruns"][0]["reason"] == "the server stopped"
    finally:
        reopened.close()


def finished_job(queue: AssessQueue, student: str, job_dir: Path, size_bytes: int = 0) -> dict:
    job, created = submit(queue, student, job_dir)
    assert created
    (job_dir / "payload").write_bytes(b"x" * size_bytes)
    queue.claim_next("host", os.getpid())
    queue.finish(job["id"], {"verdict": "fail", "reasons": []})
    return job


def test_retention_removes_a_students_oldest_job_directories_and_keeps_their_verdicts(queue, tmp_path):
    jobs_root = tmp_path / "jobs"
    ana = [finished_job(queue, "ana", jobs_root / f"ana{number}") for number in range(4)]
    ben = finished_job(queue, "ben", jobs_root / "ben0")
    outside = finished_job(queue, "cy", tmp_path / "elsewhere")
    finished_job(queue, "cy", jobs_root / "cy1")
    active, _ = submit(queue, "ana", jobs_root / "ana-active")

    removed = JobRetention(jobs_root, keep_jobs_per_student=2).prune(queue, "ana")
    assert sorted(path.name for path in removed) == ["ana0", "ana1", "ana2"]
    assert sorted(path.name for path in jobs_root.iterdir()) == ["ana-active", "ana3", "ben0", "cy1"]
    assert all(queue.get(job["id"])["verdict"]["verdict"] == "fail" for job in ana)  # rows and verdicts stay
    assert queue.get(active["id"])["state"] == QUEUED

    JobRetention(jobs_root, keep_jobs_per_student=1).prune(queue, "cy")
    assert Path(outside["job_dir"]).is_dir(), "a directory outside the jobs root is never removed"
    assert Path(ben["job_dir"]).is_dir()


def test_the_quota_removes_the_oldest_first_and_never_an_active_job_or_one_whose_grader_runs(queue, tmp_path):
    jobs_root = tmp_path / "jobs"
    oldest = finished_job(queue, "ana", jobs_root / "ana0", size_bytes=3000)
    grader_alive = finished_job(queue, "ana", jobs_root / "ana1", size_bytes=3000)
    newest = finished_job(queue, "ana", jobs_root / "ana2", size_bytes=3000)
    running, _ = submit(queue, "ana", jobs_root / "ana-running")
    (jobs_root / "ana-running" / "model.keras").write_bytes(b"x" * 20000)
    queue.claim_next("host", os.getpid())
    sleeper = subprocess.Popen(["sleep", "120"])
    try:
        queue.set_grader_process(grader_alive["id"], sleeper.pid, psutil.Process(sleeper.pid).create_time())
        removed = JobRetention(jobs_root, keep_jobs_per_student=0, disk_quota_bytes_per_student=10000).prune(
            queue, "ana")
    finally:
        sleeper.kill()
        sleeper.wait()
    # Over the quota even without them, but the running job and the one with a live grader stay.
    assert sorted(path.name for path in removed) == ["ana0", "ana2"]
    assert sorted(path.name for path in jobs_root.iterdir()) == ["ana-running", "ana1"]
    assert queue.get(running["id"])["state"] == RUNNING
    assert all(queue.get(job["id"])["state"] == DONE for job in (oldest, grader_alive, newest))


def test_the_quota_stops_removing_once_the_student_is_under_it(queue, tmp_path):
    jobs_root = tmp_path / "jobs"
    for number in range(4):
        finished_job(queue, "ana", jobs_root / f"ana{number}", size_bytes=1000)
    removed = JobRetention(jobs_root, keep_jobs_per_student=0, disk_quota_bytes_per_student=2500).prune(queue, "ana")
    assert [path.name for path in removed] == ["ana0", "ana1"]
    assert sorted(path.name for path in jobs_root.iterdir()) == ["ana2", "ana3"]
