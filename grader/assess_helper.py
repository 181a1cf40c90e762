"""A graded run with a uid of its own for a grader that is not root: root's half of the Hub's Assess service.

    sudo /usr/local/sbin/scalelab-assess --job DIR --track NAME [--track-file FILE] [--data NAME=DIR ...]

The Hub's service runs as the account ``scalelab``. Only root can give a graded run a throw-away uid, a process
limit counted on it and a memory cgroup (``launch.py`` does whenever the grader is root); without them a run is
``scalelab`` in a user namespace, and a fork bomb or a memory hog takes the service's machine. So
``containers/hub/hub.sh`` lets ``scalelab``, and no other account, run this helper as root. It grades the job as
``scalelab assess`` does, as root, and trusts its caller no further than the caller's own rights:

- ``--job``: a directory of the caller's that no other account may enter, opened without following links; its
  ``assessment.py`` is read as the grader reads a run's files (a regular file, the caller's, of bounded size). A
  copy in a directory of root's is what is graded.
- ``--track-file`` and each ``--data`` folder are read (or listed) as the caller first: root reads nothing for the
  caller that the caller could not read itself.
- What the grader writes (its progress while it runs; then the rank logs, a passing model and, last, the verdict)
  is copied into ``<job>/grader/`` by a process of the caller's uid, so it is the caller's and lands nowhere else.
  Paths in the verdict name those copies.

The caller stops a grading by closing the helper's standard input, or by ending (the kernel closes it then); SIGTERM
does the same. The grader is stopped as SIGTERM stops ``scalelab assess`` (its run stopped, its job directory
removed) and nothing is copied back: a stopped job is graded again from scratch.

Exit codes: the grader's (0 pass, 1 fail, ...); 2 the helper refused its arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from scalelab.grader import jobfiles, spec
from scalelab.grader.caller import Refused, can_list, caller_uid, open_callers_directory, read_as, start_as, \
    wait_for
from scalelab.grader.pipeline import SUBMISSION_SIZE_LIMIT_BYTES

EXIT_BAD_ARGUMENTS = 2
EXIT_STOPPED = 128 + signal.SIGTERM
# The data settings the grader reads; nothing else of the caller's environment reaches it.
DATA_VARIABLES = ("SCALELAB_CIFAR10_DIR", "SCALELAB_FASHION_MNIST_DIR")
TRACK_FILE_LIMIT_BYTES = 1 << 20
OUT_DIR_NAME = "grader"
PROGRESS_INTERVAL_S = 1.0
# How long the grader may take to stop its run and clean up after SIGTERM before it is killed.
STOP_GRACE_S = 30.0
# What is copied back once the grader is done, the verdict last: its presence says the rest is there.
MODEL_FILES = tuple(spec.MODEL_FILES.values())
RESULT_FILES = ("grader-error.log", *MODEL_FILES, "verdict.json")
LOGS_DIR_NAME = "logs"


def parse_data(settings: list[str]) -> dict[str, str]:
    data = {}
    for setting in settings:
        name, _, folder = setting.partition("=")
        if name not in DATA_VARIABLES or not folder:
            raise Refused(f"--data {setting!r}: expected NAME=DIR with NAME one of {', '.join(DATA_VARIABLES)}")
        data[name] = folder
    return data


def grader_environment(home: Path, data: dict[str, str]) -> dict[str, str]:
    """All the grader is given: the software's PATH, a home in root's private directory, the data settings."""
    return {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
            "HOME": str(home), "SCALELAB_HOME": str(home), **data}


class CopyBack:
    """Files of root's grader output, written into the caller's ``<job>/grader/`` by a process of the caller's."""

    def __init__(self, uid: int, job_fd: int):
        self.uid, self.job_fd = uid, job_fd

    def copy(self, files: list[tuple[str, int | bytes]]) -> bool:
        """``files``: (name under grader/, an open fd to copy from or the bytes); True when all were written."""
        def write_all() -> None:
            out_fd = self._open_folder(self.job_fd, OUT_DIR_NAME)
            for name, content in files:
                folder_fd, base = out_fd, name
                if "/" in name:
                    folder, base = name.split("/", 1)
                    folder_fd = self._open_folder(out_fd, folder)
                partial = f".{base}.partial"
                target = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600,
                                 dir_fd=folder_fd)
                with os.fdopen(target, "wb") as sink:
                    if isinstance(content, bytes):
                        sink.write(content)
                    else:
                        os.lseek(content, 0, os.SEEK_SET)
                        while chunk := os.read(content, 1 << 20):
                            sink.write(chunk)
                os.replace(partial, base, src_dir_fd=folder_fd, dst_dir_fd=folder_fd)
        return wait_for(start_as(self.uid, write_all)) == 0

    @staticmethod
    def _open_folder(parent_fd: int, name: str) -> int:
        try:
            os.mkdir(name, 0o700, dir_fd=parent_fd)
        except FileExistsError:
            pass
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)


