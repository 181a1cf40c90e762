"""Shared test settings: where the real data sets are, and the project's tools."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import psutil
import pytest

from scalelab.environment import KERAS_LEFT_OUT

PROJECT_ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent

# The PyTorch edition (`make setup` on Python 3.12 or 3.13) has no TensorFlow: the tests of the Keras labs and tracks
# are skipped there with the reason, which the summary counts and names (`make test` runs pytest with -rs).
HAS_TENSORFLOW = importlib.util.find_spec("tensorflow") is not None
# The local version label setup.sh gives the Horovod it builds with containers/patches/ applied (0.28.1+LABEL).
HOROVOD_BUILD_LABEL = re.search(r'horovod_build="\$horovod_version\+([\w.]+)"',
                                (PROJECT_ROOT / "containers" / "setup.sh").read_text()).group(1)
keras_only = pytest.mark.skipif(not HAS_TENSORFLOW, reason=KERAS_LEFT_OUT)
# The installed edition's quick test track (tests/submissions/tracks.toml), for the tests of the service around the
# grader: the PyTorch edition refuses a Keras track. Both have the same target and budget.
EDITION_TEST_TRACK = "fashion-mnist-test" if HAS_TENSORFLOW else "fashion-mnist-ddp-test"
# Its track with a 12 s budget, and a submission that hangs in its first allreduce until the budget ends.
EDITION_HANG_TRACK = "fashion-mnist-hang" if HAS_TENSORFLOW else "fashion-mnist-ddp-hang"
EDITION_HANG_SUBMISSION = "hang_allreduce.py" if HAS_TENSORFLOW else "hang_allreduce_ddp.py"
# A small honest submission for its test track: it reaches the target in a minute or so.
EDITION_HONEST_SUBMISSION = "honest_small.py" if HAS_TENSORFLOW else "ddp_small.py"


def needs_tensorflow() -> None:
    """Skips the calling test module on the PyTorch edition; called before it imports anything that needs TensorFlow."""
    if not HAS_TENSORFLOW:
        pytest.skip(KERAS_LEFT_OUT, allow_module_level=True)


@pytest.fixture(scope="session")
def cifar10_dir() -> Path:
    """The CIFAR-10 directory given by configuration (the Makefile passes the shared real subset)."""
    configured = os.environ.get("SCALELAB_CIFAR10_DIR")
    if not configured:
        pytest.fail("SCALELAB_CIFAR10_DIR is not set: run the tests through `make test`, or point it at a "
                    "directory holding cifar-10-batches-py")
    return Path(configured)


@pytest.fixture(scope="session")
def horovodrun() -> str:
    path = VENV_BIN / "horovodrun"
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make setup`")
    return str(path)


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a child process: ours, plus what mpirun needs as root, plus ``extra``."""
    env = dict(os.environ)
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def leftover_processes(marker: str, uid: int | None = None) -> list[str]:
    """Processes of a finished run: its sandbox uid, or a marker (e.g. the test's directory) in the command line."""
    found = []
    for process in psutil.process_iter(["uids", "cmdline"]):
        try:
            process_uid = process.info["uids"].real if process.info["uids"] else None
            command = " ".join(process.info["cmdline"] or [])
        except psutil.Error:
            continue
        if (uid is not None and process_uid == uid) or marker in command:
            found.append(f"{process.pid} {command[:120]}")
    return found
