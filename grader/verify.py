"""What the grader measures itself after a run: the held-out accuracy of the model the run saved.

The run's model is copied out of the job directory by the grader (``jobfiles``: no links, a regular file of the
run's, bounded), refused if its config names code outside Keras, and measured by ``scalelab.grader.heldout`` in
its own sandboxed process (:class:`HeldoutProcess`) on the held-out split, which the run never sees. The evidence
that all ranks trained together is ``witness``'s.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import psutil

from scalelab import data as course_data

from . import jobfiles, sandbox

MODEL_SIZE_LIMIT_BYTES = 200 << 20
HELDOUT_TIMEOUT_S = 600


@dataclasses.dataclass
class ModelCheck:
    heldout_accuracy: float | None
    reason: str | None            # why there is no accuracy (None when measured)
    trainable_variables: int | None
    images: int | None = None
    trainable_parameters: int | None = None
    accuracy_with_preprocessing: dict | None = None  # measured only below the target, for the reasons


def _modules_named(node, found: set) -> set:
    """Every ``module`` a Keras config names (Keras imports each one while loading)."""
    if isinstance(node, dict):
        if "module" in node:
            found.add(node["module"] if isinstance(node["module"], str) else repr(node["module"]))
        for value in node.values():
            _modules_named(value, found)
    elif isinstance(node, list):
        for value in node:
            _modules_named(value, found)
    return found


def model_file_problem(model_path: Path) -> str | None:
    """A reason to refuse a model file (a copy of the grader's) before anything loads it, or None.

    Keras imports any module a config names, safe mode or not; only Keras's own are let through. The compile
    settings (the optimizer, which names Horovod's module) are skipped: the measurement never compiles.
    """
    try:
        with zipfile.ZipFile(model_path) as archive:
            unpacked = sum(member.file_size for member in archive.infolist())
            if unpacked > MODEL_SIZE_LIMIT_BYTES:
                return f"the saved model unpacks to {unpacked} bytes, over the {MODEL_SIZE_LIMIT_BYTES} byte limit"
            config = json.loads(archive.read("config.json"))
    except (zipfile.BadZipFile, OSError, KeyError, ValueError, RuntimeError):
        return "the saved model.keras is not a Keras archive (corrupt, or not written by model.save)"
    if isinstance(config, dict):
        config = {key: value for key, value in config.items() if key != "compile_config"}
    foreign = sorted(module for module in _modules_named(config, set())
                     if not (module == "keras" or module.startswith("keras.")))
    if foreign:
        return (f"the saved model's configuration names the Python module(s) {', '.join(foreign)}; the grader "
                f"loads only Keras's own layers and imports nothing else. Build the model from tf.keras layers "
                f"(put preprocessing in a Rescaling or Normalization layer) and save it with model.save().")
    return None


def heldout_files(dataset: str) -> list[Path]:
    """The held-out split's files, where the grader's configuration finds them."""
    if dataset == "cifar10":
        folder = course_data.find_cifar10("test")
        names = course_data.CIFAR10_BATCHES["test"]
        if folder is not None:
            return [folder / name for name in names]
        raise course_data.DataError(f"CIFAR-10's held-out split is not available to the grader: "
                                    f"{course_data._cifar10_missing_message('test', None)}")
    names = [name for name, _ in course_data.FASHION_MNIST_FILES["test"].values()]
    for folder in course_data.fashion_mnist_dirs():
        if all((folder / name).is_file() for name in names):
            return [folder / name for name in names]
    raise course_data.DataError("Fashion-MNIST's held-out split is not available to the grader: "
                                "sudo apt-get install dataset-fashion-mnist")


class HeldoutProcess:
    """The held-out measurement of one run, in its own sandboxed process (``scalelab.grader.heldout``).

    The measuring process sees the software, the held-out split (read-only, under ``/run/scalelab/heldout``)
    and a folder into which the grader later puts its own checked copy of the model (read-only, under
    ``/run/scalelab/model``); nothing of the run, the grader or the machine beyond that. As root it runs as an
    unprivileged uid of its own. Python starts isolated (``-I``: neither the working directory nor PYTHON*
    variables reach ``sys.path``), in an empty directory.

    Importing TensorFlow is most of the measurement's time (3-5 s on 2 cores). ``start_ahead()``, called when the
    run starts, starts the process at idle priority (SCHED_IDLE: a core only when nothing else wants it), so it
    imports TensorFlow and loads the held-out split in the run's idle moments instead of after the run;
    ``measure()`` puts it back to normal priority and hands it the model. Taking a process out of SCHED_IDLE
    needs CAP_SYS_NICE (root has it, unless a container dropped it); without it the process is started by
    ``measure()``, after the run, as a plain one.
    """

    INSIDE = Path("/run/scalelab")

    def __init__(self, dataset: str, sandboxed: bool = True, explain_below: float | None = None):
        self.dataset, self.sandboxed, self.explain_below = dataset, sandboxed, explain_below
        self.waiting: subprocess.Popen | None = None
        self.private_dir = Path(tempfile.mkdtemp(prefix="scalelab-heldout-"))
        self.model_dir = self.private_dir / "model"
        self.model_dir.mkdir()
        self.model_dir.chmod(0o755)
        self.uid = None
        self.checked_model: Path | None = None  # the grader's copy of the run's model, once it passed the checks

    def _argv(self, model_argument: str) -> tuple[list[str], dict[str, str], str | None]:
        files = heldout_files(self.dataset)
        variable = "SCALELAB_CIFAR10_DIR" if self.dataset == "cifar10" else "SCALELAB_FASHION_MNIST_DIR"
        command = [sys.executable, "-I", "-m", "scalelab.grader.heldout", model_argument, self.dataset]
        if self.explain_below is not None:
            command += ["--explain-below", repr(float(self.explain_below))]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "TF_CPP_MIN_LOG_LEVEL": "2", "HOME": "/tmp",
               "KERAS_HOME": "/tmp/.keras", "MPLCONFIGDIR": "/tmp/.matplotlib", "CUDA_VISIBLE_DEVICES": ""}
        if not self.sandboxed:  # only where the instructor allowed grading without bubblewrap
            env[variable] = str(files[0].parent)
            return command, env, str(self.private_dir)
        if self.uid is None:
            self.uid = sandbox.allocate_uid()
        env[variable] = str(self.INSIDE / "heldout")
        binds = [sandbox.Bind(path, self.INSIDE / "heldout" / path.name) for path in files]
        binds.append(sandbox.Bind(self.model_dir, self.INSIDE / "model"))
        identity = self.private_dir / "etc"
        identity.mkdir(exist_ok=True)
        argv = sandbox.bwrap_argv(command, binds=binds, env=env, chdir=Path("/tmp"), private_dir=identity,
                                  uid=self.uid)
        return argv, {"PATH": "/usr/bin:/bin"}, None

    def _start(self, model_argument: str, preexec_fn=None) -> subprocess.Popen:
        argv, env, cwd = self._argv(model_argument)
        return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env, cwd=cwd or "/", preexec_fn=preexec_fn)

    def start_ahead(self) -> None:
        if self.waiting is None and may_raise_priority():
            self.waiting = self._start("-", preexec_fn=_idle_priority)

    def measure(self, job_dir: Path, relative: str, owner_uid: int | None) -> ModelCheck:
        """Copy the run's model out of ``job_dir`` (checked, see jobfiles), refuse it if its config names
        foreign code, and measure it on the held-out split in the measuring process."""
        model_copy = self.model_dir / "model.keras"
        try:
            jobfiles.copy_regular_file(job_dir, relative, model_copy, owner_uid=owner_uid,
                                       limit_bytes=MODEL_SIZE_LIMIT_BYTES)
        except jobfiles.UntrustedFile as untrusted:
            if "does not exist" in str(untrusted):
                return ModelCheck(None, "no model was saved: the run must save $SCALELAB_OUTPUT_DIR/model.keras "
                                        "from rank 0 (keep the DO-NOT-EDIT section)", None)
            return ModelCheck(None, f"the saved model was not read: {untrusted}", None)
        refused = model_file_problem(model_copy)
        if refused:
            return ModelCheck(None, refused, None)
        self.checked_model = model_copy
        inside = str(model_copy) if not self.sandboxed else str(self.INSIDE / "model" / "model.keras")
        process, self.waiting = self.waiting, None
        if process is not None and process.poll() is None and _restore_normal_priority(process.pid):
            model_line = f"{inside}\n"
        else:  # not started ahead, died meanwhile, or stuck at idle priority: a fresh process
            _stop(process)
            process, model_line = self._start(inside), ""
        try:
            stdout, stderr = process.communicate(model_line, timeout=HELDOUT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _stop(process)
            return ModelCheck(None, f"measuring the saved model took more than {HELDOUT_TIMEOUT_S} s", None)
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        if process.returncode != 0 or not lines:
            # The measuring process itself failed: the grader's problem, not the student's.
            raise RuntimeError(f"the held-out measurement failed (exit {process.returncode}): "
                               f"{stderr.strip()[-1500:]}")
        result = json.loads(lines[-1])
        return ModelCheck(result["accuracy"], result["reason"], result["trainable_variables"], result.get("images"),
                          result.get("trainable_parameters"), result.get("accuracy_with_preprocessing"))

    def close(self) -> None:
        """Stop a process started ahead that was never used, and remove the private copies."""
        process, self.waiting = self.waiting, None
        _stop(process)
        sandbox.release_uid(self.uid)
        shutil.rmtree(self.private_dir, ignore_errors=True)


def may_raise_priority() -> bool:
    """Whether this process holds CAP_SYS_NICE (bit 23 of its effective capabilities)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> 23 & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _idle_priority() -> None:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def _restore_normal_priority(pid: int) -> bool:
    """Move every thread of ``pid`` and its descendants (bubblewrap, then Python) from SCHED_IDLE to
    SCHED_OTHER; False if that was not possible."""
    # A thread started by a still-idle thread while we go through the list is idle too: go round until none is.
    for _ in range(10):
        try:
            family = [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]
        except psutil.Error:
            return False
        idle = []
        for member in family:
            try:
                idle += [int(tid) for tid in os.listdir(f"/proc/{member}/task")
                         if os.sched_getscheduler(int(tid)) == os.SCHED_IDLE]
            except (FileNotFoundError, ProcessLookupError):
                continue  # ended meanwhile
        if not idle:
            return True
        for tid in idle:
            try:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            except ProcessLookupError:
                continue  # the thread ended meanwhile
            except PermissionError:
                return False
    return False


def _stop(process: subprocess.Popen | None) -> None:
    if process is not None and process.poll() is None:
        process.kill()
    if process is not None:
        process.communicate()
