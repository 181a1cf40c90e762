"""The models a run saves while it goes, taken into the grader's own folder and stamped with the grader's clock.

The run saves its model once an epoch (the assessment's DO-NOT-EDIT section writes it whole, then renames it into
place). While the run goes, the grader looks at that file every ``POLL_INTERVAL_S``; each new version (another
inode, size or modification time) is copied out under the job-file rules (:mod:`jobfiles`: no link on the way, a
regular file of the run's uid, at most ``limit_bytes``, unchanged while it was copied) into ``destination``, and
stamped with the grader's seconds since the run started. The run's own timestamps are never read for it. A run
that ends by itself gets one more look at its exit, so that a model saved just before it is not missed.

A run cannot flood the grader: versions closer than ``min_interval_s`` to the last one kept wait for the next look,
and after ``max_snapshots`` no more are kept. A version that fails the rules is skipped with a note (once per
reason); the final model is still measured after the run, as before.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import stat
from pathlib import Path

from . import jobfiles

POLL_INTERVAL_S = 1.0
MIN_INTERVAL_S = 2.0
MAX_SNAPSHOTS = 64


@dataclasses.dataclass
class Snapshot:
    """One version of the run's model, as the grader copied it: ``at_s`` seconds after the run started (the
    grader's clock), its size and SHA-256, and the grader's copy (``file``, in the grader's folder)."""
    index: int
    at_s: float
    bytes: int
    sha256: str
    file: str

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class SnapshotCollector:
    """Collects the versions of ``root/relative`` into ``destination`` (see the module docstring)."""

    def __init__(self, root: Path, relative: str, destination: Path, *, owner_uid: int | None, limit_bytes: int,
                 min_interval_s: float = MIN_INTERVAL_S, max_snapshots: int = MAX_SNAPSHOTS,
                 poll_interval_s: float = POLL_INTERVAL_S):
        self.root, self.relative, self.destination = Path(root), relative, Path(destination)
        self.owner_uid, self.limit_bytes = owner_uid, limit_bytes
        self.min_interval_s, self.max_snapshots, self.poll_interval_s = min_interval_s, max_snapshots, poll_interval_s
        self.snapshots: list[Snapshot] = []
        self.notes: list[str] = []
        self._seen_version: tuple | None = None
        self._next_look_s = 0.0
        self._deferred = 0

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def _version(self) -> tuple | None:
        """(inode, size, mtime) of the file as it is now, without opening it; None when it is not there yet."""
        try:
            info = os.stat(self.root / self.relative, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return info.st_ino, info.st_size, info.st_mtime_ns, stat.S_IFMT(info.st_mode)

    def poll(self, elapsed_s: float) -> Snapshot | None:
        """Look at the file if it is time to; copy a new version. ``elapsed_s``: the grader's seconds since start."""
        if elapsed_s < self._next_look_s or len(self.snapshots) >= self.max_snapshots:
            return None
        self._next_look_s = elapsed_s + self.poll_interval_s
        return self._take(elapsed_s, at_exit=False)

    def final_look(self, elapsed_s: float) -> Snapshot | None:
        """The run ended by itself at ``elapsed_s``: copy the model as it left it, if that version is not kept yet.

        A run that saves and exits between two looks would otherwise leave its last model out of the curve; at the
        exit nothing writes any more, so the once-per-interval cap does not apply (the maximum still does)."""
        if len(self.snapshots) >= self.max_snapshots:
            return None
        return self._take(elapsed_s, at_exit=True)

    def _take(self, elapsed_s: float, at_exit: bool) -> Snapshot | None:
        version = self._version()
        if version is None or version == self._seen_version:
            return None
        if not at_exit and self.snapshots and elapsed_s - self.snapshots[-1].at_s < self.min_interval_s:
            self._deferred += 1
            self._note(f"the run saved its model more often than every {self.min_interval_s:g} s; the grader "
                       f"kept at most one version per {self.min_interval_s:g} s")
            return None
        self._seen_version = version
        # The copy keeps the model file's suffix (.keras or .pt2): loaders go by it.
        copy = self.destination / f"snapshot-{len(self.snapshots) + 1:03d}{Path(self.relative).suffix}"
        self.destination.mkdir(parents=True, exist_ok=True)
        try:
            jobfiles.copy_regular_file(self.root, self.relative, copy, owner_uid=self.owner_uid,
                                       limit_bytes=self.limit_bytes)
        except jobfiles.UntrustedFile as untrusted:
            self._note(f"a saved model was skipped: {untrusted}")
            return None
        digest = hashlib.sha256()
        with open(copy, "rb") as stream:
            for chunk in iter(lambda: stream.read(1 << 20), b""):
                digest.update(chunk)
        snapshot = Snapshot(len(self.snapshots) + 1, round(elapsed_s, 2), copy.stat().st_size, digest.hexdigest(),
                            str(copy))
        self.snapshots.append(snapshot)
        if len(self.snapshots) == self.max_snapshots:
            self._note(f"the grader kept the first {self.max_snapshots} versions of the saved model; later ones "
                       f"were not kept (the final model is measured all the same)")
        return snapshot
