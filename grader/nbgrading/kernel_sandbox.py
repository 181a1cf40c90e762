"""The sandbox a student's notebook runs in while nbgrader grades it: one kernel, started and watched by this helper.

    python -I -m scalelab.grader.nbgrading.kernel_sandbox --work DIR --sockets DIR [--env NAME=VALUE ...]
        [--time-limit S] [--memory-limit BYTES] -- KERNEL COMMAND ...

The kernel runs in the grader's bubblewrap sandbox (scalelab.grader.sandbox): the system, the venv and the course
library read-only, the course's data sets read-only, a private /tmp, no network, its own PID namespace, and of
the caller's files only two directories: ``--work`` (a copy of the notebook's folder, its working directory) and
``--sockets`` (the kernel's connection file and its Unix sockets: the kernel talks to nbgrader over IPC, since it
has no network). Its environment is an allow-list (``allowed_environment``): no Hub token, no secret.

As root the kernel gets a uid of its own (a throw-away one, as the assessment's runs do), a process limit counted
on that uid, and a memory limit (a cgroup) where the machine lets root make one. An instructor on the class's Hub
is not root: nbgrader reaches this helper through ``sudo`` (containers/hub/hub.sh installs the rule), and the
helper takes the instructor for the caller: the two directories must be the caller's own, and data directories
are shown only when every account may read them. Anyone else runs it as themselves: bubblewrap then makes a user
namespace, and the kernel keeps the caller's uid but still sees only what is listed above.

The caller talks to the helper through its standard input, one line a command: a signal number (nbgrader's
interrupt after a cell's timeout, its terminate and kill). The end of standard input kills the kernel. When the
kernel ends, whatever it started ends too and the work directory is emptied.

Exit codes: the kernel's own; 124 when the notebook ran past ``--time-limit``; 2 bad arguments; 3 the sandbox
could not be built.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from scalelab import environment
from scalelab.grader import sandbox as sandbox_module
from scalelab.grader.caller import Refused, caller_uid, open_callers_directory
from scalelab.grader.cgroups import SandboxCgroups

# What a grading kernel keeps of its caller's environment (anything else, tokens and secrets included, is dropped).
ALLOWED_NAMES = frozenset({"LANG", "LANGUAGE", "TZ", "NBGRADER_EXECUTION", "PYTHONHASHSEED", "MPLBACKEND",
                           "SCALELAB_CIFAR10_DIR", "SCALELAB_FASHION_MNIST_DIR", "SCALELAB_SOURCE_DIR",
                           "OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "JPY_PARENT_PID"})
ALLOWED_PREFIXES = ("LC_", "OMPI_MCA_", "HOROVOD_", "TF_CPP_")
# A name that looks like a credential never passes, whatever its prefix.
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|KEY|CREDENTIAL|COOKIE|AUTH", re.IGNORECASE)
# Counted on the kernel's own uid; threads count too (TensorFlow starts dozens per process, lab 3 runs two ranks).
NPROC_LIMIT = 1024
DEFAULT_TIME_LIMIT_S = 1800
# How long an interrupt may take to stop what the cell started before the whole kernel is stopped instead.
INTERRUPT_GRACE_S = 5.0
DEFAULT_MEMORY_LIMIT_BYTES = 6 * 1024**3
EXIT_TIME_LIMIT, EXIT_BAD_ARGUMENTS, EXIT_NO_SANDBOX = 124, 2, 3


def allowed_environment(environ: dict[str, str]) -> dict[str, str]:
    """The part of ``environ`` a grading kernel may see."""
    return {name: value for name, value in environ.items()
            if (name in ALLOWED_NAMES or name.startswith(ALLOWED_PREFIXES)) and not SECRET_NAME.search(name)}


def kernel_environment(passed: dict[str, str]) -> dict[str, str]:
    """The kernel's whole environment: the allowed part of what the caller passed, and a home inside the sandbox."""
    scripts = str(Path(sys.executable).parent)
    return {**allowed_environment(passed), "PATH": f"{scripts}:/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp",
            "USER": "scalelab-job", "IPYTHONDIR": "/tmp/.ipython", "MPLCONFIGDIR": "/tmp/.matplotlib",
            "PYTHONDONTWRITEBYTECODE": "1"}


