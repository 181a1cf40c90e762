"""The grader's Slurm backend (grader/slurm.py) against a real one-node Slurm that this module starts itself
(containers/slurm/start.sh: munged, slurmctld, slurmd on localhost). When Slurm cannot start, the tests fail with
the reason; they are never skipped.

Submissions go through `scalelab assess --backend slurm --json`, as an instructor or the Assess service runs
them: an honest conversion passes, the serial baseline fails, a hang
times out and is scancelled, and after each verdict no job of ours is left in squeue and no process of the run is
left on the machine.
"""

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (EDITION_HANG_SUBMISSION, EDITION_HANG_TRACK, HAS_TENSORFLOW, PROJECT_ROOT, keras_only,
                      leftover_processes, subprocess_env)
from scalelab.grader import launch, slurm, slurm_runner, spec

SUBMISSIONS = Path(__file__).parent / "submissions"
TEST_TRACKS = SUBMISSIONS / "tracks.toml"
START_SCRIPT = PROJECT_ROOT / "containers" / "slurm" / "start.sh"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm_cluster():
    """A running one-node Slurm (start.sh is idempotent: an already running cluster is only checked)."""
    if os.geteuid() != 0:
        pytest.fail("the Slurm tests start munged, slurmctld and slurmd and need root (run them as root, as CI does)")
    try:
        started = subprocess.run([str(START_SCRIPT)], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{START_SCRIPT} did not bring Slurm up within 600 s")
    if started.returncode != 0:
        pytest.fail(f"Slurm could not start ({START_SCRIPT} exited {started.returncode}):\n"
                    f"{started.stdout[-2000:]}\n{started.stderr[-3000:]}")
    cancel_jobs_from_before()
    queued = squeue_lines()
    assert queued == [], f"squeue is not empty before the Slurm tests: {queued}"
    return started.stdout


def cancel_jobs_from_before() -> None:
    """Jobs slurmctld restored from its saved state (a machine restored from a snapshot, an earlier run killed
    mid-test) predate this module and are none of its own: cancel them, so that every "nothing left in squeue"
    below is about this module's jobs only."""
    stale = [line.split()[0] for line in squeue_lines()]
    if not stale:
        return
    subprocess.run(["scancel", *stale], capture_output=True, text=True, timeout=60)
    deadline = time.monotonic() + 120
    while squeue_lines() and time.monotonic() < deadline:
        time.sleep(1)


def squeue_lines(*arguments: str) -> list[str]:
    done = subprocess.run(["squeue", "--noheader", *arguments], capture_output=True, text=True, timeout=60)
    if done.returncode != 0 and "Invalid job id" in done.stderr:
        return []
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if line.strip()]


def slurm_job_state(job_id: str) -> str:
    shown = subprocess.run(["scontrol", "show", "job", job_id, "--oneliner"], capture_output=True, text=True,
                           timeout=60).stdout
    return next((field.split("=", 1)[1] for field in shown.split() if field.startswith("JobState=")), "")


def assess_through_slurm(tmp_path: Path, submission: Path, track: str,
                         track_file: Path = TEST_TRACKS) -> tuple[int, dict, float]:
    out = tmp_path / "out"
    budget = spec.load_track(track, track_file)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "scalelab.cli", "assess", str(submission), "--json",
                           "--backend", "slurm", "--out", str(out), "--track", track,
                           "--track-file", str(track_file)],
                          capture_output=True, text=True, timeout=budget.time_budget_s + budget.grace_s + 300,
                          env=subprocess_env(SCALELAB_HOME=str(tmp_path / "home")))
    took = time.monotonic() - started
    assert done.stdout.count("\n") == 1, done.stdout + done.stderr  # exactly one JSON object
    verdict = json.loads(done.stdout)
    assert verdict["backend"] == "slurm"
    # It really went through Slurm: the runner wrote the Slurm job id it ran in.
    control = out / "logs" / "slurm"
    job_id = json.loads((control / slurm_runner.STARTED_FILE).read_text())["slurm_job_id"]
    assert job_id and (control / f"slurm-{job_id}.out").exists()
    assert squeue_lines("--jobs", job_id) == [], f"Slurm job {job_id} is still queued after the verdict"
    assert leftover_processes(str(tmp_path), verdict.get("sandbox_uid")) == []
    verdict["slurm_job_id"] = job_id
    return done.returncode, verdict, took


@keras_only
def test_an_honest_submission_passes_through_slurm(tmp_path, slurm_cluster):
    # The reference solutions on the course's tracks are graded by the local backend's tests (both backends share
    # launch, verify and verdict); through Slurm a small honest conversion on a test track keeps CI time down.
    code, verdict, _ = assess_through_slurm(tmp_path, SUBMISSIONS / "honest_small.py", "fashion-mnist-test")
    assert (code, verdict["verdict"]) == (0, "pass"), verdict["reasons"]
    assert verdict["ranks_seen"] == [0, 1] and verdict["np"] == 2
    assert verdict["allreduced_tensors"] >= verdict["trainable_variables"] > 0
    assert verdict["heldout_accuracy"] >= verdict["target_accuracy"]
    assert verdict["sandboxed"] is True
    assert slurm_job_state(verdict["slurm_job_id"]) == "COMPLETED"
    assert "epoch 1/1" in (Path(verdict["logs_dir"]) / "rank-0.log").read_text()  # logs came back from the job


