"""The sandbox autograding runs students' notebooks in (scalelab.grader.nbgrading): each kernel through the real
helper and bubblewrap, driven by nbclient as nbgrader drives it. A notebook's code gets a throw-away uid, a copy of
its folder, no network, no secret and none of the course's files; a cell that never returns or forks without end
is stopped and the next cell runs; memory and time are bounded per notebook. As root, as CI runs."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Iterator

import psutil
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import DeadKernelError
from nbformat.v4 import new_code_cell, new_notebook

from conftest import PROJECT_ROOT
from scalelab.grader import cgroups
from scalelab.grader.nbgrading import kernel_sandbox, sandboxed_execute
from scalelab.grader.nbgrading.sandboxed_execute import SandboxedKernelManager
from scalelab.grader.sandbox import SANDBOX_UID_RANGE


SOURCE_NOTEBOOK = PROJECT_ROOT / "labs" / "source" / "quiz" / "quiz.ipynb"


def run_notebook(folder: Path, cells: list[str], timeout: int = 60, **manager_settings) -> list[str]:
    """What each cell said: its error (name: value) if it ended in one, else its text output; executed in the
    sandbox with ``folder`` as its folder, as nbgrader's Execute does (interrupted at the timeout)."""
    notebook = new_notebook(cells=[new_code_cell(source) for source in cells])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    client = NotebookClient(notebook, timeout=timeout, kernel_manager_class=SandboxedKernelManager, allow_errors=True,
                            interrupt_on_timeout=True, raise_on_iopub_timeout=True,
                            resources={"metadata": {"path": str(folder)}})
    for name, value in manager_settings.items():
        client.config.SandboxedKernelManager[name] = value
    client.execute()
    said = []
    for cell in notebook.cells:
        errors = [f"{output.ename}: {output.evalue}" for output in cell.outputs if output.output_type == "error"]
        printed = "".join(output.get("text", "") + str(output.get("data", {}).get("text/plain", ""))
                          for output in cell.outputs)
        said.append(errors[-1] if errors else printed.strip())
    return said


def sandbox_uid_processes() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real in SANDBOX_UID_RANGE]


def assert_nothing_left() -> None:
    """No process of the kernel's uid, and none of the grader's private directories (the copy, the sockets)."""
    assert not sandbox_uid_processes(), "the kernel's processes outlive its notebook"
    left = sorted(path.name for path in Path(tempfile.gettempdir()).iterdir())
    assert left == [], f"the notebook's private directories outlive it: {left}"


@pytest.fixture
def folder(tmp_path, monkeypatch) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.fail("the throw-away uid needs root: run these tests as root (CI does)")
    notebook_folder = tmp_path / "submitted" / "alice" / "quiz"
    notebook_folder.mkdir(parents=True)
    (notebook_folder / "data.txt").write_text("the student's own file\n")
    # The kernel manager's private directory goes into a temporary directory of the test's own, where the test sees
    # whether it is removed; a short path, as the kernel's Unix sockets are in it.
    private_temp = tempfile.mkdtemp(prefix="ks-", dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", private_temp)
    yield notebook_folder
    shutil.rmtree(private_temp, ignore_errors=True)


def test_a_kernel_runs_as_a_throwaway_uid_without_secrets_network_or_the_course(folder, monkeypatch):
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "instructors-hub-token-0123")
    monkeypatch.setenv("SCALELAB_SECRET_KEY", "do-not-leak")
    monkeypatch.setenv("OMPI_MCA_btl", "self,vader")  # the course's Open MPI settings do pass
    (folder / "source-link.ipynb").symlink_to(SOURCE_NOTEBOOK)
    listener = socket.create_server(("127.0.0.1", 0))
    accepted = []
    threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True).start()
    said = run_notebook(folder, [
        "import os; print(os.getuid(), os.geteuid(), os.getgroups())",
        "print(sorted(os.environ))",
        f"print(os.path.exists({str(SOURCE_NOTEBOOK)!r}), os.path.exists('/root'), os.path.exists({str(PROJECT_ROOT / 'assessment' / 'solution')!r}))",
        "print(open('source-link.ipynb').read()[:100])",
        f"import socket; socket.create_connection(('127.0.0.1', {listener.getsockname()[1]}), timeout=3)",
        "print(open('data.txt').read())",
    ])
    uid, euid, groups = said[0].split(" ", 2)
    assert int(uid) == int(euid) and int(uid) in SANDBOX_UID_RANGE and groups == "[]"
    assert "JUPYTERHUB_API_TOKEN" not in said[1] and "SCALELAB_SECRET_KEY" not in said[1] and "OMPI_MCA_btl" in said[1]
    assert said[2] == "False False False"
    assert said[3].startswith("FileNotFoundError"), "the link in the folder leads nowhere inside"
    assert said[4].startswith("ConnectionRefusedError") and not accepted, "the host's loopback is out of reach"
    assert said[5] == "the student's own file"


