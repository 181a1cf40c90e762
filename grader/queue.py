"""The Assess service's persistent job queue (SQLAlchemy 2.0) and the workers that drain it.

A job is one click on **Assess**: the student's ``assessment.py`` copied at submit time into its own job
directory, then graded out of the server process by the real grader, exactly as on the command line::

    scalelab assess <job_dir>/assessment.py --track T --json --out <job_dir>/grader [--backend B]

The queue lives in a real database: a SQLite file by default (WAL, and ``BEGIN IMMEDIATE`` so that a submit or
a claim is one serialized transaction), or any SQLAlchemy URL (Postgres) given in the configuration.

Rules the queue keeps:

- **One active job per student**: a second submit while one is queued or running returns that job (a partial
  unique index makes this hold even for concurrent submits).
- **A pause between submissions**: a new job of a student is refused (:class:`TooSoon`, with the seconds left)
  until ``min_seconds_between_submissions`` have passed since that student's previous one; checked in the same
  transaction as the submit, so it holds across servers sharing the database.
- **FIFO across students**: workers always claim the oldest queued job (ids are assigned in arrival order).
- **Slots**: one worker thread per slot and one job per worker, so at most ``slots`` jobs run at once.
- **Restart safety**: a job found ``running`` when a server starts, left by a server of this host that is gone
  (killed, crashed, or stopped), is marked ``interrupted`` with a reason saying so; its grader, if it still
  runs, is killed first. It is never re-run silently and never reported as passed: the student clicks Assess
  again. (Re-running it automatically could loop forever on a submission that brings the server down.) The
  one exception is a grader that had already written its verdict before the server died: that verdict is the
  real grader's and is kept. Queued jobs are untouched and run as usual. A server stopped cleanly marks its
  running jobs ``interrupted`` at exit.
- **Progress** (``progress.json``, written by the grader: elapsed time vs budget, epochs seen, latest
  accuracy, checkpoint time) is copied to the job for display only; the verdict is always the grader's.
- **Disk**: job directories and the files the service writes in them are private to the server's account
  (0700/0600). The model a run wrote (``<job_dir>/grader/model.keras``, up to 200 MiB) is kept only when the
  stored verdict is a pass. :class:`JobRetention` removes a student's oldest job directories beyond a count or a
  byte quota; the database rows and verdicts stay, and the directory of a queued or running job (or of a job
  whose grader still runs) is never removed.

States: ``queued`` → ``running`` → ``done`` (with the verdict JSON) or ``interrupted`` (with a reason).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from sqlalchemy import Float, Index, Integer, String, Text, create_engine, event, func, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

QUEUED, RUNNING, DONE, INTERRUPTED = "queued", "running", "done", "interrupted"
ACTIVE_STATES = (QUEUED, RUNNING)
# The largest id every supported database's INTEGER column holds (Postgres: 32 bits); beyond it no job exists,
# and SQLite would raise OverflowError instead of finding nothing.
MAX_JOB_ID = 2**31 - 1


class QueueFull(Exception):
    """The queue already holds ``max_queued`` waiting jobs."""


class TooSoon(Exception):
    """The student submitted less than ``min_seconds_between_submissions`` ago."""

    def __init__(self, wait_s: float, min_seconds_between_submissions: float):
        super().__init__(wait_s)
        self.wait_s = wait_s
        self.min_seconds_between_submissions = min_seconds_between_submissions


class Base(DeclarativeBase):
    pass


class AssessJob(Base):
    __tablename__ = "assess_jobs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    student: Mapped[str] = mapped_column(String(200), index=True)
    state: Mapped[str] = mapped_column(String(20), index=True)
    track: Mapped[str] = mapped_column(String(200))
    backend: Mapped[str] = mapped_column(String(20))
    job_dir: Mapped[str] = mapped_column(Text)
    submission_path: Mapped[str] = mapped_column(Text)  # where the student's file was copied from
    submission_sha256: Mapped[str] = mapped_column(String(64))
    submitted_at: Mapped[float] = mapped_column(Float)  # unix seconds
    started_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)
    worker_host: Mapped[str | None] = mapped_column(String(255))
    worker_pid: Mapped[int | None] = mapped_column(Integer)  # the server process running the job
    grader_pid: Mapped[int | None] = mapped_column(Integer)
    grader_created: Mapped[float | None] = mapped_column(Float)  # its start time: tells a reused pid apart
    progress_json: Mapped[str | None] = mapped_column(Text)
    progress_history_json: Mapped[str | None] = mapped_column(Text)
    verdict: Mapped[str | None] = mapped_column(String(20))
    verdict_json: Mapped[str | None] = mapped_column(Text)
    reason: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        # At most one queued-or-running job per student, enforced by the database itself.
        Index("one_active_job_per_student", "student", unique=True,
              sqlite_where=text("state IN ('queued', 'running')"),
              postgresql_where=text("state IN ('queued', 'running')")),
    )

    def as_dict(self) -> dict:
        return {
            "id": self.id, "student": self.student, "state": self.state, "track": self.track,
            "backend": self.backend, "job_dir": self.job_dir, "submission_path": self.submission_path,
            "submission_sha256": self.submission_sha256, "submitted_at": self.submitted_at,
            "started_at": self.started_at, "finished_at": self.finished_at, "grader_pid": self.grader_pid,
            "grader_created": self.grader_created, "worker_host": self.worker_host, "worker_pid": self.worker_pid,
            "progress": json.loads(self.progress_json) if self.progress_json else None,
            "progress_history": json.loads(self.progress_history_json) if self.progress_history_json else [],
            "verdict": json.loads(self.verdict_json) if self.verdict_json else None,
            "reason": self.reason,
        }


def sqlite_url(path: Path) -> str:
    return f"sqlite:///{Path(path).resolve()}"


def make_engine(database_url: str):
    if not database_url.startswith("sqlite"):
        return create_engine(database_url, pool_pre_ping=True)
    engine = create_engine(database_url, connect_args={"timeout": 60, "check_same_thread": False})

    # pysqlite's own transaction handling defers BEGIN; take the write lock at the start instead, so that
    # "check then insert" (submit) and "pick then mark running" (claim) are atomic across processes.
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA busy_timeout=60000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection):
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


class AssessQueue:
    """The jobs table and every state change of a job, each one transaction."""

    def __init__(self, database_url: str):
        if database_url.startswith("sqlite:///"):
            Path(database_url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        self.database_url = database_url
        self.engine = make_engine(database_url)
        Base.metadata.create_all(self.engine)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)

    def close(self) -> None:
        self.engine.dispose()

    # --- students ---------------------------------------------------------------------------------------

    def submit(self, *, student: str, track: str, backend: str, job_dir: Path, submission_path: str,
               submission_sha256: str, max_queued: int,
               min_seconds_between_submissions: float = 0.0) -> tuple[dict, bool]:
        """Queue a job; returns (job, created). created is False when the student already had an active job
        (that job is returned and nothing is queued). Raises TooSoon, then QueueFull."""
        for _attempt in range(3):
            try:
                with self.sessions.begin() as session:
                    active = self._active_job(session, student)
                    if active is not None:
                        return active.as_dict(), False
                    if min_seconds_between_submissions > 0:
                        last = session.scalar(select(func.max(AssessJob.submitted_at))
                                              .where(AssessJob.student == student))
                        if last is not None:
                            # Capped: a clock set back must not lock the student out for longer.
                            wait_s = min(last + min_seconds_between_submissions - time.time(),
                                         min_seconds_between_submissions)
                            if wait_s > 0:
                                raise TooSoon(wait_s, min_seconds_between_submissions)
                    waiting = session.scalar(select(func.count()).where(AssessJob.state == QUEUED))
                    if waiting >= max_queued:
                        raise QueueFull(waiting)
                    job = AssessJob(student=student, state=QUEUED, track=track, backend=backend,
                                    job_dir=str(job_dir), submission_path=submission_path,
                                    submission_sha256=submission_sha256, submitted_at=time.time())
                    session.add(job)
                    session.flush()
                    return job.as_dict(), True
            except IntegrityError:  # a concurrent submit of the same student won (databases without IMMEDIATE)
                continue
        raise RuntimeError(f"could not queue a job for {student!r}: the database kept refusing")

    def _active_job(self, session: Session, student: str) -> AssessJob | None:
        return session.scalar(select(AssessJob).where(AssessJob.student == student,
                                                      AssessJob.state.in_(ACTIVE_STATES)))

    def get(self, job_id: int) -> dict | None:
        if not 1 <= job_id <= MAX_JOB_ID:
            return None
        with self.sessions() as session:
            job = session.get(AssessJob, job_id)
            return job.as_dict() if job else None

    def position(self, job_id: int) -> int | None:
        """1 for the next job to start; None when the job is not queued."""
        if not 1 <= job_id <= MAX_JOB_ID:
            return None
        with self.sessions() as session:
            job = session.get(AssessJob, job_id)
            if job is None or job.state != QUEUED:
                return None
            return 1 + session.scalar(select(func.count()).where(AssessJob.state == QUEUED,
                                                                 AssessJob.id < job_id))

    def history(self, student: str, limit: int = 50) -> list[dict]:
        with self.sessions() as session:
            jobs = session.scalars(select(AssessJob).where(AssessJob.student == student)
                                   .order_by(AssessJob.id.desc()).limit(limit))
            return [job.as_dict() for job in jobs]

    def job_directories(self, student: str) -> list[dict]:
        """The student's jobs, newest first, with what deciding on their directories needs (no verdicts)."""
        with self.sessions() as session:
            rows = session.execute(
                select(AssessJob.id, AssessJob.state, AssessJob.job_dir, AssessJob.grader_pid,
                       AssessJob.grader_created).where(AssessJob.student == student).order_by(AssessJob.id.desc()))
            return [row._asdict() for row in rows]

    def all_jobs(self) -> list[dict]:
        with self.sessions() as session:
            return [job.as_dict() for job in session.scalars(select(AssessJob).order_by(AssessJob.id))]

    def counts(self) -> dict[str, int]:
        with self.sessions() as session:
            rows = session.execute(select(AssessJob.state, func.count()).group_by(AssessJob.state)).all()
        found = {QUEUED: 0, RUNNING: 0, DONE: 0, INTERRUPTED: 0}
        found.update({state: count for state, count in rows})
        return found

    # --- workers ------------------------------------------------------------------------------------------

    def claim_next(self, worker_host: str, worker_pid: int) -> dict | None:
        """Mark the oldest queued job running and return it (None when nothing waits)."""
        with self.sessions.begin() as session:
            job = session.scalar(select(AssessJob).where(AssessJob.state == QUEUED).order_by(AssessJob.id)
                                 .limit(1).with_for_update(skip_locked=True))
            if job is None:
                return None
            job.state, job.started_at = RUNNING, time.time()
            job.worker_host, job.worker_pid = worker_host, worker_pid
            return job.as_dict()

    def set_grader_process(self, job_id: int, pid: int, created: float) -> None:
        with self.sessions.begin() as session:
            session.execute(update(AssessJob).where(AssessJob.id == job_id)
                            .values(grader_pid=pid, grader_created=created))

    def record_progress(self, job_id: int, progress: dict, history: list[dict]) -> None:
        with self.sessions.begin() as session:
            session.execute(update(AssessJob).where(AssessJob.id == job_id, AssessJob.state == RUNNING)
                            .values(progress_json=json.dumps(progress, default=str),
                                    progress_history_json=json.dumps(history)))

    def finish(self, job_id: int, verdict: dict) -> bool:
        """Store the grader's verdict; False if the job was no longer running (e.g. marked interrupted)."""
        with self.sessions.begin() as session:
            changed = session.execute(
                update(AssessJob).where(AssessJob.id == job_id, AssessJob.state == RUNNING)
                .values(state=DONE, finished_at=time.time(), verdict=verdict.get("verdict"),
                        verdict_json=json.dumps(verdict, sort_keys=True, default=str)))
            return changed.rowcount == 1

    def interrupt(self, job_id: int, reason: str) -> bool:
        with self.sessions.begin() as session:
            changed = session.execute(
                update(AssessJob).where(AssessJob.id == job_id, AssessJob.state == RUNNING)
                .values(state=INTERRUPTED, finished_at=time.time(), reason=reason))
            return changed.rowcount == 1

    def orphaned_running_jobs(self, host: str, server_pid: int) -> list[dict]:
        """Running jobs of this host whose server process is gone (or is not the one that claimed them)."""
        with self.sessions() as session:
            jobs = [job.as_dict() for job in session.scalars(
                select(AssessJob).where(AssessJob.state == RUNNING).order_by(AssessJob.id))]
        return [job for job in jobs
                if job["worker_host"] in (None, host) and job["worker_pid"] != server_pid
                and not _process_alive_since(job["worker_pid"], job["started_at"])]


