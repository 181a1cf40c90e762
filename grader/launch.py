"""Run one submission: a fresh job directory, the sandbox, horovodrun, and a watch on time, output and witnesses.

The interface is backend-neutral. ``prepare_job()`` makes a :class:`JobSpec` (everything a backend needs: the job
directory, the argv to run inside the sandbox, its environment, the budget); a backend runs it and returns a
:class:`RunResult`. ``run_local(job)`` is the local backend; the Slurm backend runs ``run_local`` inside its
allocation (``slurm_runner``) and gets the same ``RunResult`` back.

While the run goes, ``run_local`` also collects the evidence of distributed training (``witness``): Horovod's
timeline read as it is written, stamped with the grader's clock, and the traffic on the sandbox's loopback; and
how much CPU other work on the machine used meanwhile (``contention``).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import psutil

from scalelab import data as course_data
from scalelab.environment import openmpi_settings

from . import cgroups, contention, snapshots, verify
from . import sandbox as sandbox_module
from . import witness
from .ranklogs import LOG_CAP_BYTES, RankLogDemux

# Limits for the submission's processes (per job); generous enough for TensorFlow's thread pools, since Linux
# counts threads towards RLIMIT_NPROC.
NPROC_LIMIT = 1024
# All the run's processes together (a cgroup; only where the grader is root and the machine lets it make one). The
# course's runs use about 1 GiB a rank; a track may set its own (memory_limit_gib).
MEMORY_LIMIT_BYTES = 8 * 1024**3
FILE_SIZE_LIMIT_BYTES = 1 << 30
KILL_AFTER_TERM_S = 5.0
PROGRESS_INTERVAL_S = 2.0
WATCH_INTERVAL_S = 0.25
STRAY_CHECK_INTERVAL_S = 0.5
RANK_SAMPLE_INTERVAL_S = 1.0


class LaunchError(RuntimeError):
    """The grader could not start the job (not the submission's fault)."""


@dataclasses.dataclass
class JobSpec:
    """Everything needed to run one submission, whatever the backend.

    ``command`` is the argv to run *inside* the sandbox (``horovodrun -np N --gloo ... python assessment.py``);
    ``sandbox_argv(job, ...)`` wraps it in bubblewrap (or returns it unchanged when ``sandbox`` is False).
    ``env`` is the complete environment of that command (nothing else from the grader's environment leaks in).
    The sandbox shows the software, the job directory (writable) and nothing else (``sandbox``);
    ``hidden_paths`` are data directories to cover where they lie inside a system directory the sandbox shows.
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
    sandbox: bool = True
    sandbox_uid: int | None = None
    hidden_paths: list[Path] = dataclasses.field(default_factory=list)
    device_paths: list[Path] = dataclasses.field(default_factory=list)
    nproc_limit: int = NPROC_LIMIT
    memory_limit_bytes: int = MEMORY_LIMIT_BYTES
    file_size_limit_bytes: int = FILE_SIZE_LIMIT_BYTES
    log_cap_bytes: int = LOG_CAP_BYTES
    # Where the grader keeps the versions of the model the run saves while it goes (None: not collected).
    snapshots_dir: Path | None = None
    model_file: str = "model.keras"  # what the run saves in output_dir (its framework's format)


@dataclasses.dataclass
class RunResult:
    """What happened to a job, measured from outside it.

    ``exit_code`` is horovodrun's (None if it had to be killed); ``wall_time_s`` runs from launch to exit
    (time.monotonic, by the grader); ``timed_out`` means it was still running at budget + grace and was stopped;
    ``rank_logs`` maps rank → log file; ``rank_tracebacks`` holds the last Python traceback each rank printed;
    ``truncated_logs`` lists the log files that hit the cap; ``survivors_killed`` counts processes of the job still
    alive after horovodrun ended, ``strays_killed`` those that kept horovodrun waiting after every rank had exited
    (both killed by the grader). ``timeline`` is the streamed timeline's evidence (:class:`witness.TimelineEvidence`
    as a dict) and ``loopback_bytes`` the sandbox's loopback traffic, sent in ``loopback_packets`` packets (None:
    not measured, e.g. without a sandbox). ``cpu_contention`` is how much CPU other work on the machine used
    meanwhile (:class:`contention.CpuContention` as a dict; None: not measured). ``snapshots`` are the versions of
    the model the run saved while it went, as the grader copied them (:class:`snapshots.Snapshot` as dicts), and
    ``snapshot_notes`` what the grader skipped of them. ``stopped_at_target`` means the grader stopped the run
    because a snapshot had reached the target (then ``timed_out`` is False and ``exit_code`` is the stop's).
    ``reported_accuracy`` is the last validation accuracy the run printed (its own claim: for the reasons only).
    ``memory_limit_bytes`` is the memory limit the run had (None: none of its own), ``peak_memory_bytes`` the most
    its processes used together (None: not measured) and ``out_of_memory_kills`` how many of its processes the
    kernel killed at that limit. ``rank_cpu_s`` is the CPU time the kernel charged each rank process, and
    ``traffic_active_deciles`` / ``traffic_span_s`` say when the loopback carried bulk bytes (the witnesses of a
    torchrun run, which writes no timeline).
    """

    exit_code: int | None
    wall_time_s: float
    timed_out: bool
    started_at: str
    finished_at: str
    rank_logs: dict[int, str]
    launcher_log: str
    rank_tracebacks: dict[int, str]
    truncated_logs: list[str]
    epochs_seen: int
    survivors_killed: int
    strays_killed: int = 0
    timeline: dict = dataclasses.field(default_factory=dict)
    loopback_bytes: int | None = None
    loopback_packets: int | None = None
    cpu_contention: dict | None = None
    snapshots: list = dataclasses.field(default_factory=list)
    snapshot_notes: list = dataclasses.field(default_factory=list)
    stopped_at_target: bool = False
    reported_accuracy: float | None = None
    memory_limit_bytes: int | None = None
    peak_memory_bytes: int | None = None
    out_of_memory_kills: int = 0
    rank_cpu_s: list = dataclasses.field(default_factory=list)
    traffic_active_deciles: int = 0
    traffic_span_s: float = 0.0

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


def torchrun_path() -> str:
    beside_python = Path(sys.executable).with_name("torchrun")
    found = str(beside_python) if beside_python.exists() else shutil.which("torchrun")
    if not found:
        raise LaunchError("torchrun is not installed (it comes with PyTorch): run `make setup`")
    return found


def torchrun_command(np: int, options=()) -> list[str]:
    """PyTorch's launcher for a DDP run: ``np`` processes on this machine, its rendezvous on the sandbox's own
    loopback (--standalone), each line a rank prints tagged ``[defaultK]:`` (--tee 3) for the rank logs."""
    return [torchrun_path(), "--standalone", "--nproc_per_node", str(np), "--tee", "3", *options, "assessment.py"]


def launch_command(np: int, launcher: str, options=()) -> list[str]:
    """The command that starts the run's ranks, whichever launcher its track names."""
    return torchrun_command(np, options) if launcher == "torchrun" else horovod_command(np, launcher, options)


def horovod_command(np: int, launcher: str, options=()) -> list[str]:
    """The command the contract runs: horovodrun writing its timeline where the grader reads it as it goes,
    and no script arguments."""
    return [horovodrun_path(), "-np", str(np), f"--{launcher}", "--timeline-filename", str(witness.TIMELINE_INSIDE),
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
                hidden_paths, sandbox: bool = True, snapshots_dir: Path | None = None,
                memory_limit_bytes: int = MEMORY_LIMIT_BYTES, model_file: str = "model.keras") -> JobSpec:
    """Make the job directory (assessment.py, output/, data/ with the training split) and its JobSpec;
    ``snapshots_dir``: where the grader keeps the models the run saves while it goes (None: not kept);
    ``model_file``: the name the run saves its model under, in output/."""
    job_dir.mkdir(parents=True, exist_ok=False)
    job_dir.chmod(0o700)
    shutil.copyfile(submission, job_dir / "assessment.py")
    output_dir = job_dir / "output"
    output_dir.mkdir()
    (job_dir / "logs").mkdir()
    data_variable, data_dir = stage_training_data(dataset, job_dir)
    logs_dir.mkdir(parents=True, exist_ok=True)
    sandbox_uid = sandbox_module.allocate_uid() if sandbox else None
    if sandbox_uid is not None:
        # The submission owns its job directory and nothing else; 0700 keeps other jobs' uids out.
        for path in [job_dir, *job_dir.rglob("*")]:
            os.chown(path, sandbox_uid, sandbox_uid, follow_symlinks=False)
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
    if launcher == "mpi":
        env.update(witness.witnessed_mpi_settings())  # the traffic witness must see the ranks' messages
    for passed_through in ("CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "NVIDIA_VISIBLE_DEVICES"):
        if passed_through in os.environ:
            env[passed_through] = os.environ[passed_through]
    devices = gpu_device_paths()
    return JobSpec(job_dir=job_dir, command=launch_command(np, launcher, launcher_options),
                   env=env, np=np, time_budget_s=time_budget_s, grace_s=grace_s, logs_dir=logs_dir,
                   output_dir=output_dir, sandbox=sandbox, sandbox_uid=sandbox_uid,
                   hidden_paths=[Path(p) for p in hidden_paths], device_paths=devices, snapshots_dir=snapshots_dir,
                   memory_limit_bytes=memory_limit_bytes, model_file=model_file)


def gpu_device_paths(dev: Path = Path("/dev")) -> list[Path]:
    """The NVIDIA device nodes a run needs to reach the machine's GPUs from inside the sandbox (/dev/nvidia0..N,
    nvidiactl, nvidia-uvm, nvidia-caps/); none on a machine without an NVIDIA driver."""
    return sorted(dev.glob("nvidia*"))


def sandbox_argv(job: JobSpec, private_dir: Path, binds=()) -> list[str]:
    """The argv that runs ``job.command`` in the sandbox (``job.command`` itself when ``job.sandbox`` is False):
    the job directory writable, ``binds`` (the timeline's file), no network but a private loopback, a private PID
    namespace (killing bwrap kills every process of the job), a new session, and as root the job's own uid with
    no capabilities. ``private_dir`` is the grader's, for the sandbox's generated files."""
    if not job.sandbox:
        return list(job.command)
    try:
        return sandbox_module.bwrap_argv(
            job.command, binds=[sandbox_module.Bind(job.job_dir, job.job_dir, writable=True), *binds], env=job.env,
            chdir=job.job_dir, private_dir=private_dir, uid=job.sandbox_uid, hidden=job.hidden_paths,
            devices=job.device_paths)
    except sandbox_module.SandboxError as error:
        raise LaunchError(str(error)) from None


# ---------------------------------------------------------------------------------------------------------------
# Running and watching
# ---------------------------------------------------------------------------------------------------------------

def _limit_resources(job: JobSpec, groups: cgroups.SandboxCgroups) -> Callable[[], None]:
    def apply() -> None:
        groups.join()
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
    try:  # the run's own file: never follow a link it made
        return dt.datetime.fromtimestamp(os.stat(path, follow_symlinks=False).st_mtime,
                                         dt.timezone.utc).isoformat(timespec="seconds")
    except OSError:
        return None


def _is_rank_main(process: psutil.Process) -> bool:
    """A rank's own Python running assessment.py (not horovodrun, mpirun or torchrun, whose command lines name it
    too)."""
    try:
        command = process.cmdline()
    except psutil.Error:
        return False
    return (len(command) >= 2 and command[-1] == "assessment.py" and Path(command[0]).name.startswith("python")
            and not any(Path(argument).name in ("horovodrun", "mpirun", "torchrun") for argument in command))


class SandboxWatch:
    """What the grader sees of the processes inside the sandbox, sampled on its own clock: the loopback
    traffic, and processes that outlive every rank (orphans of a rank, re-parented to the sandbox's init)."""

    def __init__(self, leader: subprocess.Popen, sandboxed: bool):
        self.leader, self.sandboxed = leader, sandboxed
        self.init: psutil.Process | None = None  # bwrap's process inside the new namespaces
        self.launcher_pid: int | None = None     # init's first child: horovodrun (or the shell running mpirun)
        self.loopback_bytes: int | None = None
        self.loopback_packets: int | None = None
        # (seconds, bytes, packets) read from the loopback's counters: when the traffic flowed (bounded: one a tick)
        self.traffic_samples: list[tuple[float, int, int]] = []
        self.rank_cpu_s: dict[int, float] = {}  # rank process → the most CPU time the kernel had charged it
        self.next_rank_sample = 0.0
        self.strays_seen_before = False

    def _sandbox_init(self) -> psutil.Process | None:
        if self.init is None and self.sandboxed:
            try:
                children = psutil.Process(self.leader.pid).children()
                self.init = children[0] if children else None
            except psutil.Error:
                pass
        return self.init

    def sample_traffic(self, elapsed_s: float = 0.0) -> None:
        init = self._sandbox_init()
        if init is not None:
            sent = witness.loopback_sent(init.pid)
            if sent is not None:
                self.loopback_bytes = max(self.loopback_bytes or 0, sent[0])
                self.loopback_packets = max(self.loopback_packets or 0, sent[1])
                if not self.traffic_samples or self.traffic_samples[-1][1:] != (self.loopback_bytes,
                                                                                self.loopback_packets):
                    self.traffic_samples.append((round(elapsed_s, 2), self.loopback_bytes, self.loopback_packets))

    def sample_ranks(self, elapsed_s: float) -> None:
        """The CPU time of each rank's process so far (read from the kernel's accounting, once a second)."""
        if elapsed_s < self.next_rank_sample:
            return
        self.next_rank_sample = elapsed_s + RANK_SAMPLE_INTERVAL_S
        root = self._sandbox_init() if self.sandboxed else None
        try:
            family = (root or psutil.Process(self.leader.pid)).children(recursive=True)
        except psutil.Error:
            return
        for process in family:
            if process.pid in self.rank_cpu_s or _is_rank_main(process):
                try:
                    times = process.cpu_times()
                except psutil.Error:
                    continue
                self.rank_cpu_s[process.pid] = max(self.rank_cpu_s.get(process.pid, 0.0), times.user + times.system)

    def strays(self) -> list[psutil.Process]:
        """Processes that lost their parent (re-parented to the sandbox's init) while no rank runs any more:
        what ranks left behind when they exited. [] otherwise, or when not seen twice in a row."""
        init = self._sandbox_init()
        if init is None:
            return []
        try:
            children = init.children()
            if self.launcher_pid is None and children:
                self.launcher_pid = children[0].pid  # alone at first: the run starts with it
            orphans = [process for process in children if process.pid != self.launcher_pid]
            ranks_running = orphans and any(_is_rank_main(p) for p in init.children(recursive=True))
        except psutil.Error:
            return []
        left_behind = bool(orphans) and not ranks_running
        confirmed, self.strays_seen_before = left_behind and self.strays_seen_before, left_behind
        return orphans if confirmed else []


def _kill(processes: list[psutil.Process]) -> int:
    for process in processes:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(processes, timeout=5)
    return len(processes)


def run_local(job: JobSpec, on_progress: Callable[[dict], None] | None = None,
              on_snapshot: Callable[[dict], None] | None = None,
              target_reached: Callable[[], bool] | None = None, memory_cgroup: bool = True) -> RunResult:
    """Run the job on this machine: own session, budget + grace then SIGTERM, SIGKILL; no survivors.
    ``on_snapshot`` gets each snapshot the grader takes of the run's model; once ``target_reached()`` says so, the
    run is stopped as at the budget (SIGTERM, then SIGKILL), and ``stopped_at_target`` is set. As root the run
    gets a memory cgroup of its own unless ``memory_cgroup`` is False (a batch system's allocation limits it)."""
    private_dir = Path(tempfile.mkdtemp(prefix="scalelab-run-"))
    # A memory limit of the run's own takes root (the grader's uid drop): the same condition as a sandbox uid.
    groups = cgroups.SandboxCgroups("scalelab-run", job.memory_limit_bytes,
                                    enabled=memory_cgroup and job.sandbox_uid is not None)
    try:
        return _run_local(job, on_progress, private_dir, groups, on_snapshot, target_reached)
    finally:
        groups.remove()
        shutil.rmtree(private_dir, ignore_errors=True)


def _run_local(job: JobSpec, on_progress, private_dir: Path, groups: cgroups.SandboxCgroups, on_snapshot=None,
               target_reached=None) -> RunResult:
    timeline = witness.TimelineStream(private_dir)
    timeline.allow(job.sandbox_uid)
    command_inside = {str(witness.TIMELINE_INSIDE): str(timeline.path)}
    if job.sandbox:
        argv = sandbox_argv(job, private_dir, [sandbox_module.Bind(timeline.path, witness.TIMELINE_INSIDE,
                                                                   writable=True)])
    else:  # no sandbox: horovodrun writes the grader's file where it is
        argv = [command_inside.get(argument, argument) for argument in job.command]
    demux = RankLogDemux(job.logs_dir, job.log_cap_bytes)
    started_at = utc_now()
    timeline.start()
    meter = contention.ContentionMeter()
    meter.start()
    collector = None
    if job.snapshots_dir is not None:
        collector = snapshots.SnapshotCollector(
            job.job_dir, str((job.output_dir / job.model_file).relative_to(job.job_dir)), job.snapshots_dir,
            owner_uid=job.sandbox_uid if job.sandbox_uid is not None else os.getuid(),
            limit_bytes=verify.MODEL_SIZE_LIMIT_BYTES)
    started = time.monotonic()
    try:
        leader = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  env=job.env if not job.sandbox else {"PATH": "/usr/bin:/bin"},
                                  cwd=job.job_dir, start_new_session=True, preexec_fn=_limit_resources(job, groups))
    except OSError as error:
        demux.close()
        timeline.stop()
        raise LaunchError(f"could not start {argv[0]}: {error}") from error
    reader = threading.Thread(target=demux.pump, args=(leader.stdout,), daemon=True)
    reader.start()
    watch = SandboxWatch(leader, job.sandbox)
    deadline = job.time_budget_s + job.grace_s
    timed_out = killed = stopped_at_target = False
    terminated_at = None
    next_progress = next_stray_check = 0.0
    strays_killed = 0
    try:
        while leader.poll() is None:
            elapsed = time.monotonic() - started
            watch.sample_traffic(elapsed)
            watch.sample_ranks(elapsed)
            meter.sample()
            if collector is not None and terminated_at is None:
                snapshot = collector.poll(elapsed)
                if snapshot is not None and on_snapshot is not None:
                    on_snapshot(snapshot.as_dict())
            if on_progress is not None and elapsed >= next_progress:
                next_progress = elapsed + PROGRESS_INTERVAL_S
                on_progress({"state": "running", "elapsed_s": round(elapsed, 1),
                             "time_budget_s": job.time_budget_s, "epochs_seen": demux.epochs_seen,
                             "latest_accuracy": demux.latest_accuracy,
                             "checkpoint_mtime": _latest_mtime(job.output_dir / job.model_file)})
            if elapsed >= next_stray_check and terminated_at is None:
                next_stray_check = elapsed + STRAY_CHECK_INTERVAL_S
                strays_killed += _kill(watch.strays())  # horovodrun then ends with the ranks' own status
            if terminated_at is None and target_reached is not None and target_reached():
                stopped_at_target = True  # the referee has seen the target: the clock has stopped
                terminated_at = elapsed
                _signal_job(leader, job, signal.SIGTERM)
            elif elapsed >= deadline and terminated_at is None:
                timed_out = True
                terminated_at = elapsed
                _signal_job(leader, job, signal.SIGTERM)
            elif terminated_at is not None and elapsed >= terminated_at + KILL_AFTER_TERM_S:
                killed = True
                _signal_job(leader, job, signal.SIGKILL)
                leader.wait(timeout=30)
                break
            try:  # returns as soon as horovodrun exits: the clock stops then, not at the next tick
                leader.wait(timeout=WATCH_INTERVAL_S)
            except subprocess.TimeoutExpired:
                pass
    finally:
        if leader.poll() is None:  # the grader itself is being interrupted: take the job down with it
            _signal_job(leader, job, signal.SIGKILL)
            leader.wait(timeout=30)
    wall_time_s = time.monotonic() - started
    finished_at = utc_now()
    survivors = kill_survivors(leader.pid, job.sandbox_uid)
    if collector is not None and terminated_at is None:  # ended by itself: its last model joins the curve
        collector.final_look(wall_time_s)
    # horovodrun is gone; its pipe closes once every process holding it is gone too.
    reader.join(timeout=10)
    leader.stdout.close()
    cpu_contention = meter.finish()  # once nothing of the run is left
    evidence = timeline.stop()
    rank_logs, launcher_log, truncated = demux.close()
    deciles, span_s = witness.traffic_spread(watch.traffic_samples)
    return RunResult(exit_code=None if killed else leader.returncode, wall_time_s=round(wall_time_s, 2),
                     timed_out=timed_out, started_at=started_at, finished_at=finished_at,
                     rank_logs=rank_logs, launcher_log=launcher_log, rank_tracebacks=demux.tracebacks(),
                     truncated_logs=truncated, epochs_seen=demux.epochs_seen, survivors_killed=survivors,
                     strays_killed=strays_killed, timeline=dataclasses.asdict(evidence),
                     loopback_bytes=watch.loopback_bytes, loopback_packets=watch.loopback_packets,
                     cpu_contention=cpu_contention.as_dict(),
                     snapshots=[snapshot.as_dict() for snapshot in collector.snapshots] if collector else [],
                     snapshot_notes=list(collector.notes) if collector else [],
                     stopped_at_target=stopped_at_target, reported_accuracy=demux.latest_accuracy,
                     memory_limit_bytes=job.memory_limit_bytes if groups.memory is not None else None,
                     peak_memory_bytes=groups.peak_memory_bytes(), out_of_memory_kills=groups.out_of_memory_kills(),
                     rank_cpu_s=[round(watch.rank_cpu_s[pid], 2) for pid in sorted(watch.rank_cpu_s)],
                     traffic_active_deciles=deciles, traffic_span_s=span_s)
