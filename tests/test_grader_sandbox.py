"""The sandbox every graded process runs in, with the real bubblewrap: what it shows, what it hides, what it allows."""

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import HAS_TENSORFLOW
from scalelab.grader import launch
from scalelab.grader import sandbox as sandbox_module

PROJECT_ROOT = Path(__file__).resolve().parents[1]
# What a graded run imports, on either edition: the venv's software must be visible in the sandbox.
FRAMEWORK = "tensorflow" if HAS_TENSORFLOW else "torch"


def make_job(tmp_path: Path, hidden, command, sandbox_uid=None) -> launch.JobSpec:
    job_dir = tmp_path / "jobs" / "job1"
    (job_dir / "output").mkdir(parents=True)
    if sandbox_uid is not None:
        os.chown(job_dir, sandbox_uid, sandbox_uid)
        os.chown(job_dir / "output", sandbox_uid, sandbox_uid)
    return launch.JobSpec(job_dir=job_dir, command=command, env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"}, np=1,
                          time_budget_s=30, grace_s=1, logs_dir=tmp_path / "logs", output_dir=job_dir / "output",
                          sandbox_uid=sandbox_uid, hidden_paths=hidden)


def run_in_sandbox(job: launch.JobSpec, tmp_path: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    private = tmp_path / "private"
    private.mkdir(exist_ok=True)
    return subprocess.run(launch.sandbox_argv(job, private), capture_output=True, text=True, timeout=timeout)


def test_sandbox_shows_the_job_and_the_software_but_not_secrets_or_other_jobs(tmp_path):
    secret_dir = tmp_path / "heldout"
    secret_dir.mkdir()
    (secret_dir / "test_batch").write_text("labels")
    other_job = tmp_path / "jobs" / "other"
    other_job.mkdir(parents=True)
    (other_job / "assessment.py").write_text("someone else's work")
    uid = 61999 if os.geteuid() == 0 else None
    script = ("import os, sys; print(os.getuid()); "
              f"print(os.path.exists({str(secret_dir)!r})); print(os.path.exists({str(other_job / 'assessment.py')!r})); "
              "open('written.txt', 'w').write('ok'); "
              f"import {FRAMEWORK}; print('software ok')")
    job = make_job(tmp_path, [], [sys.executable, "-c", script], sandbox_uid=uid)
    done = run_in_sandbox(job, tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    if uid is not None:
        assert lines[0] == str(uid)  # root dropped to the job's own uid
    assert lines[1:4] == ["False", "False", "software ok"]
    assert (job.job_dir / "written.txt").read_text() == "ok"


def test_sandbox_is_an_allow_list_of_the_system_the_software_and_the_job(tmp_path):
    """What exists inside: the system directories, a few /etc entries, the software, the job; no home, /srv, /opt
    (beyond a venv there), no checkout beside the course library, no account or host name of the machine."""
    fashion = Path("/usr/share/datasets/fashion-mnist")
    script = ("import json, os, socket\n"
              "print(json.dumps({'root': sorted(os.listdir('/')), 'etc': sorted(os.listdir('/etc')),\n"
              f"  'checkout': sorted(os.listdir({str(PROJECT_ROOT)!r})),\n"
              f"  'fashion': sorted(os.listdir({str(fashion)!r})) if os.path.isdir({str(fashion)!r}) else None,\n"
              "  'passwd': open('/etc/passwd').read(), 'host': socket.gethostname(),\n"
              "  'localhost': socket.gethostbyname(socket.gethostname())}))\n")
    uid = 61998 if os.geteuid() == 0 else None
    job = make_job(tmp_path, sandbox_module.data_directories(), [sys.executable, "-c", script], sandbox_uid=uid)
    done = run_in_sandbox(job, tmp_path)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    software_tops = {Path(p).parts[1] for p in sandbox_module.software_paths()} | {job.job_dir.parts[1]}
    allowed_root = {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "sys", "proc", "dev", "tmp", "run",
                    "etc"} | software_tops
    assert set(seen["root"]) <= allowed_root, set(seen["root"]) - allowed_root
    for absent in ("home", "srv", "mnt", "media", "var", "boot"):
        assert absent not in seen["root"] or absent in software_tops
    assert set(seen["etc"]) <= set(sandbox_module.ETC_ENTRIES) | {"passwd", "group", "hosts"}
    assert set(seen["checkout"]) <= {"source_code", "grader", ".venv"}, seen["checkout"]  # no assessment/solution
    assert "assessment" not in seen["checkout"]
    if fashion.is_dir():
        assert seen["fashion"] == []  # Debian's copy under /usr is covered
    assert [line.split(":")[0] for line in seen["passwd"].splitlines()] == ["root", "scalelab-job", "nobody"]
    assert seen["host"] == sandbox_module.SANDBOX_HOSTNAME and seen["localhost"] == "127.0.0.1"


def test_sandbox_has_no_network_and_a_private_tmp(tmp_path):
    marker = Path("/tmp") / f"scalelab-test-{os.getpid()}"
    marker.write_text("outside")
    try:
        script = ("import os, socket\n"
                  f"print(os.path.exists({str(marker)!r}))\n"
                  "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=3); print('network')\n"
                  "except OSError as e:\n    print('no network')\n")
        job = make_job(tmp_path, [], [sys.executable, "-c", script])
        done = run_in_sandbox(job, tmp_path, timeout=120)
        assert done.stdout.split() == ["False", "no", "network"], done.stderr
    finally:
        marker.unlink()


def test_a_container_that_forbids_mounting_proc_is_told_which_flag_to_add(tmp_path, monkeypatch):
    # bubblewrap as it fails in a container whose engine masks /proc (podman and docker by default).
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho \"bwrap: Can't mount proc on /newroot/proc: Operation not permitted\" >&2\n"
                    "exit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sandbox_module, "bwrap_path", lambda: str(fake))
    reason = sandbox_module.sandbox_works()
    assert "Can't mount proc" in reason
    assert "--security-opt 'unmask=/proc/*'" in reason and "--security-opt systempaths=unconfined" in reason


def test_a_container_that_forbids_setting_the_host_name_is_told_which_flag_to_add(tmp_path, monkeypatch):
    # bubblewrap as it fails under podman's default seccomp profile, which refuses sethostname without CAP_SYS_ADMIN.
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho \"bwrap: Can't set hostname to scalelab-sandbox: Operation not permitted\" >&2\n"
                    "exit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sandbox_module, "bwrap_path", lambda: str(fake))
    reason = sandbox_module.sandbox_works()
    assert "Can't set hostname" in reason and "--security-opt seccomp=unconfined" in reason


def test_the_probe_asks_for_what_the_sandbox_asks_for(tmp_path, monkeypatch):
    # A container may allow some of it (a fresh /proc) and refuse the rest (the host name): the probe must find out.
    log = tmp_path / "argv"
    fake = tmp_path / "bwrap"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {log}\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sandbox_module, "bwrap_path", lambda: str(fake))
    assert sandbox_module.sandbox_works() is None
    probed = log.read_text().split()
    for option in ("--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--proc"):
        assert option in probed
    assert probed[probed.index("--hostname") + 1] == sandbox_module.SANDBOX_HOSTNAME


def test_the_container_run_lines_carry_the_flag_that_lets_the_sandbox_mount_proc():
    readme = (PROJECT_ROOT / "containers" / "README.md").read_text()
    run_lines = [block for block in readme.split("```") if "docker run" in block]
    assert run_lines and all("--security-opt systempaths=unconfined" in block for block in run_lines)
    podman_lines = [block for block in readme.split("```") if "podman run" in block]
    assert podman_lines and all("--security-opt 'unmask=/proc/*'" in block for block in podman_lines)
