"""The Assess service's workers: threads that drain the queue (``queue.py``), each grading one job at a time
out of the server process with the real grader, exactly as on the command line::

    scalelab assess <job_dir>/assessment.py --track T --json --out <job_dir>/grader [--backend B]

What the workers keep:

- **Slots**: one worker thread per slot and one job per worker, so at most ``slots`` jobs run at once.
- **Restart safety**: a job found ``running`` when a server starts, left by a server of this host that is gone
  (killed, crashed, or stopped), goes back to the queue at the front and is graded again from scratch (its run
  re-done, never resumed, its earlier output removed); its grader, if it still runs, is stopped first (SIGTERM,
  so that it stops its run and removes its job directory, then SIGKILL). A server stopped cleanly re-queues its
  running jobs the same way at exit. The job's ``reruns`` and its verdict's notes say when and why. A job is
  re-queued at most ``max_reruns`` times: a submission that keeps bringing the server down then ends
  ``interrupted`` with a reason, and is never reported as passed. A grader that had already written its verdict
  before the server died is not re-run: that verdict is the real grader's and is kept. Queued jobs are untouched.
- **A crowded machine**: a run that ran out of time while other work used too much of the machine's CPU (the
  grader's verdict says ``contended``; see ``contention.py``) is not the student's fault: the job goes back to the
  front of the queue the same way, within the same ``max_reruns``; past them it ends ``done`` with a verdict that
  says the machine was too busy (an ``error``, never a ``timeout``).
- **Root's helper**: a server that is not root (the Hub's service) grades local jobs through ``assess_helper.py``
  (``privileged_helper``: through sudo), so that each run gets a uid and limits of its own; the helper writes the
  same files into the job directory as this account's. This account cannot signal it: the end of its standard
  input (closed here, or by the kernel when the server dies) stops its grading.
- **Progress** (``progress.json``, written by the grader: elapsed time vs budget, epochs seen, latest
  accuracy, checkpoint time) is copied to the job for display only; the verdict is always the grader's.
- **Disk**: job directories and the files the service writes in them are private to the server's account
  (0700/0600). The model a run wrote (``<job_dir>/grader/model.keras`` or ``model.pt2``, up to 200 MiB) is kept
  only when the stored verdict is a pass. :class:`JobRetention` removes a student's oldest job directories beyond a
  count or a byte quota; the database rows and verdicts stay, and the directory of a queued or running job (or of a
  job whose grader still runs) is never removed.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from . import spec, store
from .assess_helper import DATA_VARIABLES
from .contention import busy_machine_sentence
from .queue import ACTIVE_STATES, DONE, RERUN_MACHINE_BUSY, AssessQueue

# How often one job may be graded again (after its server stopped under it, or its run was starved of CPU)
# before it ends ``interrupted`` or ``done`` with the machine too busy.
MAX_RERUNS = 2


def grader_process(job: dict) -> psutil.Process | None:
    """The job's ``scalelab assess`` process if it still runs (checked by pid *and* start time)."""
    if not job.get("grader_pid"):
        return None
    try:
        process = psutil.Process(job["grader_pid"])
        if process.is_running() and abs(process.create_time() - (job.get("grader_created") or 0)) < 1:
            return process
    except psutil.Error:
        pass
    return None


def kill_process_tree(process: psutil.Process, grace_s: float = 5.0) -> None:
    """SIGTERM the grader and everything it started, then SIGKILL what is left after ``grace_s``."""
    try:
        family = [process, *process.children(recursive=True)]
    except psutil.Error:
        return
    for member in family:
        try:
            member.terminate()
        except psutil.Error:
            pass
    _gone, alive = psutil.wait_procs(family, timeout=grace_s)
    for member in alive:
        try:
            member.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace_s)


