"""Starting the measured programs: one environment for all of them, wall time from outside, logs kept."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from scalelab.environment import horovodrun_path, openmpi_settings

SOURCE_CODE = Path(__file__).resolve().parents[1]
COURSE_ROOT = SOURCE_CODE.parent
BENCHMARKS = Path(__file__).resolve().parent


RANK_PREFIX = re.compile(r"^\[[\d,]+\]<std(?:out|err)>:")


class BenchmarkError(RuntimeError):
    """A measured program failed; the message names it and ends with its output."""


@dataclass
class Finished:
    wall_s: float
    output: str
    exit_code: int


def environment(**extra: str) -> dict[str, str]:
    """The environment every measured program gets: the caller's, with the quiet and root-safe settings the
    course uses (so a benchmark does not fail where ``make test`` works)."""
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    # As the Makefile: Open MPI's idle threads sleep rather than spin on a core the ranks' TensorFlow needs, and
    # large allreduces use the course's collective rules.
    env.update(openmpi_settings(env))
    env.setdefault("PYTHONUNBUFFERED", "1")
    # The venv's commands first, as in an activated venv: nbgrader's gradebook runs `alembic` from PATH.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def horovodrun(np: int, controller: str = "gloo") -> list[str]:
    """``horovodrun -np N --gloo|--mpi``, then the Python of this venv (the ranks must import the same stack)."""
    runner = horovodrun_path()
    if runner is None:
        raise BenchmarkError("horovodrun is not installed: run `make setup`")
    return [runner, "-np", str(np), f"--{controller}", sys.executable]


def run(argv: list[str], log: Path, *, env: dict | None = None, cwd: Path | None = None,
        timeout_s: float = 600, ok_exit_codes=(0,)) -> Finished:
    """Run ``argv`` to the end, its output (stdout and stderr together) saved to ``log``; raise if it exits
    with a code not in ``ok_exit_codes``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    # Its own session, so a run over time is ended with all its processes (horovodrun's ranks included).
    process = subprocess.Popen(argv, env=env or environment(), cwd=cwd, stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        log.write_text(output or "")
        raise BenchmarkError(f"{' '.join(map(str, argv))} ran over {timeout_s:.0f} s; log {log}") from None
    wall_s = time.perf_counter() - started
    log.write_text(output)
    if process.returncode not in ok_exit_codes:
        raise BenchmarkError(f"{' '.join(map(str, argv))} exited with {process.returncode}; log {log}:\n"
                             f"{first_error(output)}{output[-2000:]}")
    return Finished(wall_s, output, process.returncode)


def first_error(output: str) -> str:
    """The first Python traceback in ``output`` (a rank's, under horovodrun), with a separator after it; or ''.

    horovodrun's own traceback ends the output and only says that a rank failed; the rank's error is earlier.
    """
    start = output.find("Traceback (most recent call last)")
    if start < 0:
        return ""
    lines = output[start:].splitlines()
    # The traceback ends at its first unindented line after the header (the exception itself), once the
    # rank prefix horovodrun adds ("[0]<stderr>:", "[1,0]<stderr>:") is set aside.
    bodies = [RANK_PREFIX.sub("", line) for line in lines]
    end = next((i for i, body in enumerate(bodies[1:], 1) if body and not body[0].isspace()), len(lines) - 1)
    return "\n".join(lines[:end + 1])[-3000:] + "\n...\n"

