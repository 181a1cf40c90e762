"""`scalelab class gradebook` (grader/classroom/gradebook.py): the class page's rows into a real nbgrader
gradebook, read back with `nbgrader export`. The rows are made by the service's own code (classpage.csv_text);
the service itself is a small local stand-in here (tests/test_hub_class_gradebook.py asks the real one)."""

from __future__ import annotations

import csv
import hashlib
import http.server
import shutil
import socket
import subprocess
import threading
import warnings
from pathlib import Path

import pytest
from nbgrader.api import Gradebook
from sqlalchemy.exc import SAWarning

from conftest import PROJECT_ROOT, VENV_BIN, subprocess_env
from labtools import nbgrader

from scalelab.grader.classroom import gradebook as class_gradebook
from scalelab.grader.queue import DONE
from scalelab.grader.service import classpage


QUIZ = "quiz"
COURSE_ID = "scalelab"
START = 1_760_000_000  # a Unix time; each job finishes 100 s after it was submitted
TOKEN = "instructors-token"


def job(job_id: int, student: str, verdict: str | None) -> dict:
    """A job as the grader's queue gives it to the class page: finished with ``verdict``, or still running."""
    return {"id": job_id, "student": student, "state": DONE if verdict else "running",
            "verdict": {"verdict": verdict, "heldout_accuracy": 0.9 if verdict == "pass" else 0.4,
                        "wall_time_s": 50.0} if verdict else None,
            "submitted_at": START + 1000 * job_id, "finished_at": START + 1000 * job_id + 100 if verdict else None,
            "submission_path": "assessment.py"}


# alice passes on her second try; bob fails; carol's script errors; dave never submitted; erin's run is not done.
FIRST_JOBS = [job(1, "alice", "fail"), job(2, "alice", "pass"), job(3, "bob", "fail"), job(4, "carol", "error"),
              job(5, "erin", None)]
HUB_STUDENTS = ["alice", "bob", "carol", "dave", "erin"]
FIRST_SCORES = {"alice": 1.0, "bob": 0.0, "carol": 0.0, "dave": 0.0, "erin": 0.0}


def class_csv(path: Path, jobs: list[dict], students=HUB_STUDENTS) -> Path:
    path.write_text(classpage.csv_text(classpage.class_rows(jobs, list(students))), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def released_course(tmp_path_factory) -> Path:
    """A course directory with the real quiz released by nbgrader: its gradebook holds the quiz's grade cells."""
    course = tmp_path_factory.mktemp("released") / "course"
    (course / "source").mkdir(parents=True)
    shutil.copy(PROJECT_ROOT / "labs" / "nbgrader_config.py", course)
    shutil.copytree(PROJECT_ROOT / "labs" / "source" / QUIZ, course / "source" / QUIZ)
    nbgrader("generate_assignment", QUIZ, "--force", course=course)
    return course


@pytest.fixture()
def course(released_course, tmp_path) -> Path:
    """A copy of the released course where alice has 2 points for the quiz, stored with nbgrader's API."""
    course = tmp_path / "course"
    shutil.copytree(released_course, course)
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}", course_id=COURSE_ID) as gradebook, \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", SAWarning)  # nbgrader's add_submission, as in the command
        gradebook.add_student("alice")
        gradebook.add_submission(QUIZ, "alice")
        grade = gradebook.find_grade("q1-tests", QUIZ, QUIZ, "alice")
        grade.auto_score, grade.needs_manual_grade = 2.0, False
        gradebook.db.commit()
    return course


