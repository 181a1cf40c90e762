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

from conftest import leftover_processes, needs_tensorflow, subprocess_env
from scalelab.grader import spec, witness

sys.path.insert(0, str(Path(__file__).parent / "submissions" / "service"))
from jupyter_process import JupyterServer  # noqa: E402

SUBMISSIONS = Path(__file__).parent / "submissions"
TEST_TRACKS = SUBMISSIONS / "tracks.toml"
# The Keras edition's (its track trains with Keras): skipped, with the reason, on the PyTorch edition.
needs_tensorflow()
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


# ---------------------------------------------------------------------------------------------------------------
# Evidence of distributed training that the run cannot write
# ---------------------------------------------------------------------------------------------------------------

def test_a_timeline_forged_live_without_horovod_fails_on_the_traffic_witness(tmp_path):
    verdict, _ = assess_from(submission_from("forged_timeline.py", tmp_path / "student").parent, tmp_path / "home")
    assert verdict["verdict"] == "fail"
    assert verdict["heldout_accuracy"] >= verdict["target_accuracy"]  # a good model, trained alone
    timeline, traffic = verdict["witnesses"]["timeline"], verdict["witnesses"]["traffic"]
    # The forger wrote every event a timeline should have, live, into Horovod's own timeline...
    assert timeline["ranks_seen"] == [0, 1] and timeline["active_deciles"] >= 8
    # ...but no rank sent the other a gradient: the kernel's count says so, and that is the one reason.
    assert traffic["ratio"] < 0.01
    assert verdict["reasons"] == [next(r for r in verdict["reasons"] if "did not carry the model's gradients" in r)]


def test_rank_zero_training_alone_while_both_ranks_allreduce_tiny_tensors_fails(tmp_path):
    verdict, _ = assess_from(submission_from("dummy_allreduce.py", tmp_path / "student").parent, tmp_path / "home")
    assert verdict["verdict"] == "fail"
    assert verdict["heldout_accuracy"] >= verdict["target_accuracy"]
    assert verdict["ranks_seen"] == [0, 1] and verdict["allreduce_count"] > 1000
    # Horovod's own negotiation traffic remains; the gradients' is missing
    assert verdict["witnesses"]["traffic"]["ratio"] < witness.MIN_TRAFFIC_RATIO / 2
    assert any("did not carry the model's gradients" in reason for reason in verdict["reasons"])


def test_an_honest_conversion_passes_on_both_witnesses_with_gloo(tmp_path):
    folder = tmp_path / "student"
    folder.mkdir()
    shutil.copy(SUBMISSIONS / "honest_small.py", folder / "assessment.py")
    verdict, _ = assess_from(folder, tmp_path / "home")
    assert verdict["verdict"] == "pass", verdict["reasons"]
    assert 0.5 < verdict["witnesses"]["traffic"]["ratio"] < 2.0
    assert verdict["witnesses"]["timeline"]["ranks_seen"] == [0, 1]


# ---------------------------------------------------------------------------------------------------------------
# A sandbox that binds only what the run needs
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture
def decoys(tmp_path, cifar10_dir):
    """World-readable copies of the held-out split where real machines have them, and another student's work."""
    tag = f"scalelab-decoy-{os.getpid()}-{time.monotonic_ns()}"
    heldout = cifar10_dir / "cifar-10-batches-py" / "test_batch"
    places = {
        "beside the checkout": spec.COURSE_ROOT.parent / tag / "cifar-10-batches-py" / "test_batch",
        "a home's Keras cache": Path("/home") / tag / ".keras" / "datasets" / "cifar-10-batches-py" / "test_batch",
        "/srv": Path("/srv") / tag / "test_batch",
        "/opt": Path("/opt") / tag / "test_batch",
        "another student": tmp_path / "home" / "jobs" / "someone-else" / "assessment.py",
        "the solution": spec.COURSE_ROOT / "assessment" / "solution" / "assessment.py",
        "the track file": spec.COURSE_ROOT / "assessment" / "tracks.toml",
    }
    made = []
    for name, path in places.items():
        if path.exists():
            continue
        top = next(parent for parent in [path, *path.parents] if parent.parent.exists())
        made.append(top)
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(heldout, path) if "student" not in name else path.write_text("print('their work')\n")
        for part in [path, *path.parents]:
            os.chmod(part, 0o755 if part.is_dir() else 0o644)
            if part == top:
                break
    yield places
    for top in made:
        shutil.rmtree(top, ignore_errors=True) if top.is_dir() else top.unlink(missing_ok=True)


