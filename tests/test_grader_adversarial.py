"""Real submissions through `scalelab assess` (real horovodrun in the real sandbox, real data): each adversarial
case gets the right verdict and reason, and no process of the job is left behind. The attacks that need no
framework (and the crash and the hang, in DDP) run on the installed edition's track: torchrun on the PyTorch edition."""

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (EDITION_HANG_SUBMISSION, EDITION_HANG_TRACK, EDITION_TEST_TRACK, HAS_TENSORFLOW, keras_only,
                      leftover_processes, subprocess_env)
from scalelab.grader import launch, sandbox, spec, store

SUBMISSIONS = Path(__file__).parent / "submissions"
TEST_TRACKS = SUBMISSIONS / "tracks.toml"
SMALL_MEMORY_TRACK = "fashion-mnist-small-memory" if HAS_TENSORFLOW else "fashion-mnist-ddp-small-memory"
# (track, submission) whose rank 1 crashes while rank 0 waits for it in an allreduce; DDP's on either edition
CRASHES = ([("fashion-mnist-test", "rank_crash.py"), ("fashion-mnist-test-mpi", "rank_crash.py")] if HAS_TENSORFLOW
           else []) + [("fashion-mnist-ddp-test", "rank_crash_ddp.py")]

pytestmark = pytest.mark.slow


def assess(tmp_path, submission: Path, track=EDITION_TEST_TRACK, timeout=600):
    out = tmp_path / "out"
    home = tmp_path / "home"
    jobs_before = sorted((home / "jobs").iterdir()) if (home / "jobs").exists() else []
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "scalelab.cli", "assess", str(submission), "--json", "--out", str(out),
                           "--track", track, "--track-file", str(TEST_TRACKS)],
                          capture_output=True, text=True, timeout=timeout,
                          env=subprocess_env(SCALELAB_HOME=str(home)))
    took = time.monotonic() - started
    assert done.stdout.count("\n") == 1, done.stdout + done.stderr  # exactly one JSON object
    verdict = json.loads(done.stdout)
    assert json.loads((out / "verdict.json").read_text()) == verdict
    assert leftover_processes(str(home), verdict.get("sandbox_uid")) == []
    # The job's own directory is removed after the verdict; anything the test planted stays.
    assert (sorted((home / "jobs").iterdir()) if (home / "jobs").exists() else []) == jobs_before
    return done.returncode, verdict, took


def rank_log(verdict, rank=0) -> str:
    return (Path(verdict["logs_dir"]) / f"rank-{rank}.log").read_text()


@keras_only
def test_honest_submission_passes_with_evidence_from_both_ranks_over_mpi(tmp_path):
    code, verdict, _ = assess(tmp_path, SUBMISSIONS / "honest_small.py", track="fashion-mnist-test-mpi")
    assert (code, verdict["verdict"]) == (0, "pass"), verdict["reasons"]
    assert verdict["ranks_seen"] == [0, 1] and verdict["np"] == 2
    assert verdict["allreduced_tensors"] >= verdict["trainable_variables"] > 0
    assert verdict["heldout_accuracy"] >= verdict["target_accuracy"]
    assert verdict["wall_time_s"] <= verdict["time_budget_s"]
    assert verdict["sandboxed"] is True
    # As root the run had a memory cgroup: its limit (the track's default) and the most it used.
    assert verdict["memory"]["limit_bytes"] == 8 * 1024**3
    assert 100 * 1024**2 < verdict["memory"]["peak_bytes"] < verdict["memory"]["limit_bytes"], verdict["memory"]
    assert json.loads((tmp_path / "out" / "progress.json").read_text())["state"] == "done"
    stored = store.ResultsDatabase(tmp_path / "home" / "results.db").latest(None, "fashion-mnist-test-mpi",
                                                                            verdict["submission_sha256"])
    assert stored["verdict"] == "pass"


@keras_only
def test_fake_printed_accuracy_does_not_count(tmp_path):
    code, verdict, _ = assess(tmp_path, SUBMISSIONS / "fake_accuracy.py")
    assert (code, verdict["verdict"]) == (1, "fail")
    assert "0.9900" in rank_log(verdict)  # it did print the fake figure...
    assert verdict["heldout_accuracy"] < 0.5  # ...which the grader's own measurement ignores
    assert "below the target" in verdict["reasons"][0]


