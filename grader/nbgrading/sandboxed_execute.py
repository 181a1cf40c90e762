"""nbgrader's Execute with every kernel in the grading sandbox (kernel_sandbox): students' notebooks never run as the
instructor, with the instructor's files or with a secret.

The labs' nbgrader_config.py puts :class:`Execute` in autograding's preprocessors. For each notebook the kernel
manager makes a private directory with two folders of random names, a copy of the notebook's folder (the kernel's
working directory: what the notebook writes is thrown away with it, never written into the course) and one for the
connection file and the kernel's Unix sockets, then starts the kernel through the helper: directly as root, through
``sudo`` where the class's Hub installed the rule for instructors (:data:`PRIVILEGED_HELPER`), else as the caller.
Interrupts, terminate and kill travel to the helper on its standard input (under sudo the caller may not signal it).
"""

from __future__ import annotations

import grp
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import zmq
from jupyter_client.provisioning import LocalProvisioner
from traitlets import Float, Integer, List, Unicode, default

from ..classroom.accounts import ROLE_GROUPS
from scalelab.grader.nbgrading.kernel_sandbox import DEFAULT_MEMORY_LIMIT_BYTES, DEFAULT_TIME_LIMIT_S, \
    allowed_environment
from scalelab.headless import Execute as PollingExecute, PollingKernelManager

# Installed by containers/hub/hub.sh with a sudo rule for the instructors' group: root's, runs the helper with -I.
PRIVILEGED_HELPER = "/usr/local/sbin/scalelab-kernel-sandbox"

# Where the temporary folder is too deep for the kernel's Unix sockets (a socket's path fits in sun_path, 107 bytes
# on Linux), the private directory goes here instead.
SHORT_TEMP_DIR = "/tmp"


def private_dir_parent() -> str:
    """The temporary folder, or :data:`SHORT_TEMP_DIR` where the kernel's socket paths would not fit in it."""
    temp_dir = tempfile.gettempdir()
    longest_socket = len(os.fsencode(temp_dir)) + len("/scalelab-grading-12345678/") + 32 + len("/kernel-99999")
    return temp_dir if longest_socket <= zmq.IPC_PATH_MAX_LEN else SHORT_TEMP_DIR


def helper_command() -> list[str]:
    """How this process starts the helper: itself as root; through sudo for an instructor where the Hub installed
    the rule; else itself, as the caller."""
    if os.geteuid() != 0 and os.path.exists(PRIVILEGED_HELPER) and shutil.which("sudo") and in_instructors_group():
        return ["sudo", "-n", PRIVILEGED_HELPER]
    return [sys.executable, "-I", "-m", "scalelab.grader.nbgrading.kernel_sandbox"]


def in_instructors_group() -> bool:
    try:
        return grp.getgrnam(ROLE_GROUPS["instructor"]).gr_gid in os.getgroups()
    except KeyError:
        return False


class SandboxProvisioner(LocalProvisioner):
    """The local provisioner, speaking to the helper on its standard input instead of signalling it."""

    async def launch_kernel(self, cmd: list[str], **kwargs: Any):
        kwargs["stdin"] = subprocess.PIPE  # kept open: its end tells the helper to stop the kernel
        return await super().launch_kernel(cmd, **kwargs)

    async def send_signal(self, signum: int) -> None:
        if not self.process or signum == 0:
            return
        try:
            self.process.stdin.write(f"{int(signum)}\n".encode())
            self.process.stdin.flush()
            if signum == signal.SIGKILL:
                self.process.stdin.close()
        except (OSError, ValueError):
            pass  # the helper has ended already