def readable_by_everyone(path: Path) -> bool:
    """Whether every account may read ``path``, a directory: what the helper may show for a caller under sudo."""
    try:
        resolved = path.resolve(strict=True)
        mode = resolved.stat().st_mode
        if not stat.S_ISDIR(mode) or mode & 0o005 != 0o005:
            return False
        return all(parent.stat().st_mode & 0o001 for parent in resolved.parents)
    except OSError:
        return False


def data_binds(passed: dict[str, str], for_sudo_caller: bool) -> list[sandbox_module.Bind]:
    """The course's data directories, read-only; the caller's data settings count (sudo drops its environment)."""
    directories = sandbox_module.data_directories(passed.get("SCALELAB_CIFAR10_DIR") or None,
                                                  passed.get("SCALELAB_FASHION_MNIST_DIR") or None)
    directories = [d for d in directories if d.is_dir()]
    if for_sudo_caller:
        directories = [d for d in directories if readable_by_everyone(d)]
    return [sandbox_module.Bind(d, d) for d in directories]


def course_script_binds(passed: dict[str, str], for_sudo_caller: bool) -> list[sandbox_module.Bind]:
    """The course's scripts the labs run (scalelab.environment.COURSE_SCRIPTS), read-only where they are, so that a
    notebook finds them as it does outside the sandbox; none where there are none. Under sudo only a folder every
    account may read, and never through a link."""
    try:
        folder = environment.course_source_dir({"SCALELAB_SOURCE_DIR": passed.get("SCALELAB_SOURCE_DIR", "")})
    except FileNotFoundError:
        return []
    if for_sudo_caller and not readable_by_everyone(folder):
        return []
    scripts = [folder / name for name in environment.COURSE_SCRIPTS]
    if not all(stat.S_ISREG(script.lstat().st_mode) for script in scripts):
        return []
    return [sandbox_module.Bind(script, script) for script in scripts]


def sandbox_processes(leader: int) -> list[psutil.Process]:
    try:
        return psutil.Process(leader).children(recursive=True)
    except psutil.Error:
        return []


def bubblewrap_and_kernel(leader: int) -> tuple[set[int], psutil.Process | None]:
    """bubblewrap's own processes (the helper's child and the sandbox's first process), and the kernel: the oldest
    child of the sandbox's first process (orphans of the kernel's children are reparented there too)."""
    try:
        inner = [p for p in psutil.Process(leader).children() if _name(p) == "bwrap"]
        below = [p for bwrap in inner for p in bwrap.children()]
    except psutil.Error:
        return {leader}, None
    candidates = sorted((p for p in below if _name(p) != "bwrap"), key=_create_time)
    return {leader, *(p.pid for p in inner)}, (candidates[0] if candidates else None)


def _create_time(process: psutil.Process) -> float:
    try:
        return process.create_time()
    except psutil.Error:
        return float("inf")


def processes_of(uid: int) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == uid]


def signal_every_process_of(uid: int, signum: int, rounds: int = 3) -> None:
    """``signum`` to every process of ``uid`` at once, sent as that uid (kill(-1)): the kernel does it in one pass,
    which a fork bomb on every core cannot outrun, as it can a helper killing its processes one by one."""
    child = os.fork()
    if child == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            for _ in range(rounds):
                try:
                    os.kill(-1, signum)
                except OSError:
                    pass
        finally:
            os._exit(0)
    os.waitpid(child, 0)


