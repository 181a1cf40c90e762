"""The run's held-out curve, measured as it goes: the referee's time to accuracy.

Each snapshot the grader takes of the run's model (:mod:`snapshots`) is measured on the held-out split by the
run's measuring process (:class:`verify.HeldoutProcess`), on a thread of its own so that the grader's watch over
the run never waits for it. The first snapshot at or above the target, taken within the budget, decides: its time
(the grader's clock when the snapshot appeared, never when it was measured) is the run's time to accuracy, and the
grader may stop the run there. Snapshots after it are not measured.

The snapshot is the run's own file, so it decides nothing by itself: its accuracy is measured by the grader on data
the run never sees, and its time is when the grader saw it.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from pathlib import Path

from . import verify

# A snapshot's measurement while the run goes; longer than this and it is skipped with a note.
SNAPSHOT_TIMEOUT_S = 120.0
# After the run, the snapshots not measured yet get this long in all (the final model is measured after them).
AFTER_RUN_S = 120.0


@dataclasses.dataclass
class Point:
    """One snapshot's held-out accuracy: ``at_s`` on the grader's clock (when the snapshot appeared)."""
    index: int
    at_s: float
    accuracy: float | None
    reason: str | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class LiveCurve:
    """Measures snapshots (``add``) in the order they came; ``deciding`` is the first point at the target within
    ``budget_s``, once measured (None until then)."""

    def __init__(self, heldout: verify.HeldoutProcess, target: float, budget_s: float):
        self.heldout, self.target, self.budget_s = heldout, target, budget_s
        self.points: list[Point] = []
        self.notes: list[str] = []
        self.checks: dict[int, verify.ModelCheck] = {}
        self.deciding: Point | None = None
        self._files: dict[int, Path] = {}
        self._handed: set[int] = set()
        self._waiting: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._stop_by: float | None = None
        self._thread = threading.Thread(target=self._measure_in_turn, name="held-out curve", daemon=True)
        self._thread.start()

    def add(self, snapshot: dict) -> None:
        """A snapshot the grader took (``snapshots.Snapshot.as_dict()``): measured in turn."""
        self._handed.add(snapshot["index"])
        self._waiting.put(snapshot)

    def reached(self) -> bool:
        return self.deciding is not None

    def curve(self) -> list[dict]:
        with self._lock:
            return [point.as_dict() for point in self.points]

    def deciding_check(self) -> verify.ModelCheck | None:
        return None if self.deciding is None else self.checks[self.deciding.index]

    def deciding_file(self) -> Path | None:
        return None if self.deciding is None else self._files.get(self.deciding.index)

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def _measure_in_turn(self) -> None:
        while True:
            snapshot = self._waiting.get()
            if snapshot is None:
                return
            if self.deciding is not None:
                continue  # the target was reached earlier: nothing after it counts
            if snapshot["at_s"] > self.budget_s:
                self._note("snapshots taken after the time budget were not measured")
                continue
            if self._stop_by is not None and time.monotonic() > self._stop_by:
                self._note(f"snapshot {snapshot['index']} and later were not measured: the grader measures "
                           f"snapshots for at most {AFTER_RUN_S:.0f} s after the run")
                continue
            try:
                check = self.heldout.measure_copy(Path(snapshot["file"]), timeout_s=SNAPSHOT_TIMEOUT_S)
            except (verify.MeasurementTimeout, RuntimeError, OSError) as error:
                self._note(f"snapshot {snapshot['index']} was not measured: {error}")
                check = verify.ModelCheck(None, f"not measured: {error}", None)
            point = Point(snapshot["index"], snapshot["at_s"], check.heldout_accuracy,
                          None if check.heldout_accuracy is not None else check.reason)
            with self._lock:
                self.points.append(point)
                self.checks[point.index] = check
                self._files[point.index] = Path(snapshot["file"])
                if point.accuracy is not None and point.accuracy >= self.target:
                    self.deciding = point

    def finish(self, snapshots=()) -> None:
        """The run is over: measure what is still waiting (and ``snapshots`` not handed over yet, by index) for at
        most ``AFTER_RUN_S``, then stop the thread."""
        for snapshot in snapshots:
            if snapshot["index"] not in self._handed:
                self.add(snapshot)
        self._stop_by = time.monotonic() + AFTER_RUN_S
        self._waiting.put(None)
        self._thread.join(AFTER_RUN_S + SNAPSHOT_TIMEOUT_S + 10)

    def abandon(self) -> None:
        """Stop measuring (the grading is over, or failed): nothing more is started; the thread ends by itself."""
        self._stop_by = 0.0
        self._waiting.put(None)