def test_a_ddp_submission_passes_through_slurm_on_a_torchrun_track(tmp_path, slurm_cluster):
    # torchrun starts every rank inside the one Slurm task, as horovodrun does; the witnesses are read there too.
    code, verdict, _ = assess_through_slurm(tmp_path, SUBMISSIONS / "ddp_small.py", "fashion-mnist-ddp-test")
    assert (code, verdict["verdict"]) == (0, "pass"), verdict["reasons"]
    ranks = verdict["witnesses"]["ranks"]
    assert len(ranks["rank_cpu_s"]) == 2 and ranks["active_deciles"] >= 6
    assert verdict["witnesses"]["traffic"]["steps"] >= 60
    assert slurm_job_state(verdict["slurm_job_id"]) == "COMPLETED"
    assert Path(verdict["model_path"]).name == "model.pt2"
    assert "epoch 2/2" in (Path(verdict["logs_dir"]) / "rank-1.log").read_text()


@keras_only
def test_serial_baseline_fails_through_slurm(tmp_path, slurm_cluster):
    # The cifar10-cpu reference/baseline pair is graded by the local backend's test (test_grader_reference.py);
    # both backends share the same launch, verify and verdict code. Through Slurm the baseline runs on the short
    # fashion-mnist-hang track (12 s budget) to keep CI time down: each rank trains the serial script alone.
    code, verdict, _ = assess_through_slurm(tmp_path, PROJECT_ROOT / "assessment" / "assessment.py",
                                            "fashion-mnist-hang")
    assert code == 1 and verdict["verdict"] in ("fail", "timeout"), verdict["reasons"]
    assert verdict["allreduce_count"] == 0


def test_hang_times_out_is_scancelled_and_leaves_nothing(tmp_path, slurm_cluster):
    code, verdict, took = assess_through_slurm(tmp_path, SUBMISSIONS / EDITION_HANG_SUBMISSION, EDITION_HANG_TRACK)
    assert (code, verdict["verdict"]) == (1, "timeout"), verdict["reasons"]
    assert "time budget" in verdict["reasons"][0]
    # The grader's scancel ended it (the runner's own watch waits longer), and queue time did not count.
    assert slurm_job_state(verdict["slurm_job_id"]) == "CANCELLED"
    assert verdict["time_budget_s"] + 5 <= verdict["wall_time_s"] <= verdict["time_budget_s"] + 5 + 8
    assert squeue_lines() == []


# ---------------------------------------------------------------------------------------------------------------
# The backend's own behaviour, with a trivial job (no training) so each case takes seconds
# ---------------------------------------------------------------------------------------------------------------

def trivial_job(root: Path, shell_command: str, time_budget_s: float = 30, grace_s: float = 2) -> launch.JobSpec:
    """An unsandboxed JobSpec whose "horovodrun" is a shell line printing in horovodrun's rank format."""
    (root / "job" / "output").mkdir(parents=True)
    return launch.JobSpec(job_dir=root / "job", command=["/bin/sh", "-c", shell_command],
                          env={"PATH": "/usr/bin:/bin"}, np=2, time_budget_s=time_budget_s, grace_s=grace_s,
                          logs_dir=root / "logs", output_dir=root / "job" / "output", sandbox=False)


def test_queue_position_and_state_come_from_squeue(tmp_path, slurm_cluster):
    blocker = subprocess.run(["sbatch", "--parsable", "--cpus-per-task=2", "--output=/dev/null",
                              "--job-name=scalelab-test-blocker", "--wrap", "sleep 4"],
                             capture_output=True, text=True, check=True).stdout.strip()
    deadline = time.monotonic() + 30
    while squeue_lines("--jobs", blocker, "--states", "RUNNING") == [] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert squeue_lines("--jobs", blocker, "--states", "RUNNING"), "the blocking job never started"
    states = []
    job = trivial_job(tmp_path, "echo '[0]<stdout>:epoch 1/1 accuracy 0.5'; echo '[1]<stdout>:ready'; sleep 2")
    submitted = time.monotonic()
    run = slurm.run(job, on_progress=states.append)
    assert run.exit_code == 0 and not run.timed_out and run.epochs_seen == 1
    assert run.wall_time_s < 4 < time.monotonic() - submitted  # waiting behind the blocker is not run time
    assert (tmp_path / "logs" / "rank-1.log").read_text() == "ready\n"
    queued = [state for state in states if state["state"] == "queued"]
    assert queued and queued[0]["queue_position"] == 1 and queued[0]["slurm_state"] == "PENDING"
    assert {"Resources", "Priority"} & {state["slurm_reason"] for state in queued}  # Slurm's own reason, not ours
    running = [state for state in states if state["state"] == "running"]
    assert running and running[-1]["slurm_state"] == "RUNNING" and running[-1]["elapsed_s"] > 0
    assert {state["slurm_job_id"] for state in states} - {blocker} == {queued[0]["slurm_job_id"]}
    assert squeue_lines() == []


