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
import select
import shutil
import subprocess
import sys
import tempfile
import time
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
    A ``.pt2`` (torch.export) archive is checked for its size unpacked only: it is loaded in the sandbox alone.
    """
    if Path(model_path).suffix == ".pt2":
        try:
            with zipfile.ZipFile(model_path) as archive:
                unpacked = sum(member.file_size for member in archive.infolist())
        except (zipfile.BadZipFile, OSError, RuntimeError):
            return "the saved model.pt2 is not a torch.export archive (corrupt, or not written by torch.export.save)"
        if unpacked > MODEL_SIZE_LIMIT_BYTES:
            return f"the saved model unpacks to {unpacked} bytes, over the {MODEL_SIZE_LIMIT_BYTES} byte limit"
        return None
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
    """The held-out measurements of one run, in one sandboxed process (``scalelab.grader.heldout -``) that lives
    as long as the run's grading: TensorFlow is imported and the held-out split loaded once, then each model the
    grader hands it (every snapshot as it arrives, then the final model) is measured in turn.

    The measuring process sees the software, the held-out split (read-only, under ``/run/scalelab/heldout``)
    and a folder into which the grader puts its own checked copies of the models (read-only, under
    ``/run/scalelab/model``); nothing of the run, the grader or the machine beyond that. As root it runs as an
    unprivileged uid of its own. Python starts isolated (``-I``: neither the working directory nor PYTHON*
    variables reach ``sys.path``), in an empty directory.

    ``start_ahead()``, called when the run starts, starts it at idle priority (SCHED_IDLE: a core only when
    nothing else wants it; where the grader may not raise it again, at nice 19), so that importing TensorFlow and
    measuring snapshots take no CPU from the run; ``normal_priority()`` puts it back once the run is over.
    """

    INSIDE = Path("/run/scalelab")

    def __init__(self, dataset: str, sandboxed: bool = True, explain_below: float | None = None,
                 framework: str = "keras"):
        self.dataset, self.sandboxed, self.explain_below = dataset, sandboxed, explain_below
        self.framework = framework
        self.process: subprocess.Popen | None = None
        self.at_low_priority = False
        self._answer_buffer = b""
        self.private_dir = Path(tempfile.mkdtemp(prefix="scalelab-heldout-"))
        self.model_dir = self.private_dir / "model"
        self.model_dir.mkdir()
        self.model_dir.chmod(0o755)
        self.uid = None
        self.checked_model: Path | None = None  # the grader's copy of the run's model, once it passed the checks

    def _argv(self) -> tuple[list[str], dict[str, str], str | None]:
        files = heldout_files(self.dataset)
        variable = "SCALELAB_CIFAR10_DIR" if self.dataset == "cifar10" else "SCALELAB_FASHION_MNIST_DIR"
        command = [sys.executable, "-I", "-m", "scalelab.grader.heldout", "-", self.dataset,
                   "--framework", self.framework]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "TF_CPP_MIN_LOG_LEVEL": "2", "HOME": "/tmp",
               "KERAS_HOME": "/tmp/.keras", "MPLCONFIGDIR": "/tmp/.matplotlib", "CUDA_VISIBLE_DEVICES": ""}
        if not self.sandboxed:  # only where the instructor allowed grading without bubblewrap
            env[variable] = str(files[0].parent)
            env["TMPDIR"] = str(self.private_dir)  # removed by close(), whatever the process left there
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

    def _start(self, low_priority: bool) -> subprocess.Popen:
        argv, env, cwd = self._argv()
        if low_priority:
            preexec, self.at_low_priority = (_idle_priority if may_raise_priority() else _lowest_nice), True
        else:
            preexec, self.at_low_priority = None, False
        self._answer_buffer = b""
        # Its stderr goes to a file: TensorFlow's warnings must never fill a pipe nobody reads while it waits.
        with open(self.private_dir / "measuring.log", "ab") as log:
            return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                                    cwd=cwd or "/", preexec_fn=preexec)

    def start_ahead(self) -> None:
        if self.process is None:
            self.process = self._start(low_priority=True)

    def normal_priority(self) -> None:
        """Give the measuring process normal priority again (the run is over); a process that cannot be raised
        stays as it is: it is alone then, and only slower on a busy machine."""
        if self.process is not None and self.at_low_priority and self.process.poll() is None:
            if may_raise_priority() and _restore_normal_priority(self.process.pid):
                self.at_low_priority = False

    def _ask(self, model_name: str, explain_below: float | None, timeout_s: float) -> dict:
        """Have the measuring process measure ``model_dir/model_name``; its JSON answer. A process that died
        is started again (once); one that does not answer in time is stopped."""
        inside = self.model_dir if not self.sandboxed else self.INSIDE / "model"
        request = json.dumps({"model": str(inside / model_name), "explain_below": explain_below}) + "\n"
        if self.process is None or self.process.poll() is not None:
            _stop(self.process)
            self.process = self._start(low_priority=False)
        try:
            self.process.stdin.write(request.encode())
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # it died meanwhile: said below, with its log
        deadline = time.monotonic() + timeout_s
        while True:
            line, newline, rest = self._answer_buffer.partition(b"\n")
            if newline:
                self._answer_buffer = rest
                if line.startswith(b"{"):
                    return json.loads(line)
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                _stop(self.process)
                self.process = None
                raise MeasurementTimeout(f"measuring a saved model took more than {timeout_s:.0f} s")
            ready, _, _ = select.select([self.process.stdout], [], [], min(remaining, 1.0))
            if ready:
                chunk = os.read(self.process.stdout.fileno(), 1 << 16)
                if not chunk:  # the measuring process itself failed: the grader's problem, not the student's
                    code = self.process.wait()
                    self.process = None
                    log = (self.private_dir / "measuring.log").read_text(errors="replace").strip()[-1500:]
                    raise RuntimeError(f"the held-out measurement failed (exit {code}): {log}")
                self._answer_buffer += chunk

    def _check(self, answer: dict) -> ModelCheck:
        return ModelCheck(answer["accuracy"], answer["reason"], answer["trainable_variables"], answer.get("images"),
                          answer.get("trainable_parameters"), answer.get("accuracy_with_preprocessing"))

    def measure_copy(self, model: Path, explain: bool = False, timeout_s: float = HELDOUT_TIMEOUT_S) -> ModelCheck:
        """Measure one of the grader's own files (a snapshot it copied under the job-file rules): a copy of it is
        handed to the measuring process, refused first if its config names foreign code."""
        copy = self.model_dir / f"measured-{Path(model).name}"
        shutil.copyfile(model, copy)
        copy.chmod(0o644)
        try:
            refused = model_file_problem(copy)
            if refused:
                return ModelCheck(None, refused, None)
            return self._check(self._ask(copy.name, self.explain_below if explain else None, timeout_s))
        finally:
            copy.unlink(missing_ok=True)

    def measure(self, job_dir: Path, relative: str, owner_uid: int | None) -> ModelCheck:
        """Copy the run's model out of ``job_dir`` (checked, see jobfiles), refuse it if its config names
        foreign code, and measure it on the held-out split in the measuring process."""
        model_copy = self.model_dir / Path(relative).name
        try:
            jobfiles.copy_regular_file(job_dir, relative, model_copy, owner_uid=owner_uid,
                                       limit_bytes=MODEL_SIZE_LIMIT_BYTES)
        except jobfiles.UntrustedFile as untrusted:
            if "does not exist" in str(untrusted):
                return ModelCheck(None, f"no model was saved: the run must save $SCALELAB_OUTPUT_DIR/"
                                        f"{Path(relative).name} from rank 0 (keep the DO-NOT-EDIT section)", None)
            return ModelCheck(None, f"the saved model was not read: {untrusted}", None)
        refused = model_file_problem(model_copy)
        if refused:
            return ModelCheck(None, refused, None)
        self.checked_model = model_copy
        self.normal_priority()
        try:
            return self._check(self._ask(model_copy.name, self.explain_below, HELDOUT_TIMEOUT_S))
        except MeasurementTimeout as timeout:
            return ModelCheck(None, str(timeout), None)

    def close(self) -> None:
        """Stop the measuring process and remove the private copies."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            try:
                process.stdin.close()  # end of requests: it ends by itself
                process.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        _stop(process)
        sandbox.release_uid(self.uid)
        shutil.rmtree(self.private_dir, ignore_errors=True)


class MeasurementTimeout(RuntimeError):
    """The measuring process did not answer in time (it was stopped)."""


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


def _lowest_nice() -> None:
    os.setpriority(os.PRIO_PROCESS, 0, 19)


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
    if process is None:
        return
    if process.poll() is None:
        process.kill()
    process.wait()
    for stream in (process.stdin, process.stdout):
        if stream is not None and not stream.closed:
            try:
                stream.close()
            except OSError:
                pass
