"""AssessService (grader/serve.py) in this process, workers not started: identity, paths, slots, queue full."""

from __future__ import annotations

import getpass
import shutil
from pathlib import Path

import pytest
from jupyter_server.auth.identity import IdentityProvider, PasswordIdentityProvider, User
from traitlets.config import Config

from scalelab.grader.serve import AssessService, SubmissionProblem

FAST_SUBMISSION = Path(__file__).parent / "submissions" / "service" / "syntax_error_fast.py"
TEST_TRACKS = Path(__file__).parent / "submissions" / "tracks.toml"


def make_service(tmp_path, monkeypatch, identity_provider=None, **settings) -> AssessService:
    monkeypatch.setenv("SCALELAB_HOME", str(tmp_path / "home"))
    config = Config({"AssessService": {"track": "fashion-mnist-test", "tracks_file": str(TEST_TRACKS), **settings}})
    return AssessService(str(tmp_path / "course"), identity_provider=identity_provider, config=config)


def student_folder(tmp_path, student: str, content: bytes | None = None) -> Path:
    folder = tmp_path / "course" / student / "assessment"
    folder.mkdir(parents=True, exist_ok=True)
    if content is not None:
        (folder / "assessment.py").write_bytes(content)
    return folder


class NamedUsers(IdentityProvider):
    """Stands for JupyterHub's provider: any provider other than Jupyter's stock ones names real users."""


def test_the_student_is_the_server_owner_under_jupyters_anonymous_token_users(tmp_path, monkeypatch):
    user = User(username="a1b2c3", name="Anonymous Io")
    for stock in (IdentityProvider(), PasswordIdentityProvider()):
        assert make_service(tmp_path, monkeypatch, stock).student_of(user) == getpass.getuser()
    assert make_service(tmp_path, monkeypatch, NamedUsers()).student_of(user) == "a1b2c3"
    forced = make_service(tmp_path, monkeypatch, IdentityProvider(), student_identity="jupyter-user")
    assert forced.student_of(user) == "a1b2c3"


def test_slots_default_to_cores_divided_by_the_tracks_ranks(tmp_path, monkeypatch):
    import os
    cores = len(os.sched_getaffinity(0))
    assert make_service(tmp_path, monkeypatch).slot_count == max(1, cores // 2)  # the test track has 2 ranks
    assert make_service(tmp_path, monkeypatch, slots=3).slot_count == 3


def test_a_full_queue_is_refused_with_a_sentence_and_leaves_no_job_directory(tmp_path, monkeypatch):
    service = make_service(tmp_path, monkeypatch, max_queued=2, submission_path="{student}/assessment/assessment.py")
    for student in ("ann", "ben", "cy"):
        student_folder(tmp_path, student, FAST_SUBMISSION.read_bytes())
    service.submit("ann")
    service.submit("ben")
    with pytest.raises(SubmissionProblem, match="The Assess queue is full \\(2 submissions are waiting\\)") as refused:
        service.submit("cy")
    assert refused.value.status == 503
    assert len(list(service.jobs_root.iterdir())) == 2
    service.stop()


def test_a_repeated_submit_keeps_one_job_directory(tmp_path, monkeypatch):
    service = make_service(tmp_path, monkeypatch)
    student_folder(tmp_path, "", FAST_SUBMISSION.read_bytes())
    first, created = service.submit("ann")
    again, created_again = service.submit("ann")
    assert created and not created_again and again["id"] == first["id"] and again["position"] == 1
    assert len(list(service.jobs_root.iterdir())) == 1
    service.stop()


def test_submission_paths_cannot_leave_the_root_directory(tmp_path, monkeypatch):
    service = make_service(tmp_path, monkeypatch, submission_path="{student}/assessment.py")
    assert service.submission_file("../../etc").is_relative_to(tmp_path / "course")
    escaping = make_service(tmp_path, monkeypatch, submission_path="../outside/assessment.py")
    with pytest.raises(SubmissionProblem, match="outside the server's root directory"):
        escaping.submission_file("ann")


def test_binary_files_are_refused_with_a_sentence(tmp_path, monkeypatch):
    service = make_service(tmp_path, monkeypatch)
    student_folder(tmp_path, "", b"\x00\x01binary")
    with pytest.raises(SubmissionProblem, match="cannot be assessed: the file is binary") as refused:
        service.submit("ann")
    assert refused.value.status == 400
    assert list(service.jobs_root.iterdir()) == []
    shutil.rmtree(tmp_path / "course")
    with pytest.raises(SubmissionProblem, match="There is no assessment/assessment.py to assess"):
        service.submit("ann")