def test_what_a_notebook_writes_stays_in_its_copy_and_nothing_of_it_survives(folder):
    said = run_notebook(folder, [
        "open('written.txt', 'w').write('x'); os_ = __import__('os'); os_.symlink('/etc/passwd', 'planted.ipynb')",
        "import subprocess; subprocess.Popen(['sleep', '600']); print('started')",
    ])
    assert said == ["", "started"]
    assert sorted(path.name for path in folder.iterdir()) == ["data.txt"]
    assert_nothing_left()


def test_a_temporary_folder_too_deep_for_the_kernels_sockets_leaves_them_to_a_short_one(folder, tmp_path, monkeypatch):
    # A Unix socket's path fits in 108 bytes: in a deep temporary folder (an instructor's TMPDIR, a test runner's)
    # every kernel would fail with "File name too long".
    short_temp = tempfile.gettempdir()  # the fixture's own, where the test sees what is left
    deep_temp = tmp_path / ("deep-" * 12)
    deep_temp.mkdir()
    monkeypatch.setattr(sandboxed_execute, "SHORT_TEMP_DIR", short_temp)
    monkeypatch.setattr(tempfile, "tempdir", str(deep_temp))
    assert run_notebook(folder, ["print(6 * 7)"]) == ["42"]
    assert list(deep_temp.iterdir()) == []
    monkeypatch.setattr(tempfile, "tempdir", short_temp)
    assert_nothing_left()


def test_a_cell_that_never_returns_is_interrupted_and_the_next_cell_runs(folder):
    said = run_notebook(folder, [
        "import subprocess\nsubprocess.Popen(['sleep', '600'])\nwhile True:\n    pass",
        "print('still grading')",
    ], timeout=10)
    assert said[0].startswith("KeyboardInterrupt"), said[0]
    assert said[1] == "still grading"
    assert_nothing_left()


def test_a_cell_that_forks_and_ignores_interrupts_stops_its_kernel_with_a_clear_error(folder):
    """A forking loop that goes on after an interrupt (one that lands in Python's at-fork callbacks is swallowed
    there; this cell ignores every one, so that the test does not depend on where it lands): the helper stops the
    whole kernel (nbgrader reports the notebook's error) and nothing of it is left."""
    with pytest.raises(DeadKernelError):
        run_notebook(folder, ["import os, signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n"
                              "    try:\n        os.fork()\n    except OSError:\n        pass", "print('never')"],
                     timeout=5)
    assert_nothing_left()


