"""``scalelab class gradebook``: the assessment's verdicts into nbgrader's gradebook, beside the quiz and the labs.

The grader service keeps the verdicts (its class page, ``class.csv``); the instructors keep nbgrader's course
directory, which the service's account must not write. So an instructor pulls them: in a terminal of their
JupyterLab on the Hub this fetches the class's rows from the service with their own token
(``$JUPYTERHUB_API_TOKEN``; the service answers instructors only), or reads a saved ``class.csv``, and writes them
with nbgrader's Gradebook API into the gradebook nbgrader's configuration names (the class's course directory).

In the gradebook the assessment is the assignment ``assessment``: one notebook, one autograded grade cell worth 1.
A student whose best verdict is ``pass`` scores 1, any other verdict (fail, timeout, error) 0. A student with no
verdict yet (never submitted, or a run still queued or running) gets no submission, so nbgrader counts them as not
handed in (0, no timestamp). Each import replaces the previous one: the assessment's submissions are made to match
the rows, missing students are added (none is removed), and no other assignment is touched.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import html
import io
import logging
import os
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from .accounts import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, ClassError

ASSIGNMENT = NOTEBOOK = "assessment"
GRADE_CELL = "verdict"
MAX_SCORE = 1.0
PASS = "pass"
# The columns of the class page's class.csv (grader/service/classpage.py, CSV_COLUMNS) that the import reads.
REQUIRED_COLUMNS = ("student", "best_verdict", "best_finished_at")
# The class page quotes a cell starting with these with a "'", so that a spreadsheet takes it for text.
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
# What the Hub puts in every server's environment (grader/service/hub.py, register()).
SERVICE_URL_VARIABLE = "SCALELAB_ASSESS_SERVICE_URL"
TOKEN_VARIABLE = "JUPYTERHUB_API_TOKEN"
FETCH_TIMEOUT_S = 60
# Tables every nbgrader gradebook has; a database without them is not one.
GRADEBOOK_TABLES = {"alembic_version", "assignment", "student", "submitted_assignment", "grade"}

EXIT_NO_SERVICE, EXIT_NOT_INSTRUCTOR = 5, 6
EXIT_CODES = (f"{EXIT_OK} imported; {EXIT_FAILED} the gradebook cannot be opened or written; {EXIT_BAD_INPUT} the "
              f"rows are not the class page's class.csv; {EXIT_NO_SERVICE} the grader service cannot be asked (no "
              f"token, not reachable, an error); {EXIT_NOT_INSTRUCTOR} the service refused (not an instructor)")


@dataclass(frozen=True)
class StudentVerdict:
    student: str
    verdict: str | None  # the best run's; None while no run has finished
    finished_at: dt.datetime | None

    @property
    def score(self) -> float:
        return MAX_SCORE if self.verdict == PASS else 0.0


# --- the rows -----------------------------------------------------------------------------------------------------

def _unquoted(value: str | None) -> str:
    value = (value or "").strip()
    if value[:1] == "'" and value[1:2] in FORMULA_START:
        return value[1:]
    return value


def read_rows(text: str, source: str) -> list[StudentVerdict]:
    """The class page's rows in ``text`` (a class.csv); ``source`` names it in the sentence of a ``ClassError``."""
    reader = csv.DictReader(io.StringIO(text))
    missing = [column for column in REQUIRED_COLUMNS if column not in (reader.fieldnames or [])]
    if missing:
        raise ClassError(f"{source} is not the class page's class.csv: it has no column {', '.join(missing)} "
                         f"(it needs {', '.join(REQUIRED_COLUMNS)}).", EXIT_BAD_INPUT)
    rows: dict[str, StudentVerdict] = {}
    for row in reader:
        student = _unquoted(row["student"])
        where = f"{source}, line {reader.line_num}"
        if not student:
            raise ClassError(f"{where} names no student.", EXIT_BAD_INPUT)
        if student in rows:
            raise ClassError(f"{where}: {student} has a row already; class.csv has one row per student.",
                             EXIT_BAD_INPUT)
        finished = _unquoted(row["best_finished_at"])
        try:
            finished_at = dt.datetime.fromisoformat(finished) if finished else None
        except ValueError:
            raise ClassError(f"{where}: best_finished_at {finished!r} is not an ISO 8601 time.",
                             EXIT_BAD_INPUT) from None
        rows[student] = StudentVerdict(student, _unquoted(row["best_verdict"]) or None, finished_at)
    return list(rows.values())


