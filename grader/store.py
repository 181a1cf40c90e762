"""Durable results: verdict files written atomically, and a SQLite database of every verdict.

Where things go: ``$SCALELAB_HOME`` (default ``~/.scalelab``) holds ``runs/`` (one out directory per assess),
``jobs/`` (the job directories while they run) and ``results.db``. A crash at any moment leaves either the old
or the new verdict file (tmp + fsync + rename), and SQLite in WAL mode never leaves a half-written row. The
database holds every student's verdicts: a directory the store creates for it is private to its account (0700).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sqlite3
import tempfile
from pathlib import Path


def scalelab_home() -> Path:
    return Path(os.environ.get("SCALELAB_HOME") or Path.home() / ".scalelab")


def private_home() -> Path:
    """``scalelab_home()``, created readable by this account alone when it does not exist yet: it holds every
    student's submissions, logs and verdicts."""
    home = scalelab_home()
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    return home


def jobs_root() -> Path:
    return scalelab_home() / "jobs"


def runs_root() -> Path:
    return scalelab_home() / "runs"


def default_database() -> Path:
    return scalelab_home() / "results.db"


def new_run_dir(label: str) -> Path:
    """A fresh, uniquely named directory under runs/ (time first, so listings sort by age)."""
    private_home()
    root = runs_root()
    root.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return Path(tempfile.mkdtemp(prefix=f"{stamp}-{label}-", dir=root))


def write_json_atomic(path: Path, document: dict) -> None:
    """Write ``document`` so that readers see the old file or the whole new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "w") as stream:
            json.dump(document, stream, indent=2, sort_keys=True, default=str)
            stream.write("\n")
            stream.flush()
            os.fsync(stream.fileno())
        os.chmod(temporary, 0o644)  # readable by the Jupyter service, whoever runs it
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a crash
    finally:
        os.close(directory)


SCHEMA = """
CREATE TABLE IF NOT EXISTS verdicts (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    student TEXT,
    track TEXT NOT NULL,
    submission_sha256 TEXT,
    verdict TEXT NOT NULL,
    heldout_accuracy REAL,
    wall_time_s REAL,
    out_dir TEXT,
    recorded_at TEXT NOT NULL,
    verdict_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS verdicts_by_submission ON verdicts (student, track, submission_sha256);
"""


class ResultsDatabase:
    """One row per verdict; the newest row for (student, track, submission) is the one that counts."""

    def __init__(self, path: Path | None = None):
        self.path = Path(path or default_database())
        # Every student's verdicts: a new directory for them is this account's alone.
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with self._connect() as connection:
            connection.executescript(SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        connection = sqlite3.connect(self.path, timeout=60, isolation_level=None)
        connection.execute("PRAGMA journal_mode=WAL")
        connection.execute("PRAGMA synchronous=FULL")
        return connection

    def record(self, verdict: dict, student: str | None = None) -> int:
        with self._connect() as connection:
            cursor = connection.execute(
                "INSERT INTO verdicts (student, track, submission_sha256, verdict, heldout_accuracy, wall_time_s, "
                "out_dir, recorded_at, verdict_json) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (student, verdict.get("track") or "", verdict.get("submission_sha256"), verdict["verdict"],
                 verdict.get("heldout_accuracy"), verdict.get("wall_time_s"), verdict.get("out_dir"),
                 dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                 json.dumps(verdict, sort_keys=True, default=str)))
            return cursor.lastrowid

    def latest(self, student: str | None, track: str, submission_sha256: str) -> dict | None:
        """The newest stored verdict for this exact submission, or None (then it must be graded)."""
        with self._connect() as connection:
            row = connection.execute(
                "SELECT verdict_json FROM verdicts WHERE student IS ? AND track = ? AND submission_sha256 = ? "
                "ORDER BY id DESC LIMIT 1", (student, track, submission_sha256)).fetchone()
        return json.loads(row[0]) if row else None
