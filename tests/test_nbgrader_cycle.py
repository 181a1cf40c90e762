"""The instructor's nbgrader cycle on the quiz, with the real nbgrader commands in a temporary copy of the course:
generate the release, collect submissions, autograde into the gradebook, generate feedback, export the grades.
Also the Makefile's `release` and `autograde` targets, pointed at a copy of the course with LABS=..."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
from pathlib import Path

import nbformat
import pytest
from nbgrader.api import Gradebook

from conftest import PROJECT_ROOT, VENV_BIN, subprocess_env
from labtools import nbgrader

LABS = PROJECT_ROOT / "labs"
QUIZ = "quiz"
MAX_SCORE = 13.0
# What nbgrader produces; a copy of the course starts without them.
GENERATED = ("release", "submitted", "autograded", "feedback", "gradebook.db", "grades.csv", ".ipynb_checkpoints")

RIGHT_ANSWERS = {1: {"a", "b", "e"}, 2: "b", 3: {"a", "b", "d", "f", "g"}, 4: "c", 5: {"a", "c", "e"},
                 6: {"a", "b", "d"}, 7: "c", 8: {"a", "b"}}
# Some right, some wrong, written the ways students write them (a list, upper case, stray spaces):
# Q1 2 + Q4 1 + Q5 2 + Q7 1 + Q8 2 = 8 points; Q2, Q3 and Q6 are wrong.
MIXED_ANSWERS = {1: {"a", "b", "e"}, 2: "a", 3: {"a", "c"}, 4: " c", 5: ["a", "c", "e"], 6: {"a", "b", "c", "e"},
                 7: "C", 8: {"A", "b"}}
MIXED_SCORE = 8.0


def copy_of_course(destination: Path) -> Path:
    """A copy of labs/ without anything nbgrader generated: tests never write into the repository's labs/."""
    course = destination / "labs"
    shutil.copytree(LABS, course, ignore=shutil.ignore_patterns(*GENERATED))
    return course


def released_course(destination: Path) -> Path:
    course = copy_of_course(destination)
    nbgrader("generate_assignment", QUIZ, "--force", course=course)
    return course


def answered(release_notebook: Path, answers: dict[int, object]):
    """The released quiz with the given answers typed into the answer cells, as a student would."""
    notebook = nbformat.read(release_notebook, as_version=4)
    for cell in notebook.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id", "")
        if grade_id.endswith("-answer"):
            number = int(grade_id[1:-len("-answer")])
            if number in answers:
                cell.source = f"ANSWER_Q{number} = {answers[number]!r}"
    return notebook


def submit(course: Path, student: str, notebook) -> None:
    folder = course / "submitted" / student / QUIZ
    folder.mkdir(parents=True)
    nbformat.write(notebook, folder / "quiz.ipynb")


@pytest.fixture(scope="module")
def graded_course(tmp_path_factory) -> Path:
    """Release, four submissions, autograde, feedback and export, each by the real nbgrader command."""
    course = released_course(tmp_path_factory.mktemp("cycle"))
    release = course / "release" / QUIZ / "quiz.ipynb"
    submit(course, "alice", answered(release, MIXED_ANSWERS))
    submit(course, "bob", nbformat.read(release, as_version=4))          # handed in untouched
    submit(course, "carol", answered(release, RIGHT_ANSWERS))
    # dave gets Q1 wrong and replaces its (locked) test cell with `pass`: autograde must restore the real test.
    tampered = answered(release, {**RIGHT_ANSWERS, 1: {"c"}})
    for cell in tampered.cells:
        if cell.metadata.get("nbgrader", {}).get("grade_id") == "q1-tests":
            cell.source = "pass"
    submit(course, "dave", tampered)
    nbgrader("autograde", QUIZ, course=course)
    nbgrader("generate_feedback", QUIZ, course=course)
    nbgrader("export", course=course)
    return course


def gradebook_scores(course: Path) -> dict[str, tuple[float, float]]:
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        return {submission.student_id: (submission.score, submission.max_score)
                for submission in gradebook.assignment_submissions(QUIZ)}


def test_autograde_stores_each_students_exact_score_in_the_gradebook(graded_course):
    assert gradebook_scores(graded_course) == {"alice": (MIXED_SCORE, MAX_SCORE), "bob": (0.0, MAX_SCORE),
                                              "carol": (MAX_SCORE, MAX_SCORE), "dave": (MAX_SCORE - 2, MAX_SCORE)}