def _process_alive_since(pid: int | None, claimed_at: float | None) -> bool:
    """True if ``pid`` runs and was started before ``claimed_at`` (so it can be the server that claimed it)."""
    if not pid:
        return False
    try:
        process = psutil.Process(pid)
        return process.is_running() and process.create_time() <= (claimed_at or 0) + 1
    except psutil.Error:
        return False


def grader_process(job: dict) -> psutil.Process | None:
    """The job's ``scalelab assess`` process if it still runs (checked by pid *and* start time)."""
    if not job.get("grader_pid"):
        return None
    try:
        process = psutil.Process(job["grader_pid"])
        if process.is_running() and abs(process.create_time() - (job.get("grader_created") or 0)) < 1:
            return process
    except psutil.Error:
        pass
    return None


def kill_process_tree(process: psutil.Process, grace_s: float = 5.0) -> None:
    """SIGTERM the grader and everything it started, then SIGKILL what is left after ``grace_s``."""
    try:
        family = [process, *process.children(recursive=True)]
    except psutil.Error:
        return
    for member in family:
        try:
            member.terminate()
        except psutil.Error:
            pass
    _gone, alive = psutil.wait_procs(family, timeout=grace_s)
    for member in alive:
        try:
            member.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace_s)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def utc_iso(unix_seconds: float | None) -> str | None:
    if unix_seconds is None:
        return None
    return dt.datetime.fromtimestamp(unix_seconds, dt.timezone.utc).isoformat(timespec="seconds")