def read_csv_file(path: Path) -> list[StudentVerdict]:
    try:
        text = path.read_text(encoding="utf-8-sig")  # a spreadsheet saves UTF-8 with a byte order mark
    except (OSError, UnicodeDecodeError) as error:
        raise ClassError(f"{path} cannot be read as UTF-8 text ({error.__class__.__name__}: "
                         f"{getattr(error, 'strerror', None) or error}).", EXIT_BAD_INPUT) from None
    return read_rows(text, str(path))


def _service_says(answer) -> str:
    """The sentence of the service's error page (classpage.InstructorPage) or JSON error, else the status."""
    found = re.search(r"<p>(.*?)</p>", answer.text, re.S)
    if found:
        return html.unescape(found.group(1)).strip()
    try:
        return str(answer.json()["message"])
    except (ValueError, KeyError, TypeError):
        return answer.reason or f"HTTP {answer.status_code}"


def fetch_rows(service_url: str, token: str) -> list[StudentVerdict]:
    """The class's rows from the grader service's ``class.csv``, asked with the instructor's Hub token."""
    import requests

    url = service_url.rstrip("/") + "/class.csv"
    try:
        answer = requests.get(url, headers={"Authorization": f"token {token}"}, timeout=FETCH_TIMEOUT_S,
                              allow_redirects=False)
    except requests.RequestException as error:
        raise ClassError(f"the grader service at {url} did not answer ({error.__class__.__name__}): is the Hub "
                         "running, and is this its address?", EXIT_NO_SERVICE) from None
    if answer.is_redirect:  # to the Hub's login: the token is not one the Hub accepts
        raise ClassError(f"the grader service at {url} did not accept ${TOKEN_VARIABLE} (it sent the request to the "
                         "Hub's login): run this in a terminal of your JupyterLab on the Hub.", EXIT_NOT_INSTRUCTOR)
    if answer.status_code in (401, 403):
        raise ClassError(f"the grader service refused the class's rows ({answer.status_code}): "
                         f"{_service_says(answer)}", EXIT_NOT_INSTRUCTOR)
    if answer.status_code != 200:
        raise ClassError(f"the grader service at {url} answered {answer.status_code}: {_service_says(answer)}",
                         EXIT_NO_SERVICE)
    answer.encoding = "utf-8"
    return read_rows(answer.text, url)


# --- the gradebook ------------------------------------------------------------------------------------------------

def configured_gradebook() -> tuple[str, str]:
    """(gradebook URL, course id) as `nbgrader` typed in this folder would read them from its configuration: on the
    Hub, the class's course directory for an instructor (containers/hub/nbgrader_config.py)."""
    from nbgrader.apps.baseapp import NbGrader

    app = NbGrader(log_level=logging.ERROR)
    try:
        app.initialize([])
        return app.coursedir.db_url, app.coursedir.course_id
    except (Exception, SystemExit) as error:
        raise ClassError(f"nbgrader's configuration cannot be read ({error.__class__.__name__}: {error}).",
                         EXIT_FAILED) from None
    finally:
        NbGrader.clear_instance()


def _sqlite_path(db_url: str) -> Path | None:
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        url = make_url(db_url)
    except ArgumentError:
        raise ClassError(f"{db_url!r} is not a database URL (e.g. sqlite:////srv/nbgrader/course/gradebook.db).",
                         EXIT_FAILED) from None
    if url.get_backend_name() != "sqlite" or not url.database or url.database == ":memory:":
        return None
    return Path(url.database)


