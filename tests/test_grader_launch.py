"""The sandbox and the log handling of the launcher, with the real bubblewrap and real horovodrun output."""

import os
import subprocess
import sys
from pathlib import Path

from scalelab.grader import launch, sandbox


def make_job(tmp_path: Path, hidden, command, sandbox_uid=None) -> launch.JobSpec:
    job_dir = tmp_path / "jobs" / "job1"
    (job_dir / "output").mkdir(parents=True)
    if sandbox_uid is not None:
        os.chown(job_dir, sandbox_uid, sandbox_uid)
        os.chown(job_dir / "output", sandbox_uid, sandbox_uid)
    return launch.JobSpec(job_dir=job_dir, command=command, env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"}, np=1,
                          time_budget_s=30, grace_s=1, logs_dir=tmp_path / "logs", output_dir=job_dir / "output",
                          timeline_path=job_dir / "timeline.json", sandbox_uid=sandbox_uid, hidden_paths=hidden,
                          readonly_paths=sandbox.software_paths())


def test_sandbox_hides_secrets_and_other_jobs_but_not_the_job_or_the_software(tmp_path):
    secret_dir = tmp_path / "heldout"
    secret_dir.mkdir()
    (secret_dir / "test_batch").write_text("labels")
    other_job = tmp_path / "jobs" / "other"
    other_job.mkdir(parents=True)
    (other_job / "assessment.py").write_text("someone else's work")
    uid = 61999 if os.geteuid() == 0 else None
    script = ("import os, sys; print(os.getuid()); "
              f"print(os.listdir({str(secret_dir)!r})); print(os.path.exists({str(other_job / 'assessment.py')!r})); "
              "open('written.txt', 'w').write('ok'); import tensorflow; print('software ok')")
    job = make_job(tmp_path, [secret_dir, tmp_path / "jobs"], [sys.executable, "-c", script], sandbox_uid=uid)
    done = subprocess.run(launch.sandbox_argv(job), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    if uid is not None:
        assert lines[0] == str(uid)  # root dropped to the job's own uid
    assert lines[1] == "[]" and lines[2] == "False" and lines[3] == "software ok"
    assert (job.job_dir / "written.txt").read_text() == "ok"


def test_sandbox_has_no_network_and_a_private_tmp(tmp_path):
    marker = Path("/tmp") / f"scalelab-test-{os.getpid()}"
    marker.write_text("outside")
    try:
        script = ("import os, socket\n"
                  f"print(os.path.exists({str(marker)!r}))\n"
                  "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=3); print('network')\n"
                  "except OSError as e:\n    print('no network')\n")
        job = make_job(tmp_path, [], [sys.executable, "-c", script])
        done = subprocess.run(launch.sandbox_argv(job), capture_output=True, text=True, timeout=120)
        assert done.stdout.split() == ["False", "no", "network"], done.stderr
    finally:
        marker.unlink()


def test_rank_log_demux_splits_gloo_and_mpi_prefixes_and_caps_each_log(tmp_path):
    demux = launch.RankLogDemux(tmp_path, cap_bytes=100)
    demux.feed_line(b"[0]<stdout>:epoch 3/10  loss 1.2  accuracy 0.5  val_accuracy 0.4500\n")
    demux.feed_line(b"[1,1]<stderr>:Traceback (most recent call last):\n")
    demux.feed_line(b'[1,1]<stderr>:  File "assessment.py", line 3, in <module>\n')
    demux.feed_line(b"[1,1]<stderr>:ValueError: bad\n")
    demux.feed_line(b"horovodrun's own message\n")
    for _ in range(50):
        demux.feed_line(b"[0]<stdout>:" + b"x" * 30 + b"\n")
    assert demux.epochs_seen == 3 and demux.latest_accuracy == 0.45
    assert demux.tracebacks()[1].splitlines()[-1] == "ValueError: bad"
    ranks, launcher_log, truncated = demux.close()
    assert set(ranks) == {0, 1}
    assert Path(launcher_log).read_text() == "horovodrun's own message\n"
    rank0 = Path(ranks[0]).read_text()
    assert rank0.startswith("epoch 3/10") and "log capped at 100 bytes" in rank0
    assert truncated == [ranks[0]]


def test_mpi_output_tagged_in_mid_line_is_put_back_together_per_rank(tmp_path):
    import io
    # As Open MPI forwarded a crash under horovodrun --mpi: Python wrote the exception line in pieces and each
    # piece got the rank's tag; rank 0's progress came in between rank 1's pieces.
    stream = (b"[1,1]<stderr>:Traceback (most recent call last):\n"
              b'[1,1]<stderr>:  File "assessment.py", line 9, in <module>\n'
              b"[1,1]<stderr>:RuntimeError[1,0]<stdout>:epoch 2/5  accuracy 0.6100\n"
              b"[1,1]<stderr>:: [1,1]<stderr>:rank one failed on purpose[1,1]<stderr>:\n"
              b"[1,0]<stderr>:Traceback (most recent call last):\n[1,0]<stderr>:ValueError: ended without newline")
    demux = launch.RankLogDemux(tmp_path)
    demux.pump(io.BytesIO(stream))
    ranks, launcher_log, _ = demux.close()
    assert demux.tracebacks()[1].splitlines()[-1] == "RuntimeError: rank one failed on purpose"
    assert demux.tracebacks()[0].splitlines()[-1] == "ValueError: ended without newline"
    assert demux.epochs_seen == 2 and demux.latest_accuracy == 0.61
    assert Path(ranks[1]).read_text().endswith('line 9, in <module>\nRuntimeError: rank one failed on purpose\n')
    assert "<stderr>" not in Path(ranks[0]).read_text() + Path(ranks[1]).read_text()
    assert Path(launcher_log).read_text() == ""


def test_over_long_lines_are_cut_and_stay_in_their_rank_log(tmp_path):
    import io
    demux = launch.RankLogDemux(tmp_path, cap_bytes=10 * launch.LINE_CAP_BYTES)
    demux.pump(io.BytesIO(b"[1]<stdout>:" + b"y" * (3 * launch.LINE_CAP_BYTES) + b"\n[0]<stdout>:short\n"))
    ranks, launcher_log, _ = demux.close()
    assert Path(ranks[1]).read_text().count("y") == 3 * launch.LINE_CAP_BYTES
    assert Path(ranks[0]).read_text() == "short\n"
    assert Path(launcher_log).read_text() == ""
