"""The labs through nbgrader's exchange on the class's Hub (`make hub`, containers/hub/nbgrader_config.py): an
instructor releases the quiz from the class's course directory with nbgrader's own commands, student A fetches,
answers and submits it through their server's Assignments API (what the Assignments tab calls), the instructor
collects and autogrades it, and A's score is in the one gradebook. Students get the Assignments tab and none of
nbgrader's instructor tools; student B cannot list A's submission. As root, with the accounts and the Hub of
tests/hubtools.py (the exchange and the course directory are the fixture's own)."""

from __future__ import annotations

import csv
import json
import pwd
import re
import stat
import subprocess
from pathlib import Path

import nbformat
import psutil
import pytest
from nbgrader.api import Gradebook

from conftest import PROJECT_ROOT
from scalelab.grader.sandbox import SANDBOX_UID_RANGE
from hubtools import HUB_VENV, accounts, hub, logged_in_server  # noqa: F401 — accounts and hub are fixtures

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

COURSE_ID = "scalelab"
QUIZ = "quiz"
SOURCE_QUIZ = PROJECT_ROOT / "labs" / "source" / QUIZ / "quiz.ipynb"
QUIZ_MAX_SCORE = 13.0
INSTRUCTOR_LAB_TOOLS = ("@jupyter/nbgrader:formgrader", "@jupyter/nbgrader:create-assignment",
                        "@jupyter/nbgrader:course-list")
SOLUTION_MARKERS = ("### BEGIN SOLUTION", "### END SOLUTION")


