"""Inside a Slurm allocation: run one grader job exactly as the local backend does, and report through files.

The batch script that ``grader/slurm.py`` submits ends in ``python -m scalelab.grader.slurm_runner CONTROL_DIR``.
This runner is the grader's own code (it runs outside the sandbox, as the grader's user): it loads the
:class:`~scalelab.grader.launch.JobSpec` the grader wrote, and calls :func:`launch.run_local` on it, so the
sandbox, the limits, the capped per-rank logs and the watch on the budget are the local backend's, unchanged.

The control directory (``logs/slurm`` of the run) lies outside the sandbox, like the rest of the logs, so the
submission cannot forge anything in it:

    job.json        the JobSpec (written by the grader before sbatch)
    started         written just before the sandbox starts (the grader's clock for scancel starts when it sees it)
    progress.json   what run_local reports every 2 s (epochs seen, latest accuracy, checkpoint time)
    result.json     the RunResult, and whether the job was cancelled (scancel or Slurm's time limit)
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import sys
import threading
from pathlib import Path

import psutil

from . import launch, store

JOB_FILE, STARTED_FILE, PROGRESS_FILE, RESULT_FILE = "job.json", "started", "progress.json", "result.json"
# After scancel's SIGTERM, how long the job gets before SIGKILL: well inside Slurm's KillWait (5 s in
# containers/slurm/start.sh, 30 s by default), so the runner still writes result.json before Slurm kills it.
CANCEL_KILL_AFTER_S = 2.0
# The grader outside scancels at budget + grace; run_local's own watch stops the run this much later, so it only
# acts when the grader cannot (gone, or cut off from slurmctld) and Slurm's --time is further still.
BACKSTOP_AFTER_GRADER_S = 10.0
# Variables Slurm sets for the allocation that the submission's environment needs (GPUs granted by --gres).
ALLOCATION_VARIABLES = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
_PATH_FIELDS = ("job_dir", "logs_dir", "output_dir")
_PATH_LIST_FIELDS = ("hidden_paths", "device_paths")


def job_to_json(job: launch.JobSpec) -> str:
    return json.dumps(dataclasses.asdict(job), default=str, indent=1)


def job_from_json(text: str) -> launch.JobSpec:
    fields = json.loads(text)
    for name in _PATH_FIELDS:
        fields[name] = Path(fields[name])
    for name in _PATH_LIST_FIELDS:
        fields[name] = [Path(p) for p in fields[name]]
    if fields.get("snapshots_dir") is not None:
        fields["snapshots_dir"] = Path(fields["snapshots_dir"])
    return launch.JobSpec(**fields)


def adapt_to_node(job: launch.JobSpec, environ=os.environ) -> launch.JobSpec:
    """The JobSpec as this compute node needs it: its own GPU devices and the GPUs Slurm granted, and a budget
    watch that leaves stopping the run to the grader's scancel."""
    env = dict(job.env)
    for name in ALLOCATION_VARIABLES:
        if name in environ:
            env[name] = environ[name]
    return dataclasses.replace(job, env=env, device_paths=launch.gpu_device_paths(),
                               grace_s=job.grace_s + BACKSTOP_AFTER_GRADER_S)


def _stop_children(job: launch.JobSpec, signum: int) -> None:
    # run_local started the sandbox as our only child, in its own session (session id = its pid).
    for child in psutil.Process().children():
        launch._signal_job(child, job, signum)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m scalelab.grader.slurm_runner CONTROL_DIR", file=sys.stderr)
        return 2
    control = Path(argv[0])
    job = adapt_to_node(job_from_json((control / JOB_FILE).read_text()))
    cancelled = threading.Event()

    def on_cancel(signum, _frame):
        # scancel (or Slurm's time limit) sends SIGTERM to every process of the job; pass it on to the sandbox
        # in case it missed it, escalate to SIGKILL shortly after, and let run_local finish its report.
        if not cancelled.is_set():
            cancelled.set()
            _stop_children(job, signal.SIGTERM)
            escalate = threading.Timer(CANCEL_KILL_AFTER_S, _stop_children, args=(job, signal.SIGKILL))
            escalate.daemon = True  # once result.json is written nothing is left to kill: exit without waiting
            escalate.start()

    signal.signal(signal.SIGTERM, on_cancel)
    signal.signal(signal.SIGINT, on_cancel)
    store.write_json_atomic(control / STARTED_FILE, {"node": socket.gethostname(),
                                                    "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                                                    "started_at": launch.utc_now()})
    # No cgroup of our own: it would take the run out of Slurm's, whose --mem limit and tracking are the cluster's.
    run = launch.run_local(job, on_progress=lambda state: store.write_json_atomic(control / PROGRESS_FILE, state),
                           memory_cgroup=False)
    store.write_json_atomic(control / RESULT_FILE, {"run": run.as_dict(), "cancelled": cancelled.is_set(),
                                                   "node": socket.gethostname()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
