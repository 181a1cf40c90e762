"""`scalelab doctor` reports the real stack and names each missing piece."""

from __future__ import annotations

import re
import subprocess

from conftest import HAS_TENSORFLOW, HOROVOD_BUILD_LABEL, VENV_BIN, subprocess_env
from scalelab.environment import KERAS_LEFT_OUT, OPENMPI_COLLECTIVE_RULES, openmpi_settings


def _doctor(**env):
    return subprocess.run([str(VENV_BIN / "scalelab"), "doctor"], capture_output=True, text=True, timeout=300,
                          env=subprocess_env(**{**openmpi_settings({}), **env}))


def test_doctor_reports_the_pinned_stack_and_horovod_build(cifar10_dir, tmp_path):
    result = _doctor(SCALELAB_CIFAR10_DIR=str(cifar10_dir), KERAS_HOME=str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout.splitlines()
    if HAS_TENSORFLOW:
        assert "tensorflow      2.15.1" in out
        assert "torch           2.13.0+cpu" in out
        assert "horovod build   TensorFlow yes  PyTorch yes  MPI yes  Gloo yes  NCCL no" in out
    else:  # the PyTorch edition: PyPI's default build of torch where PyTorch's CPU index is out of reach
        assert f"edition         PyTorch only: {KERAS_LEFT_OUT}" in out
        assert "tensorflow      not installed" in out
        assert any(re.fullmatch(r"torch           2\.13\.0(\+cpu)?", line) for line in out), out
        assert "horovod build   TensorFlow no  PyTorch yes  MPI yes  Gloo yes  NCCL no" in out
    assert f"horovod         0.28.1+{HOROVOD_BUILD_LABEL}" in out  # the build with containers/patches/ applied
    assert "Open MPI" in result.stdout
    assert f"mpi rules       {OPENMPI_COLLECTIVE_RULES}" in out
    assert f"data cifar10    {cifar10_dir}/cifar-10-batches-py" in result.stdout
    assert "data fashion-mnist /usr/share/datasets/fashion-mnist" in result.stdout
    assert "everything the course needs is here" in result.stdout


def test_doctor_fails_with_one_line_per_missing_piece(tmp_path):
    moved_rules = tmp_path / "moved.conf"
    result = _doctor(SCALELAB_CIFAR10_DIR=str(tmp_path / "nowhere"), KERAS_HOME=str(tmp_path),
                     OMPI_MCA_coll_tuned_dynamic_rules_filename=str(moved_rules))
    assert result.returncode == 1
    assert "data cifar10    missing" in result.stdout
    assert f"mpi rules       {moved_rules} (missing)" in result.stdout
    problems = [line for line in result.stderr.splitlines() if line.startswith("problem: ")]
    assert problems == [
        f"problem: OMPI_MCA_coll_tuned_dynamic_rules_filename names {moved_rules}, which does not exist: Open MPI "
        f"silently ignores it; point it at {OPENMPI_COLLECTIVE_RULES}.",
        "problem: CIFAR-10 is not available offline: set SCALELAB_CIFAR10_DIR to a directory "
        "holding cifar-10-batches-py (or let the first run download it)."]


def test_doctor_names_a_horovod_built_without_pytorch_where_torch_is_installed(monkeypatch, capsys):
    from scalelab import cli, environment

    built_for_tensorflow_only = {"TensorFlow": True, "PyTorch": False, "MPI": True, "Gloo": True, "NCCL": False}
    monkeypatch.setattr(environment, "horovod_build", lambda: built_for_tensorflow_only)
    assert cli.doctor(None) == cli.EXIT_PROBLEMS
    out, err = capsys.readouterr()
    assert "horovod build   TensorFlow yes  PyTorch no  MPI yes  Gloo yes  NCCL no" in out.splitlines()
    torch_version = environment.package_version("torch")
    assert f"problem: torch {torch_version} is installed but Horovod was built without PyTorch: pip uninstall " \
           "horovod, then `make setup`." in err.splitlines()


def test_doctor_on_the_pytorch_edition_says_what_it_leaves_out_and_asks_for_no_tensorflow(monkeypatch, capsys):
    from scalelab import cli, environment

    # What a Python 3.13 host has after `make setup`: PyTorch, and Horovod built for it alone.
    monkeypatch.setattr(environment, "tensorflow_version", lambda: None)
    monkeypatch.setattr(environment, "horovod_build", lambda: {"TensorFlow": False, "PyTorch": True, "MPI": True,
                                                                "Gloo": True, "NCCL": False})
    cli.doctor(None)
    out, err = capsys.readouterr()
    assert environment.edition() == "pytorch"
    assert f"edition         PyTorch only: {environment.KERAS_LEFT_OUT}" in out.splitlines()
    assert "tensorflow      not installed" in out.splitlines()
    assert not any("TensorFlow" in line for line in err.splitlines()), err


def test_the_pytorch_edition_warns_of_no_keras_track_it_could_neither_grade_nor_recalibrate(monkeypatch):
    from scalelab import cli, environment
    from scalelab.grader import grading, spec

    # A machine unlike every calibrated track's: each calibrated track is worth a warning, unless it is left out.
    monkeypatch.setattr(grading, "machine_facts", lambda: {"cpu_model": "no such CPU", "cpus": 1024, "gpus": []})
    tracks = spec.load_tracks()
    calibrated = {name for name, track in tracks.items()
                  if grading.machine_differences(track, grading.machine_facts())}
    keras = {name for name in calibrated if tracks[name].framework == "keras"}
    assert keras and calibrated - keras, "the track file no longer has calibrated tracks of both frameworks"

    def warned() -> set[str]:
        return {re.match(r"track (\S+) ", line).group(1) for line in cli.track_warnings()}

    monkeypatch.setattr(environment, "tensorflow_version", lambda: "2.15.1")
    assert warned() == calibrated
    monkeypatch.setattr(environment, "tensorflow_version", lambda: None)
    assert environment.edition() == "pytorch"
    assert warned() == calibrated - keras


def test_doctor_without_either_framework_says_to_run_make_setup(monkeypatch, capsys):
    from scalelab import cli, environment

    monkeypatch.setattr(environment, "tensorflow_version", lambda: None)
    monkeypatch.setattr(environment, "package_version", lambda name: None)
    assert cli.doctor(None) == cli.EXIT_PROBLEMS
    assert "problem: Neither TensorFlow nor PyTorch is installed: run `make setup`." in capsys.readouterr().err


def test_unknown_command_is_a_usage_error():
    result = subprocess.run([str(VENV_BIN / "scalelab"), "frobnicate"], capture_output=True, text=True,
                            env=subprocess_env())
    assert result.returncode == 2
    assert "invalid choice" in result.stderr
