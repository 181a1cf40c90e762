"""`scalelab class gradebook` on a real Hub (`make hub`, tests/hubtools.py): student A's assessment verdict, asked
from the grader service with instructor I's token, lands in the class's gradebook (the course directory nbgrader's
configuration gives I) and `nbgrader export` lists it; A's own token is refused. Slow, as root."""

from __future__ import annotations

import csv
import grp
import pwd
import stat
import subprocess
from pathlib import Path

import pytest
from nbgrader.api import Gradebook

from hubtools import FAST_SUBMISSION, HUB_VENV, SCALELAB, running_hub

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

COURSE_ID = "scalelab"


@pytest.fixture(scope="module")
def hub():
    with running_hub(student_roles=("A",), instructor_roles=("I",)) as running:
        student = running.students["A"]
        answer = running.submit(student, FAST_SUBMISSION.read_text())
        assert answer.status_code == 201, answer.text
        job = running.wait_for_job(student, answer.json()["job"]["id"])
        assert job["verdict"]["verdict"] == "fail"
        yield running


def as_account(name: str, *command: str, **environment: str) -> subprocess.CompletedProcess:
    """``command`` as ``name`` in their home, with what a terminal of their JupyterLab on the Hub has: the shared
    venv first on PATH, their token and the service's address, and nothing of root's environment."""
    home = pwd.getpwnam(name).pw_dir
    variables = [f"{key}={value}" for key, value in environment.items()]
    return subprocess.run(
        ["runuser", "-u", name, "--", "env", "-i", f"HOME={home}", f"USER={name}", f"LOGNAME={name}",
         f"PATH={HUB_VENV / 'bin'}:/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8", *variables, *command],
        cwd=home, capture_output=True, text=True, timeout=600)


def gradebook_command(hub, name: str) -> subprocess.CompletedProcess:
    return as_account(name, SCALELAB, "class", "gradebook", JUPYTERHUB_API_TOKEN=hub.tokens[name],
                      SCALELAB_ASSESS_SERVICE_URL=hub.service_url)


def test_an_instructor_puts_the_assessment_scores_into_the_class_gradebook(hub):
    student, instructor = hub.students["A"], hub.instructors["I"]
    gradebook_file = hub.nbgrader_home / "course" / "gradebook.db"
    done = gradebook_command(hub, instructor)
    assert done.returncode == 0, done.stderr
    assert f"in sqlite:///{gradebook_file}" in done.stdout and "0 passed (score 1), 1 did not (0)" in done.stdout
    with Gradebook(f"sqlite:///{gradebook_file}", course_id=COURSE_ID) as gradebook:
        submission = gradebook.find_submission("assessment", student)
        assert (submission.score, submission.max_score) == (0.0, 1.0)
    # Still the instructors' shared gradebook: any of them carries on.
    mode = gradebook_file.stat()
    assert mode.st_gid == grp.getgrnam("scalelab-instructors").gr_gid and stat.S_IMODE(mode.st_mode) == 0o660
    exported = as_account(instructor, str(HUB_VENV / "bin" / "nbgrader"), "export")
    assert exported.returncode == 0, exported.stderr
    with (Path(pwd.getpwnam(instructor).pw_dir) / "grades.csv").open(newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if row["assignment"] == "assessment"]
    assert [(row["student_id"], row["score"], row["max_score"]) for row in rows] == [(student, "0.0", "1.0")]
    assert rows[0]["timestamp"], "a student with a verdict has a submission"


def test_a_students_token_is_refused_with_the_services_sentence(hub):
    student = hub.students["A"]
    done = gradebook_command(hub, student)
    assert done.returncode == 6, done.stdout + done.stderr
    assert "the grader service refused the class's rows (403):" in done.stderr
    assert f"{student} is not an instructor" in done.stderr
