"""What this machine runs: versions, Horovod's build, MPI, CPUs, GPUs and data sets.

``describe()`` is cheap (no TensorFlow import) and goes into every verdict; ``horovod_build()`` runs
``horovodrun --check-build`` and ``gpus()`` asks ``nvidia-smi``, for ``scalelab doctor``.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from . import data
from .runtime import usable_cores


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def tensorflow_version() -> str | None:
    for distribution in ("tensorflow-cpu", "tensorflow", "tensorflow-gpu"):
        version = package_version(distribution)
        if version:
            return version
    return None


# The one sentence for what the PyTorch edition leaves out: said by `scalelab doctor` and by every test it skips.
KERAS_LEFT_OUT = ("the Keras labs and tracks need TensorFlow 2.15.1, which has wheels for Python 3.10 and 3.11 only "
                  "and is not installed here (the PyTorch edition)")


def edition() -> str | None:
    """What `make setup` installed: "all" (TensorFlow, hence the Keras labs and tracks, and PyTorch), "keras" (a base
    image's TensorFlow and Horovod alone), "pytorch" (the PyTorch edition: no TensorFlow) or None (neither)."""
    if tensorflow_version():
        return "all" if package_version("torch") else "keras"
    return "pytorch" if package_version("torch") else None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def gpus() -> list[str]:
    """GPU names from ``nvidia-smi`` (empty without an NVIDIA driver)."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        listing = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in listing.stdout.splitlines() if line.strip()] if listing.returncode == 0 else []


# The course's scripts the labs run, next to the library in a checkout (source_code/); a shared install (the Hub's
# venv) has only the library, and the operator's SCALELAB_SOURCE_DIR names where the scripts are.
COURSE_SCRIPTS = ("fashion_mnist.py", "fashion_mnist_pytorch.py", "cifar10_ladder.py")


def course_source_dir(environ: dict[str, str] | None = None) -> Path:
    """The folder that holds the course's scripts (:data:`COURSE_SCRIPTS`); a clear error where there is none."""
    environ = os.environ if environ is None else environ
    named = environ.get("SCALELAB_SOURCE_DIR")
    folder = Path(named) if named else Path(__file__).resolve().parents[1]
    missing = [name for name in COURSE_SCRIPTS if not (folder / name).is_file()]
    if missing:
        where = f"SCALELAB_SOURCE_DIR={named}" if named else f"{folder}, beside the installed scalelab package,"
        raise FileNotFoundError(f"the course's scripts are not in {where} (missing: {', '.join(missing)}): set "
                                "SCALELAB_SOURCE_DIR to the course's source_code folder")
    return folder


def horovodrun_path() -> str | None:
    beside_python = Path(sys.executable).with_name("horovodrun")
    return str(beside_python) if beside_python.exists() else shutil.which("horovodrun")


def torchrun_path() -> str | None:
    beside_python = Path(sys.executable).with_name("torchrun")
    return str(beside_python) if beside_python.exists() else shutil.which("torchrun")


def horovod_build() -> dict[str, bool] | None:
    """Which frameworks, controllers and tensor operations Horovod was built with (None: no horovodrun)."""
    horovodrun = horovodrun_path()
    if horovodrun is None:
        return None
    check = subprocess.run([horovodrun, "--check-build"], capture_output=True, text=True, timeout=120)
    return {name: bool(re.search(rf"\[X\] {re.escape(name)}\b", check.stdout))
            for name in ("TensorFlow", "PyTorch", "MPI", "Gloo", "NCCL")}


# Open MPI settings for every `horovodrun --mpi` of the course (the Makefile and the containers export the same).
OPENMPI_COLLECTIVE_RULES = Path(__file__).with_name("openmpi-collective-rules.conf")
RULES_SWITCH = "OMPI_MCA_coll_tuned_use_dynamic_rules"
RULES_FILE = "OMPI_MCA_coll_tuned_dynamic_rules_filename"


def openmpi_settings(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The course's Open MPI settings, each one the caller's environment sets taken from there instead.

    Waiting threads sleep rather than spin on a core TensorFlow needs (Horovod's background thread waits every
    cycle), and large allreduces use the segmented ring (see openmpi-collective-rules.conf).
    """
    environ = os.environ if environ is None else environ
    course = {"OMPI_MCA_mpi_yield_when_idle": "1", RULES_SWITCH: "1", RULES_FILE: str(OPENMPI_COLLECTIVE_RULES)}
    return {name: environ.get(name, value) for name, value in course.items()}


def openmpi_rules(environ: dict[str, str] | None = None) -> tuple[str, str | None]:
    """What Open MPI's collective tuning will be under ``environ``, and a problem to report (or None).

    Open MPI says nothing when the rules file is missing or switched off; it silently uses its fixed decisions.
    """
    environ = os.environ if environ is None else environ
    path = environ.get(RULES_FILE)
    if not path:
        return "Open MPI's fixed decisions (no rules file set)", None
    if environ.get(RULES_SWITCH) != "1":
        return f"Open MPI's fixed decisions ({RULES_SWITCH} is not 1, so {path} is not read)", None
    if not Path(path).is_file():
        return f"{path} (missing)", (f"{RULES_FILE} names {path}, which does not exist: Open MPI silently "
                                     f"ignores it; point it at {OPENMPI_COLLECTIVE_RULES}.")
    return path, None


def mpi_implementation() -> str | None:
    if not shutil.which("mpirun"):
        return None
    try:
        version = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    first_line = (version.stdout or version.stderr).strip().splitlines()
    return first_line[0] if first_line else None


def datasets() -> dict[str, str | None]:
    """Where each data set's training split would be loaded from (None: not available offline)."""
    fashion = next((str(d) for d in data.fashion_mnist_dirs() if data.fashion_mnist_available(d)), None)
    cifar = data.find_cifar10("train")
    return {"fashion-mnist": fashion, "cifar10": str(cifar) if cifar else None}


def describe() -> dict:
    """The environment recorded in verdicts and benchmark reports."""
    return {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "tensorflow": tensorflow_version(),
        "torch": package_version("torch"),
        "horovod": package_version("horovod"),
        "cpu_model": cpu_model(),
        "cpu_count": usable_cores(),
        "platform": platform.platform(),
    }