def signal_kernel(leader: int, signum: int, uid: int | None, cgroups: SandboxCgroups) -> bool:
    """An interrupt reaches the kernel once everything else in the sandbox (what the interrupted cell started: a
    fork bomb, a stray server, their orphans) is killed, so that the kernel has the cores to answer it and no
    forked copy of it answers in its place. False when the kernel cannot be interrupted: it must be stopped."""
    bubblewrap, kernel = bubblewrap_and_kernel(leader)
    if kernel is None:
        return True
    if signum != signal.SIGINT:
        _send(kernel, signum)
        return True
    # Frozen, nothing forks: the others are killed and the kernel interrupted before it runs again. Repeated, with
    # the interrupt, until nothing else is left. A cell that forks in a loop may never stop: an interrupt that
    # lands in one of Python's at-fork callbacks is swallowed there ("Exception ignored in ...").
    deadline = time.monotonic() + INTERRUPT_GRACE_S
    while time.monotonic() < deadline:
        if cgroups.freeze(True):
            others = [pid for pid in cgroups.pids() if pid != kernel.pid and pid not in bubblewrap]
        elif uid is not None:
            signal_every_process_of(uid, signal.SIGSTOP)  # the kernel too, for a moment
            others = [p.pid for p in processes_of(uid) if p.pid != kernel.pid]
        else:
            stop_all_but(leader, kernel.pid)
            others = []
        for pid in others:
            _kill_pid(pid)
        _send(kernel, signum)
        cgroups.freeze(False)
        _send(kernel, signal.SIGCONT)
        time.sleep(0.2)
        if not [pid for pid in cgroups.pids() if pid != kernel.pid and pid not in bubblewrap]:
            return True
    print(f"kernel_sandbox: the interrupted cell kept starting processes for {INTERRUPT_GRACE_S:.0f} s; its kernel "
          f"was stopped", file=sys.stderr)
    return False


def _kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def _send(process: psutil.Process, signum: int) -> None:
    try:
        process.send_signal(signum)
    except psutil.Error:
        pass


def stop_all_but(leader: int, kernel_pid: int) -> None:
    """Without a uid of the sandbox's own: kill every process of the sandbox but bubblewrap's and the kernel, each
    round first stopping what runs (a stopped process cannot fork)."""
    stopped: dict[int, psutil.Process] = {}
    for _ in range(100):
        running = [p for p in sandbox_processes(leader)
                   if p.pid != kernel_pid and p.pid not in stopped and _name(p) != "bwrap"]
        if not running:
            break
        for process in running:
            try:
                process.suspend()
                stopped[process.pid] = process
            except psutil.Error:
                pass
    for process in stopped.values():
        _send(process, signal.SIGKILL)
    psutil.wait_procs(list(stopped.values()), timeout=2)


def _name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.Error:
        return ""


def kill_everything(leader: subprocess.Popen, uid: int | None) -> None:
    """The sandbox and every process in it: bubblewrap's PID namespace ends with its first process, and as root
    every process of the kernel's uid is killed as well (nothing of it survives the grading)."""
    for _ in range(20):
        if leader.poll() is None:
            leader.kill()
        if uid is not None:
            signal_every_process_of(uid, signal.SIGKILL)
        left = sandbox_processes(leader.pid) + (processes_of(uid) if uid is not None else [])
        for process in left:
            _send(process, signal.SIGKILL)
        if not left and leader.poll() is not None:
            return
        psutil.wait_procs(left, timeout=0.5)


def empty_directory(fd: int) -> None:
    """Remove what is in the directory open as ``fd`` without following any link in it."""
    for entry in os.scandir(fd):
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.name, dir_fd=fd)
            else:
                os.unlink(entry.name, dir_fd=fd)
        except OSError:
            pass