def scalelab_class_gradebook(*arguments: str, cwd: Path, **environment: str) -> subprocess.CompletedProcess:
    """The command as typed in ``cwd``, without a Hub's token unless given."""
    env = subprocess_env(**environment)
    for name in ("JUPYTERHUB_API_TOKEN", "SCALELAB_ASSESS_SERVICE_URL"):
        if name not in environment:
            env.pop(name, None)
    return subprocess.run([str(VENV_BIN / "scalelab"), "class", "gradebook", *arguments], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def imported(course: Path, csv_file: Path) -> subprocess.CompletedProcess:
    done = scalelab_class_gradebook("--csv", str(csv_file), cwd=course)
    assert done.returncode == 0, done.stderr
    return done


def exported(course: Path) -> dict[tuple[str, str], dict]:
    """`nbgrader export` in the course: (assignment, student) → its row of grades.csv."""
    nbgrader("export", course=course)
    with (course / "grades.csv").open(newline="") as handle:
        return {(row["assignment"], row["student_id"]): row for row in csv.DictReader(handle)}


def scores(rows: dict[tuple[str, str], dict], assignment: str) -> dict[str, float]:
    return {student: float(row["score"]) for (name, student), row in rows.items() if name == assignment}


def gradebook_contents(course: Path) -> dict:
    """Everything the gradebook says about every assignment, without nbgrader's random ids."""
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}", course_id=COURSE_ID) as gradebook:
        contents = {"students": sorted(student.id for student in gradebook.students)}
        for assignment in gradebook.assignments:
            cells = sorted((notebook.name, cell.name, cell.max_score) for notebook in assignment.notebooks
                           for cell in notebook.grade_cells)
            submissions = {}
            for submission in gradebook.assignment_submissions(assignment.name):
                grades = sorted((grade.notebook.name, grade.cell.name, grade.auto_score, grade.manual_score,
                                 grade.needs_manual_grade) for notebook in submission.notebooks
                                for grade in notebook.grades)
                submissions[submission.student_id] = (submission.timestamp, submission.score, grades)
            contents[assignment.name] = {"duedate": assignment.duedate, "cells": cells, "submissions": submissions}
        return contents


def file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- from a class.csv --------------------------------------------------------------------------------------------

def test_the_columns_the_import_reads_are_columns_of_the_class_pages_csv():
    assert set(class_gradebook.REQUIRED_COLUMNS) <= set(classpage.CSV_COLUMNS)
    assert class_gradebook.FORMULA_START == classpage.FORMULA_START


def test_export_lists_each_students_assessment_score_next_to_the_quiz(course, tmp_path):
    done = imported(course, class_csv(tmp_path / "class.csv", FIRST_JOBS))
    assert "5 students: 1 passed (score 1), 2 did not (0), 2 without a verdict yet" in done.stdout
    rows = exported(course)
    assert scores(rows, "assessment") == FIRST_SCORES
    assert {row["max_score"] for (name, _), row in rows.items() if name == "assessment"} == {"1.0"}
    assert scores(rows, QUIZ) == {"alice": 2.0, "bob": 0.0, "carol": 0.0, "dave": 0.0, "erin": 0.0}
    # The timestamp is when the counted run finished; no verdict yet is no submission, as for a quiz not handed in.
    assert rows[("assessment", "alice")]["timestamp"] == "2025-10-09 09:28:20"  # job 2: START + 2100 s, UTC
    assert rows[("assessment", "dave")]["timestamp"] == rows[("assessment", "erin")]["timestamp"] == ""


def test_a_fail_that_becomes_a_pass_is_updated_and_the_quiz_is_left_as_it_was(course, tmp_path):
    imported(course, class_csv(tmp_path / "first.csv", FIRST_JOBS))
    quiz_before = gradebook_contents(course)[QUIZ]
    imported(course, class_csv(tmp_path / "second.csv", [*FIRST_JOBS, job(6, "bob", "pass")]))
    rows = exported(course)
    assert scores(rows, "assessment") == {**FIRST_SCORES, "bob": 1.0}
    assert gradebook_contents(course)[QUIZ] == quiz_before
    assert scores(rows, QUIZ)["alice"] == 2.0


def test_importing_the_same_rows_twice_gives_the_same_gradebook(course, tmp_path):
    rows = class_csv(tmp_path / "class.csv", FIRST_JOBS)
    imported(course, rows)
    once = gradebook_contents(course)
    again = imported(course, rows)
    assert gradebook_contents(course) == once
    assert "students added: 0, submissions of an earlier import removed: 0." in again.stdout


