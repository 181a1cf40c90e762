"""The class board: students ranked by their best time to accuracy (passes only), from the service's jobs.

A student's place is their fastest pass (``time_to_accuracy_s``, the grader's clock; a verdict from before the
referee measured it counts its run's wall time). Equal times share a rank. Fails, timeouts and errors are not on
the board. The instructors' page shows every name; a student sees their own best time and rank, and the others'
names only where the course says so (``AssessService.board_names``).
"""

from __future__ import annotations

import dataclasses

DONE = "done"


@dataclasses.dataclass
class Place:
    rank: int
    student: str
    time_to_accuracy_s: float
    job: int
    heldout_accuracy: float | None
    curve: list  # (at_s, held-out accuracy) of the deciding run's snapshots, as the grader measured them


def time_to_accuracy(verdict: dict) -> float | None:
    """A passing verdict's time to accuracy; None for anything else."""
    if not isinstance(verdict, dict) or verdict.get("verdict") != "pass":
        return None
    value = verdict.get("time_to_accuracy_s")
    if value is None:
        value = verdict.get("wall_time_s")
    return float(value) if isinstance(value, (int, float)) else None


def curve(verdict: dict) -> list:
    return [(snapshot["at_s"], snapshot["heldout_accuracy"]) for snapshot in verdict.get("snapshots") or []
            if isinstance(snapshot, dict) and isinstance(snapshot.get("at_s"), (int, float))
            and isinstance(snapshot.get("heldout_accuracy"), (int, float))]


def standings(jobs: list[dict]) -> list[Place]:
    """Each student with a pass, fastest first; equal times share the rank (1, 2, 2, 4)."""
    best: dict[str, tuple] = {}
    for job in jobs:
        if job.get("state") != DONE:
            continue
        seconds = time_to_accuracy(job.get("verdict"))
        if seconds is None:
            continue
        key = (seconds, job["id"])
        if job["student"] not in best or key < best[job["student"]][0]:
            best[job["student"]] = (key, job)
    ordered = sorted(best.items(), key=lambda item: (item[1][0], item[0]))
    places, previous = [], None
    for position, (student, ((seconds, job_id), job)) in enumerate(ordered, start=1):
        rank = previous.rank if previous is not None and previous.time_to_accuracy_s == seconds else position
        previous = Place(rank, student, seconds, job_id, job["verdict"].get("heldout_accuracy"),
                         curve(job["verdict"]))
        places.append(previous)
    return places


def student_view(jobs: list[dict], student: str, names_shown: bool) -> dict:
    """What one student sees: their own best time and rank (None without a pass), how many are on the board,
    and the board itself, with the others' names only when ``names_shown``."""
    places = standings(jobs)
    own = next((place for place in places if place.student == student), None)
    return {"best_time_to_accuracy_s": own.time_to_accuracy_s if own else None,
            "rank": own.rank if own else None, "on_board": len(places), "names_shown": names_shown,
            "board": [{"rank": place.rank, "time_to_accuracy_s": place.time_to_accuracy_s,
                       "student": place.student if names_shown or place.student == student else None,
                       "you": place.student == student} for place in places]}
