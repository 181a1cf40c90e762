"""The Assess service's persistent job queue (SQLAlchemy 2.0): the jobs table and every state change of a job.

A job is one click on **Assess**: the student's ``assessment.py`` copied at submit time into its own job
directory, waiting to be graded by the workers (``workers.py``).

The queue lives in a real database: a SQLite file by default (WAL, and ``BEGIN IMMEDIATE`` so that a submit or
a claim is one serialized transaction), or any SQLAlchemy URL (Postgres) given in the configuration. A SQLite
file's directory is created private to the server's account (0700): the database holds every student's verdicts.

Rules the queue keeps:

- **One active job per student**: a second submit while one is queued or running returns that job (a partial
  unique index makes this hold even for concurrent submits).
- **A pause between submissions**: a new job of a student is refused (:class:`TooSoon`, with the seconds left)
  until ``min_seconds_between_submissions`` have passed since that student's previous one; checked in the same
  transaction as the submit, so it holds across servers sharing the database.
- **FIFO across students**: a claim always takes the oldest queued job (ids are assigned in arrival order).
- **Orphans are found and settled by the workers**: :meth:`AssessQueue.orphaned_running_jobs` lists the running
  jobs whose server (of this host) is gone. A job the server stopped under goes back to ``queued`` at the front
  (:meth:`AssessQueue.requeue`: its run is graded again from scratch, never resumed, and its ``reruns`` say when,
  why and the cause), a bounded number of times; so does a job whose run other work on the machine starved.
- **Re-queued jobs first**: a claim takes a re-queued job before any other, then the oldest queued job.

States: ``queued`` → ``running`` → ``done`` (with the verdict JSON) or ``interrupted`` (with a reason); a running
job may go back to ``queued`` once its server stops under it, or once its run ran out of time on a crowded machine.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil
from sqlalchemy import (Float, Index, Integer, String, Text, create_engine, event, func, inspect, or_, select, text,
                        update)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

QUEUED, RUNNING, DONE, INTERRUPTED = "queued", "running", "done", "interrupted"
ACTIVE_STATES = (QUEUED, RUNNING)
# Why a job was graded again: its server stopped under it, or its run ran out of time on a crowded machine.
RERUN_SERVER_STOPPED, RERUN_MACHINE_BUSY = "server stopped", "machine busy"
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
    rerun_count: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    reruns_json: Mapped[str | None] = mapped_column(Text)  # [{"at": unix seconds, "reason": sentence, "cause"}, ...]

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
            "rerun_count": self.rerun_count or 0,
            "reruns": json.loads(self.reruns_json) if self.reruns_json else [],
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
            # Every student's verdicts: a new directory for them is the server account's alone.
            Path(database_url.removeprefix("sqlite:///")).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.database_url = database_url
        self.engine = make_engine(database_url)
        Base.metadata.create_all(self.engine)
        self._add_new_columns()
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)

    def close(self) -> None:
        self.engine.dispose()

    def _add_new_columns(self) -> None:
        """A database written by an earlier version gains the columns added since (empty: no job was re-run)."""
        present = {column["name"] for column in inspect(self.engine).get_columns(AssessJob.__tablename__)}
        added = {"rerun_count": "INTEGER NOT NULL DEFAULT 0", "reruns_json": "TEXT"}
        with self.engine.begin() as connection:
            for name, definition in added.items():
                if name not in present:
                    connection.exec_driver_sql(f"ALTER TABLE {AssessJob.__tablename__} ADD COLUMN {name} {definition}")

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
            if job.rerun_count > 0:
                ahead = (AssessJob.rerun_count > 0) & (AssessJob.id < job_id)
            else:
                ahead = or_(AssessJob.rerun_count > 0, AssessJob.id < job_id)
            return 1 + session.scalar(select(func.count()).where(AssessJob.state == QUEUED, ahead))

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
        """Mark the next queued job running and return it (None when nothing waits): a re-queued job first, then
        the oldest."""
        with self.sessions.begin() as session:
            job = session.scalar(select(AssessJob).where(AssessJob.state == QUEUED)
                                 .order_by((AssessJob.rerun_count == 0), AssessJob.id)
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

    def requeue(self, job_id: int, reason: str, cause: str = RERUN_SERVER_STOPPED) -> bool:
        """Put a running job back in the queue, at the front, to be graded again from scratch: what its run had
        reported is cleared, and ``reason`` (a sentence) and ``cause`` (RERUN_SERVER_STOPPED or
        RERUN_MACHINE_BUSY) are added to its reruns. False if it was no longer running."""
        with self.sessions.begin() as session:
            job = session.scalar(select(AssessJob).where(AssessJob.id == job_id, AssessJob.state == RUNNING))
            if job is None:
                return False
            reruns = json.loads(job.reruns_json) if job.reruns_json else []
            reruns.append({"at": time.time(), "reason": reason, "cause": cause})
            job.state, job.rerun_count, job.reruns_json = QUEUED, len(reruns), json.dumps(reruns)
            job.started_at = job.worker_host = job.worker_pid = job.grader_pid = job.grader_created = None
            job.progress_json = job.progress_history_json = None
            return True

    def orphaned_running_jobs(self, host: str, server_pid: int) -> list[dict]:
        """Running jobs of this host whose server process is gone (or is not the one that claimed them). A pid
        equal to ``server_pid`` is no exception: in a container every start of the server is pid 1."""
        with self.sessions() as session:
            jobs = [job.as_dict() for job in session.scalars(
                select(AssessJob).where(AssessJob.state == RUNNING).order_by(AssessJob.id))]
        return [job for job in jobs
                if job["worker_host"] in (None, host)
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