def default_scalelab_command() -> list[str]:
    """The ``scalelab`` executable beside this Python (the venv's), so the worker grades with our grader."""
    beside = Path(sys.executable).with_name("scalelab")
    return [str(beside)] if beside.exists() else [sys.executable, "-m", "scalelab.cli"]


@dataclass
class GraderSettings:
    """How a worker calls ``scalelab assess``."""
    track: str
    track_file: str | None = None
    backend: str = "local"
    allow_unsandboxed: bool = False
    command: list[str] = field(default_factory=default_scalelab_command)
    environment: dict[str, str] | None = None  # None: the server's own environment
    poll_interval_s: float = 1.0


def submission_copy(job_dir: Path) -> Path:
    return Path(job_dir) / "assessment.py"


def grader_out_dir(job_dir: Path) -> Path:
    return Path(job_dir) / "grader"


def model_file(job_dir: Path) -> Path:
    return grader_out_dir(job_dir) / "model.keras"


def open_private(path: Path, mode: str):
    """``open`` for a new file only the server's account can read (0600 whatever the umask)."""
    return open(path, mode, opener=lambda name, flags: os.open(name, flags, 0o600))


def is_pass(job: dict | None) -> bool:
    return bool(job) and job["state"] == DONE and (job["verdict"] or {}).get("verdict") == "pass"