def stop_grader(popen: subprocess.Popen) -> None:
    """Stop a grader this server started: the end of its input stops root's helper, which this account cannot
    signal; a grader of this account's own is stopped as a process tree."""
    if popen.stdin is not None:
        try:
            popen.stdin.close()
        except OSError:
            pass
    try:
        kill_process_tree(psutil.Process(popen.pid))
    except psutil.Error:
        pass


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def utc_iso(unix_seconds: float | None) -> str | None:
    if unix_seconds is None:
        return None
    return dt.datetime.fromtimestamp(unix_seconds, dt.timezone.utc).isoformat(timespec="seconds")


def default_scalelab_command() -> list[str]:
    """The ``scalelab`` executable beside this Python (the venv's), so the worker grades with our grader."""
    beside = Path(sys.executable).with_name("scalelab")
    return [str(beside)] if beside.exists() else [sys.executable, "-m", "scalelab.cli"]


@dataclass
class GraderSettings:
    """How a worker calls ``scalelab assess``."""
    track: str
    track_file: str | None = None
    backend: str = "local"
    allow_unsandboxed: bool = False
    command: list[str] = field(default_factory=default_scalelab_command)
    environment: dict[str, str] | None = None  # None: the server's own environment
    poll_interval_s: float = 1.0
    # A server that is not root grades through root's helper (assess_helper.py), e.g. ["sudo", "-n", HELPER], so
    # that each run gets a uid and limits of its own; local jobs only (Slurm gives runs their own).
    privileged_helper: list[str] | None = None


def submission_copy(job_dir: Path) -> Path:
    return Path(job_dir) / "assessment.py"


def grader_out_dir(job_dir: Path) -> Path:
    return Path(job_dir) / "grader"


def model_files(job_dir: Path) -> list[Path]:
    """Where the grader leaves the model a run saved, whichever framework's file it is."""
    return [grader_out_dir(job_dir) / name for name in spec.MODEL_FILES.values()]


def open_private(path: Path, mode: str):
    """``open`` for a new file only the server's account can read (0600 whatever the umask)."""
    return open(path, mode, opener=lambda name, flags: os.open(name, flags, 0o600))


def is_pass(job: dict | None) -> bool:
    return bool(job) and job["state"] == DONE and (job["verdict"] or {}).get("verdict") == "pass"


def directory_bytes(path: Path) -> int:
    """Bytes in the files under ``path`` (links counted as links, never followed)."""
    total = 0
    for folder, _subfolders, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


@dataclass
class JobRetention:
    """How much of a student's finished jobs stays on disk; their rows and verdicts stay in the database."""
    jobs_root: Path
    keep_jobs_per_student: int = 20  # 0: no limit
    disk_quota_bytes_per_student: int = 0  # 0: no limit

    def prune(self, queue: AssessQueue, student: str) -> list[Path]:
        """Remove the student's oldest job directories beyond the count, then beyond the quota; returns them."""
        root = os.path.realpath(self.jobs_root)
        on_disk = [job for job in queue.job_directories(student)  # newest first
                   if os.path.dirname(os.path.realpath(job["job_dir"])) == root and os.path.isdir(job["job_dir"])]
        doomed, kept = [], []
        for index, job in enumerate(on_disk):
            beyond_count = 0 < self.keep_jobs_per_student <= index
            (doomed if beyond_count and _removable(job) else kept).append(job)
        if self.disk_quota_bytes_per_student > 0:
            sizes = {job["id"]: directory_bytes(job["job_dir"]) for job in kept}
            total = sum(sizes.values())
            for job in reversed(kept):  # oldest first
                if total <= self.disk_quota_bytes_per_student:
                    break
                if _removable(job):
                    doomed.append(job)
                    total -= sizes[job["id"]]
        for job in doomed:
            shutil.rmtree(job["job_dir"], ignore_errors=True)
        return [Path(job["job_dir"]) for job in doomed]


def _removable(job: dict) -> bool:
    # States only move forward, so a finished job never becomes active again; a grader that outlived its
    # job (a server stopped under it) may still be writing there.
    return job["state"] not in ACTIVE_STATES and grader_process(job) is None


