"""A short two-rank run of a student's DDP conversion under the probe, and what each rank did.

``run_ddp(script)`` trains the script for two short epochs on a small slice of Fashion-MNIST under
``torchrun --standalone --nproc_per_node 2``, each rank wrapped by :mod:`ddp_probe`, and returns a :class:`DDPRun`:
the ranks' records and how the run ended. Two epochs, so that a sampler whose order never changes shows. A run in
which no rank has done anything new for ``stall_s`` seconds is stopped (a conversion that hangs, for example an
all-reduce that only one rank joins), and the records say where each rank was.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .conversion_run import fresh_record_dir, probe_environment, read_records, watch_run

SIZE = 2
EPOCHS = 2
TRAIN_IMAGES = 256
VAL_IMAGES = 128
BATCH_SIZE = 32
LR = 0.01
STALL_S = 45.0
DEADLINE_S = 240.0

@dataclass
class DDPRun:
    """What a short probed run of a DDP conversion did; the questions of :mod:`ddp_questions` read it."""
    returncode: int | None                       # None: stopped by the harness
    stopped: str | None                          # why the harness stopped it, or None
    records: dict[int, dict] = field(default_factory=dict)
    tail: str = ""                               # the run's last lines, for messages
    elapsed_s: float = 0.0
    size: int = SIZE
    epochs: int = EPOCHS
    train_images: int = TRAIN_IMAGES
    batch_size: int = BATCH_SIZE
    lr: float = LR

    @property
    def finished(self) -> bool:
        return self.returncode == 0 and self.stopped is None

    def where(self) -> str:
        """Where each rank was when the run ended, in words."""
        parts = []
        for rank in range(self.size):
            record = self.records.get(rank)
            parts.append(f"rank {rank}: {record['stage'] if record else 'had not started Python'}")
        return "; ".join(parts)


def probe_command(script: Path, record_dir: Path, output_dir: Path) -> list[str]:
    from scalelab.environment import torchrun_path

    return [torchrun_path() or "torchrun", "--standalone", "--nproc_per_node", str(SIZE), "--tee", "3",
            "-m", "scalelab.grader.labchecks.ddp_probe", str(record_dir), str(script),
            "--epochs", str(EPOCHS), "--train-images", str(TRAIN_IMAGES), "--val-images", str(VAL_IMAGES),
            "--batch-size", str(BATCH_SIZE), "--lr", str(LR), "--output-dir", str(output_dir)]


def run_ddp(script: Path | str, workdir: Path | str | None = None, stall_s: float = STALL_S,
            deadline_s: float = DEADLINE_S) -> DDPRun:
    """Run ``script`` on two ranks under the probe (see the module docstring)."""
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="ddp_conversion_") as scratch:
            return run_ddp(script, scratch, stall_s, deadline_s)
    script, workdir = Path(script).resolve(), Path(workdir)
    record_dir = fresh_record_dir(workdir)
    env = probe_environment(workdir)
    output_path = workdir / "output.txt"
    started = time.monotonic()
    with open(output_path, "wb") as output:
        process = subprocess.Popen(probe_command(script, record_dir, workdir / "output"), stdin=subprocess.DEVNULL,
                                   stdout=output, stderr=subprocess.STDOUT, env=env, cwd=workdir,
                                   start_new_session=True)
        stopped = watch_run(process, record_dir, started, stall_s, deadline_s)
    text = output_path.read_text(errors="replace")
    run = DDPRun(None if stopped else process.returncode, stopped,
                 tail="\n".join(text.strip().splitlines()[-15:]), elapsed_s=time.monotonic() - started,
                 records=read_records(record_dir))
    return run
