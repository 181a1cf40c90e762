"""AssessService (grader/serve.py) in this process, workers not started: identity, paths, slots, queue full."""

from __future__ import annotations

import getpass
import json
import os
import re
import shutil
import socket
import stat
from pathlib import Path

import pytest
from jupyter_server.auth.identity import IdentityProvider, PasswordIdentityProvider, User
from traitlets.config import Config

from conftest import EDITION_TEST_TRACK
from scalelab.grader import spec, store
from scalelab.grader.serve import VERDICT_FIELDS_FOR_STUDENTS, AssessService, SubmissionProblem

FAST_SUBMISSION = Path(__file__).parent / "submissions" / "service" / "syntax_error_fast.py"
TEST_TRACKS = Path(__file__).parent / "submissions" / "tracks.toml"
# The file the installed edition's students submit (assessment.py, or assessment_pytorch.py on the PyTorch edition).
SUBMITTED = spec.load_track(EDITION_TEST_TRACK, TEST_TRACKS).submission_file


def make_service(tmp_path, monkeypatch, identity_provider=None, **settings) -> AssessService:
    monkeypatch.setenv("SCALELAB_HOME", str(tmp_path / "home"))
    config = Config({"AssessService": {"track": EDITION_TEST_TRACK, "tracks_file": str(TEST_TRACKS), **settings}})
    return AssessService(str(tmp_path / "course"), identity_provider=identity_provider, config=config)


def student_folder(tmp_path, student: str, content: bytes | None = None) -> Path:
    folder = tmp_path / "course" / student / "assessment"
    folder.mkdir(parents=True, exist_ok=True)
    if content is not None:
        (folder / SUBMITTED).write_bytes(content)
    return folder


class NamedUsers(IdentityProvider):
    """Stands for JupyterHub's provider: any provider other than Jupyter's stock ones names real users."""


def test_the_student_is_the_server_owner_under_jupyters_anonymous_token_users(tmp_path, monkeypatch):
    user = User(username="a1b2c3", name="Anonymous Io")
    for stock in (IdentityProvider(), PasswordIdentityProvider()):
        assert make_service(tmp_path, monkeypatch, stock).student_of(user) == getpass.getuser()
    assert make_service(tmp_path, monkeypatch, NamedUsers()).student_of(user) == "a1b2c3"
    forced = make_service(tmp_path, monkeypatch, NamedUsers(), student_identity="jupyter-user")
    assert forced.student_of(user) == "a1b2c3"


def test_jupyter_user_identity_with_jupyters_stock_provider_is_refused_at_start(tmp_path, monkeypatch):
    # Every token request would be a new anonymous student: one person could queue without limit.
    for stock in (IdentityProvider(), PasswordIdentityProvider()):
        with pytest.raises(ValueError, match="AssessService.student_identity = 'jupyter-user' cannot be used "
                                             "with Jupyter's stock identity provider"):
            make_service(tmp_path, monkeypatch, stock, student_identity="jupyter-user")