def test_each_import_replaces_the_previous_one(course, tmp_path):
    """A student with no verdict in the new rows keeps no submission of an earlier import; a student who is not in
    the rows any more stays in the gradebook (their quiz is theirs) without an assessment submission."""
    imported(course, class_csv(tmp_path / "first.csv", FIRST_JOBS))
    later = [job(1, "alice", "fail"), job(3, "bob", "fail")]
    done = imported(course, class_csv(tmp_path / "later.csv", later, students=["alice", "bob"]))
    assert "submissions of an earlier import removed: 1." in done.stdout  # carol's
    rows = exported(course)
    assert scores(rows, "assessment") == {"alice": 0.0, "bob": 0.0, "carol": 0.0, "dave": 0.0, "erin": 0.0}
    assert rows[("assessment", "carol")]["timestamp"] == ""
    assert set(gradebook_contents(course)["assessment"]["submissions"]) == {"alice", "bob"}


def test_the_gradebook_can_be_named_from_another_folder(course, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = scalelab_class_gradebook("--csv", str(class_csv(tmp_path / "class.csv", FIRST_JOBS)),
                                    "--gradebook", f"sqlite:///{course / 'gradebook.db'}", cwd=elsewhere)
    assert done.returncode == 0, done.stderr
    assert scores(exported(course), "assessment") == FIRST_SCORES


def test_a_csv_without_the_class_pages_columns_is_refused_and_the_gradebook_is_unchanged(course, tmp_path):
    wrong = tmp_path / "grades.csv"
    wrong.write_text("student,score\nalice,1\n")
    before = file_hash(course / "gradebook.db")
    done = scalelab_class_gradebook("--csv", str(wrong), cwd=course)
    assert done.returncode == class_gradebook.EXIT_BAD_INPUT == 2
    assert done.stderr.strip().splitlines() == [
        f"scalelab class gradebook: {wrong} is not the class page's class.csv: it has no column best_verdict, "
        "best_finished_at (it needs student, best_verdict, best_finished_at)."]
    assert file_hash(course / "gradebook.db") == before


def test_a_row_without_a_student_is_refused_and_the_gradebook_is_unchanged(course, tmp_path):
    rows = class_csv(tmp_path / "class.csv", FIRST_JOBS)
    rows.write_text(rows.read_text() + ",1,0,7,done,pass,,7,pass,0.9,50,\r\n")
    before = file_hash(course / "gradebook.db")
    done = scalelab_class_gradebook("--csv", str(rows), cwd=course)
    assert done.returncode == 2 and "line 7 names no student" in done.stderr, done.stderr
    assert file_hash(course / "gradebook.db") == before


def test_a_gradebook_that_does_not_exist_is_refused_and_not_created(tmp_path):
    missing = tmp_path / "nowhere" / "gradebook.db"
    done = scalelab_class_gradebook("--csv", str(class_csv(tmp_path / "class.csv", FIRST_JOBS)),
                                    "--gradebook", f"sqlite:///{missing}", cwd=tmp_path)
    assert done.returncode == class_gradebook.EXIT_FAILED == 1
    assert f"there is no gradebook at {missing}" in done.stderr
    assert not missing.parent.exists()


def test_a_file_that_is_not_a_gradebook_is_refused_and_left_as_it_was(tmp_path):
    not_a_database = tmp_path / "gradebook.db"
    not_a_database.write_text("not a database\n" * 100)
    done = scalelab_class_gradebook("--csv", str(class_csv(tmp_path / "class.csv", FIRST_JOBS)),
                                    "--gradebook", f"sqlite:///{not_a_database}", cwd=tmp_path)
    assert done.returncode == 1 and "cannot be opened or written" in done.stderr, done.stderr
    assert not_a_database.read_text() == "not a database\n" * 100


def test_an_nbgrader_assignment_of_the_same_name_is_not_overwritten(course, tmp_path):
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}", course_id=COURSE_ID) as gradebook:
        gradebook.add_assignment("assessment")
        gradebook.add_notebook("essay", "assessment")
        gradebook.add_grade_cell("essay-grade", "essay", "assessment", max_score=10, cell_type="markdown")
    before = gradebook_contents(course)
    done = scalelab_class_gradebook("--csv", str(class_csv(tmp_path / "class.csv", FIRST_JOBS)), cwd=course)
    assert done.returncode == 1 and "did not make (essay/essay-grade)" in done.stderr, done.stderr
    assert gradebook_contents(course) == before


