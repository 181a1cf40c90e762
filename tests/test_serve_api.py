"""The Assess service's REST API against a real Jupyter server process (scalelab.grader.serve enabled).

Two students (token table identity provider, see tests/submissions/service/scalelab_test_identity.py), each with
their own folder, and the syntax-error submission so that a verdict comes in seconds.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "submissions" / "service"))
from jupyter_process import TEST_TRACKS, JupyterServer  # noqa: E402

from scalelab.grader import panel  # noqa: E402

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
        "slots": 1, "track": "fashion-mnist-test", "tracks_file": str(TEST_TRACKS), "max_queued": 5,
        "submission_path": "{student}/assessment/assessment.py"}).start()
    yield jupyter
    jupyter.stop()


def test_every_route_requires_jupyter_authentication(server):
    for method, path in (("GET", "service"), ("GET", "assessments"), ("POST", "assessments"),
                         ("GET", "assessments/1")):
        assert server.api(method, path, token="").status_code in (401, 403), (method, path)
        assert server.api(method, path, token="not-a-token").status_code in (401, 403), (method, path)


def test_service_describes_the_track_and_the_student(server):
    info = server.api("GET", "service", token="alice-token").json()
    assert info["student"] == "alice"
    assert info["track"] == "fashion-mnist-test" and info["slots"] == 1
    assert info["time_budget_s"] == 400 and info["target_accuracy"] == 0.70


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

    # Once the job has its verdict, Assess queues a new one (the edited file this time).
    third = server.api("POST", "assessments", token="alice-token")
    assert third.status_code == 201 and third.json()["job"]["id"] > job["id"]
    assert third.json()["job"]["submission_sha256"] != submitted_sha256
    server.wait_for_job(third.json()["job"]["id"], "alice-token")


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