def test_slots_default_to_cores_divided_by_the_tracks_ranks(tmp_path, monkeypatch):
    import os
    cores = len(os.sched_getaffinity(0))
    assert make_service(tmp_path, monkeypatch).slot_count == max(1, cores // 2)  # the test track has 2 ranks
    assert make_service(tmp_path, monkeypatch, slots=3).slot_count == 3


def test_a_full_queue_is_refused_with_a_sentence_and_leaves_no_job_directory(tmp_path, monkeypatch):
    service = make_service(tmp_path, monkeypatch, max_queued=2, submission_path=f"{{student}}/assessment/{SUBMITTED}")
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
    service = make_service(tmp_path, monkeypatch, submission_path=f"{{student}}/{SUBMITTED}")
    assert service.submission_file("../../etc").is_relative_to(tmp_path / "course")
    escaping = make_service(tmp_path, monkeypatch, submission_path=f"../outside/{SUBMITTED}")
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
    with pytest.raises(SubmissionProblem, match=f"There is no assessment/{SUBMITTED} to assess"):
        service.submit("ann")


def test_a_link_or_a_special_file_is_refused_with_a_sentence_and_nothing_is_copied(tmp_path, monkeypatch):
    # The server's account reads what a student may not (another student's file, the grader's state): a link
    # would have it copy that file and grade it as the student's.
    service = make_service(tmp_path, monkeypatch, submission_path=f"{{student}}/assessment/{SUBMITTED}")
    others = student_folder(tmp_path, "ben", FAST_SUBMISSION.read_bytes()) / SUBMITTED
    state = tmp_path / "grader-state.py"
    state.write_bytes(FAST_SUBMISSION.read_bytes())
    (student_folder(tmp_path, "ann") / SUBMITTED).symlink_to(others)
    (student_folder(tmp_path, "dee") / SUBMITTED).symlink_to(state)
    (tmp_path / "course" / "cy").mkdir()
    (tmp_path / "course" / "cy" / "assessment").symlink_to(others.parent, target_is_directory=True)
    os.mkfifo(student_folder(tmp_path, "eve") / SUBMITTED)
    (student_folder(tmp_path, "fay") / SUBMITTED).mkdir()
    refusals = {"ann": f"ann/assessment/{SUBMITTED} is a link; save your script as a plain file "
                       f"ann/assessment/{SUBMITTED} (not a link, nor in a linked folder) and click Assess again.",
                "dee": f"dee/assessment/{SUBMITTED} is a link; save your script as a plain file",
                "cy": f"cy/assessment is a link; save your script as a plain file cy/assessment/{SUBMITTED}",
                "eve": f"eve/assessment/{SUBMITTED} is not a plain file; save your script as a plain file",
                "fay": f"fay/assessment/{SUBMITTED} is not a plain file; save your script as a plain file"}
    for student, sentence in refusals.items():
        with pytest.raises(SubmissionProblem, match=re.escape(sentence)) as refused:
            service.submit(student)
        assert refused.value.status == 400
    assert list(service.jobs_root.iterdir()) == [] and service.queue.all_jobs() == []
    with pytest.raises(SubmissionProblem, match=f"There is no gus/assessment/{SUBMITTED} to assess") as missing:
        service.submit("gus")
    assert missing.value.status == 404
    assert service.submit("ben")[1], "a plain file is still taken"
    service.stop()


def finish_queued_job(service: AssessService, verdict: dict | None = None) -> dict:
    """Stand in for a worker: claim the oldest queued job and store a verdict for it."""
    job = service.queue.claim_next("host", os.getpid())
    service.queue.finish(job["id"], verdict or {"verdict": "fail", "reasons": []})
    return job


def test_a_submit_too_soon_after_the_last_is_refused_with_429_but_an_active_job_is_shown(tmp_path, monkeypatch):
    service = make_service(tmp_path, monkeypatch, min_seconds_between_submissions=3600)
    student_folder(tmp_path, "", FAST_SUBMISSION.read_bytes())
    first, created = service.submit("ann")
    again, created_again = service.submit("ann")  # the job is queued: the click shows it, no 429
    assert created and not created_again and again["id"] == first["id"]
    finish_queued_job(service)
    with pytest.raises(SubmissionProblem, match=r"Please wait \d+ more seconds before clicking Assess again: "
                                                r"each student may submit once every 3600 seconds") as refused:
        service.submit("ann")
    assert refused.value.status == 429 and 3500 < refused.value.retry_after_s <= 3600
    assert f"wait {refused.value.retry_after_s} more seconds" in str(refused.value)
    assert len(list(service.jobs_root.iterdir())) == 1, "a refused click leaves no job directory"
    assert service.submit("ben")[1], "the wait is per student"


def test_job_directories_the_queue_database_and_the_copied_file_are_private_to_the_server_account(
        tmp_path, monkeypatch):
    jobs_root = tmp_path / "home" / "assess" / "jobs"
    jobs_root.mkdir(parents=True, mode=0o755)
    os.chmod(jobs_root, 0o755)  # as an older version of the service left it
    os.chmod(jobs_root.parent, 0o755)
    service = make_service(tmp_path, monkeypatch)
    assert stat.S_IMODE(jobs_root.parent.stat().st_mode) == 0o700, "queue.db's directory: every student's verdicts"
    assert (jobs_root.parent / "queue.db").is_file()
    student_folder(tmp_path, "", FAST_SUBMISSION.read_bytes())
    service.submit("ann")
    [job_dir] = service.jobs_root.iterdir()
    assert service.jobs_root == jobs_root
    assert stat.S_IMODE(jobs_root.stat().st_mode) == 0o700
    assert stat.S_IMODE(job_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((job_dir / "assessment.py").stat().st_mode) == 0o600
    assert (job_dir / "assessment.py").read_bytes() == FAST_SUBMISSION.read_bytes()


def test_submitting_prunes_the_students_oldest_job_directories_and_keeps_their_verdicts(tmp_path, monkeypatch):
    service = make_service(tmp_path, monkeypatch, keep_jobs_per_student=2, min_seconds_between_submissions=0,
                           submission_path=f"{{student}}/assessment/{SUBMITTED}")
    for student in ("ann", "ben"):
        student_folder(tmp_path, student, FAST_SUBMISSION.read_bytes())
    service.submit("ben")
    finish_queued_job(service)
    for _click in range(4):
        service.submit("ann")
        finish_queued_job(service)
    active, created = service.submit("ann")
    assert created
    history = service.history("ann")
    assert len(history) == 5 and all(job["verdict"]["verdict"] == "fail" for job in history[1:])
    kept = {Path(job["job_dir"]).name for job in service.queue.job_directories("ann")[:2]}
    ann_dirs = {path.name for path in service.jobs_root.iterdir()} - {
        Path(job["job_dir"]).name for job in service.queue.job_directories("ben")}
    assert ann_dirs == kept and Path(service.queue.get(active["id"])["job_dir"]).name in kept
    assert Path(service.queue.job_directories("ben")[0]["job_dir"]).is_dir(), "another student's job stays"


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


def test_a_student_sees_an_allow_list_of_the_job_and_verdict_without_server_paths_host_or_uid(tmp_path, monkeypatch):
    service = make_service(tmp_path, monkeypatch)
    student_folder(tmp_path, "", FAST_SUBMISSION.read_bytes())
    queued, _ = service.submit("ann")
    job_dir = service.queue.get(queued["id"])["job_dir"]
    home, host = str(store.scalelab_home()), socket.gethostname()
    job = service.queue.claim_next(host, os.getpid())
    service.queue.record_progress(job["id"], {"state": "running", "elapsed_s": 3.0, "log_file": f"{job_dir}/x"},
                                  [{"elapsed_s": 3.0, "accuracy": 0.5, "epochs_seen": 1, "path": job_dir}])
    verdict = {  # what the grader's verdict holds, private fields included
        "verdict": "error", "notes": [f"ran on {host}"], "heldout_accuracy": None, "np": 2, "ranks_seen": [0, 1],
        "reasons": [f"internal error: FileNotFoundError: {job_dir}/grader/model.keras under {home} on {host}"],
        "submission": f"{job_dir}/assessment.py", "logs_dir": f"{job_dir}/grader/logs", "out_dir": f"{job_dir}/grader",
        "model_path": f"{job_dir}/grader/model.keras", "sandbox_uid": 61234, "sandboxed": True,
        "environment": {"hostname": host, "python": "/usr/bin/python3"}, "student": "ann",
        "witnesses": {"allreduce_bytes": 1024, "ranks_with_gradients": [0, 1]},
    }
    service.queue.finish(job["id"], verdict)

    for view in (service.job("ann", job["id"]), service.history("ann")[0]):
        assert view["verdict"]["witnesses"] == verdict["witnesses"]
        assert set(view["verdict"]) <= set(VERDICT_FIELDS_FOR_STUDENTS)
        assert view["verdict"]["np"] == 2 and view["verdict"]["sandboxed"] is True
        assert "FileNotFoundError" in view["verdict"]["reasons"][0]
        assert view["progress"] == {"state": "running", "elapsed_s": 3.0}
        assert view["progress_history"] == [{"elapsed_s": 3.0, "accuracy": 0.5, "epochs_seen": 1}]
        assert not {"job_dir", "submission_path", "worker_host", "worker_pid", "grader_pid"} & set(view)
        for text in _strings_in(view):
            assert str(service.jobs_root) not in text and home not in text, text
            assert not re.search(rf"\b{re.escape(host)}\b", text), text
            assert "sandbox_uid" not in text, text
        assert "sandbox_uid" not in json.dumps(view)