def test_a_cell_that_forks_in_a_loop_is_stopped_and_leaves_nothing(folder):
    """An ordinary forking loop: its interrupt ends the cell (the next one runs) or, when it lands in an at-fork
    callback, the kernel is stopped; either way grading goes on within the grace and no process is left."""
    try:
        said = run_notebook(folder, ["import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                                     "        pass", "print('next')"], timeout=5)
    except DeadKernelError:
        pass
    else:
        # (Python 3.12 and later warn first that forking a multi-threaded process may deadlock.)
        assert any(line.startswith("KeyboardInterrupt") for line in said[0].splitlines()) and said[1] == "next", said
    assert_nothing_left()


def test_a_notebook_over_its_memory_is_stopped(folder):
    assert cgroups.SandboxCgroups.available(), "this machine lets root make a memory cgroup"
    with pytest.raises(DeadKernelError):
        run_notebook(folder, ["hog = b'x' * (2 * 1024**3)", "print('survived')"],
                     memory_limit_bytes=400 * 1024**2)
    assert_nothing_left()


def test_a_notebook_over_its_time_is_stopped(folder):
    with pytest.raises(DeadKernelError):
        run_notebook(folder, ["import time; time.sleep(120)"], timeout=300, time_limit_s=8)
    assert_nothing_left()


def test_the_helper_takes_only_folders_that_belong_to_its_caller(folder, tmp_path):
    """Under sudo the caller is SUDO_UID: a folder of root's (or a link) is refused before anything runs."""
    work, sockets = tmp_path / "work", tmp_path / "sockets"
    work.mkdir()
    sockets.mkdir()
    nobody = 65534
    helper = [sys.executable, "-I", "-m", "scalelab.grader.nbgrading.kernel_sandbox"]
    refused = subprocess.run([*helper, "--work", str(work), "--sockets", str(sockets), "--", "true"],
                             env={"SUDO_UID": str(nobody), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == kernel_sandbox.EXIT_BAD_ARGUMENTS
    assert "does not belong to the caller" in refused.stderr
    (tmp_path / "link").symlink_to(work)
    refused = subprocess.run([*helper, "--work", str(tmp_path / "link"), "--sockets", str(sockets), "--", "true"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == kernel_sandbox.EXIT_BAD_ARGUMENTS and "not a directory of yours" in refused.stderr


def test_only_allowed_names_reach_the_kernels_environment():
    passed = kernel_sandbox.allowed_environment({
        "JUPYTERHUB_API_TOKEN": "t", "JPY_API_TOKEN": "t", "HOROVOD_SECRET_KEY": "k", "AWS_SECRET_ACCESS_KEY": "k",
        "OMPI_MCA_pml": "ob1", "SCALELAB_CIFAR10_DIR": "/data", "LANG": "C.UTF-8", "HOME": "/home/instructor",
        "NBGRADER_EXECUTION": "autograde", "TF_CPP_MIN_LOG_LEVEL": "2", "SSH_AUTH_SOCK": "/tmp/agent"})
    assert passed == {"OMPI_MCA_pml": "ob1", "SCALELAB_CIFAR10_DIR": "/data", "LANG": "C.UTF-8",
                      "NBGRADER_EXECUTION": "autograde", "TF_CPP_MIN_LOG_LEVEL": "2"}


def test_the_data_folder_the_caller_names_is_shown_read_only(folder, tmp_path, monkeypatch):
    data = tmp_path / "staged" / "cifar-10-batches-py"
    data.mkdir(parents=True)
    (data / "batches.meta").write_text("meta")
    monkeypatch.setenv("SCALELAB_CIFAR10_DIR", str(data.parent))
    said = run_notebook(folder, [f"print(sorted(__import__('os').listdir({str(data)!r})))",
                                 f"open({str(data / 'batches.meta')!r}, 'a').write('x')"])
    assert said[0] == "['batches.meta']"
    assert said[1].startswith(("OSError", "PermissionError")), said[1]


def test_the_course_scripts_the_labs_run_are_shown_read_only_and_nothing_else_of_their_folder(tmp_path):
    from scalelab import environment
    checkout = kernel_sandbox.course_script_binds({}, for_sudo_caller=False)
    assert [(bind.source, bind.target, bind.writable) for bind in checkout] == [
        (PROJECT_ROOT / "source_code" / name, PROJECT_ROOT / "source_code" / name, False)
        for name in environment.COURSE_SCRIPTS]
    staged = tmp_path / "course" / "source_code"
    staged.mkdir(parents=True)
    for name in environment.COURSE_SCRIPTS:
        (staged / name).write_text("# the course's script\n")
    shown = kernel_sandbox.course_script_binds({"SCALELAB_SOURCE_DIR": str(staged)}, for_sudo_caller=False)
    assert [bind.source for bind in shown] == [staged / name for name in environment.COURSE_SCRIPTS]
    (staged / environment.COURSE_SCRIPTS[0]).unlink()
    (staged / environment.COURSE_SCRIPTS[0]).symlink_to("/etc/shadow")
    assert kernel_sandbox.course_script_binds({"SCALELAB_SOURCE_DIR": str(staged)}, for_sudo_caller=False) == []
    assert kernel_sandbox.course_script_binds({"SCALELAB_SOURCE_DIR": str(tmp_path)}, for_sudo_caller=False) == []