def _assessment_is_ours(gradebook) -> None:
    """Refuses an assignment ``assessment`` that holds notebooks or cells this import did not make (an nbgrader
    assignment of that name): replacing its submissions would lose real work."""
    from nbgrader.api import MissingEntry

    try:
        assignment = gradebook.find_assignment(ASSIGNMENT)
    except MissingEntry:
        return
    found = {(notebook.name, cell.name) for notebook in assignment.notebooks
             for cell in [*notebook.grade_cells, *notebook.solution_cells, *notebook.task_cells,
                          *notebook.source_cells]}
    notebooks = {notebook.name for notebook in assignment.notebooks}
    if notebooks - {NOTEBOOK} or found - {(NOTEBOOK, GRADE_CELL)}:
        raise ClassError(f"the gradebook's assignment '{ASSIGNMENT}' holds notebooks or cells this command did not "
                         f"make ({', '.join(sorted(f'{nb}/{cell}' for nb, cell in found))}): nothing was changed.",
                         EXIT_FAILED)


def write_scores(gradebook, rows: list[StudentVerdict]) -> dict[str, int]:
    """The rows as the assignment ``assessment`` of an open nbgrader Gradebook; returns what was done, counted."""
    from nbgrader.api import MissingEntry

    _assessment_is_ours(gradebook)
    gradebook.update_or_create_assignment(ASSIGNMENT)
    gradebook.update_or_create_notebook(NOTEBOOK, ASSIGNMENT)
    gradebook.update_or_create_grade_cell(GRADE_CELL, NOTEBOOK, ASSIGNMENT, max_score=MAX_SCORE, cell_type="code")
    known = {student.id for student in gradebook.students}
    counts = {"passed": 0, "not_passed": 0, "no_verdict": 0, "students_added": 0, "submissions_removed": 0}
    for row in rows:
        if row.student not in known:
            gradebook.add_student(row.student)
            counts["students_added"] += 1
        if row.verdict is None:
            counts["no_verdict"] += 1
            continue
        try:
            grade = gradebook.find_grade(GRADE_CELL, NOTEBOOK, ASSIGNMENT, row.student)
        except MissingEntry:  # no submission yet, or one made before the grade cell was: made again
            try:
                gradebook.remove_submission(ASSIGNMENT, row.student)
            except MissingEntry:
                pass
            gradebook.add_submission(ASSIGNMENT, row.student, timestamp=row.finished_at)
            grade = gradebook.find_grade(GRADE_CELL, NOTEBOOK, ASSIGNMENT, row.student)
        else:
            gradebook.update_or_create_submission(ASSIGNMENT, row.student, timestamp=row.finished_at)
        # As nbgrader's autograder stores a score (preprocessors/saveautogrades.py); an earlier manual score or
        # extra credit would outlive the verdict it was given for, so the import clears them.
        grade.auto_score, grade.manual_score, grade.extra_credit = row.score, None, None
        grade.needs_manual_grade = False
        gradebook.db.commit()
        counts["passed" if row.score == MAX_SCORE else "not_passed"] += 1
    with_verdict = {row.student for row in rows if row.verdict is not None}
    for submission in list(gradebook.assignment_submissions(ASSIGNMENT)):
        if submission.student_id not in with_verdict:
            gradebook.remove_submission(ASSIGNMENT, submission.student_id)
            counts["submissions_removed"] += 1
    return counts


