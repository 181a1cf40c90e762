"""`scalelab grade`: a class in nbgrader's layout, graded for real, stored, resumable, CSV, feedback and scores
in nbgrader's gradebook."""

import csv
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import keras_only, subprocess_env
from scalelab.grader import grading, report

SUBMISSIONS = Path(__file__).parent / "submissions"
TEST_TRACKS = SUBMISSIONS / "tracks.toml"
# A class on each edition's track: (track, bob's honest submission, the file students submit).
KERAS_CLASS = pytest.param(("fashion-mnist-test", "honest_small.py", "assessment.py"), marks=keras_only, id="keras")
DDP_CLASS = pytest.param(("fashion-mnist-ddp-test", "ddp_small.py", "assessment_pytorch.py"), id="ddp")


def make_class(course: Path, honest: str = "honest_small.py", name: str = "assessment.py") -> None:
    """alice: syntax error; bob: an honest submission; carol: submitted nothing; dave: an empty file."""
    for student, source in (("alice", "syntax_error.py"), ("bob", honest)):
        folder = course / "submitted" / student / "assessment"
        folder.mkdir(parents=True)
        shutil.copyfile(SUBMISSIONS / source, folder / name)
    (course / "submitted" / "carol" / "assessment").mkdir(parents=True)
    (course / "submitted" / "dave").mkdir(parents=True)
    (course / "submitted" / "dave" / name).write_text("")


def grade(course: Path, tmp_path: Path, *extra, track: str = "fashion-mnist-test"):
    return subprocess.run([sys.executable, "-m", "scalelab.cli", "grade", str(course), "--track", track,
                           "--track-file", str(TEST_TRACKS), "--parallel", "2", "--out", str(tmp_path / "graded"),
                           "--gradebook", str(tmp_path / "gradebook.db"), *extra],
                          capture_output=True, text=True, timeout=900,
                          env=subprocess_env(SCALELAB_HOME=str(tmp_path / "home")))


def test_find_submissions_accepts_both_layouts(tmp_path):
    (tmp_path / "flat" / "erin").mkdir(parents=True)
    (tmp_path / "flat" / "erin" / "assessment.py").write_text("print(1)\n")
    make_class(tmp_path / "course")
    assert grading.find_submissions(tmp_path / "flat") == {"erin": tmp_path / "flat" / "erin" / "assessment.py"}
    found = grading.find_submissions(tmp_path / "course")
    assert found["bob"] == tmp_path / "course" / "submitted" / "bob" / "assessment" / "assessment.py"
    assert found["carol"] is None and found["dave"] == tmp_path / "course" / "submitted" / "dave" / "assessment.py"


@pytest.mark.slow
@pytest.mark.parametrize("edition", [KERAS_CLASS, DDP_CLASS])
def test_grading_a_class_stores_csv_feedback_and_gradebook_and_resumes(tmp_path, edition):
    track, honest, name = edition
    course = tmp_path / "course"
    make_class(course, honest, name)
    first = grade(course, tmp_path, track=track)
    assert first.returncode == 0, first.stdout + first.stderr
    rows = {row["student"]: row for row in csv.DictReader((tmp_path / "graded" / "grades.csv").open())}
    assert {s: rows[s]["verdict"] for s in rows} == {"alice": "fail", "bob": "pass", "carol": "fail", "dave": "fail"}
    assert {s: float(rows[s]["score"]) for s in rows} == {"alice": 0.0, "bob": 1.0, "carol": 0.0, "dave": 0.0}
    assert "SyntaxError" in rows["alice"]["reasons"] and f"no {name} was submitted" in rows["carol"]["reasons"]
    assert "is empty" in rows["dave"]["reasons"]

    feedback = (tmp_path / "graded" / "bob" / "feedback.md").read_text()
    # The grader's own measurements are always there; the run may be stopped at its target before it prints.
    assert "**Verdict: PASS**" in feedback and "## Held-out accuracy the grader measured" in feedback
    assert re.search(r"\| \d+ \(decided the verdict\) \| [0-9.]+ \| 0\.(7|8|9)\d+ \|", feedback), feedback
    assert "held-out accuracy" in (tmp_path / "graded" / "alice" / "feedback.md").read_text()

    gradebook = grading.NbgraderGradebook(tmp_path / "gradebook.db")
    try:
        assert [gradebook.score(s) for s in ("alice", "bob", "carol", "dave")] == [0.0, 1.0, 0.0, 0.0]
        assert gradebook.gradebook.find_submission("assessment", "bob").score == 1.0
    finally:
        gradebook.close()

    again = grade(course, tmp_path, track=track)  # nothing changed: every verdict comes from the results database
    assert again.returncode == 0
    assert "bob                  pass     (already graded" in again.stdout
    # A changed file is graded again; --regrade grades again what did not change (alice alone, to stay quick).
    alice = course / "submitted" / "alice" / "assessment" / name
    alice.write_text(alice.read_text() + "# changed\n")
    small_class = tmp_path / "small"
    (small_class / "alice").mkdir(parents=True)
    shutil.copyfile(alice, small_class / "alice" / name)
    changed = grade(small_class, tmp_path, track=track)
    assert f"alice                fail     {name} is not valid Python" in changed.stdout
    unchanged = grade(small_class, tmp_path, track=track)
    assert "alice                fail     (already graded" in unchanged.stdout
    regraded = grade(small_class, tmp_path, "--regrade", track=track)
    assert "already graded" not in regraded.stdout and "alice" in regraded.stdout


def test_feedback_shows_the_epoch_curve_rank_0_printed(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank-0.log").write_text("epoch 1/2  loss 1.5000  accuracy 0.4000\nnoise\n"
                                     "epoch 2/2  loss 1.1000  accuracy 0.6000  val_accuracy 0.5500\n")
    verdict = {"verdict": "fail", "student": "erin", "track": "t", "np": 2, "heldout_accuracy": 0.41,
               "target_accuracy": 0.5, "wall_time_s": 12.0, "time_budget_s": 60, "ranks_seen": [0, 1],
               "reasons": ["held-out accuracy 0.4100 is below the target 0.5000"], "notes": [],
               "logs_dir": str(logs)}
    text = report.feedback_markdown(verdict)
    assert "Held-out accuracy the grader measured" not in text  # no snapshot was measured
    assert "| epoch | accuracy | loss | val_accuracy |" in text
    assert "| 2 | 0.6000 | 1.1000 | 0.5500 |" in text
    assert "- held-out accuracy 0.4100 is below the target" in text


def test_feedback_shows_the_held_out_curve_the_grader_measured_and_the_deciding_snapshot():
    verdict = {"verdict": "pass", "student": "erin", "track": "t", "np": 2, "heldout_accuracy": 0.71,
               "target_accuracy": 0.7, "wall_time_s": 31.0, "time_budget_s": 60, "time_to_accuracy_s": 24.5,
               "ranks_seen": [0, 1], "reasons": ["held-out accuracy 0.7100 ≥ target 0.7000"], "notes": [],
               "deciding_snapshot": 2,
               "snapshots": [{"index": 1, "at_s": 12.25, "heldout_accuracy": 0.52},
                             {"index": 2, "at_s": 24.5, "heldout_accuracy": 0.71},
                             {"index": 3, "at_s": 30.0, "heldout_accuracy": None}]}
    text = report.feedback_markdown(verdict)
    assert "| time to accuracy (the grader's clock) | 24.5 s | ≤ 60 s |" in text
    assert "| 1 | 12.2 | 0.5200 |\n| 2 (decided the verdict) | 24.5 | 0.7100 |" in text
    assert "| 3 |" not in text  # not measured: not shown as if it were