def as_account(name: str, *command: str, input: str | None = None,
               extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``command`` as ``name`` in their home, with what a terminal of their JupyterLab has: the shared venv first on
    PATH, and nothing of root's environment (``extra_env`` adds to it)."""
    home = pwd.getpwnam(name).pw_dir
    added = [f"{key}={value}" for key, value in (extra_env or {}).items()]
    return subprocess.run(
        ["runuser", "-u", name, "--", "env", "-i", f"HOME={home}", f"USER={name}", f"LOGNAME={name}",
         f"PATH={HUB_VENV / 'bin'}:/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8", *added, *command],
        cwd=home, capture_output=True, text=True, timeout=600, input=input)


def nbgrader_as(name: str, *arguments: str) -> subprocess.CompletedProcess:
    done = as_account(name, str(HUB_VENV / "bin" / "nbgrader"), *arguments)
    assert done.returncode == 0, f"nbgrader {' '.join(arguments)} as {name} failed:\n{done.stdout[-3000:]}" \
                                 f"{done.stderr[-3000:]}"
    return done


def page_config(session, server: str) -> dict:
    """The configuration JupyterLab's page hands the browser (which lab extensions it loads)."""
    page = session.get(f"{server}/lab", timeout=60)
    assert page.status_code == 200
    found = re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>', page.text, re.S)
    assert found, "no jupyter-config-data in JupyterLab's page"
    return json.loads(found.group(1))


def solutions(source: Path) -> dict[str, str]:
    """grade_id → the instructor's answer, from the source notebook's solution cells (markers left out)."""
    answers = {}
    for cell in nbformat.read(source, as_version=4).cells:
        metadata = cell.metadata.get("nbgrader", {})
        if metadata.get("solution"):
            answers[metadata["grade_id"]] = "\n".join(
                line for line in cell.source.splitlines() if line.strip() not in SOLUTION_MARKERS)
    return answers


@pytest.fixture(scope="module")
def course_dir(hub) -> Path:
    return hub.nbgrader_home / "course"


@pytest.fixture(scope="module")
def inbound(hub) -> Path:
    return hub.nbgrader_home / "exchange" / COURSE_ID / "inbound"


@pytest.fixture(scope="module")
def released_quiz(hub, accounts):
    """The instructor's two commands, from their home (the course directory comes from the Hub's nbgrader config)."""
    instructor = accounts["instructor"]
    nbgrader_as(instructor, "generate_assignment", QUIZ)
    released = nbgrader_as(instructor, "release_assignment", QUIZ)
    assert f"Released as: {COURSE_ID} {QUIZ}" in released.stdout + released.stderr
    return instructor


@pytest.fixture(scope="module")
def student_a(hub, accounts):
    return logged_in_server(hub, accounts["student_a"])


@pytest.fixture(scope="module")
def submitted_quiz(student_a, released_quiz):
    """A fetches the quiz, types the right answers and saves (the contents API, as JupyterLab saves), submits it.
    Returns the Assignments API's answer to the fetch and the submit."""
    session, server, headers = student_a
    body = {"course_id": COURSE_ID, "assignment_id": QUIZ}
    fetched = session.post(f"{server}/assignments/fetch", json=body, headers=headers, timeout=120)
    assert fetched.status_code == 200, fetched.text
    fetched = fetched.json()
    assert fetched["success"], fetched
    entry = next((a for a in fetched["value"] if a["assignment_id"] == QUIZ and a["status"] == "fetched"), None)
    assert entry, f"the quiz is not fetched: {fetched}"
    path = entry["notebooks"][0]["path"]

    notebook_url = f"{server}/api/contents/{path}"
    model = session.get(notebook_url, headers=headers, timeout=60).json()
    notebook = nbformat.from_dict(model["content"])
    answers, typed = solutions(SOURCE_QUIZ), 0
    for cell in notebook.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id in answers:
            cell.source = answers[grade_id]
            typed += 1
    assert typed == len(answers) == 8, f"answered {typed} of {len(answers)} answer cells"
    saved = session.put(notebook_url, headers=headers, timeout=60,
                        json={"type": "notebook", "format": "json", "content": notebook})
    assert saved.status_code == 200, saved.text

    submitted = session.post(f"{server}/assignments/submit", json=body, headers=headers, timeout=120)
    assert submitted.status_code == 200, submitted.text
    submitted = submitted.json()
    assert submitted["success"], submitted.get("value")
    return {"fetched": fetched, "submitted": submitted, "path": path}


@pytest.fixture(scope="module")
def graded_quiz(submitted_quiz, released_quiz, course_dir):
    instructor = released_quiz
    nbgrader_as(instructor, "collect", QUIZ)
    nbgrader_as(instructor, "autograde", QUIZ)
    return course_dir / "gradebook.db"


def test_students_get_the_assignments_tab_and_none_of_nbgraders_instructor_tools(student_a, released_quiz):
    session, server, headers = student_a
    disabled = set(page_config(session, server)["disabledExtensions"])
    assert set(INSTRUCTOR_LAB_TOOLS) <= disabled
    assert not {"@jupyter/nbgrader:assignment-list", "@jupyter/nbgrader:validate-assignment"} & disabled
    listing = session.get(f"{server}/assignments", params={"course_id": COURSE_ID}, headers=headers, timeout=120)
    assert listing.status_code == 200 and listing.json()["success"], listing.text
    assert any(a["assignment_id"] == QUIZ and a["status"] == "released" for a in listing.json()["value"])
    for tool in ("formgrader", "formgrader/api/assignments", "formgraders"):
        assert session.get(f"{server}/{tool}", headers=headers, timeout=60).status_code == 404, tool


def test_instructors_get_the_formgrader_on_the_class_course_directory(hub, accounts, released_quiz):
    session, server, headers = logged_in_server(hub, accounts["instructor"])
    disabled = set(page_config(session, server)["disabledExtensions"])
    assert not set(INSTRUCTOR_LAB_TOOLS) & disabled
    assert session.get(f"{server}/formgrader", headers=headers, timeout=60).status_code == 200
    assignments = session.get(f"{server}/formgrader/api/assignments", headers=headers, timeout=60)
    assert assignments.status_code == 200, assignments.text
    assert QUIZ in {assignment["name"] for assignment in assignments.json()}, assignments.text


def test_a_student_fetches_the_release_without_solutions_into_their_home_and_submits_it(hub, accounts,
                                                                                       submitted_quiz):
    released = (hub.nbgrader_home / "exchange" / COURSE_ID / "outbound" / QUIZ / "quiz.ipynb").read_text()
    assert "BEGIN HIDDEN TESTS" in SOURCE_QUIZ.read_text() and "BEGIN SOLUTION" in SOURCE_QUIZ.read_text()
    assert "BEGIN HIDDEN TESTS" not in released and "BEGIN SOLUTION" not in released
    student = pwd.getpwnam(accounts["student_a"])
    assert submitted_quiz["path"] == f"{QUIZ}/quiz.ipynb", "fetched into the server's root folder, the home"
    fetched = Path(student.pw_dir) / submitted_quiz["path"]
    assert fetched.is_file() and fetched.stat().st_uid == student.pw_uid
    assert any(a["assignment_id"] == QUIZ and a["status"] == "submitted" for a in submitted_quiz["submitted"]["value"])


def test_the_instructor_collects_and_autogrades_and_the_students_score_is_in_the_gradebook(accounts, graded_quiz,
                                                                                           course_dir):
    student = accounts["student_a"]
    collected = course_dir / "submitted" / student / QUIZ / "quiz.ipynb"
    assert collected.is_file()
    with Gradebook(f"sqlite:///{graded_quiz}", course_id=COURSE_ID) as gradebook:
        submission = gradebook.find_submission(QUIZ, student)
        assert submission.max_score == QUIZ_MAX_SCORE
        assert submission.score > 0
        assert submission.score == QUIZ_MAX_SCORE, "every answer typed was the instructor's"
    instructor = accounts["instructor"]
    nbgrader_as(instructor, "export")
    with (Path(pwd.getpwnam(instructor).pw_dir) / "grades.csv").open() as exported:
        rows = [row for row in csv.DictReader(exported) if row["student_id"] == student and row["assignment"] == QUIZ]
    assert len(rows) == 1 and float(rows[0]["score"]) == QUIZ_MAX_SCORE


def test_the_student_fetches_the_feedback_the_instructor_released(accounts, graded_quiz, student_a):
    instructor, student = accounts["instructor"], pwd.getpwnam(accounts["student_a"])
    nbgrader_as(instructor, "generate_feedback", QUIZ)
    nbgrader_as(instructor, "release_feedback", QUIZ)
    session, server, headers = student_a
    fetched = session.post(f"{server}/assignments/fetch_feedback", headers=headers, timeout=120,
                           json={"course_id": COURSE_ID, "assignment_id": QUIZ})
    assert fetched.status_code == 200 and fetched.json()["success"], fetched.text
    feedback = list((Path(student.pw_dir) / QUIZ / "feedback").glob("*/quiz.html"))
    assert len(feedback) == 1 and feedback[0].stat().st_uid == student.pw_uid
    text = feedback[0].read_text()
    assert "BEGIN HIDDEN TESTS" not in text and "Score:" in text


def test_another_student_cannot_list_or_read_a_submission(accounts, submitted_quiz, inbound, course_dir):
    student_a, student_b = accounts["student_a"], accounts["student_b"]
    submissions = [path for path in inbound.iterdir() if path.name.startswith(f"{student_a}+{QUIZ}+")]
    assert len(submissions) == 1 and submissions[0].stat().st_uid == pwd.getpwnam(student_a).pw_uid
    mode = inbound.stat().st_mode
    assert stat.S_IMODE(mode) & 0o007 == 0o003, "students may write into inbound/, never list it"
    listing = as_account(student_b, "ls", str(inbound))
    assert listing.returncode != 0 and "Permission denied" in listing.stderr
    assert student_a not in listing.stdout
    guessed = as_account(student_b, "python3", "-c", f"import glob; print(glob.glob('{inbound}/{student_a}+*'))")
    assert guessed.returncode == 0 and guessed.stdout.strip() == "[]"
    for private in (course_dir / "submitted", course_dir / "gradebook.db", course_dir / "source" / QUIZ):
        attempt = as_account(student_b, "ls", str(private))
        assert attempt.returncode != 0 and "Permission denied" in attempt.stderr, private


# --- a student's notebook code never runs as the instructor (autograde in the grading sandbox) --------------------

# Student B's quiz: each answer cell attacks the instructor who autogrades it, and would earn its points if the
# attack worked (a cell that forks without end stops its kernel: tests/test_kernel_sandbox.py). {course}, {gradebook}, {home} and {hub} are filled in with the class's real paths and address.
ATTACKS = {
    "q1-answer": '''import os, re
ANSWER_Q1 = {{"f"}}  # wrong, unless the instructor's source can be read
for path in ["{course}/source/quiz/quiz.ipynb", os.path.expanduser("~/nbgrader-course/source/quiz/quiz.ipynb")]:
    try:
        ANSWER_Q1 = eval(re.search(r"ANSWER_Q1 = (\\{{[^}}]*\\}})", open(path).read()).group(1))
        print("READ-THE-SOURCE", path)
    except OSError as error:
        print("no source:", type(error).__name__)''',
    "q2-answer": '''ANSWER_Q2 = "b"
for target in ["{gradebook}", "{home}/pwned.txt", "{course}/pwned.txt"]:
    try:
        with open(target, "a") as written:
            written.write("pwned")
        print("WROTE", target)
    except OSError as error:
        print("refused:", type(error).__name__)''',
    "q3-answer": '''import os, urllib.request
ANSWER_Q3 = {{"c"}}  # wrong, unless the Hub answers with the instructor's token
token = os.environ.get("JUPYTERHUB_API_TOKEN", "")
print("TOKEN:" + token)
try:
    request = urllib.request.Request("{hub}/hub/api/user", headers={{"Authorization": "token " + token}})
    print("HUB-API-REACHED", urllib.request.urlopen(request, timeout=5).read()[:200])
    ANSWER_Q3 = {{"a", "b", "d", "f", "g"}}
except Exception as error:
    print("no hub:", type(error).__name__)''',
    "q4-answer": '''while True:  # never return
    pass''',
    "q6-answer": '''from IPython.display import HTML, display
display(HTML('<img src="x" onerror="window.stolen = document.cookie"><script>window.stolen = 1</script><b>SHOWN-TO-THE-INSTRUCTOR</b>'))
ANSWER_Q6 = {{"a", "b", "d"}}''',
}
# Right answers for the rest, so that the notebook still earns what it should after the attacks.
ATTACKED_SCORES = {"q1-tests": 0, "q2-tests": 1, "q3-tests": 0, "q4-tests": 0, "q5-tests": 2, "q6-tests": 2,
                   "q7-tests": 1, "q8-tests": 2}
CELL_TIMEOUT_S = 20


def server_token(name: str) -> str:
    """The Hub API token in the environment of ``name``'s JupyterLab (what a terminal of theirs inherits)."""
    uid = pwd.getpwnam(name).pw_uid
    for process in psutil.process_iter(["uids", "cmdline"]):
        if process.info["uids"] and process.info["uids"].real == uid and \
                any("jupyterhub-singleuser" in part for part in process.info["cmdline"] or []):
            token = process.environ().get("JUPYTERHUB_API_TOKEN")
            if token:
                return token
    pytest.fail(f"no running server of {name} with a Hub token")


@pytest.fixture(scope="module")
def attacked_and_graded(hub, accounts, graded_quiz, course_dir):
    """B fetches the quiz and submits the attacks (by nbgrader's own commands, as B); the instructor, from a
    terminal of their JupyterLab (its Hub token in the environment), collects and autogrades the class."""
    instructor, student_b = accounts["instructor"], accounts["student_b"]
    logged_in_server(hub, instructor)
    token = server_token(instructor)
    nbgrader_as(student_b, "fetch_assignment", QUIZ)
    fetched = Path(pwd.getpwnam(student_b).pw_dir) / QUIZ / "quiz.ipynb"
    notebook = nbformat.read(fetched, as_version=4)
    answers = solutions(SOURCE_QUIZ)
    filled = {"course": course_dir, "gradebook": course_dir / "gradebook.db", "hub": hub.url,
              "home": pwd.getpwnam(instructor).pw_dir}
    for cell in notebook.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id in ATTACKS:
            cell.source = ATTACKS[grade_id].format(**filled)
        elif grade_id in answers:
            cell.source = answers[grade_id]
    written = as_account(student_b, "python3", "-c", "import sys; open(sys.argv[1], 'w').write(sys.stdin.read())",
                         str(fetched), input=nbformat.writes(notebook))
    assert written.returncode == 0, written.stderr
    nbgrader_as(student_b, "submit", QUIZ)
    nbgrader_as(instructor, "collect", QUIZ)
    graded = as_account(instructor, str(HUB_VENV / "bin" / "nbgrader"), "autograde", QUIZ,
                        f"--Execute.timeout={CELL_TIMEOUT_S}",
                        extra_env={"JUPYTERHUB_API_TOKEN": token, "JUPYTERHUB_API_URL": f"{hub.url}/hub/api"})
    assert graded.returncode == 0, graded.stdout[-3000:] + graded.stderr[-3000:]
    autograded = course_dir / "autograded" / student_b / QUIZ / "quiz.ipynb"
    outputs = [output for cell in nbformat.read(autograded, as_version=4).cells for output in cell.get("outputs", [])]
    said = "\n".join(output.get("text", "") + str(output.get("data", {}).get("text/plain", "")) +
                     (f"{output.ename}: {output.evalue}" if output.output_type == "error" else "")
                     for output in outputs)
    return {"token": token, "said": said, "notebook": autograded.read_text(), "log": graded.stdout + graded.stderr,
            "homes": {name: pwd.getpwnam(name).pw_dir for name in accounts.values()}}


def test_a_students_attacks_on_the_autograding_instructor_are_contained_and_graded(accounts, course_dir,
                                                                                    attacked_and_graded):
    student_a, student_b = accounts["student_a"], accounts["student_b"]
    said = attacked_and_graded["said"]  # what B's cells printed while they were graded
    assert "READ-THE-SOURCE" not in said and "no source: FileNotFoundError" in said
    assert "WROTE" not in said and "refused: FileNotFoundError" in said
    assert not (course_dir / "pwned.txt").exists()
    assert not (Path(attacked_and_graded["homes"][accounts["instructor"]]) / "pwned.txt").exists()
    assert attacked_and_graded["token"] not in attacked_and_graded["notebook"] and "TOKEN:\n" in said
    assert "HUB-API-REACHED" not in said and "no hub: URLError" in said
    assert "KeyboardInterrupt" in said, "the cell that never returns was interrupted"
    with Gradebook(f"sqlite:///{course_dir / 'gradebook.db'}", course_id=COURSE_ID) as gradebook:
        for grade_id, points in ATTACKED_SCORES.items():
            assert gradebook.find_grade(grade_id, QUIZ, QUIZ, student_b).score == points, grade_id
        assert gradebook.find_submission(QUIZ, student_b).score == sum(ATTACKED_SCORES.values())
        assert gradebook.find_submission(QUIZ, student_a).score == QUIZ_MAX_SCORE, "A's grade is untouched"
    # Nothing B's kernel started outlives the grading.
    assert not [p for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real in SANDBOX_UID_RANGE]


def test_the_formgrader_shows_a_students_html_sanitised(hub, accounts, course_dir, attacked_and_graded):
    session, server, headers = logged_in_server(hub, accounts["instructor"])
    listed = session.get(f"{server}/formgrader/api/submitted_notebooks/{QUIZ}/quiz", headers=headers, timeout=60)
    assert listed.status_code == 200, listed.text
    submission = next(entry for entry in listed.json() if entry["student"] == accounts["student_b"])
    page = session.get(f"{server}/formgrader/submissions/{submission['id']}/", headers=headers, timeout=120)
    assert page.status_code == 200, page.text[:2000]
    # The output is rendered as HTML (its harmless part shows), the script and the handler are gone; the cell's
    # source, shown escaped, is text.
    assert "<b>SHOWN-TO-THE-INSTRUCTOR</b>" in page.text
    assert "<script>window.stolen" not in page.text
    assert not re.search(r"<img[^>]*onerror", page.text), "an event handler of the student's reached the page"
