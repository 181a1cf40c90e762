"""The grader's snapshots of the models a run saves while it goes (grader/snapshots.py, grader/jobfiles.py).

The run controls its job directory: each test plays the run's part by hand (versions saved at chosen moments, a
pipe, a link to /dev/zero, a file of 5 GB, a file rewritten while the grader copies it) and checks what the grader
kept, on its own clock, and what it said about the rest."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
from pathlib import Path

import pytest

from scalelab.grader import jobfiles, launch, sandbox, snapshots

RELATIVE = "output/model.keras"
LIMIT = 1 << 20


@pytest.fixture()
def job(tmp_path):
    (tmp_path / "job" / "output").mkdir(parents=True)
    return tmp_path / "job"


def collector(job: Path, destination: Path, **settings) -> snapshots.SnapshotCollector:
    return snapshots.SnapshotCollector(job, RELATIVE, destination, owner_uid=os.getuid(), limit_bytes=LIMIT,
                                       poll_interval_s=0.0, **settings)


def save(job: Path, content: bytes) -> None:
    """As the assessment's DO-NOT-EDIT section saves: written beside, renamed into place."""
    partial = job / "output" / ".model.partial.keras"
    partial.write_bytes(content)
    partial.replace(job / RELATIVE)


def test_each_new_version_is_copied_once_with_the_graders_time_and_digest(job, tmp_path):
    taken = collector(job, tmp_path / "snapshots")
    assert taken.poll(0.5) is None, "nothing saved yet"
    save(job, b"epoch 1 model")
    first = taken.poll(3.0)
    assert taken.poll(6.0) is None, "the same version is not copied again"
    save(job, b"epoch 2 model")
    second = taken.poll(9.5)
    assert [(s.index, s.at_s, s.bytes) for s in (first, second)] == [(1, 3.0, 13), (2, 9.5, 13)]
    assert first.sha256 == hashlib.sha256(b"epoch 1 model").hexdigest()
    assert Path(second.file).read_bytes() == b"epoch 2 model" and Path(second.file).parent == tmp_path / "snapshots"
    assert taken.notes == []


def test_a_run_that_saves_faster_than_the_cap_gets_one_version_per_interval_and_at_most_the_maximum(job, tmp_path):
    taken = collector(job, tmp_path / "snapshots", min_interval_s=2.0, max_snapshots=3)
    kept_at = []
    for step in range(40):  # a new version every 0.25 s for 10 s
        save(job, f"version {step}".encode())
        snapshot = taken.poll(step * 0.25)
        if snapshot:
            kept_at.append(snapshot.at_s)
    assert kept_at == [0.0, 2.0, 4.0], "one per 2 s, and no more than 3"
    assert len(list((tmp_path / "snapshots").iterdir())) == 3
    assert any("more often than every 2 s" in note for note in taken.notes)
    assert any("first 3 versions" in note for note in taken.notes)


@pytest.mark.parametrize("planted, said", [
    (lambda path: os.mkfifo(path), "not a regular file"),
    (lambda path: path.symlink_to("/dev/zero"), "symbolic link"),
    (lambda path: os.truncate(path.write_bytes(b"") or path, 5 << 30), "over the 1048576 byte limit"),
], ids=["a pipe", "a link to /dev/zero", "a sparse 5 GB file"])
def test_a_model_file_the_grader_must_not_read_is_skipped_with_a_note_and_nothing_is_copied(job, tmp_path, planted,
                                                                                            said):
    planted(job / RELATIVE)
    taken = collector(job, tmp_path / "snapshots")
    assert taken.poll(2.0) is None and taken.poll(5.0) is None
    assert taken.snapshots == [] and not list((tmp_path / "snapshots").glob("*"))
    [note] = taken.notes
    assert note.startswith("a saved model was skipped") and said in note
    (job / RELATIVE).unlink()
    save(job, b"a real model")  # a plain file saved later is taken
    assert taken.poll(8.0).bytes == 12


def test_a_model_rewritten_while_the_grader_copies_it_is_not_kept(job, tmp_path, monkeypatch):
    (job / RELATIVE).write_bytes(b"x" * 3000)
    real_read, writes = os.read, []

    def read_while_the_run_writes(descriptor, size):
        chunk = real_read(descriptor, 1000)
        if not writes:  # the run is still writing into the same file, in place
            with open(job / RELATIVE, "r+b") as writer:
                writer.seek(2500)
                writes.append(writer.write(b"y" * 500))
        return chunk

    monkeypatch.setattr(jobfiles.os, "read", read_while_the_run_writes)
    taken = collector(job, tmp_path / "snapshots")
    assert taken.poll(2.0) is None
    assert taken.snapshots == [] and not list((tmp_path / "snapshots").glob("*"))
    assert "changed while the grader read it" in taken.notes[0]


def test_a_model_saved_just_before_the_run_exits_is_taken_at_the_exit(job, tmp_path):
    taken = snapshots.SnapshotCollector(job, RELATIVE, tmp_path / "snapshots", owner_uid=os.getuid(),
                                        limit_bytes=LIMIT, poll_interval_s=1.0, min_interval_s=2.0)
    save(job, b"epoch 1 model")
    assert taken.poll(9.0).at_s == 9.0
    save(job, b"epoch 2 model")  # saved, then the run exits before the next look is due
    assert taken.poll(9.5) is None
    final = taken.final_look(9.6)
    assert (final.index, final.at_s) == (2, 9.6), "the exit is looked at even within the once-per-2 s cap"
    assert Path(final.file).read_bytes() == b"epoch 2 model"
    assert taken.final_look(9.7) is None, "the version already kept is not copied again"
    assert taken.notes == []


def test_a_run_that_saves_its_model_and_exits_at_once_leaves_that_model_in_the_graders_snapshots(tmp_path):
    """A run, in the real sandbox, that saves its model and ends a moment later, between two of the grader's looks."""
    problem = sandbox.sandbox_works()
    if problem:
        pytest.fail(problem)
    submission = tmp_path / "assessment.py"
    submission.write_text("")
    job = launch.prepare_job(submission, tmp_path / "job", dataset="fashion-mnist", track_name="test", np=1,
                             launcher="gloo", launcher_options=(), time_budget_s=60, grace_s=5,
                             logs_dir=tmp_path / "logs", hidden_paths=[], snapshots_dir=tmp_path / "snapshots")
    saves_and_exits = ("import os, pathlib, time; time.sleep(1.5); "
                       "pathlib.Path(os.environ['SCALELAB_OUTPUT_DIR'], 'model.keras').write_bytes(b'final model')")
    try:
        run = launch.run_local(dataclasses.replace(job, command=[sys.executable, "-c", saves_and_exits]))
    finally:
        sandbox.release_uid(job.sandbox_uid)
    assert run.exit_code == 0, run.launcher_log
    [final] = run.snapshots
    assert final["at_s"] == pytest.approx(run.wall_time_s, abs=0.5) and final["bytes"] == len(b"final model")
    assert Path(final["file"]).read_bytes() == b"final model"
