"""The Slurm backend: run a prepared :class:`~scalelab.grader.launch.JobSpec` as one Slurm batch job.

``run(job)`` returns the same :class:`~scalelab.grader.launch.RunResult` as ``launch.run_local``, so the verify
step and the verdict are the local backend's. The grader writes ``job.json`` and a batch script into the control
directory (``logs/slurm`` of the run, outside the sandbox), submits it with ``sbatch --parsable`` and then only
watches: the state and the queue position come from ``squeue`` (``scontrol``/``sacct`` once the job left the
queue), the run's own progress from the files ``grader/slurm_runner.py`` writes inside the allocation.

Time: queue waiting never counts. The grader's clock starts when ``started`` appears in the control directory;
at budget + grace the grader ``scancel``s the job (Slurm sends SIGTERM, then SIGKILL after its KillWait). Whatever
the outcome, the verdict waits (bounded) until ``squeue`` no longer lists the job.

The job directory and the run's out directory must be on a file system the compute node shares with the grader.
Configuration, from the environment of the grader (the CLI or the Assess service):

    SCALELAB_SLURM_PARTITION       --partition (default: the cluster's default partition)
    SCALELAB_SLURM_ACCOUNT         --account
    SCALELAB_SLURM_NODES           must be 1: horovodrun (or torchrun) starts every rank on the allocated node
    SCALELAB_SLURM_GPUS_PER_NODE   --gres=gpu:N (default: one per rank when the grader's machine has GPUs, else none)
    SCALELAB_SLURM_QUEUE_TIMEOUT_S how long a job may wait in the queue before the grader gives up (default 3600)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from . import launch, slurm_runner, store

POLL_INTERVAL_S = 0.5
TIME_SLACK_MIN = 1            # Slurm's own --time is a safety net behind the grader's scancel
START_TIMEOUT_S = 120.0       # running, but the runner never wrote `started`: it could not start
RESULT_WAIT_S = 30.0          # the job left the queue; the shared file system may show result.json a bit later
LEAVE_QUEUE_TIMEOUT_S = 60.0  # after the result, how long the job may take to leave squeue (KillWait + epilog)
CONTROLLER_RETRY_S = 60.0     # slurmctld may be briefly unreachable (restart, failover); longer is an error
DEFAULT_QUEUE_TIMEOUT_S = 3600.0
COMMAND_TIMEOUT_S = 30.0
# squeue prints these for a job that is still being worked on; anything else means it is over.
ACTIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING",
                 "SIGNALING", "STAGE_OUT", "STOPPED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"}


class SlurmError(launch.LaunchError):
    """Slurm could not run the job (not the submission's fault); the message says what to fix."""


@dataclasses.dataclass
class JobState:
    state: str          # Slurm's job state (PENDING, RUNNING, COMPLETING, ...)
    reason: str         # why it is pending (Priority, Resources, ...), "None" when running
    partition: str


# ---------------------------------------------------------------------------------------------------------------
# Slurm's commands
# ---------------------------------------------------------------------------------------------------------------

def _slurm(arguments: list[str], check: bool = True) -> subprocess.CompletedProcess:
    program = shutil.which(arguments[0])
    if program is None:
        raise SlurmError(f"{arguments[0]} is not installed: the Slurm backend needs Slurm's client commands on the "
                         f"grader's machine (apt-get install slurm-client), or use the local backend")
    try:
        done = subprocess.run([program, *arguments[1:]], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{shlex.join(arguments)}` did not answer within {COMMAND_TIMEOUT_S:.0f} s: "
                         f"is slurmctld overloaded or unreachable?") from None
    if check and done.returncode != 0:
        raise SlurmError(f"`{shlex.join(arguments)}` failed (exit status {done.returncode}): "
                         f"{done.stderr.strip() or done.stdout.strip()}")
    return done


def check_commands() -> None:
    missing = [name for name in ("sbatch", "squeue", "scancel", "scontrol") if shutil.which(name) is None]
    if missing:
        raise SlurmError(f"{', '.join(missing)} not installed: the Slurm backend needs Slurm's client commands on "
                         f"the grader's machine (apt-get install slurm-client), or use the local backend")


def check_controller() -> None:
    """Fail fast with a sentence when slurmctld is down (sbatch itself would retry for about 10 s, then fail)."""
    ping = _slurm(["scontrol", "ping"], check=False)
    if ping.returncode != 0 or "is UP" not in ping.stdout:
        first_line = (ping.stdout.strip() or ping.stderr.strip()).splitlines()[:1]
        raise SlurmError(f"the Slurm controller (slurmctld) does not answer ({' '.join(first_line) or 'no reply'}): "
                         f"start Slurm (for a one-node cluster here: containers/slurm/start.sh) or use the local "
                         f"backend")


def _controller_unreachable(done: subprocess.CompletedProcess) -> bool:
    return "Unable to contact slurm controller" in done.stderr or "Socket timed out" in done.stderr


def job_state(job_id: str) -> JobState | None:
    """The job as squeue lists it; None when squeue no longer lists it (finished and gone)."""
    done = _slurm(["squeue", "--noheader", "--jobs", job_id, "--format", "%T|%r|%P"], check=False)
    if done.returncode != 0:
        if "Invalid job id" in done.stderr:
            return None  # slurmctld already forgot the job
        if _controller_unreachable(done):
            raise ConnectionError(done.stderr.strip())
        raise SlurmError(f"squeue failed for job {job_id}: {done.stderr.strip()}")
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if not lines:
        return None
    state, reason, partition = (lines[0].split("|") + ["", ""])[:3]
    return JobState(state=state.strip(), reason=reason.strip(), partition=partition.strip())


def queue_position(job_id: str, partition: str) -> int | None:
    """1 + the number of pending jobs Slurm would start before ours in its partition (priority, then age)."""
    done = _slurm(["squeue", "--noheader", "--states", "PENDING", "--partition", partition, "--format", "%i",
                   "--sort", "-p,i"], check=False)
    if done.returncode != 0:
        return None
    pending = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    return pending.index(job_id) + 1 if job_id in pending else None


def final_state(job_id: str) -> str:
    """How a job that left the queue ended: slurmctld's memory (scontrol), else accounting (sacct)."""
    shown = _slurm(["scontrol", "show", "job", job_id, "--oneliner"], check=False)
    for field in shown.stdout.split():
        if field.startswith("JobState="):
            return field.split("=", 1)[1]
    accounted = _slurm(["sacct", "--noheader", "--parsable2", "--allocations", "--jobs", job_id, "--format",
                        "State"], check=False)
    states = [line.strip() for line in accounted.stdout.splitlines() if line.strip()]
    return states[0] if states else "UNKNOWN"


def cancel(job_id: str) -> None:
    _slurm(["scancel", job_id], check=False)


def wait_until_gone(job_id: str, timeout_s: float) -> bool:
    """Wait until squeue no longer lists the job; True if it left within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if job_state(job_id) is None:
                return True
        except ConnectionError:
            pass
        time.sleep(POLL_INTERVAL_S)
    return False


# ---------------------------------------------------------------------------------------------------------------
# The batch job
# ---------------------------------------------------------------------------------------------------------------

def time_limit_minutes(time_budget_s: float, grace_s: float) -> int:
    """Slurm's --time: budget + grace rounded up to minutes, plus a minute for the runner's start and report."""
    return math.ceil((time_budget_s + grace_s) / 60) + TIME_SLACK_MIN


def gpus_per_node(job: launch.JobSpec, environ=os.environ) -> int:
    configured = environ.get("SCALELAB_SLURM_GPUS_PER_NODE")
    if configured:
        return int(configured)
    return job.np if job.device_paths else 0  # one GPU per rank, as the local backend would use them


def sbatch_options(job: launch.JobSpec, control: Path, environ=os.environ) -> list[str]:
    """The #SBATCH options: one node, one task (horovodrun or torchrun starts the ranks), a CPU per rank, the time
    limit."""
    nodes = environ.get("SCALELAB_SLURM_NODES", "1")
    if nodes != "1":
        raise SlurmError(f"SCALELAB_SLURM_NODES={nodes}: the grader's Slurm backend runs a job on one node "
                         f"(the launcher starts every rank there); see containers/README.md for multi-node recipes")
    options = [f"--job-name=scalelab-{job.job_dir.name}", "--nodes=1", "--ntasks=1",
               f"--cpus-per-task={job.np}", f"--time={time_limit_minutes(job.time_budget_s, job.grace_s)}",
               f"--chdir={control}", f"--output={control}/slurm-%j.out", "--open-mode=append",
               # Our own SIGTERM handling does the job's shutdown; never requeue a graded run.
               "--no-requeue"]
    gpus = gpus_per_node(job, environ)
    if gpus > 0:
        options.append(f"--gres=gpu:{gpus}")
    for variable, option in (("SCALELAB_SLURM_PARTITION", "--partition"), ("SCALELAB_SLURM_ACCOUNT", "--account")):
        if environ.get(variable):
            options.append(f"{option}={environ[variable]}")
    return options


def batch_script(job: launch.JobSpec, control: Path, environ=os.environ) -> str:
    lines = ["#!/bin/bash", "# Written by the ScaleLab grader (grader/slurm.py): one graded run."]
    lines += [f"#SBATCH {option}" for option in sbatch_options(job, control, environ)]
    # exec: the runner itself receives scancel's SIGTERM and shuts the sandbox down in order.
    lines.append(f"exec {shlex.quote(sys.executable)} -m scalelab.grader.slurm_runner {shlex.quote(str(control))}")
    return "\n".join(lines) + "\n"


def submit(job: launch.JobSpec, control: Path) -> str:
    """Write job.json and the batch script, sbatch it; returns Slurm's job id."""
    check_commands()
    control.mkdir(parents=True, exist_ok=True)
    (control / slurm_runner.JOB_FILE).write_text(slurm_runner.job_to_json(job))
    script = control / "job.sbatch"
    script.write_text(batch_script(job, control))
    check_controller()
    done = _slurm(["sbatch", "--parsable", str(script)])
    job_id = done.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise SlurmError(f"sbatch did not print a job id: {done.stdout.strip()!r} {done.stderr.strip()}")
    return job_id


# ---------------------------------------------------------------------------------------------------------------
# Watching it
# ---------------------------------------------------------------------------------------------------------------

def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # absent, or being replaced: the next poll reads it


def _output_tail(control: Path, job_id: str, lines: int = 15) -> str:
    try:
        text = (control / f"slurm-{job_id}.out").read_text(errors="replace")
    except OSError:
        return "(the job wrote no output)"
    return "\n".join(text.strip().splitlines()[-lines:]) or "(the job wrote no output)"


def run_result_from(document: dict) -> launch.RunResult:
    """The RunResult the runner wrote (JSON turned the rank numbers into strings)."""
    fields = dict(document)
    fields["rank_logs"] = {int(rank): path for rank, path in fields["rank_logs"].items()}
    fields["rank_tracebacks"] = {int(rank): text for rank, text in fields["rank_tracebacks"].items()}
    return launch.RunResult(**fields)


def _cancelled_without_result(job: launch.JobSpec, started: dict, wall_time_s: float,
                              epochs_seen: int) -> launch.RunResult:
    """When Slurm killed the runner before it could report: what the grader itself knows of the run."""
    rank_logs = {int(path.stem.split("-")[1]): str(path) for path in job.logs_dir.glob("rank-*.log")}
    return launch.RunResult(exit_code=None, wall_time_s=round(wall_time_s, 2), timed_out=True,
                            started_at=started.get("started_at") or launch.utc_now(), finished_at=launch.utc_now(),
                            rank_logs=rank_logs, launcher_log=str(job.logs_dir / "launcher.log"),
                            rank_tracebacks={}, truncated_logs=[], epochs_seen=epochs_seen, survivors_killed=0)


def queue_timeout_s(environ=os.environ) -> float:
    return float(environ.get("SCALELAB_SLURM_QUEUE_TIMEOUT_S") or DEFAULT_QUEUE_TIMEOUT_S)


def run(job: launch.JobSpec, on_progress: Callable[[dict], None] | None = None) -> launch.RunResult:
    """Run ``job`` through Slurm; returns when the job has left Slurm's queue (or after a bounded wait)."""
    control = job.logs_dir / "slurm"
    job_id = submit(job, control)
    report = on_progress or (lambda state: None)
    submitted = time.monotonic()
    started_seen = None          # the grader's clock: when `started` appeared
    running_seen = None
    cancelled_for_time = False
    controller_lost_since = None
    last_progress: dict = {}
    result = None
    try:
        while result is None:
            result = _read_json(control / slurm_runner.RESULT_FILE)
            if result is not None:
                break
            now = time.monotonic()
            try:
                state = job_state(job_id)
                controller_lost_since = None
            except ConnectionError as error:
                controller_lost_since = controller_lost_since or now
                if now - controller_lost_since > CONTROLLER_RETRY_S:
                    raise SlurmError(f"lost contact with slurmctld for {CONTROLLER_RETRY_S:.0f} s while job {job_id} "
                                     f"ran: {error}") from None
                time.sleep(POLL_INTERVAL_S)
                continue
            started = _read_json(control / slurm_runner.STARTED_FILE)
            if started is not None and started_seen is None:
                started_seen = now
            if state is None or state.state not in ACTIVE_STATES:
                # The job is over; the runner's result may still be on its way through the shared file system.
                result = _wait_for_result(control)
                if result is None and cancelled_for_time:
                    return _cancelled_without_result(job, started or {}, now - started_seen,
                                                     last_progress.get("epochs_seen", 0))
                if result is None:
                    raise SlurmError(f"Slurm job {job_id} ended ({final_state(job_id)}) without the runner's "
                                     f"result; its output:\n{_output_tail(control, job_id)}")
                break
            if started_seen is None:
                if state.state == "PENDING":
                    if now - submitted > queue_timeout_s():
                        raise SlurmError(f"Slurm job {job_id} waited {now - submitted:.0f} s in the queue "
                                         f"({state.reason}) without starting; it was cancelled")
                    report({"state": "queued", "elapsed_s": 0.0, "time_budget_s": job.time_budget_s,
                            "epochs_seen": 0, "latest_accuracy": None, "checkpoint_mtime": None,
                            "slurm_job_id": job_id, "slurm_state": state.state, "slurm_reason": state.reason,
                            "queue_position": queue_position(job_id, state.partition)})
                else:
                    running_seen = running_seen or now
                    if now - running_seen > START_TIMEOUT_S:
                        raise SlurmError(f"Slurm job {job_id} has been {state.state} for {START_TIMEOUT_S:.0f} s "
                                         f"but the grader's runner never started; its output:\n"
                                         f"{_output_tail(control, job_id)}")
            else:
                elapsed = now - started_seen
                progress = _read_json(control / slurm_runner.PROGRESS_FILE) or {}
                last_progress = progress or last_progress
                report({**{"state": "running", "epochs_seen": 0, "latest_accuracy": None,
                           "checkpoint_mtime": None}, **last_progress, "elapsed_s": round(elapsed, 1),
                        "time_budget_s": job.time_budget_s, "slurm_job_id": job_id, "slurm_state": state.state})
                if elapsed >= job.time_budget_s + job.grace_s and not cancelled_for_time:
                    cancelled_for_time = True
                    cancel(job_id)
            time.sleep(POLL_INTERVAL_S)
    finally:
        # Whatever happened (a result, an error, the grader interrupted), no job of ours stays in the queue.
        _leave_queue(job_id, control, reported=result is not None)
    run_result = run_result_from(result["run"])
    if cancelled_for_time:
        run_result.timed_out = True
    return run_result


def _wait_for_result(control: Path) -> dict | None:
    deadline = time.monotonic() + RESULT_WAIT_S
    while time.monotonic() < deadline:
        result = _read_json(control / slurm_runner.RESULT_FILE)
        if result is not None:
            return result
        if not (control / slurm_runner.STARTED_FILE).exists():
            return None  # the runner never started: no result will come
        time.sleep(POLL_INTERVAL_S)
    return None


def _leave_queue(job_id: str, control: Path, reported: bool) -> None:
    """Make sure squeue no longer lists the job: a job that reported gets time to exit by itself, then scancel;
    one the grader gave up on (an error, the grader interrupted) is cancelled at once."""
    if reported and wait_until_gone(job_id, LEAVE_QUEUE_TIMEOUT_S / 2):
        return
    cancel(job_id)
    if not wait_until_gone(job_id, LEAVE_QUEUE_TIMEOUT_S / 2):
        _slurm(["scancel", "--signal=KILL", "--full", job_id], check=False)
        if not wait_until_gone(job_id, LEAVE_QUEUE_TIMEOUT_S / 2):
            message = (f"Slurm job {job_id} is still listed by squeue {LEAVE_QUEUE_TIMEOUT_S * 1.5:.0f} s after the "
                       f"run; it was cancelled, Slurm has not finished it yet")
            store.write_json_atomic(control / "still-queued.json", {"slurm_job_id": job_id, "message": message})
            print(f"scalelab: warning: {message}", file=sys.stderr)