def test_overrunning_job_is_scancelled_at_budget_plus_grace(tmp_path, slurm_cluster):
    # An odd duration marks our sleep apart from any other process on the machine.
    job = trivial_job(tmp_path, "echo '[0]<stdout>:start'; exec sleep 297.31", time_budget_s=3, grace_s=2)
    started = time.monotonic()
    run = slurm.run(job)
    assert run.timed_out and run.exit_code != 0
    assert 5 <= run.wall_time_s <= 5 + 4
    assert time.monotonic() - started < 30
    job_id = json.loads((tmp_path / "logs" / "slurm" / slurm_runner.STARTED_FILE).read_text())["slurm_job_id"]
    assert slurm_job_state(job_id) == "CANCELLED"
    assert squeue_lines() == []
    assert leftover_processes("sleep 297.31") == [] and leftover_processes(str(tmp_path)) == []


def test_time_limit_and_resources_in_the_batch_script(tmp_path):
    assert slurm.time_limit_minutes(45, 5) == 2          # 50 s → 1 minute, plus a minute
    assert slurm.time_limit_minutes(400, 5) == 8
    assert slurm.time_limit_minutes(60, 0) == 2
    job = trivial_job(tmp_path, "true", time_budget_s=240, grace_s=10)
    script = slurm.batch_script(job, tmp_path / "control", environ={"SCALELAB_SLURM_PARTITION": "gpu"})
    assert "#SBATCH --cpus-per-task=2" in script and "#SBATCH --time=6" in script
    assert "#SBATCH --partition=gpu" in script and "--gres" not in script
    with_gpus = slurm.batch_script(dataclasses.replace(job, device_paths=[Path("/dev/nvidia0")]),
                                   tmp_path / "control", environ={})
    assert "#SBATCH --gres=gpu:2" in with_gpus and "--partition" not in with_gpus
    assert script.rstrip().endswith(f"-m scalelab.grader.slurm_runner {tmp_path / 'control'}")
    with pytest.raises(slurm.SlurmError, match="one node"):
        slurm.batch_script(job, tmp_path / "control", environ={"SCALELAB_SLURM_NODES": "2"})


def test_missing_sbatch_is_a_clear_error(tmp_path, monkeypatch):
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    monkeypatch.setenv("PATH", str(empty_bin))
    with pytest.raises(RuntimeError, match=r"^sbatch, squeue, scancel, scontrol not installed: .*slurm-client"):
        slurm.run(trivial_job(tmp_path, "true"))


def test_controller_down_is_a_clear_error(tmp_path, monkeypatch, slurm_cluster):
    # The same cluster configuration, but a port where no slurmctld listens.
    conf = Path("/etc/slurm/slurm.conf").read_text().replace("SlurmctldPort=6817", "SlurmctldPort=6999")
    (tmp_path / "slurm.conf").write_text(conf)
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"the Slurm controller \(slurmctld\) does not answer"):
        slurm.run(trivial_job(tmp_path, "true"))
    assert time.monotonic() - started < 5  # a prompt answer, not sbatch's own retries


def test_assess_with_slurm_down_gives_an_error_verdict_with_the_reason(tmp_path, slurm_cluster):
    conf = Path("/etc/slurm/slurm.conf").read_text().replace("SlurmctldPort=6817", "SlurmctldPort=6999")
    (tmp_path / "slurm.conf").write_text(conf)
    # Whichever edition is installed: Slurm being down is no framework's business.
    submission, track = ("honest_small.py", "fashion-mnist-test") if HAS_TENSORFLOW else \
        ("ddp_small.py", "fashion-mnist-ddp-test")
    done = subprocess.run([sys.executable, "-m", "scalelab.cli", "assess", str(SUBMISSIONS / submission),
                           "--json", "--backend", "slurm", "--out", str(tmp_path / "out"),
                           "--track", track, "--track-file", str(TEST_TRACKS)],
                          capture_output=True, text=True, timeout=300,
                          env=subprocess_env(SCALELAB_HOME=str(tmp_path / "home"),
                                             SLURM_CONF=str(tmp_path / "slurm.conf")))
    verdict = json.loads(done.stdout)
    assert (done.returncode, verdict["verdict"]) == (3, "error")
    assert "slurmctld" in verdict["reasons"][0] and "not your submission's fault" in verdict["reasons"][0]
    assert list((tmp_path / "home" / "jobs").iterdir()) == []  # the prepared job directory is cleaned up