def peek(tmp_path: Path, places: dict, home: Path, track=TRACK.name, as_user: list[str] = ()) -> dict:
    folder = tmp_path / "student"
    submission_from("peek_paths.py", folder, PATHS=repr([str(p) for p in places.values()]))
    done = subprocess.run([*as_user, sys.executable, "-m", "scalelab.cli", "assess", "assessment.py", "--json",
                           "--out", str(home / "out"), "--track", track, "--track-file", str(TEST_TRACKS)],
                          capture_output=True, text=True, timeout=600, cwd=folder,
                          env=subprocess_env(SCALELAB_HOME=str(home)))
    verdict = json.loads(done.stdout)
    log = (Path(verdict["logs_dir"]) / "rank-0.log").read_text()
    return {name: ("SEEN " if f"SEEN {path}" in log else "ABSENT " if f"ABSENT {path}" in log else "?")
            for name, path in places.items()} | {"_log": log, "_verdict": verdict}


@pytest.mark.parametrize("track", [TRACK.name, "fashion-mnist-test-mpi"])
def test_a_graded_run_sees_no_decoy_no_other_student_and_no_solution(tmp_path, decoys, track):
    for name, path in decoys.items():
        assert path.exists() and os.stat(path).st_mode & 0o004, name  # really there, world-readable
    found = peek(tmp_path, decoys, tmp_path / "home", track)
    assert {name: found[name] for name in decoys} == {name: "ABSENT " for name in decoys}, found["_log"]


def test_without_root_the_run_still_sees_nothing_but_its_job(tmp_path, decoys):
    """The grader as an ordinary account (a user namespace mapping it to uid 1000): no sandbox uid to drop to,
    bubblewrap builds the same allow-list in a user namespace of its own."""
    unshare = shutil.which("unshare")
    assert unshare, "util-linux's unshare is part of every Debian system"
    found = peek(tmp_path, decoys, tmp_path / "home",
                 as_user=[unshare, "--user", "--map-user=1000", "--map-group=1000", "--"])
    assert found["_verdict"]["sandbox_uid"] is None  # really graded as an ordinary account
    assert {name: found[name] for name in decoys} == {name: "ABSENT " for name in decoys}, found["_log"]


# ---------------------------------------------------------------------------------------------------------------
# Verdicts that explain
# ---------------------------------------------------------------------------------------------------------------

def test_pixels_standardized_outside_the_model_are_named_as_the_cause_of_a_low_accuracy(tmp_path):
    folder = tmp_path / "student"
    folder.mkdir()
    shutil.copy(SUBMISSIONS / "scaled_outside_the_model.py", folder / "assessment.py")
    verdict, _ = assess_from(folder, tmp_path / "home")
    assert verdict["verdict"] == "fail" and verdict["heldout_accuracy"] < TRACK.target_accuracy, verdict
    reason = next(r for r in verdict["reasons"] if "held-out accuracy" in r)
    assert "standardized per pixel" in reason and "Normalization" in reason and "train longer" not in reason


def test_processes_left_behind_by_ranks_that_ended_do_not_hold_the_run_to_its_budget(tmp_path):
    folder = tmp_path / "student"
    folder.mkdir()
    shutil.copy(SUBMISSIONS / "stray_processes.py", folder / "assessment.py")
    verdict, took = assess_from(folder, tmp_path / "home")
    assert verdict["verdict"] == "fail" and verdict["wall_time_s"] < 60, verdict
    assert "no model was saved" in verdict["reasons"][0]
    assert any("kept horovodrun from ending" in note for note in verdict["notes"]), verdict["notes"]
    assert leftover_processes("sleep 3141") == []


def test_a_traceback_names_the_students_file_and_line_and_no_path_of_the_grader(tmp_path):
    home = tmp_path / "home"
    folder = tmp_path / "student"
    folder.mkdir()
    shutil.copy(SUBMISSIONS / "rank_crash.py", folder / "assessment.py")
    verdict, _ = assess_from(folder, home)
    assert verdict["verdict"] == "fail"
    crash_line = next(number for number, line in enumerate((folder / "assessment.py").read_text().splitlines(), 1)
                      if "rank one failed on purpose" in line)
    assert f'File "assessment.py", line {crash_line}' in verdict["reasons"][1]
    for private in (str(home), sys.prefix, str(spec.COURSE_ROOT)):
        assert not any(private in reason for reason in verdict["reasons"]), private