def directory_bytes(path: Path) -> int:
    """Bytes in the files under ``path`` (links counted as links, never followed)."""
    total = 0
    for folder, _subfolders, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


@dataclass
class JobRetention:
    """How much of a student's finished jobs stays on disk; their rows and verdicts stay in the database."""
    jobs_root: Path
    keep_jobs_per_student: int = 20  # 0: no limit
    disk_quota_bytes_per_student: int = 0  # 0: no limit

    def prune(self, queue: AssessQueue, student: str) -> list[Path]:
        """Remove the student's oldest job directories beyond the count, then beyond the quota; returns them."""
        root = os.path.realpath(self.jobs_root)
        on_disk = [job for job in queue.job_directories(student)  # newest first
                   if os.path.dirname(os.path.realpath(job["job_dir"])) == root and os.path.isdir(job["job_dir"])]
        doomed, kept = [], []
        for index, job in enumerate(on_disk):
            beyond_count = 0 < self.keep_jobs_per_student <= index
            (doomed if beyond_count and _removable(job) else kept).append(job)
        if self.disk_quota_bytes_per_student > 0:
            sizes = {job["id"]: directory_bytes(job["job_dir"]) for job in kept}
            total = sum(sizes.values())
            for job in reversed(kept):  # oldest first
                if total <= self.disk_quota_bytes_per_student:
                    break
                if _removable(job):
                    doomed.append(job)
                    total -= sizes[job["id"]]
        for job in doomed:
            shutil.rmtree(job["job_dir"], ignore_errors=True)
        return [Path(job["job_dir"]) for job in doomed]