@keras_only
def test_untrained_model_fails_on_accuracy_and_on_missing_allreduce(tmp_path):
    code, verdict, _ = assess(tmp_path, SUBMISSIONS / "untrained_model.py")
    assert (code, verdict["verdict"]) == (1, "fail")
    assert verdict["heldout_accuracy"] < 0.3
    assert any("below the target" in reason for reason in verdict["reasons"])
    assert any("shows no allreduce" in reason for reason in verdict["reasons"])


@keras_only
def test_training_on_every_rank_without_horovod_fails_for_lack_of_evidence(tmp_path):
    code, verdict, _ = assess(tmp_path, SUBMISSIONS / "no_horovod.py")
    assert (code, verdict["verdict"]) == (1, "fail")
    assert verdict["heldout_accuracy"] >= verdict["target_accuracy"]  # accurate, yet not distributed
    assert verdict["allreduce_count"] == 0 and verdict["ranks_seen"] == []
    assert verdict["reasons"] == [next(r for r in verdict["reasons"] if "shows no allreduce" in r)]


@pytest.mark.parametrize(("track", "submission"), CRASHES)
def test_crashing_rank_ends_the_job_fast_with_its_traceback_in_the_reasons(tmp_path, track, submission):
    code, verdict, _ = assess(tmp_path, SUBMISSIONS / submission, track=track)
    assert (code, verdict["verdict"]) == (1, "fail")
    assert verdict["wall_time_s"] < verdict["time_budget_s"] / 2
    assert verdict["reasons"][1].startswith("rank 1 raised RuntimeError: rank one failed on purpose")
    assert 'raise RuntimeError("rank one failed on purpose")' in verdict["reasons"][1]


def test_hang_in_allreduce_ends_at_the_budget_as_timeout(tmp_path):
    track = spec.load_track(EDITION_HANG_TRACK, TEST_TRACKS)
    code, verdict, took = assess(tmp_path, SUBMISSIONS / EDITION_HANG_SUBMISSION, track=EDITION_HANG_TRACK)
    assert (code, verdict["verdict"]) == (1, "timeout")
    assert track.time_budget_s + track.grace_s <= verdict["wall_time_s"] <= track.time_budget_s + track.grace_s + 30
    assert "time budget" in verdict["reasons"][0]


def test_output_flood_is_capped_per_log(tmp_path):
    code, verdict, _ = assess(tmp_path, SUBMISSIONS / "flood_output.py")
    assert (code, verdict["verdict"]) == (1, "fail")
    for rank in (0, 1):
        log = Path(verdict["logs_dir"]) / f"rank-{rank}.log"
        assert log.stat().st_size <= launch.LOG_CAP_BYTES + 200
        assert "log capped at" in log.read_text()[-200:]
    assert any("capped" in note for note in verdict["notes"])
    assert "no model was saved" in verdict["reasons"][0]


def test_filling_dev_shm_is_refused_at_the_sandboxs_size_and_ends_with_a_verdict(tmp_path):
    code, verdict, _ = assess(tmp_path, SUBMISSIONS / "fill_dev_shm.py")
    assert (code, verdict["verdict"]) == (1, "fail")
    # A rank may be stopped by horovodrun (the other one failed) before it prints: the ones that printed count.
    reports = [line for rank in (0, 1) for line in rank_log(verdict, rank).splitlines() if line.startswith("wrote ")]
    assert reports and all("refused with ENOSPC" in report for report in reports), reports
    # Both ranks share the sandbox's /dev/shm: together they got no further than its size.
    total = sum(int(report.split()[1]) for report in reports)
    assert total <= sandbox.TMPFS_SIZES["/dev/shm"] // 1024**2, reports