class GradingWorkers:
    """``slots`` threads, each claiming the oldest queued job and grading it with ``scalelab assess``."""

    def __init__(self, queue: AssessQueue, settings: GraderSettings, slots: int, log=None,
                 retention: JobRetention | None = None, server_name: str = "the Jupyter server",
                 max_reruns: int = MAX_RERUNS):
        if slots < 1:
            raise ValueError(f"slots must be at least 1, not {slots}")
        if max_reruns < 0:
            raise ValueError(f"max_reruns must be at least 0, not {max_reruns}")
        self.queue, self.settings, self.slots, self.max_reruns = queue, settings, slots, max_reruns
        self.log = log
        self.retention = retention
        self.server_name = server_name  # what stopped, in the reason an interrupted job's student reads
        self.host, self.server_pid = socket.gethostname(), os.getpid()
        self._stopping = threading.Event()
        self.stop_reason = ""
        self._wakeup = threading.Condition()
        self._running: dict[int, subprocess.Popen] = {}
        self._running_lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    # --- life cycle -----------------------------------------------------------------------------------------

    def recover(self) -> list[dict]:
        """Settle the running jobs a dead server of this host left behind (see the module docstring)."""
        settled = []
        for job in self.queue.orphaned_running_jobs(self.host, self.server_pid):
            process = grader_process(job)
            if process is not None:
                kill_process_tree(process)
            verdict = read_json(grader_out_dir(job["job_dir"]) / "verdict.json")
            if process is None and verdict is not None and verdict.get("finished_at"):
                verdict.setdefault("notes", []).append(
                    "the server restarted after the grader had finished; this is the grader's own verdict.")
                self.queue.finish(job["id"], verdict)
            else:
                started = utc_iso(job["started_at"]) or "an unknown time"
                self._requeue_or_interrupt(job, f"{self.server_name} stopped while this assessment was running "
                                                f"(it started at {started})")
            self._tidy(job)
            settled.append(self.queue.get(job["id"]))
        return settled

    def _requeue_or_interrupt(self, job: dict, what_happened: str) -> None:
        """A running job its server stopped under: graded again from scratch, or, past ``max_reruns``,
        interrupted with a reason."""
        if job.get("rerun_count", 0) < self.max_reruns:
            if self.queue.requeue(job["id"], f"{what_happened}; it was graded again from scratch."):
                self.wake()
            return
        self.queue.interrupt(job["id"], (
            f"Interrupted: {what_happened}, and it had already been graded again {job['rerun_count']} time(s) "
            f"after the same; it is not re-run once more. Nothing was recorded as a result; click Assess to submit "
            f"it again."))

    def start(self) -> None:
        for slot in range(self.slots):
            thread = threading.Thread(target=self._work, name=f"scalelab-assess-slot-{slot}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def wake(self) -> None:
        with self._wakeup:
            self._wakeup.notify_all()

    def stop(self, reason: str | None = None) -> None:
        """Stop claiming; re-queue running jobs (first, so no verdict races in), then kill graders."""
        self.stop_reason = reason or f"{self.server_name} was stopped while this assessment was running"
        with self._running_lock:  # with _grade's registration: a grader is either seen here or never started
            self._stopping.set()
            running = dict(self._running)
        self.wake()
        for job_id, popen in running.items():
            self._settle_stopped(job_id)
            stop_grader(popen)
        for thread in self._threads:
            thread.join(timeout=10)

    # --- one worker ------------------------------------------------------------------------------------------

    def _work(self) -> None:
        while not self._stopping.is_set():
            try:
                job = self.queue.claim_next(self.host, self.server_pid)
            except Exception as error:  # the database is away for a moment: try again shortly
                self._say(f"could not claim a job: {error}")
                job = None
            if job is None:
                with self._wakeup:
                    self._wakeup.wait(timeout=self.settings.poll_interval_s)
                continue
            if self._stopping.is_set():  # claimed just as the server stops: do not start it
                self._settle_stopped(job["id"])
                return
            try:
                self._grade(job)
            except Exception as error:  # never leave a job running because the worker itself failed
                self._say(f"job {job['id']}: {type(error).__name__}: {error}")
                self.queue.finish(job["id"], service_error_verdict(
                    job, f"the Assess service could not run the grader: {type(error).__name__}: {error}"))
            self._tidy(job)

    def uses_helper(self, job: dict) -> bool:
        return bool(self.settings.privileged_helper) and job["backend"] == "local"

    def grader_argv(self, job: dict) -> list[str]:
        if self.uses_helper(job):
            argv = [*self.settings.privileged_helper, "--job", str(job["job_dir"]), "--track", job["track"]]
            if self.settings.track_file:
                argv += ["--track-file", str(self.settings.track_file)]
            environment = os.environ if self.settings.environment is None else self.settings.environment
            return argv + [f"--data={name}={environment[name]}" for name in DATA_VARIABLES if environment.get(name)]
        argv = [*self.settings.command, "assess", str(submission_copy(job["job_dir"])), "--track", job["track"],
                "--json", "--out", str(grader_out_dir(job["job_dir"])), "--backend", job["backend"]]
        if self.settings.track_file:
            argv += ["--track-file", str(self.settings.track_file)]
        if self.settings.allow_unsandboxed:
            argv.append("--allow-unsandboxed")
        return argv

    def _settle_stopped(self, job_id: int) -> None:
        job = self.queue.get(job_id)
        if job is not None and job["state"] != DONE:
            self._requeue_or_interrupt(job, self.stop_reason)

    def _grade(self, job: dict) -> None:
        job_dir = Path(job["job_dir"])
        if job.get("reruns"):  # graded from scratch: nothing an earlier, stopped grader wrote is read
            shutil.rmtree(grader_out_dir(job_dir), ignore_errors=True)
        with open_private(job_dir / "grader.stdout", "wb") as stdout, \
                open_private(job_dir / "grader.stderr", "wb") as stderr:
            # Own session: the grader and its horovodrun can be stopped as one tree, apart from the server.
            # Not in the job directory: it holds the student's file, and Python imports from the cwd.
            # The helper grades as root, out of this account's reach: it stops its grader when its input ends.
            popen = subprocess.Popen(self.grader_argv(job),
                                     stdin=subprocess.PIPE if self.uses_helper(job) else subprocess.DEVNULL,
                                     stdout=stdout, stderr=stderr, cwd="/", env=self.settings.environment,
                                     start_new_session=True)
        with self._running_lock:
            self._running[job["id"]] = popen
            stopped_meanwhile = self._stopping.is_set()
        if stopped_meanwhile:  # stop() ran between the claim and the start: it did not see this grader
            self._settle_stopped(job["id"])
            stop_grader(popen)
        try:
            try:
                self.queue.set_grader_process(job["id"], popen.pid, psutil.Process(popen.pid).create_time())
            except psutil.Error:
                pass  # it already ended
            self._follow_progress(job, popen)
        finally:
            with self._running_lock:
                self._running.pop(job["id"], None)
            if popen.stdin is not None:
                popen.stdin.close()
        if self._stopping.is_set():
            return  # stop() has re-queued it (or marked it interrupted)
        verdict = read_json(grader_out_dir(job_dir) / "verdict.json")
        if verdict is not None and self.uses_helper(job):
            self._record(verdict)  # root's grader kept its results database in a folder of its own, now gone
        if verdict is None:  # only a refused command line (exit 2) or a crash before the grader started
            message = _last_line((job_dir / "grader.stderr").read_bytes()) or f"exit status {popen.returncode}"
            verdict = service_error_verdict(job, f"the grader refused the submission: {message}",
                                            verdict="fail" if popen.returncode == 2 else "error")
        verdict["student"] = verdict.get("student") or job["student"]  # the grader CLI does not know who it was
        if verdict.get("contended") and self._requeued_as_contended(job, verdict):
            return
        for rerun in job.get("reruns") or []:
            verdict.setdefault("notes", []).append(f"Re-run on {utc_iso(rerun['at'])}: {rerun['reason']}")
        self.queue.finish(job["id"], verdict)

    def _requeued_as_contended(self, job: dict, verdict: dict) -> bool:
        """A run out of time on a crowded machine: graded again from scratch (True), or, past ``max_reruns``,
        ``verdict`` is rewritten to say the machine was too busy, for the caller to store (False)."""
        busy = busy_machine_sentence(verdict["cpu_contention"])
        if job.get("rerun_count", 0) < self.max_reruns:
            if self.queue.requeue(job["id"], f"{busy}, and it ran out of time; it was graded again from scratch.",
                                  cause=RERUN_MACHINE_BUSY):
                self.wake()
            return True
        earlier = (f" It had already been graded again {job['rerun_count']} time(s); it is not re-run once more."
                   if job.get("rerun_count") else "")
        verdict["reasons"] = [
            f"Not graded: the grading machine was too busy. {busy[0].upper()}{busy[1:]}, and it ran out of time; "
            f"the time budget assumes the machine to itself.{earlier} Nothing was recorded against you; click Assess "
            f"to submit it again later."]
        return False

    def _follow_progress(self, job: dict, popen: subprocess.Popen) -> None:
        progress_file = grader_out_dir(job["job_dir"]) / "progress.json"
        last, history = None, []
        while True:
            ended = popen.poll() is not None
            progress = read_json(progress_file)
            if progress is not None and progress != last:
                last = progress
                point = {"elapsed_s": progress.get("elapsed_s"), "accuracy": progress.get("latest_accuracy"),
                         "epochs_seen": progress.get("epochs_seen")}
                if point["accuracy"] is not None and (not history or history[-1]["epochs_seen"] != point["epochs_seen"]
                                                      or history[-1]["accuracy"] != point["accuracy"]):
                    history.append(point)
                self.queue.record_progress(job["id"], progress, history)
            if ended:
                return
            try:  # back at once when the grader ends: its verdict is read then, not up to a poll later
                popen.wait(timeout=self.settings.poll_interval_s)
            except subprocess.TimeoutExpired:
                pass

    def _record(self, verdict: dict) -> None:
        """In this account's results database ($SCALELAB_HOME/results.db), as ``scalelab assess`` records it."""
        try:
            store.ResultsDatabase(None).record(verdict)
        except Exception as error:  # the queue's database keeps the verdict regardless
            self._say(f"could not record a verdict in the results database: {type(error).__name__}: {error}")

    def _tidy(self, job: dict) -> None:
        """Once a job has ended: its model stays only with a stored pass; then the student's retention."""
        try:
            if not is_pass(self.queue.get(job["id"])):
                for model in model_files(job["job_dir"]):
                    model.unlink(missing_ok=True)
            if self.retention is not None:
                self.retention.prune(self.queue, job["student"])
        except Exception as error:  # a full or failing disk must not stop the worker
            self._say(f"job {job['id']}: could not tidy its files: {type(error).__name__}: {error}")

    def _say(self, message: str) -> None:
        if self.log is not None:
            self.log.warning("scalelab assess service: %s", message)
        else:
            print(f"scalelab assess service: {message}", file=sys.stderr)


def _last_line(data: bytes) -> str:
    lines = [line.strip() for line in data.decode("utf-8", "replace").splitlines() if line.strip()]
    return lines[-1][:500] if lines else ""


def service_error_verdict(job: dict, reason: str, verdict: str = "error") -> dict:
    """A verdict in the grader's shape for when the grader gave none."""
    now = utc_iso(time.time())
    return {"verdict": verdict, "reasons": [reason], "notes": [], "heldout_accuracy": None, "target_accuracy": None,
            "wall_time_s": None, "time_budget_s": None, "np": None, "ranks_seen": [], "allreduce_count": 0,
            "track": job["track"], "submission_sha256": job["submission_sha256"], "started_at": now,
            "finished_at": now, "logs_dir": None, "environment": None, "student": job["student"]}
