"""The verdict: every field a grading writes, with its default, in one place. Verdicts are stored and served as
plain dicts (JSON); ``new_verdict`` builds one from this definition, so a misspelt field fails at once."""

from __future__ import annotations

import dataclasses

VERDICTS = ("pass", "fail", "timeout", "error")


@dataclasses.dataclass
class Verdict:
    verdict: str = "error"                  # one of VERDICTS
    reasons: list = dataclasses.field(default_factory=list)   # why, one sentence a student can act on each
    notes: list = dataclasses.field(default_factory=list)     # facts that did not decide the verdict
    heldout_accuracy: float | None = None   # measured by the grader on the held-out split
    target_accuracy: float | None = None
    wall_time_s: float | None = None        # on the grader's clock
    time_budget_s: float | None = None
    np: int | None = None
    ranks_seen: list = dataclasses.field(default_factory=list)
    allreduce_count: int = 0
    allreduced_tensors: int = 0
    active_deciles: int = 0
    trainable_variables: int | None = None
    epochs_seen: int = 0
    # Every snapshot of the model the grader took while the run went: index, at_s (the grader's clock), bytes,
    # sha256, heldout_accuracy (None: not measured) — the held-out curve.
    snapshots: list = dataclasses.field(default_factory=list)
    time_to_accuracy_s: float | None = None  # when the deciding snapshot appeared (grader's clock); passes only
    deciding_snapshot: int | None = None    # index of the first snapshot at the target within the budget
    stopped_at_target: bool = False         # the grader stopped the run once that snapshot was measured
    witnesses: dict | None = None           # each witness's own figures (timeline, loopback traffic)
    exit_code: int | None = None            # horovodrun's
    cpu_contention: dict | None = None      # CPU other work on the machine used during the run (contention.py)
    contended: bool = False                 # ran out of time while others crowded the machine: not graded
    track: str | None = None
    dataset: str | None = None
    submission: str | None = None
    submission_sha256: str | None = None
    student: str | None = None
    started_at: str | None = None
    finished_at: str | None = None
    logs_dir: str | None = None
    out_dir: str | None = None
    model_path: str | None = None
    backend: str = "local"
    sandboxed: bool = True
    sandbox_uid: int | None = None
    grader_version: str | None = None
    environment: dict | None = None


def new_verdict(**fields) -> dict:
    """A verdict dict with every field of ``Verdict``; unknown fields raise TypeError."""
    return dataclasses.asdict(Verdict(**fields))
