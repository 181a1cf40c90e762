"""Run one submission: a fresh job directory, a bubblewrap sandbox, horovodrun, a watch on time and output.

The interface is backend-neutral. ``prepare_job()`` makes a :class:`JobSpec` (everything a backend needs: the job
directory, the argv to run inside the sandbox, its environment, the budget); a backend runs it and returns a
:class:`RunResult`. ``run_local(job)`` is the local backend; a Slurm backend runs the same ``sandbox_argv(job)``
inside its allocation and fills the same ``RunResult``, writing the rank logs with :class:`RankLogDemux`.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import psutil

from scalelab import data as course_data
from scalelab.environment import openmpi_settings

from . import sandbox as sandbox_module

# Limits for the submission's processes (per job); generous enough for TensorFlow's thread pools, since Linux
# counts threads towards RLIMIT_NPROC.
NPROC_LIMIT = 1024
FILE_SIZE_LIMIT_BYTES = 1 << 30
LOG_CAP_BYTES = 1 << 20
LINE_CAP_BYTES = 16 << 10
UNENDED_LINES_CAP = 64  # rank streams whose unended line is held back at once (memory stays bounded)
KILL_AFTER_TERM_S = 5.0
PROGRESS_INTERVAL_S = 2.0
# Never hidden, even if configured: the sandbox needs them to run anything.
SYSTEM_PATHS = {Path(p) for p in ("/", "/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/proc", "/dev",
                                  "/var", "/opt", "/tmp")}
# horovodrun prefixes each whole line of a rank with "[0]<stdout>:" under Gloo; Open MPI tags each chunk it reads
# from a rank with "[1,0]<stdout>:", also in mid-line: "[1,1]<stderr>:RuntimeError[1,1]<stderr>:: ...".
RANK_TAG = re.compile(rb"\[(?:\d+,)?(\d+)\]<(stdout|stderr)>:")
MPI_TAG = re.compile(rb"\[\d+,(\d+)\]<(stdout|stderr)>:")
EPOCH_LINE = re.compile(r"\bepoch (\d+)/(\d+)")
ACCURACY_IN_LINE = re.compile(r"\b(val_accuracy|accuracy)[ =:]+([0-9]*\.?[0-9]+)")


class LaunchError(RuntimeError):
    """The grader could not start the job (not the submission's fault)."""


@dataclasses.dataclass
class JobSpec:
    """Everything needed to run one submission, whatever the backend.

    ``command`` is the argv to run *inside* the sandbox (``horovodrun -np N --gloo ... python assessment.py``);
    ``sandbox_argv(job)`` wraps it in bubblewrap (or returns it unchanged when ``sandbox`` is False).
    ``env`` is the complete environment of that command (nothing else from the grader's environment leaks in).
    ``hidden_paths`` become empty inside the sandbox; ``readonly_paths`` (the Python installation, the venv, the
    course library) and ``job_dir`` (writable) are bound back even where they lie under a hidden path.
    ``logs_dir`` is outside the sandbox and written by the grader only. ``sandbox_uid`` is the unprivileged
    uid the submission runs as when the grader is root (None: keep the grader's uid).
    """

    job_dir: Path
    command: list[str]
    env: dict[str, str]
    np: int
    time_budget_s: float
    grace_s: float
    logs_dir: Path
    output_dir: Path
    timeline_path: Path
    sandbox: bool = True
    sandbox_uid: int | None = None
    hidden_paths: list[Path] = dataclasses.field(default_factory=list)
    readonly_paths: list[Path] = dataclasses.field(default_factory=list)
    device_paths: list[Path] = dataclasses.field(default_factory=list)
    nproc_limit: int = NPROC_LIMIT
    file_size_limit_bytes: int = FILE_SIZE_LIMIT_BYTES
    log_cap_bytes: int = LOG_CAP_BYTES


@dataclasses.dataclass
class RunResult:
    """What happened to a job, measured from outside it.

    ``exit_code`` is horovodrun's (None if it had to be killed); ``wall_time_s`` runs from launch to exit
    (time.monotonic, by the grader); ``timed_out`` means it was still running at budget + grace and was stopped;
    ``rank_logs`` maps rank → log file; ``rank_tracebacks`` holds the last Python traceback each rank printed;
    ``truncated_logs`` lists the log files that hit the cap; ``survivors_killed`` counts processes of the job
    still alive after horovodrun ended (killed by the grader).
    """

    exit_code: int | None
    wall_time_s: float
    timed_out: bool
    killed: bool
    started_at: str
    finished_at: str
    rank_logs: dict[int, str]
    launcher_log: str
    rank_tracebacks: dict[int, str]
    truncated_logs: list[str]
    epochs_seen: int
    survivors_killed: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


# ---------------------------------------------------------------------------------------------------------------
# Preparing a job
# ---------------------------------------------------------------------------------------------------------------

def horovodrun_path() -> str:
    beside_python = Path(sys.executable).with_name("horovodrun")
    found = str(beside_python) if beside_python.exists() else shutil.which("horovodrun")
    if not found:
        raise LaunchError("horovodrun is not installed: run `make setup`")
    return found


def horovod_command(np: int, launcher: str, timeline_path: Path, options=()) -> list[str]:
    """The command the contract runs: horovodrun with the grader's own timeline, and no script arguments."""
    return [horovodrun_path(), "-np", str(np), f"--{launcher}", "--timeline-filename", str(timeline_path),
            *options, sys.executable, "assessment.py"]


def data_paths_to_hide(dataset_dirs) -> list[Path]:
    """Every place a data set could be read from, and the folder holding it (where a held-out copy may sit)."""
    hidden = set()
    for directory in dataset_dirs:
        directory = Path(directory).resolve()
        if directory.exists():
            hidden.add(directory)
            hidden.add(directory.parent)
    return sorted(hidden)


def stage_training_data(dataset: str, job_dir: Path) -> tuple[str, Path]:
    """Copy the training split only into ``job_dir/data``; returns (environment variable, directory)."""
    target = job_dir / "data"
    target.mkdir(parents=True, exist_ok=True)
    if dataset == "cifar10":
        course_data.stage_cifar10_training_split(target)
        return "SCALELAB_CIFAR10_DIR", target
    for directory in course_data.fashion_mnist_dirs():
        sources = [directory / name for name, _ in course_data.FASHION_MNIST_FILES["train"].values()]
        if all(source.is_file() for source in sources):
            for source in sources:
                shutil.copyfile(source, target / source.name)
            return "SCALELAB_FASHION_MNIST_DIR", target
    raise course_data.DataError("Fashion-MNIST's training split is not available offline: "
                                "sudo apt-get install dataset-fashion-mnist")


def prepare_job(submission: Path, job_dir: Path, *, dataset: str, track_name: str, np: int, launcher: str,
                launcher_options, time_budget_s: float, grace_s: float, logs_dir: Path,
                hidden_paths, sandbox: bool = True) -> JobSpec:
    """Make the job directory (assessment.py, output/, data/ with the training split) and its JobSpec."""
    job_dir.mkdir(parents=True, exist_ok=False)
    shutil.copyfile(submission, job_dir / "assessment.py")
    output_dir = job_dir / "output"
    output_dir.mkdir()
    (job_dir / "logs").mkdir()
    data_variable, data_dir = stage_training_data(dataset, job_dir)
    timeline_path = job_dir / "timeline.json"
    logs_dir.mkdir(parents=True, exist_ok=True)
    sandbox_uid = sandbox_module.allocate_uid() if sandbox else None
    if sandbox_uid is not None:
        # The submission owns its job directory and nothing else; 0700 keeps other jobs' uids out.
        for path in [job_dir, *job_dir.rglob("*")]:
            os.chown(path, sandbox_uid, sandbox_uid, follow_symlinks=False)
        job_dir.chmod(0o700)
    venv_bin = str(Path(sys.executable).parent)
    env = {
        "PATH": f"{venv_bin}:/usr/local/bin:/usr/bin:/bin",
        "HOME": "/tmp" if sandbox else str(job_dir),
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        # Keep the run's own caches (Keras, matplotlib, Horovod) inside the job.
        "KERAS_HOME": str(job_dir / ".keras"),
        "MPLCONFIGDIR": str(job_dir / ".matplotlib"),
        "SCALELAB_OUTPUT_DIR": str(output_dir),
        "SCALELAB_TRACK": track_name,
        "SCALELAB_DATASET": dataset,
        data_variable: str(data_dir),
        # The course's Open MPI settings (an operator's own OMPI_MCA_ values for them win), so a --mpi track
        # is graded as the student ran it in the lab; the rules file is inside the course library, readable.
        **openmpi_settings(),
    }
    for passed_through in ("CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "NVIDIA_VISIBLE_DEVICES"):
        if passed_through in os.environ:
            env[passed_through] = os.environ[passed_through]
    devices = sorted(Path("/dev").glob("nvidia*"))
    return JobSpec(job_dir=job_dir, command=horovod_command(np, launcher, timeline_path, launcher_options),
                   env=env, np=np, time_budget_s=time_budget_s, grace_s=grace_s, logs_dir=logs_dir,
                   output_dir=output_dir, timeline_path=timeline_path, sandbox=sandbox, sandbox_uid=sandbox_uid,
                   hidden_paths=[Path(p) for p in hidden_paths], readonly_paths=sandbox_module.software_paths(),
                   device_paths=devices)


# ---------------------------------------------------------------------------------------------------------------
# The sandbox
# ---------------------------------------------------------------------------------------------------------------

def _is_under(path: Path, ancestor: Path) -> bool:
    return path == ancestor or ancestor in path.parents


def sandbox_argv(job: JobSpec) -> list[str]:
    """The argv that runs ``job.command`` in bubblewrap (``job.command`` itself when ``job.sandbox`` is False).

    The whole file system is read-only; /tmp, /dev/shm and every hidden path are empty tmpfs; the software and
    the job directory are bound back (the job directory writable); no network (a private loopback only), a
    private PID namespace (killing bwrap kills every process of the job), a new session (no terminal), and as
    root the command drops to ``job.sandbox_uid`` with no capabilities and no way to regain privileges.
    """
    if not job.sandbox:
        return list(job.command)
    bwrap = sandbox_module.bwrap_path()
    if bwrap is None:
        raise LaunchError("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")
    hidden = sorted({Path(p).resolve() for p in job.hidden_paths} - SYSTEM_PATHS, key=lambda p: len(p.parts))
    hidden = [p for p in hidden if p.exists() and p.is_dir()]
    argv = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
            "--perms", "1777", "--tmpfs", "/tmp", "--perms", "1777", "--tmpfs", "/dev/shm"]
    for device in job.device_paths:
        argv += ["--dev-bind", str(device), str(device)]
    for path in hidden:
        argv += ["--tmpfs", str(path)]
    covers = [Path("/tmp"), *hidden]
    created: set[Path] = set()
    binds = [(Path(p).resolve(), "--ro-bind") for p in job.readonly_paths]
    binds.append((job.job_dir.resolve(), "--bind"))
    for path, how in sorted(binds, key=lambda item: len(item[0].parts)):
        cover = max((c for c in covers if _is_under(path, c) and c != path), key=lambda c: len(c.parts),
                    default=None)
        if cover is None and how == "--ro-bind":
            continue  # already visible, read-only, through the root bind
        if cover is not None:
            # bwrap would create the missing parents as 0700 root: the unprivileged uid could not pass them.
            for parent in reversed(path.parents):
                if _is_under(parent, cover) and parent != cover and parent not in created:
                    argv += ["--perms", "0755", "--dir", str(parent)]
                    created.add(parent)
        argv += [how, str(path), str(path)]
    argv += ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--die-with-parent", "--new-session",
             "--chdir", str(job.job_dir)]
    argv += ["--clearenv"] + [arg for name, value in job.env.items() for arg in ("--setenv", name, value)]
    argv.append("--")
    if job.sandbox_uid is not None:
        argv += [shutil.which("setpriv") or "/usr/bin/setpriv", f"--reuid={job.sandbox_uid}",
                 f"--regid={job.sandbox_uid}", "--clear-groups", "--no-new-privs", "--inh-caps=-all"]
    return argv + list(job.command)