def test_autograde_scores_each_question_all_or_nothing(graded_course):
    with Gradebook(f"sqlite:///{graded_course / 'gradebook.db'}") as gradebook:
        alice = {number: gradebook.find_grade(f"q{number}-tests", "quiz", QUIZ, "alice").score
                 for number in RIGHT_ANSWERS}
    assert alice == {1: 2.0, 2: 0.0, 3: 0.0, 4: 1.0, 5: 2.0, 6: 0.0, 7: 1.0, 8: 2.0}


def test_autograde_runs_the_hidden_tests_and_restores_tampered_test_cells(graded_course):
    autograded = nbformat.read(graded_course / "autograded" / "dave" / QUIZ / "quiz.ipynb", as_version=4)
    q1_tests = next(cell for cell in autograded.cells if cell.metadata["nbgrader"].get("grade_id") == "q1-tests")
    assert "BEGIN HIDDEN TESTS" in q1_tests.source and q1_tests.source != "pass"
    errors = [output for output in q1_tests.outputs if output.output_type == "error"]
    assert len(errors) == 1 and errors[0].ename == "AssertionError"
    assert "(a) is true: " in errors[0].evalue and "(c) is false: " in errors[0].evalue


def test_feedback_html_explains_every_wrong_answer_and_only_those(graded_course):
    html = (graded_course / "feedback" / "alice" / QUIZ / "quiz.html").read_text()
    # Q2: she chose (a); Q3: she picked (c) and left out (b), (d), (f) and (g); Q6: she picked (c) and (e).
    for explanation in ("You chose (a): a model that fits on one GPU is trained faster with data parallelism",
                        "(c) is false: waiting for the slowest worker is the straggler problem of synchronous SGD",
                        "(b) is true: with N workers a gradient is on average about N - 1 updates old",
                        "(e) is false: more capacity lets the model fit the training set even more closely"):
        assert explanation in html, explanation
    assert html.count("AssertionError</span>: Not quite.") == 3
    assert f"quiz (Score: {MIXED_SCORE} / {MAX_SCORE})" in html
    perfect = (graded_course / "feedback" / "carol" / QUIZ / "quiz.html").read_text()
    assert f"quiz (Score: {MAX_SCORE} / {MAX_SCORE})" in perfect and "AssertionError" not in perfect


def test_export_writes_every_students_score_to_csv(graded_course):
    with open(graded_course / "grades.csv", newline="") as handle:
        rows = {row["student_id"]: row for row in csv.DictReader(handle) if row["assignment"] == QUIZ}
    assert {student: (float(row["score"]), float(row["max_score"])) for student, row in rows.items()} == \
        gradebook_scores(graded_course)


def make(target: str, course: Path) -> subprocess.CompletedProcess:
    """`make TARGET` as an instructor types it: the venv is not on PATH (nbgrader needs its `alembic` there)."""
    env = subprocess_env()
    env["PATH"] = os.pathsep.join(folder for folder in env["PATH"].split(os.pathsep)
                                  if Path(folder).resolve() != VENV_BIN.resolve())
    result = subprocess.run(["make", "--no-print-directory", target, f"LABS={course}"], cwd=PROJECT_ROOT,
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, f"make {target} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
    return result


def test_make_release_then_make_autograde_on_a_copy_of_the_course(tmp_path):
    course = copy_of_course(tmp_path)
    # Three assignments show the recipe loops over source/ (no list of labs to keep up to date: lab 6, the newest,
    # is released because it is there); all seven would take 40 s of nbgrader start-ups.
    for assignment in (course / "source").iterdir():
        if assignment.name not in (QUIZ, "lab1", "lab6"):
            shutil.rmtree(assignment)
    make("release", course)
    assignments = sorted(path.name for path in (course / "source").iterdir() if path.is_dir())
    assert assignments == ["lab1", "lab6", QUIZ]
    assert {path.name for path in (course / "release" / "lab6").iterdir()} == {
        "lab6_beyond_data_parallelism.ipynb", "mwms_fashion_mnist.py", "horovod_fashion_mnist.py",
        "ddp_fashion_mnist.py"}
    for assignment in assignments:
        released = list((course / "release" / assignment).glob("*.ipynb"))
        assert released, f"make release produced no notebook for {assignment}"
        assert all("### BEGIN SOLUTION" not in notebook.read_text() for notebook in released)
    submit(course, "erin", answered(course / "release" / QUIZ / "quiz.ipynb", MIXED_ANSWERS))
    make("autograde", course)
    assert gradebook_scores(course) == {"erin": (MIXED_SCORE, MAX_SCORE)}
