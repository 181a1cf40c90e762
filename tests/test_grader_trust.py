"""Attacks on the grader itself, through `scalelab assess` and through the Assess service's REST API: a model file
that makes the grader import the submission, and files that block or never end where the grader reads."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import leftover_processes, subprocess_env
from scalelab.grader import spec

sys.path.insert(0, str(Path(__file__).parent / "submissions" / "service"))
from jupyter_process import JupyterServer  # noqa: E402

SUBMISSIONS = Path(__file__).parent / "submissions"
TEST_TRACKS = SUBMISSIONS / "tracks.toml"
TRACK = spec.load_track("fashion-mnist-test", TEST_TRACKS)
# A verdict for a run that ends in seconds must come long before the budget: the grader waited on nothing.
PROMPT_VERDICT_S = 180

pytestmark = pytest.mark.slow


def submission_from(template: str, directory: Path, **markers: str) -> Path:
    source = (SUBMISSIONS / template).read_text()
    for name, value in markers.items():
        source = source.replace(f"@@{name}@@", value)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "assessment.py"
    path.write_text(source)
    return path


def assess_from(folder: Path, home: Path, timeout: float = TRACK.time_budget_s + TRACK.grace_s + 120):
    """`scalelab assess assessment.py` run the way an instructor runs it: from the folder holding the file."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "scalelab.cli", "assess", "assessment.py", "--json",
                           "--out", str(home / "out"), "--track", TRACK.name, "--track-file", str(TEST_TRACKS)],
                          capture_output=True, text=True, timeout=timeout, cwd=folder,
                          env=subprocess_env(SCALELAB_HOME=str(home)))
    verdict = json.loads(done.stdout)
    assert leftover_processes(str(home), verdict.get("sandbox_uid")) == []
    return verdict, time.monotonic() - started


def test_model_naming_the_submissions_module_is_refused_and_never_imported_cli(tmp_path):
    proof = tmp_path / "proof.txt"
    folder = tmp_path / "student"
    submission_from("model_imports_submission.py", folder, PROOF=str(proof))
    verdict, _ = assess_from(folder, tmp_path / "home")
    assert not proof.exists(), proof.read_text()
    assert verdict["verdict"] == "fail" and verdict["heldout_accuracy"] is None
    assert any("names the Python module(s) assessment" in reason for reason in verdict["reasons"]), verdict


@pytest.mark.parametrize("trap", ["fifo", "zero"])
def test_pipes_and_endless_files_where_the_grader_reads_do_not_stall_it_cli(tmp_path, trap):
    folder = tmp_path / "student"
    submission_from("trap_files.py", folder, TRAP=trap, OTHER="")
    verdict, took = assess_from(folder, tmp_path / "home")
    assert took < PROMPT_VERDICT_S, verdict
    assert verdict["verdict"] == "fail" and verdict["heldout_accuracy"] is None
    assert any("not a regular file" in reason or "symbolic link" in reason for reason in verdict["reasons"]), verdict


def test_model_linked_to_another_students_model_is_not_measured(tmp_path):
    import tensorflow as tf

    other = tmp_path / "other-student" / "model.keras"
    other.parent.mkdir()
    tf.keras.Sequential([tf.keras.Input((28, 28)), tf.keras.layers.Flatten(),
                         tf.keras.layers.Dense(10)]).save(other)
    folder = tmp_path / "student"
    submission_from("trap_files.py", folder, TRAP="other", OTHER=str(other))
    verdict, _ = assess_from(folder, tmp_path / "home")
    assert verdict["heldout_accuracy"] is None and verdict["verdict"] == "fail"
    assert any("symbolic link" in reason for reason in verdict["reasons"]), verdict


@pytest.fixture
def service(tmp_path):
    root, home = tmp_path / "course", tmp_path / "home"
    students = ("alice", "bob", "carol")
    for student in students:
        (root / student / "assessment").mkdir(parents=True)
    jupyter = JupyterServer(root, home, user_tokens={f"{s}-token": s for s in students}, service={
        "slots": 1, "track": TRACK.name, "tracks_file": str(TEST_TRACKS), "max_queued": 5,
        "submission_path": "{student}/assessment/assessment.py"}).start()
    yield jupyter
    jupyter.stop()


def test_attacks_through_the_service_get_verdicts_promptly_and_the_queue_goes_on(service, tmp_path):
    proof = tmp_path / "proof.txt"
    attacks = {
        "alice": submission_from("trap_files.py", tmp_path / "a", TRAP="fifo", OTHER=""),
        "bob": submission_from("model_imports_submission.py", tmp_path / "b", PROOF=str(proof)),
        "carol": SUBMISSIONS / "service" / "syntax_error_fast.py",  # queued behind both, on the one slot
    }
    jobs = {}
    for student, source in attacks.items():
        shutil.copy(source, service.root_dir / student / "assessment" / "assessment.py")
        answer = service.api("POST", "assessments", token=f"{student}-token")
        assert answer.status_code == 201, answer.text
        jobs[student] = answer.json()["job"]["id"]
    started = time.monotonic()
    finished = {student: service.wait_for_job(job_id, f"{student}-token", timeout_s=3 * PROMPT_VERDICT_S)
                for student, job_id in jobs.items()}
    assert time.monotonic() - started < 3 * PROMPT_VERDICT_S
    for student, job in finished.items():
        assert job["state"] == "done", (student, job, service.log_tail())
        assert job["verdict"]["verdict"] == "fail", (student, job["verdict"]["reasons"])
    assert finished["alice"]["verdict"]["heldout_accuracy"] is None
    assert any("not a regular file" in r for r in finished["alice"]["verdict"]["reasons"])
    assert any("names the Python module(s) assessment" in r for r in finished["bob"]["verdict"]["reasons"])
    assert not proof.exists(), proof.read_text()
    # no file of the run's appeared outside the job directories
    assert not any(path.name == "proof.txt" for path in service.home.rglob("*"))
    assert os.listdir(tmp_path / "b") == ["assessment.py"]