def test_a_run_over_its_memory_limit_is_stopped_by_the_kernel_and_told_why(tmp_path):
    assert os.geteuid() == 0, "a run's memory limit is a cgroup the grader makes as root: run this test as root"
    code, verdict, _ = assess(tmp_path, SUBMISSIONS / "memory_hog.py", track=SMALL_MEMORY_TRACK)
    assert (code, verdict["verdict"]) == (1, "fail")
    assert verdict["reasons"][0].startswith("the run reached its memory limit (1.0 GiB for all ranks together)")
    logs = [rank_log(verdict, rank) for rank in (0, 1)]
    assert not any("never stopped" in log for log in logs), logs
    held = [int(line.split()[1]) for log in logs for line in log.splitlines() if line.startswith("holding")]
    assert max(held) <= 1024, held


def test_process_spawning_hits_the_process_limit_and_leaves_no_survivors(tmp_path):
    code, verdict, _ = assess(tmp_path, SUBMISSIONS / "many_processes.py")
    assert (code, verdict["verdict"]) == (1, "fail")
    log = rank_log(verdict)
    assert "then refused" in log, log
    assert int(log.split()[1]) < launch.NPROC_LIMIT
    assert leftover_processes("sleep 3141") == []


def test_forging_and_peeking_from_inside_the_run_is_blocked(tmp_path, cifar10_dir):
    home = tmp_path / "home"
    other_job = home / "jobs" / "someone-else"
    other_job.mkdir(parents=True)
    (other_job / "assessment.py").write_text("print('their work')\n")
    database = store.ResultsDatabase(home / "results.db")
    solution = spec.COURSE_ROOT / "assessment" / "solution" / "assessment.py"
    solution_before = solution.read_bytes()
    replacements = {
        "@@HELDOUT@@": str(cifar10_dir / "cifar-10-batches-py" / "test_batch"),
        "@@FASHION_TEST@@": "/usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz",
        "@@RESULTS_DB@@": str(database.path), "@@OTHER_JOB_FILE@@": str(other_job / "assessment.py"),
        "@@OUT_DIR@@": str(tmp_path / "out"), "@@SOLUTION@@": str(solution),
    }
    source = (SUBMISSIONS / "forge_results.py").read_text()
    for marker, path in replacements.items():
        source = source.replace(marker, path)
    submission = tmp_path / "assessment.py"
    submission.write_text(source)
    code, verdict, _ = assess(tmp_path, submission)
    assert (code, verdict["verdict"]) == (1, "fail")
    log = rank_log(verdict)
    assert "OPENED" not in log and "WROTE" not in log, log
    assert log.count("BLOCKED") == 10, log
    if os.geteuid() == 0:
        assert f"uid {os.getuid()}" not in log  # dropped root
    assert solution.read_bytes() == solution_before
    assert "forged" not in (tmp_path / "out" / "verdict.json").read_text()
    assert database.latest(None, EDITION_TEST_TRACK, verdict["submission_sha256"])["verdict"] == "fail"
    if HAS_TENSORFLOW:
        assert any("shows no allreduce" in reason for reason in verdict["reasons"])


@keras_only
def test_a_fixed_epoch_run_that_stalls_on_its_way_out_passes_at_its_time_to_accuracy(tmp_path):
    code, verdict, took = assess(tmp_path, SUBMISSIONS / "fixed_epochs_then_stall.py", track="fashion-mnist-referee")
    assert (code, verdict["verdict"]) == (0, "pass"), verdict["reasons"]
    # The grader measured each epoch's snapshot as it came, and stopped the run at the first at the target.
    assert verdict["stopped_at_target"] is True and verdict["wall_time_s"] < verdict["time_budget_s"]
    deciding = next(s for s in verdict["snapshots"] if s["index"] == verdict["deciding_snapshot"])
    assert verdict["time_to_accuracy_s"] == deciding["at_s"] <= verdict["wall_time_s"]
    assert deciding["heldout_accuracy"] == verdict["heldout_accuracy"] >= verdict["target_accuracy"]
    earlier = [s for s in verdict["snapshots"] if s["index"] < deciding["index"]]
    assert earlier and all(s["heldout_accuracy"] < verdict["target_accuracy"] for s in earlier)
    assert verdict["ranks_seen"] == [0, 1] and verdict["allreduced_tensors"] >= verdict["trainable_variables"]
    # The grader's copy of the deciding snapshot is the model kept with the verdict.
    assert hashlib.sha256(Path(verdict["model_path"]).read_bytes()).hexdigest() == deciding["sha256"]
