"""A short two-rank run of a student's lab-3 conversion under the probe, and what each rank did.

``run_conversion(script)`` trains the script for one short epoch on a small slice of Fashion-MNIST under
``horovodrun -np 2``, each rank wrapped by :mod:`conversion_probe`, and returns a :class:`ConversionRun`: the
ranks' records, what each rank printed, and how the run ended. A run in which no rank has done anything new for
``stall_s`` seconds is stopped (a conversion that hangs, for example a broadcast that only one rank joins), and the
records say where each rank was.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

SIZE = 2
TRAIN_IMAGES = 384
VAL_IMAGES = 128
BATCH_SIZE = 32
BASE_LR = 0.01
STALL_S = 45.0
DEADLINE_S = 240.0
RANK_LINE = re.compile(r"^\[(?:\d+,)?(\d+)\]<(stdout|stderr)>:(.*)$")


@dataclass
class ConversionRun:
    """What a short probed run of a conversion did; the questions of :mod:`conversion_questions` read it."""
    returncode: int | None                       # None: stopped by the harness
    stopped: str | None                          # why the harness stopped it, or None
    records: dict[int, dict] = field(default_factory=dict)
    printed: dict[int, list[str]] = field(default_factory=dict)   # rank -> the lines it wrote to stdout
    errors: dict[int, list[str]] = field(default_factory=dict)    # rank -> its last stderr lines
    tail: str = ""                               # the run's last lines, for messages
    elapsed_s: float = 0.0
    size: int = SIZE
    train_images: int = TRAIN_IMAGES
    batch_size: int = BATCH_SIZE
    base_lr: float = BASE_LR

    @property
    def finished(self) -> bool:
        return self.returncode == 0 and self.stopped is None

    def where(self) -> str:
        """Where each rank was when the run ended, in words."""
        parts = []
        for rank in range(self.size):
            record = self.records.get(rank)
            stage = record["stage"] if record else "had not started Python"
            parts.append(f"rank {rank}: {stage}")
        return "; ".join(parts)


def probe_command(script: Path, record_dir: Path, output_dir: Path, controller: str) -> list[str]:
    from scalelab.environment import horovodrun_path

    return [horovodrun_path() or "horovodrun", "-np", str(SIZE), controller, sys.executable, "-m",
            "scalelab.grader.labchecks.conversion_probe", str(record_dir), str(script),
            "--epochs", "1", "--train-images", str(TRAIN_IMAGES), "--val-images", str(VAL_IMAGES),
            "--batch-size", str(BATCH_SIZE), "--base-lr", str(BASE_LR), "--warmup-epochs", "0",
            "--output-dir", str(output_dir)]


def _latest_change(record_dir: Path) -> float | None:
    times = [path.stat().st_mtime for path in record_dir.glob("rank*.json")]
    return max(times) if times else None


def _stop(process: subprocess.Popen) -> None:
    for signum, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def fresh_record_dir(workdir: Path) -> Path:
    """The folder the probe's ranks write their records to, emptied of an earlier run's."""
    record_dir = workdir / "records"
    record_dir.mkdir(parents=True, exist_ok=True)
    for stale in record_dir.iterdir():
        stale.unlink()
    return record_dir


def read_records(record_dir: Path) -> dict[int, dict]:
    """Each rank's record, for the ranks that wrote one."""
    paths = {rank: record_dir / f"rank{rank}.json" for rank in range(SIZE)}
    return {rank: json.loads(path.read_text()) for rank, path in paths.items() if path.is_file()}


def probe_environment(workdir: Path, **settings: str) -> dict[str, str]:
    """The probed run's environment: this Python's launchers first on PATH, output unbuffered, outside nbgrader's
    execution, and a temporary folder (TMPDIR) inside its scratch folder, so that what its ranks leave there
    (TensorFlow's autograph sources when a rank is stopped, torchrun's folder after every run) goes with it."""
    temp_dir = workdir / "tmp"
    temp_dir.mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(temp_dir),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", **settings)
    env.pop("NBGRADER_EXECUTION", None)
    return env


def watch_run(process: subprocess.Popen, record_dir: Path, started: float, stall_s: float,
              deadline_s: float) -> str | None:
    """Wait for the probed run to end; stop it when no rank records anything new for ``stall_s`` or it outlasts
    ``deadline_s``, and say which (None: it ended by itself). Its end is seen at once, the rest every half second."""
    while True:
        try:
            process.wait(timeout=0.5)
            return None
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        changed = _latest_change(record_dir)
        quiet_for = time.time() - changed if changed is not None else now - started
        stopped = None
        if quiet_for > stall_s:
            stopped = f"no rank did anything new for {stall_s:.0f} s"
        elif now - started > deadline_s:
            stopped = f"the run took longer than {deadline_s:.0f} s"
        if stopped:
            _stop(process)
            return stopped


def split_by_rank(output: str) -> tuple[dict[int, list[str]], dict[int, list[str]]]:
    printed: dict[int, list[str]] = {}
    errors: dict[int, list[str]] = {}
    for line in output.splitlines():
        match = RANK_LINE.match(line)
        if match:
            rank, stream, text = int(match[1]), match[2], match[3]
            (printed if stream == "stdout" else errors).setdefault(rank, []).append(text)
    return printed, {rank: lines[-20:] for rank, lines in errors.items()}


def run_conversion(script: Path | str, workdir: Path | str | None = None, controller: str = "--gloo",
                   stall_s: float = STALL_S, deadline_s: float = DEADLINE_S) -> ConversionRun:
    """Run ``script`` on two ranks under the probe (see the module docstring)."""
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="conversion_") as scratch:
            return run_conversion(script, scratch, controller, stall_s, deadline_s)
    script, workdir = Path(script).resolve(), Path(workdir)
    record_dir = fresh_record_dir(workdir)
    env = probe_environment(workdir, TF_CPP_MIN_LOG_LEVEL="2")
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    output_path = workdir / "output.txt"
    started = time.monotonic()
    with open(output_path, "wb") as output:
        process = subprocess.Popen(probe_command(script, record_dir, workdir / "output", controller),
                                   stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT, env=env,
                                   cwd=workdir, start_new_session=True)
        stopped = watch_run(process, record_dir, started, stall_s, deadline_s)
    text = output_path.read_text(errors="replace")
    printed, errors = split_by_rank(text)
    run = ConversionRun(None if stopped else process.returncode, stopped, printed=printed, errors=errors,
                        tail="\n".join(text.strip().splitlines()[-15:]), elapsed_s=time.monotonic() - started,
                        records=read_records(record_dir))
    return run


def script_digest(script: Path | str) -> str:
    return hashlib.sha256(Path(script).read_bytes()).hexdigest()