def open_result(path: Path) -> int | None:
    """A file root's grader wrote, opened for copying (None when it is not there)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        return None
    return descriptor


def verdict_for_caller(verdict_path: Path, private_out: Path, caller_out: Path) -> bytes | None:
    """The verdict with the paths of root's private copies replaced by the caller's."""
    try:
        text = verdict_path.read_text()
        for private_path, callers in ((private_out, caller_out),
                                      (private_out.parent / "assessment.py", caller_out.parent / "assessment.py")):
            text = text.replace(json.dumps(str(private_path))[1:-1], json.dumps(str(callers))[1:-1])
        verdict = json.loads(text)
    except (OSError, ValueError):
        return None
    return json.dumps(verdict, indent=2, sort_keys=True).encode() + b"\n"


def copy_results(copier: CopyBack, private_out: Path, caller_out: Path) -> bool:
    files: list[tuple[str, int | bytes]] = []
    descriptors = []
    try:
        logs = private_out / LOGS_DIR_NAME
        for name in sorted(os.listdir(logs)) if logs.is_dir() else []:
            descriptor = open_result(logs / name)
            if descriptor is not None:
                descriptors.append(descriptor)
                files.append((f"{LOGS_DIR_NAME}/{name}", descriptor))
        verdict = verdict_for_caller(private_out / "verdict.json", private_out, caller_out)
        passed = verdict is not None and json.loads(verdict).get("verdict") == "pass"
        for name in RESULT_FILES:
            if name in MODEL_FILES and not passed:
                continue  # the service keeps a model only with a pass
            if name == "verdict.json":
                if verdict is not None:
                    files.append((name, verdict))
                continue
            descriptor = open_result(private_out / name)
            if descriptor is not None:
                descriptors.append(descriptor)
                files.append((name, descriptor))
        return copier.copy(files)
    finally:
        for descriptor in descriptors:
            os.close(descriptor)


def watch_stdin(stop: threading.Event) -> None:
    """The caller gone or done with this job: its end of standard input closes."""
    try:
        while os.read(0, 4096):  # unbuffered: no lock for the interpreter's exit to wait on
            pass
    except OSError:
        pass
    stop.set()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scalelab-assess", description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", required=True, help="the caller's job directory, holding assessment.py")
    parser.add_argument("--track", required=True)
    parser.add_argument("--track-file")
    parser.add_argument("--data", action="append", default=[], metavar="NAME=DIR")
    arguments = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("scalelab-assess: must run as root (through sudo): it gives a graded run a uid of its own",
              file=sys.stderr)
        return EXIT_BAD_ARGUMENTS
    uid = caller_uid()
    private = Path(tempfile.mkdtemp(prefix="scalelab-assess-"))  # root's, 0700
    try:
        try:
            job_fd = open_callers_directory(arguments.job, uid, private=True)
            data = parse_data(arguments.data)
            for name, folder in data.items():
                if not can_list(uid, folder):
                    raise Refused(f"--data {name}={folder}: not a folder uid {uid} may read")
                data[name] = os.path.realpath(folder)
            submission = jobfiles.read_regular_file(job_fd, "assessment.py", owner_uid=uid,
                                                    limit_bytes=SUBMISSION_SIZE_LIMIT_BYTES)
            track_file = None
            if arguments.track_file:
                track_file = private / "tracks.toml"
                track_file.write_bytes(read_as(uid, arguments.track_file, TRACK_FILE_LIMIT_BYTES))
        except (Refused, jobfiles.UntrustedFile) as refusal:
            print(f"scalelab-assess: {refusal}", file=sys.stderr)
            return EXIT_BAD_ARGUMENTS
        return grade(private, submission, arguments.track, track_file, data, CopyBack(uid, job_fd),
                     Path(arguments.job) / OUT_DIR_NAME)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def grade(private: Path, submission: bytes, track: str, track_file: Path | None, data: dict[str, str],
          copier: CopyBack, caller_out: Path) -> int:
    (private / "assessment.py").write_bytes(submission)
    out, home = private / OUT_DIR_NAME, private / "home"
    home.mkdir(mode=0o700)
    argv = [sys.executable, "-I", "-m", "scalelab.cli", "assess", str(private / "assessment.py"), "--track", track,
            "--json", "--out", str(out), "--backend", "local"]
    if track_file is not None:
        argv += ["--track-file", str(track_file)]
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, lambda _signum, _frame: stop.set())
    threading.Thread(target=watch_stdin, args=(stop,), daemon=True).start()
    grader = subprocess.Popen(argv, stdin=subprocess.DEVNULL, cwd="/", env=grader_environment(home, data),
                              start_new_session=True)
    last_progress = None
    while grader.poll() is None:
        if stop.wait(PROGRESS_INTERVAL_S):
            return stop_grader(grader)
        try:
            progress = (out / "progress.json").read_bytes()
        except OSError:
            continue
        if progress != last_progress:
            copier.copy([("progress.json", progress)])
            last_progress = progress
    if stop.is_set():
        return stop_grader(grader)
    if not copy_results(copier, out, caller_out):
        print("scalelab-assess: the grader's results could not be written into the job directory", file=sys.stderr)
    return grader.returncode


def stop_grader(grader: subprocess.Popen) -> int:
    """SIGTERM: ``scalelab assess`` stops its run and removes its job directory; SIGKILL what is left after that."""
    try:
        os.killpg(grader.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + STOP_GRACE_S
    while grader.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        os.killpg(grader.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    grader.wait()
    print("scalelab-assess: stopped by its caller: the run was stopped and nothing was copied back", file=sys.stderr)
    return EXIT_STOPPED


if __name__ == "__main__":
    sys.exit(main())