# ---------------------------------------------------------------------------------------------------------------
# Running and watching
# ---------------------------------------------------------------------------------------------------------------

class CappedLog:
    """A log file that stops growing at ``cap_bytes`` and says at its end how much it dropped."""

    def __init__(self, path: Path, cap_bytes: int):
        self.path, self.cap_bytes = path, cap_bytes
        self.handle = path.open("wb")
        self.written = 0
        self.dropped = 0

    def write(self, chunk: bytes) -> None:
        room = self.cap_bytes - self.written
        if room > 0:
            kept = chunk[:room]
            self.handle.write(kept)
            self.written += len(kept)
            chunk = chunk[room:]
        self.dropped += len(chunk)

    def close(self) -> None:
        if self.dropped:
            self.handle.write(f"\n[scalelab: log capped at {self.cap_bytes} bytes; "
                              f"{self.dropped} more bytes were dropped]\n".encode())
        self.handle.close()


class RankLogDemux:
    """Splits horovodrun's merged output (``[rank]<stdout>:`` with Gloo, ``[1,rank]<stdout>:`` with MPI) into
    ``rank-K.log`` files and ``launcher.log``, each capped; keeps only a bounded tail of each rank in memory
    (for tracebacks) and the progress that rank 0 printed."""

    def __init__(self, logs_dir: Path, cap_bytes: int = LOG_CAP_BYTES):
        self.logs_dir, self.cap_bytes = logs_dir, cap_bytes
        self.logs: dict[int | None, CappedLog] = {}
        self.tails: dict[int, collections.deque] = {}
        self.epochs_seen = 0
        self.latest_accuracy: float | None = None
        self.partial_lines: dict[tuple[int, bytes], bytes] = {}  # a rank's line that has not ended yet
        self.lock = threading.Lock()

    def _log(self, rank: int | None) -> CappedLog:
        if rank not in self.logs:
            name = "launcher.log" if rank is None else f"rank-{rank}.log"
            self.logs[rank] = CappedLog(self.logs_dir / name, self.cap_bytes)
        return self.logs[rank]

    def feed_line(self, line: bytes) -> None:
        first = RANK_TAG.match(line)
        with self.lock:
            if first is None:
                self._log(None).write(line)
                return
            tags = list(MPI_TAG.finditer(line)) if MPI_TAG.match(line) else [first]
            for tag, following in zip(tags, tags[1:] + [None]):
                end = following.start() if following else len(line)
                rank = int(tag.group(1))
                if rank > 4096:  # not a real rank: output that only looks like a tag
                    self._log(None).write(line[tag.start():end])
                else:
                    self._take(rank, tag.group(2), line[tag.end():end])

    def _take(self, rank: int, stream: bytes, content: bytes) -> None:
        """A piece of one rank's output: into its log now; into its tail and progress once its line is whole."""
        self._log(rank).write(content)
        key = (rank, stream)
        pending = self.partial_lines.pop(key, b"") + content
        if pending.endswith(b"\n") or len(pending) >= LINE_CAP_BYTES \
                or len(self.partial_lines) >= UNENDED_LINES_CAP:
            self._line_seen(rank, stream, pending)
        else:
            self.partial_lines[key] = pending

    def _line_seen(self, rank: int, stream: bytes, line: bytes) -> None:
        text = line.decode("utf-8", "replace").rstrip("\n")
        self.tails.setdefault(rank, collections.deque(maxlen=400)).append(text[:2000])
        if rank == 0 and stream == b"stdout":
            epoch = EPOCH_LINE.search(text)
            if epoch:
                self.epochs_seen = max(self.epochs_seen, int(epoch.group(1)))
                accuracies = dict((name, value) for name, value in ACCURACY_IN_LINE.findall(text))
                value = accuracies.get("val_accuracy", accuracies.get("accuracy"))
                if value is not None:
                    self.latest_accuracy = float(value)

    def pump(self, stream) -> None:
        """Read ``stream`` to its end, line by line, with lines cut at LINE_CAP_BYTES (memory stays bounded)."""
        pending_rank_prefix = b""
        while True:
            line = stream.readline(LINE_CAP_BYTES)
            if not line:
                break
            if not line.endswith(b"\n"):
                # An over-long line: keep its rank prefix on the continuation so it lands in the same log.
                match = RANK_TAG.match(line)
                self.feed_line(pending_rank_prefix + line if match is None else line)
                if match is not None:
                    pending_rank_prefix = match.group(0)
                continue
            self.feed_line(line if RANK_TAG.match(line) else pending_rank_prefix + line)
            pending_rank_prefix = b""

    def tracebacks(self) -> dict[int, str]:
        """The last Python traceback (or fatal error) of each rank, as the rank printed it."""
        found = {}
        for rank, tail in self.tails.items():
            lines = list(tail)
            starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
            if starts:
                block = lines[starts[-1]:]
                # the traceback ends at its first unindented line after the header: the exception itself
                for end, line in enumerate(block[1:], start=1):
                    if line and not line.startswith((" ", "\t")):
                        block = block[:end + 1]
                        break
                found[rank] = "\n".join(block[-25:])
        return found

    def close(self) -> tuple[dict[int, str], str, list[str]]:
        with self.lock:
            for (rank, stream), unended in self.partial_lines.items():  # output that ended without a newline
                self._line_seen(rank, stream, unended)
            self.partial_lines.clear()
            launcher = self._log(None)
            for log in self.logs.values():
                log.close()
            ranks = {rank: str(log.path) for rank, log in self.logs.items() if rank is not None}
            truncated = [str(log.path) for log in self.logs.values() if log.dropped]
        return ranks, str(launcher.path), truncated