# --- from the grader service -------------------------------------------------------------------------------------

class StandInService(http.server.BaseHTTPRequestHandler):
    """The service's class.csv route as classpage.ClassCsvHandler answers: the rows for the instructor's token,
    the error page of classpage.InstructorPage for any other."""

    csv_text = ""
    requests: list[tuple[str, str | None]] = []

    def do_GET(self):
        self.requests.append((self.path, self.headers.get("Authorization")))
        if self.headers.get("Authorization") == f"token {TOKEN}":
            status, kind, body = 200, "text/csv", self.csv_text
        else:
            message = "slb is not an instructor: the class page is for the Hub group 'instructors' only."
            status, kind = 403, "text/html"
            body = classpage.page("403 Forbidden", f"<h1>403 Forbidden</h1><p>{classpage.escape(message)}</p>")
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", f"{kind}; charset=UTF-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *arguments):
        pass


@pytest.fixture()
def service():
    StandInService.csv_text = classpage.csv_text(classpage.class_rows(FIRST_JOBS, HUB_STUDENTS))
    StandInService.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StandInService)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/services/scalelab/"
    server.shutdown()
    server.server_close()


def test_the_rows_are_asked_from_the_service_with_the_instructors_token(course, service):
    done = scalelab_class_gradebook(cwd=course, JUPYTERHUB_API_TOKEN=TOKEN, SCALELAB_ASSESS_SERVICE_URL=service)
    assert done.returncode == 0, done.stderr
    assert StandInService.requests == [("/services/scalelab/class.csv", f"token {TOKEN}")]
    assert scores(exported(course), "assessment") == FIRST_SCORES


def test_someone_who_is_not_an_instructor_gets_the_services_sentence(course, service):
    before = file_hash(course / "gradebook.db")
    done = scalelab_class_gradebook(cwd=course, JUPYTERHUB_API_TOKEN="a-students-token",
                                    SCALELAB_ASSESS_SERVICE_URL=service)
    assert done.returncode == class_gradebook.EXIT_NOT_INSTRUCTOR == 6
    assert done.stderr.strip() == ("scalelab class gradebook: the grader service refused the class's rows (403): slb "
                                   "is not an instructor: the class page is for the Hub group 'instructors' only.")
    assert file_hash(course / "gradebook.db") == before


def test_without_a_token_the_command_says_where_to_run_it(course):
    done = scalelab_class_gradebook(cwd=course, SCALELAB_ASSESS_SERVICE_URL="http://127.0.0.1:8000/services/x/")
    assert done.returncode == class_gradebook.EXIT_NO_SERVICE == 5
    assert done.stderr.strip() == ("scalelab class gradebook: $JUPYTERHUB_API_TOKEN not set: run this in a terminal "
                                   "of your JupyterLab on the Hub, or give the class page's class.csv with --csv FILE.")


def test_a_service_that_does_not_answer_is_reported(course):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = scalelab_class_gradebook(cwd=course, JUPYTERHUB_API_TOKEN=TOKEN,
                                    SCALELAB_ASSESS_SERVICE_URL=f"http://127.0.0.1:{port}/services/scalelab/")
    assert done.returncode == 5
    assert f"the grader service at http://127.0.0.1:{port}/services/scalelab/class.csv did not answer" in done.stderr