def _removable(job: dict) -> bool:
    # States only move forward, so a finished job never becomes active again; a grader that outlived its
    # job (a server stopped under it) may still be writing there.
    return job["state"] not in ACTIVE_STATES and grader_process(job) is None


class GradingWorkers:
    """``slots`` threads, each claiming the oldest queued job and grading it with ``scalelab assess``."""

    def __init__(self, queue: AssessQueue, settings: GraderSettings, slots: int, log=None,
                 retention: JobRetention | None = None):
        if slots < 1:
            raise ValueError(f"slots must be at least 1, not {slots}")
        self.queue, self.settings, self.slots = queue, settings, slots
        self.log = log
        self.retention = retention
        self.host, self.server_pid = socket.gethostname(), os.getpid()
        self._stopping = threading.Event()
        self.stop_reason = ""
        self._wakeup = threading.Condition()
        self._running: dict[int, subprocess.Popen] = {}
        self._running_lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    # --- life cycle -----------------------------------------------------------------------------------------

    def recover(self) -> list[dict]:
        """Settle the running jobs a dead server of this host left behind (see the module docstring)."""
        settled = []
        for job in self.queue.orphaned_running_jobs(self.host, self.server_pid):
            process = grader_process(job)
            if process is not None:
                kill_process_tree(process)
            verdict = read_json(grader_out_dir(job["job_dir"]) / "verdict.json")
            if process is None and verdict is not None and verdict.get("finished_at"):
                verdict.setdefault("notes", []).append(
                    "the server restarted after the grader had finished; this is the grader's own verdict.")
                self.queue.finish(job["id"], verdict)
            else:
                started = utc_iso(job["started_at"]) or "an unknown time"
                self.queue.interrupt(job["id"], (
                    f"Interrupted: the Jupyter server stopped while this assessment was running (it started at "
                    f"{started}), so it was not graded. Nothing was recorded as a result; click Assess to "
                    f"submit it again."))
            self._tidy(job)
            settled.append(self.queue.get(job["id"]))
        return settled

    def start(self) -> None:
        for slot in range(self.slots):
            thread = threading.Thread(target=self._work, name=f"scalelab-assess-slot-{slot}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def wake(self) -> None:
        with self._wakeup:
            self._wakeup.notify_all()

    def stop(self, reason: str = "Interrupted: the Jupyter server was stopped while this assessment was "
                                 "running, so it was not graded. Click Assess to submit it again.") -> None:
        """Stop claiming; mark running jobs interrupted (first, so no verdict races in), then kill graders."""
        self.stop_reason = reason
        with self._running_lock:  # with _grade's registration: a grader is either seen here or never started
            self._stopping.set()
            running = dict(self._running)
        self.wake()
        for job_id, popen in running.items():
            self.queue.interrupt(job_id, reason)
            try:
                kill_process_tree(psutil.Process(popen.pid))
            except psutil.Error:
                pass
        for thread in self._threads:
            thread.join(timeout=10)

    # --- one worker ------------------------------------------------------------------------------------------

    def _work(self) -> None:
        while not self._stopping.is_set():
            try:
                job = self.queue.claim_next(self.host, self.server_pid)
            except Exception as error:  # the database is away for a moment: try again shortly
                self._say(f"could not claim a job: {error}")
                job = None
            if job is None:
                with self._wakeup:
                    self._wakeup.wait(timeout=self.settings.poll_interval_s)
                continue
            if self._stopping.is_set():  # claimed just as the server stops: do not start it
                self.queue.interrupt(job["id"], self.stop_reason)
                return
            try:
                self._grade(job)
            except Exception as error:  # never leave a job running because the worker itself failed
                self._say(f"job {job['id']}: {type(error).__name__}: {error}")
                self.queue.finish(job["id"], service_error_verdict(
                    job, f"the Assess service could not run the grader: {type(error).__name__}: {error}"))
            self._tidy(job)

    def grader_argv(self, job: dict) -> list[str]:
        argv = [*self.settings.command, "assess", str(submission_copy(job["job_dir"])), "--track", job["track"],
                "--json", "--out", str(grader_out_dir(job["job_dir"])), "--backend", job["backend"]]
        if self.settings.track_file:
            argv += ["--track-file", str(self.settings.track_file)]
        if self.settings.allow_unsandboxed:
            argv.append("--allow-unsandboxed")
        return argv

    def _grade(self, job: dict) -> None:
        job_dir = Path(job["job_dir"])
        with open_private(job_dir / "grader.stdout", "wb") as stdout, \
                open_private(job_dir / "grader.stderr", "wb") as stderr:
            # Own session: the grader and its horovodrun can be stopped as one tree, apart from the server.
            # Not in the job directory: it holds the student's file, and Python imports from the cwd.
            popen = subprocess.Popen(self.grader_argv(job), stdin=subprocess.DEVNULL, stdout=stdout,
                                     stderr=stderr, cwd="/", env=self.settings.environment,
                                     start_new_session=True)
        with self._running_lock:
            self._running[job["id"]] = popen
            stopped_meanwhile = self._stopping.is_set()
        if stopped_meanwhile:  # stop() ran between the claim and the start: it did not see this grader
            self.queue.interrupt(job["id"], self.stop_reason)
            try:
                kill_process_tree(psutil.Process(popen.pid))
            except psutil.Error:
                pass
        try:
            try:
                self.queue.set_grader_process(job["id"], popen.pid, psutil.Process(popen.pid).create_time())
            except psutil.Error:
                pass  # it already ended
            self._follow_progress(job, popen)
        finally:
            with self._running_lock:
                self._running.pop(job["id"], None)
        if self._stopping.is_set():
            return  # stop() has marked it interrupted
        verdict = read_json(grader_out_dir(job_dir) / "verdict.json")
        if verdict is None:  # only a refused command line (exit 2) or a crash before the grader started
            message = _last_line((job_dir / "grader.stderr").read_bytes()) or f"exit status {popen.returncode}"
            verdict = service_error_verdict(job, f"the grader refused the submission: {message}",
                                            verdict="fail" if popen.returncode == 2 else "error")
        verdict["student"] = verdict.get("student") or job["student"]  # the grader CLI does not know who it was
        self.queue.finish(job["id"], verdict)

    def _follow_progress(self, job: dict, popen: subprocess.Popen) -> None:
        progress_file = grader_out_dir(job["job_dir"]) / "progress.json"
        last, history = None, []
        while True:
            ended = popen.poll() is not None
            progress = read_json(progress_file)
            if progress is not None and progress != last:
                last = progress
                point = {"elapsed_s": progress.get("elapsed_s"), "accuracy": progress.get("latest_accuracy"),
                         "epochs_seen": progress.get("epochs_seen")}
                if point["accuracy"] is not None and (not history or history[-1]["epochs_seen"] != point["epochs_seen"]
                                                      or history[-1]["accuracy"] != point["accuracy"]):
                    history.append(point)
                self.queue.record_progress(job["id"], progress, history)
            if ended:
                return
            time.sleep(self.settings.poll_interval_s)

    def _tidy(self, job: dict) -> None:
        """Once a job has ended: its model stays only with a stored pass; then the student's retention."""
        try:
            if not is_pass(self.queue.get(job["id"])):
                model_file(job["job_dir"]).unlink(missing_ok=True)
            if self.retention is not None:
                self.retention.prune(self.queue, job["student"])
        except Exception as error:  # a full or failing disk must not stop the worker
            self._say(f"job {job['id']}: could not tidy its files: {type(error).__name__}: {error}")

    def _say(self, message: str) -> None:
        if self.log is not None:
            self.log.warning("scalelab assess service: %s", message)
        else:
            print(f"scalelab assess service: {message}", file=sys.stderr)


def _last_line(data: bytes) -> str:
    lines = [line.strip() for line in data.decode("utf-8", "replace").splitlines() if line.strip()]
    return lines[-1][:500] if lines else ""


def service_error_verdict(job: dict, reason: str, verdict: str = "error") -> dict:
    """A verdict in the grader's shape for when the grader gave none."""
    now = utc_iso(time.time())
    return {"verdict": verdict, "reasons": [reason], "notes": [], "heldout_accuracy": None, "target_accuracy": None,
            "wall_time_s": None, "time_budget_s": None, "np": None, "ranks_seen": [], "allreduce_count": 0,
            "track": job["track"], "submission_sha256": job["submission_sha256"], "started_at": now,
            "finished_at": now, "logs_dir": None, "environment": None, "student": job["student"]}