def _nbgrader_tables_missing(db_url: str) -> set[str]:
    from sqlalchemy import create_engine, inspect

    engine = create_engine(db_url)
    try:
        return GRADEBOOK_TABLES - set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def import_rows(rows: list[StudentVerdict], db_url: str, course_id: str) -> dict[str, int]:
    """Opens the gradebook ``db_url`` (it must exist) and writes the rows into it; see ``write_scores``."""
    from nbgrader.api import Gradebook, InvalidEntry
    from sqlalchemy.exc import SAWarning, SQLAlchemyError

    path = _sqlite_path(db_url)
    if path is not None and not path.is_file():
        raise ClassError(f"there is no gradebook at {path}: give the class's with --gradebook sqlite:///PATH, or run "
                         "this where nbgrader's configuration names it (an instructor's terminal on the Hub, or the "
                         "course directory).", EXIT_FAILED)
    try:
        missing = _nbgrader_tables_missing(db_url)
        if missing:  # Gradebook() would add its tables to any database
            raise ClassError(f"{db_url} is not nbgrader's gradebook (it has no table {', '.join(sorted(missing))}): "
                             "nothing was changed.", EXIT_FAILED)
        with Gradebook(db_url, course_id=course_id or "default_course") as gradebook, warnings.catch_warnings():
            # nbgrader's add_submission builds its rows before adding them to the session, which SQLAlchemy 2
            # remarks on; the rows are stored all the same.
            warnings.filterwarnings("ignore", category=SAWarning, module=r"nbgrader\.api")
            return write_scores(gradebook, rows)
    except (SQLAlchemyError, InvalidEntry, OSError) as error:
        said = str(error).strip().splitlines()[0] if str(error).strip() else error.__class__.__name__
        raise ClassError(f"the gradebook {db_url} cannot be opened or written ({said}).", EXIT_FAILED) from None


# --- the command --------------------------------------------------------------------------------------------------

def command(args: argparse.Namespace) -> int:
    try:
        if args.csv is not None:
            rows, source = read_csv_file(args.csv), str(args.csv)
        else:
            token = os.environ.get(TOKEN_VARIABLE, "")
            service_url = args.service or os.environ.get(SERVICE_URL_VARIABLE, "")
            if not token or not service_url:
                lacking = " and ".join(f"${name}" for name, value in ((TOKEN_VARIABLE, token),
                                                                        (SERVICE_URL_VARIABLE, service_url))
                                       if not value)
                raise ClassError(f"{lacking} not set: run this in a terminal of your JupyterLab on the Hub, or give "
                                 "the class page's class.csv with --csv FILE.", EXIT_NO_SERVICE)
            rows, source = fetch_rows(service_url, token), service_url
        db_url, course_id = configured_gradebook()
        db_url = args.gradebook or db_url
        counts = import_rows(rows, db_url, course_id)
    except ClassError as error:
        print(f"scalelab class gradebook: {error}", file=sys.stderr)
        return error.exit_code
    print(f"assignment '{ASSIGNMENT}' in {db_url}, from {source}: {len(rows)} students: {counts['passed']} passed "
          f"(score 1), {counts['not_passed']} did not (0), {counts['no_verdict']} without a verdict yet (no "
          f"submission); students added: {counts['students_added']}, submissions of an earlier import removed: "
          f"{counts['submissions_removed']}.")
    return EXIT_OK


def register(actions: argparse._SubParsersAction) -> None:
    parser = actions.add_parser(
        "gradebook", help="the assessment's verdicts into nbgrader's gradebook (an instructor, on the Hub)",
        description="Write each student's assessment score into nbgrader's gradebook as the assignment "
                    f"'{ASSIGNMENT}' (1 for a best verdict 'pass', 0 for any other verdict, no submission without "
                    "a verdict), replacing the previous import, so that `nbgrader export` lists it next to the quiz "
                    "and the labs. The rows come from the grader service's class.csv, asked with "
                    f"${TOKEN_VARIABLE} at ${SERVICE_URL_VARIABLE} (both set in your JupyterLab on the Hub), or "
                    f"from --csv. Exit codes: {EXIT_CODES}.")
    parser.add_argument("--csv", type=Path, metavar="FILE",
                        help="read the class page's class.csv from FILE instead of asking the grader service")
    parser.add_argument("--gradebook", metavar="URL",
                        help="nbgrader's gradebook, e.g. sqlite:////srv/nbgrader/course/gradebook.db (default: the "
                             "one nbgrader's configuration names here)")
    parser.add_argument("--service", metavar="URL",
                        help=f"the grader service's address (default: ${SERVICE_URL_VARIABLE})")
    parser.set_defaults(func=command)
