"""The Assess service's REST API against a real Jupyter server process (scalelab.grader.serve enabled).

Two students (token table identity provider, see tests/submissions/service/scalelab_test_identity.py), each with
their own folder, and the syntax-error submission so that a verdict comes in seconds. The pause between a
student's submissions is an hour, so a second submission after a verdict is always too early here.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import socket
import stat
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "submissions" / "service"))
from conftest import EDITION_TEST_TRACK  # noqa: E402
from jupyter_process import TEST_TRACKS, JupyterServer  # noqa: E402

from scalelab.grader import panel  # noqa: E402
from scalelab.grader.queue import AssessQueue, sqlite_url  # noqa: E402

FAST_SUBMISSION = Path(__file__).parent / "submissions" / "service" / "syntax_error_fast.py"
TOKENS = {"alice-token": "alice", "bob-token": "bob"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("course")
    home = tmp_path_factory.mktemp("home")
    for student in TOKENS.values():
        (root / student / "assessment").mkdir(parents=True)
    shutil.copy(FAST_SUBMISSION, root / "alice" / "assessment" / "assessment.py")
    jupyter = JupyterServer(root, home, user_tokens=TOKENS, service={
        "slots": 1, "track": EDITION_TEST_TRACK, "tracks_file": str(TEST_TRACKS), "max_queued": 5,
        "submission_path": "{student}/assessment/assessment.py", "min_seconds_between_submissions": 3600}).start()
    yield jupyter
    jupyter.stop()


def test_every_route_requires_jupyter_authentication(server):
    for method, path in (("GET", "service"), ("GET", "assessments"), ("POST", "assessments"),
                         ("GET", "assessments/1"), ("GET", "board")):
        assert server.api(method, path, token="").status_code in (401, 403), (method, path)
        assert server.api(method, path, token="not-a-token").status_code in (401, 403), (method, path)


def test_the_board_answers_the_student_with_their_own_standing(server):
    standing = server.api("GET", "board", token="bob-token").json()
    assert standing["names_shown"] is False and standing["rank"] is None
    assert set(standing) == {"best_time_to_accuracy_s", "rank", "on_board", "names_shown", "board"}


def test_service_describes_the_track_and_the_student(server):
    info = server.api("GET", "service", token="alice-token").json()
    assert info["student"] == "alice"
    assert info["track"] == EDITION_TEST_TRACK and info["slots"] == 1
    assert info["time_budget_s"] == 400 and info["target_accuracy"] == 0.70
    assert info["min_seconds_between_submissions"] == 3600


def test_submit_copies_the_file_at_submit_time_and_a_second_submit_returns_the_active_job(server):
    source = server.root_dir / "alice" / "assessment" / "assessment.py"
    submitted_sha256 = hashlib.sha256(source.read_bytes()).hexdigest()
    first = server.api("POST", "assessments", token="alice-token")
    assert first.status_code == 201, first.text
    job = first.json()["job"]
    assert job["state"] in ("queued", "running") and job["student"] == "alice"
    source.write_text(source.read_text() + "\n# edited after submitting\n")  # must not change the queued job
    again = server.api("POST", "assessments", token="alice-token")
    assert again.status_code == 200 and again.json()["created"] is False
    assert again.json()["job"]["id"] == job["id"]

    done = server.wait_for_job(job["id"], "alice-token")
    assert done["state"] == "done", done
    verdict = done["verdict"]
    assert verdict["verdict"] == "fail"
    assert any("not valid Python" in reason for reason in verdict["reasons"])
    assert verdict["submission_sha256"] == submitted_sha256 == done["submission_sha256"]
    assert done["position"] is None and done["finished_at"] >= done["started_at"] >= done["submitted_at"]

    history = server.api("GET", "assessments", token="alice-token").json()
    assert history["student"] == "alice"
    assert [entry["id"] for entry in history["assessments"]][:1] == [job["id"]]
    assert history["assessments"][0]["verdict"]["verdict"] == "fail"

    # The job has its verdict, but the next submission comes too early: a sentence with the wait, and no job.
    third = server.api("POST", "assessments", token="alice-token")
    assert third.status_code == 429, third.text
    wait_s = int(third.headers["Retry-After"])
    assert 3000 < wait_s <= 3600
    assert third.json()["message"] == (f"Please wait {wait_s} more seconds before clicking Assess again: each "
                                       f"student may submit once every 3600 seconds.")
    after = server.api("GET", "assessments", token="alice-token").json()["assessments"]
    assert [entry["id"] for entry in after] == [job["id"]]
    with pytest.raises(panel.ServiceError, match="Please wait \\d+ more seconds"):
        panel.AssessClient(server.url, "alice-token").submit()


def _strings_in(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _strings_in(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings_in(item)


def test_a_students_view_holds_no_server_path_host_name_or_sandbox_uid(server):
    done = [entry for entry in server.api("GET", "assessments", token="alice-token").json()["assessments"]
            if entry["state"] == "done"]
    assert done, "the submit test above should have left alice a graded job"
    job_id = done[0]["id"]
    queue = AssessQueue(sqlite_url(server.database))
    stored = queue.get(job_id)
    queue.close()
    jobs_dir, home, host = str(server.home / "assess" / "jobs"), str(server.home), socket.gethostname()
    # What the grader stored does hold them, so the checks below are not vacuous.
    stored_text = json.dumps(stored)
    assert jobs_dir in stored_text and host in stored["verdict"]["environment"].values()
    assert "sandbox_uid" in stored["verdict"]

    one = server.api("GET", f"assessments/{job_id}", token="alice-token")
    history = server.api("GET", "assessments", token="alice-token")
    for view in (one.json(), *[entry for entry in history.json()["assessments"] if entry["id"] == job_id]):
        assert view["verdict"]["verdict"] == "fail" and view["verdict"]["reasons"]
        assert view["verdict"]["submission_sha256"] == stored["submission_sha256"]
        for text in _strings_in(view):
            assert jobs_dir not in text and home not in text, text
            assert not re.search(rf"\b{re.escape(host)}\b", text), text
    for body in (one.text, history.text):
        assert "sandbox_uid" not in body and "environment" not in body and "job_dir" not in body


def test_job_directories_and_their_files_are_private_to_the_server_account(server):
    jobs_root = server.home / "assess" / "jobs"
    assert stat.S_IMODE(jobs_root.stat().st_mode) == 0o700
    job_dirs = list(jobs_root.iterdir())
    assert job_dirs, "the submit test above should have left alice a job directory"
    for job_dir in job_dirs:
        assert stat.S_IMODE(job_dir.stat().st_mode) == 0o700
        for name in ("assessment.py", "grader.stdout", "grader.stderr"):
            assert stat.S_IMODE((job_dir / name).stat().st_mode) == 0o600, name


def test_an_id_beyond_the_databases_integer_range_answers_404_with_the_usual_sentence(server):
    for job_id in ("99999999999999999999", str(2**63), str(2**31), "9" * 5000):
        response = server.api("GET", f"assessments/{job_id}", token="alice-token")
        assert response.status_code == 404, response.text
        assert response.json()["message"] == f"There is no assessment {job_id} of yours."
    assert "OverflowError" not in server.log_tail(lines=400)


def test_a_student_sees_only_their_own_jobs(server):
    alice_jobs = server.api("GET", "assessments", token="alice-token").json()["assessments"]
    assert alice_jobs, "the submit test above should have left alice a job"
    assert server.api("GET", f"assessments/{alice_jobs[0]['id']}", token="bob-token").status_code == 404
    assert server.api("GET", "assessments", token="bob-token").json()["assessments"] == []


def test_a_missing_assessment_py_is_refused_with_a_sentence(server):
    response = server.api("POST", "assessments", token="bob-token")
    assert response.status_code == 404
    assert "There is no bob/assessment/assessment.py to assess" in response.json()["message"]
    assert server.api("GET", "assessments", token="bob-token").json()["assessments"] == []


def test_an_empty_file_is_refused_with_a_sentence(server):
    empty = server.root_dir / "bob" / "assessment" / "assessment.py"
    empty.write_text("")
    try:
        response = server.api("POST", "assessments", token="bob-token")
    finally:
        empty.unlink()
    assert response.status_code == 400
    assert "cannot be assessed" in response.json()["message"] and "empty" in response.json()["message"]


def test_the_panel_client_turns_service_errors_into_sentences(server):
    client = panel.AssessClient(server.url, "bob-token")
    assert client.service()["student"] == "bob"
    with pytest.raises(panel.ServiceError, match="There is no bob/assessment/assessment.py"):
        client.submit()
    with pytest.raises(panel.ServiceError, match="not logged in"):
        panel.AssessClient(server.url, "wrong-token").service()
    with pytest.raises(panel.ServiceError, match="not reachable"):
        panel.AssessClient(f"http://127.0.0.1:{_closed_port()}/", "bob-token").service()


def _closed_port() -> int:
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_jupyter_user_identity_under_jupyters_token_login_is_refused_at_start(tmp_path):
    # Jupyter's stock identity provider (no user table): each token request would be a new anonymous student.
    refused = JupyterServer(tmp_path / "course", tmp_path / "home", service={
        "track": EDITION_TEST_TRACK, "tracks_file": str(TEST_TRACKS), "student_identity": "jupyter-user"})
    refused.root_dir.mkdir()
    refused.start(ready_path="api/status")
    try:
        assert refused.api("GET", "service").status_code == 404
        assert refused.api("POST", "assessments").status_code == 404
        assert "AssessService.student_identity = 'jupyter-user' cannot be used with Jupyter's stock identity " \
               "provider (PasswordIdentityProvider)" in refused.log_tail(lines=400)
    finally:
        refused.stop()