class SandboxedKernelManager(PollingKernelManager):
    """A kernel manager whose kernels run in the grading sandbox, reached over IPC sockets."""

    time_limit_s = Float(DEFAULT_TIME_LIMIT_S, help="Seconds a notebook's kernel may live.").tag(config=True)
    memory_limit_bytes = Integer(DEFAULT_MEMORY_LIMIT_BYTES,
                                 help="Memory of the kernel and all it starts (where a cgroup can be made).").tag(
        config=True)
    helper = List(Unicode(), help="The command that starts kernel_sandbox (default: helper_command()).").tag(
        config=True)

    @default("helper")
    def _default_helper(self) -> list[str]:
        return helper_command()

    @default("transport")
    def _default_transport(self) -> str:
        return "ipc"

    _private_dir: Path | None = None
    _work_dir: Path | None = None
    _sockets_dir: Path | None = None

    async def _async_pre_start_kernel(self, **kw: Any):
        self.transport = "ipc"
        self._prepare_directories(Path(kw.get("cwd") or os.getcwd()))
        self.kernel_id = self.kernel_id or kw.pop("kernel_id", None) or secrets.token_hex(16)
        if self.provisioner is None:
            self.provisioner = SandboxProvisioner(kernel_id=self.kernel_id, kernel_spec=self.kernel_spec, parent=self)
        kw["cwd"] = str(self._work_dir)
        # The helper receives the allowed part of the environment as arguments (sudo would drop it); the process
        # itself starts with the caller's environment minus anything that is not allowed.
        kw["env"] = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": os.environ.get("LANG", "C.UTF-8")}
        return await super()._async_pre_start_kernel(**kw)

    def _prepare_directories(self, notebook_dir: Path) -> None:
        if self._private_dir is None:
            self._private_dir = Path(tempfile.mkdtemp(prefix="scalelab-grading-", dir=private_dir_parent()))
            # Others may pass (the kernel's uid must) but not list: the folders inside have unguessable names.
            self._private_dir.chmod(0o711)
        self._work_dir = self._private_dir / secrets.token_hex(16)
        self._sockets_dir = self._private_dir / secrets.token_hex(16)
        shutil.copytree(notebook_dir, self._work_dir, symlinks=True,
                        ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
        self._sockets_dir.mkdir()
        for directory in (self._work_dir, self._sockets_dir):
            for path in [directory, *directory.rglob("*")]:
                if not path.is_symlink():
                    path.chmod(0o777 if path.is_dir() else 0o666)
        self.connection_file = str(self._sockets_dir / "kernel.json")
        self.ip = str(self._sockets_dir / "kernel")

    def write_connection_file(self, **kwargs: Any) -> None:
        super().write_connection_file(**kwargs)
        os.chmod(self.connection_file, 0o644)  # the kernel's uid reads it; its folder's name is the secret

    def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
        kernel = super().format_kernel_cmd(extra_arguments)
        passed = allowed_environment({**os.environ, **(self.kernel_spec.env or {})})
        passed = {name: value for name, value in passed.items() if "${" not in value}
        return [*self.helper, "--work", str(self._work_dir), "--sockets", str(self._sockets_dir),
                "--time-limit", str(self.time_limit_s), "--memory-limit", str(self.memory_limit_bytes),
                *[f"--env={name}={value}" for name, value in sorted(passed.items())], "--", *kernel]

    async def _async_cleanup_resources(self, restart: bool = False) -> None:
        await super()._async_cleanup_resources(restart=restart)
        if self._private_dir is not None and not restart:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None

    # AsyncKernelManager binds the public name to the base class's coroutine, and nbclient calls it, not the shutdown
    # that would reach the override above, when it finds the kernel dead (stopped for its time, memory or forks).
    cleanup_resources = _async_cleanup_resources


class Execute(PollingExecute):
    """nbgrader's Execute (reading the kernel as scalelab.headless does) with the kernel in the grading sandbox."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["kernel_manager_class"] = SandboxedKernelManager
        super().__init__(*args, **kwargs)


def with_sandboxed_execute(preprocessors: list) -> list:
    """An nbgrader preprocessor list with its Execute (nbgrader's or scalelab.headless's) replaced by the one above."""
    from nbgrader.preprocessors import Execute as NbgraderExecute

    return [Execute if preprocessor in (NbgraderExecute, PollingExecute) else preprocessor
            for preprocessor in preprocessors]