def read_commands(leader: subprocess.Popen, uid: int | None, cgroups: SandboxCgroups, on_end) -> None:
    """Signal numbers from standard input, one a line; the end of input (the caller gone) ends the kernel."""
    for line in sys.stdin:
        word = line.strip()
        if word.isdigit() and 0 < int(word) < signal.NSIG:
            if int(word) == signal.SIGKILL:
                break
            if not signal_kernel(leader.pid, int(word), uid, cgroups):
                break
    on_end()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kernel_sandbox", description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", required=True, help="the copy of the notebook's folder: the working directory")
    parser.add_argument("--sockets", required=True, help="the connection file's directory, for the kernel's sockets")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT_S, metavar="SECONDS")
    parser.add_argument("--memory-limit", type=int, default=DEFAULT_MEMORY_LIMIT_BYTES, metavar="BYTES")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    arguments = parser.parse_args(argv)
    command = arguments.command[1:] if arguments.command[:1] == ["--"] else arguments.command
    if not command or arguments.time_limit <= 0 or arguments.memory_limit <= 0:
        parser.print_usage(sys.stderr)
        return EXIT_BAD_ARGUMENTS
    passed = dict(pair.split("=", 1) for pair in arguments.env if "=" in pair)

    uid = caller_uid()
    under_sudo = os.geteuid() == 0 and uid != 0
    try:
        work_fd = open_callers_directory(arguments.work, uid)
        sockets_fd = open_callers_directory(arguments.sockets, uid)
    except Refused as refusal:
        print(f"kernel_sandbox: {refusal}", file=sys.stderr)
        return EXIT_BAD_ARGUMENTS
    kernel_uid = sandbox_module.allocate_uid()
    private_dir = Path(tempfile.mkdtemp(prefix="scalelab-kernel-"))
    private_dir.chmod(0o755)
    cgroups = SandboxCgroups("scalelab-kernel", arguments.memory_limit, enabled=kernel_uid is not None)
    work, sockets = Path(arguments.work), Path(arguments.sockets)
    binds = [sandbox_module.Bind(work, work, writable=True, fd=work_fd),
             sandbox_module.Bind(sockets, sockets, writable=True, fd=sockets_fd), *data_binds(passed, under_sudo),
             *course_script_binds(passed, under_sudo)]
    # Sockets the kernel makes must be open to the caller, another uid: the directory keeps everyone else out.
    wrapped = ["/bin/sh", "-c", 'umask 000 && exec "$@"', "kernel", *command]
    try:
        sandbox_argv = sandbox_module.bwrap_argv(wrapped, binds=binds, env=kernel_environment(passed), chdir=work,
                                                 private_dir=private_dir, uid=kernel_uid)
    except sandbox_module.SandboxError as error:
        print(f"kernel_sandbox: {error}", file=sys.stderr)
        return EXIT_NO_SANDBOX

    def limits() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if kernel_uid is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (NPROC_LIMIT, NPROC_LIMIT))
        cgroups.join()

    leader = subprocess.Popen(sandbox_argv, stdin=subprocess.DEVNULL, pass_fds=(work_fd, sockets_fd),
                              preexec_fn=limits, start_new_session=True)
    ended = threading.Event()
    threading.Thread(target=read_commands, args=(leader, kernel_uid, cgroups, ended.set), daemon=True).start()
    deadline = time.monotonic() + arguments.time_limit
    returncode = None
    try:
        while returncode is None:
            if ended.is_set():
                break
            if time.monotonic() > deadline:
                print(f"kernel_sandbox: the notebook ran past its limit of {arguments.time_limit:.0f} s; its "
                      f"kernel was stopped", file=sys.stderr)
                returncode = EXIT_TIME_LIMIT
                break
            try:
                returncode = leader.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
    finally:
        cgroups.freeze(False)  # a frozen process dies only once thawed
        kill_everything(leader, kernel_uid)
        cgroups.remove()
        empty_directory(work_fd)
        sandbox_module.release_uid(kernel_uid)
        shutil.rmtree(private_dir, ignore_errors=True)
    return returncode if returncode is not None else -signal.SIGKILL


if __name__ == "__main__":
    sys.exit(main())