def _limit_resources(job: JobSpec) -> Callable[[], None]:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_FSIZE, (job.file_size_limit_bytes, job.file_size_limit_bytes))
        if job.sandbox_uid is not None:
            # Counted per uid, so only with a uid of the job's own (root itself ignores the limit).
            resource.setrlimit(resource.RLIMIT_NPROC, (job.nproc_limit, job.nproc_limit))
    return apply


def job_processes(session_id: int, sandbox_uid: int | None) -> list[psutil.Process]:
    """Processes that belong to a job: in its session, or running as its sandbox uid."""
    found = []
    for process in psutil.process_iter(["uids"]):
        try:
            if (sandbox_uid is not None and process.info["uids"] and process.info["uids"].real == sandbox_uid) \
                    or os.getsid(process.pid) == session_id:
                found.append(process)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    return [p for p in found if p.pid != os.getpid()]


def _signal_job(leader: subprocess.Popen, job: JobSpec, signum: int) -> None:
    for process in job_processes(leader.pid, job.sandbox_uid):
        try:
            process.send_signal(signum)
        except psutil.Error:
            pass
    try:
        os.killpg(leader.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def kill_survivors(session_id: int, sandbox_uid: int | None, wait_s: float = 5.0) -> int:
    """SIGKILL whatever is left of a job; returns how many processes there were."""
    survivors = job_processes(session_id, sandbox_uid)
    for process in survivors:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(survivors, timeout=wait_s)
    return len(survivors)


def _latest_mtime(path: Path) -> str | None:
    try:
        return dt.datetime.fromtimestamp(path.stat().st_mtime, dt.timezone.utc).isoformat(timespec="seconds")
    except OSError:
        return None


def run_local(job: JobSpec, on_progress: Callable[[dict], None] | None = None) -> RunResult:
    """Run the job on this machine: own session, budget + grace then SIGTERM, SIGKILL; no survivors."""
    argv = sandbox_argv(job)
    demux = RankLogDemux(job.logs_dir, job.log_cap_bytes)
    started_at = utc_now()
    started = time.monotonic()
    try:
        leader = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  env=job.env if not job.sandbox else {"PATH": "/usr/bin:/bin"},
                                  cwd=job.job_dir, start_new_session=True, preexec_fn=_limit_resources(job))
    except OSError as error:
        demux.close()
        raise LaunchError(f"could not start {argv[0]}: {error}") from error
    reader = threading.Thread(target=demux.pump, args=(leader.stdout,), daemon=True)
    reader.start()
    deadline = job.time_budget_s + job.grace_s
    timed_out = killed = False
    terminated_at = None
    next_progress = 0.0
    try:
        while leader.poll() is None:
            elapsed = time.monotonic() - started
            if on_progress is not None and elapsed >= next_progress:
                next_progress = elapsed + PROGRESS_INTERVAL_S
                on_progress({"state": "running", "elapsed_s": round(elapsed, 1),
                             "time_budget_s": job.time_budget_s, "epochs_seen": demux.epochs_seen,
                             "latest_accuracy": demux.latest_accuracy,
                             "checkpoint_mtime": _latest_mtime(job.output_dir / "model.keras")})
            if elapsed >= deadline and terminated_at is None:
                timed_out = True
                terminated_at = elapsed
                _signal_job(leader, job, signal.SIGTERM)
            elif terminated_at is not None and elapsed >= terminated_at + KILL_AFTER_TERM_S:
                killed = True
                _signal_job(leader, job, signal.SIGKILL)
                leader.wait(timeout=30)
                break
            try:  # returns as soon as horovodrun exits: the clock stops then, not at the next tick
                leader.wait(timeout=0.25)
            except subprocess.TimeoutExpired:
                pass
    finally:
        if leader.poll() is None:  # the grader itself is being interrupted: take the job down with it
            _signal_job(leader, job, signal.SIGKILL)
            leader.wait(timeout=30)
    wall_time_s = time.monotonic() - started
    finished_at = utc_now()
    survivors = kill_survivors(leader.pid, job.sandbox_uid)
    # horovodrun is gone; its pipe closes once every process holding it is gone too.
    reader.join(timeout=10)
    leader.stdout.close()
    rank_logs, launcher_log, truncated = demux.close()
    return RunResult(exit_code=None if killed else leader.returncode, wall_time_s=round(wall_time_s, 2),
                     timed_out=timed_out, killed=killed, started_at=started_at, finished_at=finished_at,
                     rank_logs=rank_logs, launcher_log=launcher_log, rank_tracebacks=demux.tracebacks(),
                     truncated_logs=truncated, epochs_seen=demux.epochs_seen, survivors_killed=survivors)
