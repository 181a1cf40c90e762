"""The held-out measurement: its refusals (before and after loading), its sandboxed process, its priorities."""

import os
import time
import zipfile
from pathlib import Path

import psutil
import pytest

from conftest import keras_only
from scalelab.grader import verify


def heldout_accuracy(model_path: Path, dataset: str) -> verify.ModelCheck:
    """Measure a model file the way the grader measures a run's: from a folder, through its own checked copy."""
    heldout = verify.HeldoutProcess(dataset)
    try:
        return heldout.measure(model_path.parent, model_path.name, owner_uid=None)
    finally:
        heldout.close()


def test_model_file_refusals(tmp_path):
    assert "no model was saved" in heldout_accuracy(tmp_path / "model.keras", "fashion-mnist").reason
    corrupt = tmp_path / "corrupt.keras"
    corrupt.write_bytes(b"PK\x03\x04 not really a zip")
    assert "not a Keras archive" in verify.model_file_problem(corrupt)
    bomb = tmp_path / "bomb.keras"
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("model.weights.h5", b"\0" * (verify.MODEL_SIZE_LIMIT_BYTES + 1))
    assert "unpacks to" in verify.model_file_problem(bomb)


@keras_only
def test_a_config_naming_any_module_outside_keras_is_refused_before_loading(tmp_path):
    import json

    import tensorflow as tf

    inputs = tf.keras.Input((28, 28))
    tf.keras.Model(inputs, tf.keras.layers.Dense(10)(tf.keras.layers.Flatten()(inputs))).save(tmp_path / "ok.keras")
    assert verify.model_file_problem(tmp_path / "ok.keras") is None  # Horovod's optimizer in compile_config is fine
    with zipfile.ZipFile(tmp_path / "ok.keras") as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    for where, module in (("model", "assessment"), ("layer", "os"), ("initializer", "scalelab.models")):
        config = json.loads(members["config.json"])
        target = {"model": config, "layer": config["config"]["layers"][-1],
                  "initializer": config["config"]["layers"][-1]["config"]["kernel_initializer"]}[where]
        target["module"] = module
        forged = tmp_path / f"{where}.keras"
        with zipfile.ZipFile(forged, "w") as archive:
            for name, content in {**members, "config.json": json.dumps(config).encode()}.items():
                archive.writestr(name, content)
        assert f"names the Python module(s) {module}" in verify.model_file_problem(forged), where


@keras_only
def test_heldout_measurement_refuses_lambda_layers_and_wrong_outputs(tmp_path):
    import tensorflow as tf

    inputs = tf.keras.Input((28, 28, 1))
    hacked = tf.keras.Model(inputs, tf.keras.layers.Lambda(lambda x: tf.reduce_mean(x, axis=(1, 2)) * 0 + 1)(
        tf.keras.layers.Flatten()(inputs)[:, :10, None, None]))
    hacked.save(tmp_path / "lambda.keras")
    refused = heldout_accuracy(tmp_path / "lambda.keras", "fashion-mnist")
    # the lambda's code is pickled with its module's name: refused before Keras (or its safe mode) sees it
    assert refused.heldout_accuracy is None and "names the Python module(s) builtins" in refused.reason

    wrong = tf.keras.Sequential([tf.keras.Input((28, 28, 1)), tf.keras.layers.Flatten(), tf.keras.layers.Dense(3)])
    wrong.save(tmp_path / "wrong.keras")
    refused = heldout_accuracy(tmp_path / "wrong.keras", "fashion-mnist")
    assert refused.heldout_accuracy is None and "10 class scores" in refused.reason


def thread_policies(pid: int) -> set[int]:
    return {os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


@keras_only
@pytest.mark.skipif(not verify.may_raise_priority(), reason="needs CAP_SYS_NICE (the grader runs as root here)")
def test_heldout_process_started_ahead_waits_at_idle_priority_and_measures_at_normal(tmp_path):
    import tensorflow as tf

    model = tf.keras.Sequential([tf.keras.Input((28, 28, 1)), tf.keras.layers.Flatten(),
                                 tf.keras.layers.Dense(10, activation="softmax")])
    model.save(tmp_path / "model.keras")
    fresh = heldout_accuracy(tmp_path / "model.keras", "fashion-mnist")

    heldout = verify.HeldoutProcess("fashion-mnist")
    heldout.start_ahead()
    waiting = heldout.process
    assert waiting is not None and waiting.poll() is None
    # the Python inside the sandbox (bwrap's last descendant), once it has started TensorFlow's threads
    deadline = time.monotonic() + 120
    python = None
    while time.monotonic() < deadline:
        family = psutil.Process(waiting.pid).children(recursive=True)
        python = next((p for p in family if "scalelab.grader.heldout" in " ".join(p.cmdline())
                       and "bwrap" not in p.name()), None)
        if python is not None and len(os.listdir(f"/proc/{python.pid}/task")) >= 2:
            break
        time.sleep(0.2)
    # every thread it starts while importing TensorFlow inherits the idle policy: it takes no CPU from a run
    assert python is not None and thread_policies(python.pid) == {os.SCHED_IDLE}
    assert verify._restore_normal_priority(waiting.pid)
    assert thread_policies(python.pid) == {os.SCHED_OTHER}

    measured = heldout.measure(tmp_path, "model.keras", owner_uid=None)
    # the process started ahead did the measuring, and stays to measure more models until the grader closes it
    assert heldout.process is waiting and waiting.poll() is None
    assert measured == fresh and measured.images == 10000 and 0 <= measured.heldout_accuracy <= 1
    again = heldout.measure_copy(tmp_path / "model.keras")
    assert heldout.process is waiting and again.heldout_accuracy == measured.heldout_accuracy
    heldout.close()
    assert waiting.returncode == 0 and heldout.process is None


@pytest.mark.skipif(not verify.may_raise_priority(), reason="needs CAP_SYS_NICE (the grader runs as root here)")
def test_heldout_process_started_ahead_is_stopped_when_there_is_no_model(tmp_path):
    heldout = verify.HeldoutProcess("fashion-mnist")
    heldout.start_ahead()
    waiting = heldout.process
    # the run saved no model: refused without asking the measuring process anything...
    assert heldout.measure(tmp_path, "model.keras", owner_uid=None).reason.startswith("no model was saved")
    assert waiting.poll() is None
    heldout.close()  # ...which the grader then stops, rather than leave it waiting
    assert waiting.returncode is not None and heldout.process is None


@keras_only
def test_the_runs_final_model_reaches_the_measuring_uid_whatever_the_graders_umask(tmp_path):
    # The Hub's service runs with umask 077, and root's helper under sudo with it: the grader's copy of the run's
    # final model must still be readable by the measuring process, a sandbox uid of its own.
    import tensorflow as tf

    model = tf.keras.Sequential([tf.keras.Input((28, 28, 1)), tf.keras.layers.Flatten(),
                                 tf.keras.layers.Dense(10, activation="softmax")])
    model.save(tmp_path / "model.keras")
    previous = os.umask(0o077)
    try:
        measured = heldout_accuracy(tmp_path / "model.keras", "fashion-mnist")
    finally:
        os.umask(previous)
    assert measured.reason is None and measured.images == 10000, measured


def pytorch_heldout_accuracy(model_path: Path, dataset: str) -> verify.ModelCheck:
    heldout = verify.HeldoutProcess(dataset, framework="pytorch")
    try:
        return heldout.measure(model_path.parent, model_path.name, owner_uid=None)
    finally:
        heldout.close()


def test_a_torch_export_program_is_measured_in_the_sandbox_in_the_pixel_type_it_was_exported_with(tmp_path):
    import numpy as np
    import torch

    from scalelab.data import load
    from scalelab.torch_models import SmallCNN, export_model_atomically

    torch.manual_seed(0)
    network = SmallCNN(input_shape=(28, 28, 1), filters=(8, 16), dense_units=32)
    images, labels = load("fashion-mnist", "train")
    pixels = torch.from_numpy(images[:512, ..., None])  # uint8, as the data loaders give them
    optimizer = torch.optim.Adam(network.parameters(), 0.003)
    for _ in range(30):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(network(pixels), torch.from_numpy(labels[:512].astype(np.int64))).backward()
        optimizer.step()
    export_model_atomically(network, tmp_path / "model.pt2", pixels[:2])
    # The example the program keeps is two images, not the whole tensor it was sliced from.
    assert (tmp_path / "model.pt2").stat().st_size < 400_000
    measured = pytorch_heldout_accuracy(tmp_path / "model.pt2", "fashion-mnist")
    assert measured.reason is None and measured.images == 10000, measured
    assert 0.3 < measured.heldout_accuracy <= 1 and measured.trainable_variables == len(list(network.parameters()))
    assert measured.trainable_parameters == sum(parameter.numel() for parameter in network.parameters())
    # A float32 program gets float32 pixels, the same raw values: the same accuracy.
    export_model_atomically(network, tmp_path / "float.pt2", pixels[:2].float())
    assert pytorch_heldout_accuracy(tmp_path / "float.pt2", "fashion-mnist").heldout_accuracy == \
        pytest.approx(measured.heldout_accuracy, abs=1e-3)
    # A program for other images is refused with the shapes named.
    export_model_atomically(SmallCNN(input_shape=(32, 32, 3)), tmp_path / "cifar.pt2",
                            torch.zeros(2, 32, 32, 3, dtype=torch.uint8))
    refused = pytorch_heldout_accuracy(tmp_path / "cifar.pt2", "fashion-mnist")
    assert "takes inputs of shape (32, 32, 3)" in refused.reason


def test_pytorch_model_file_refusals(tmp_path):
    assert "save $SCALELAB_OUTPUT_DIR/model.pt2" in pytorch_heldout_accuracy(tmp_path / "model.pt2",
                                                                               "fashion-mnist").reason
    corrupt = tmp_path / "model.pt2"
    corrupt.write_bytes(b"PK\x03\x04 not really a zip")
    assert "not a torch.export archive" in verify.model_file_problem(corrupt)
    bomb = tmp_path / "bomb.pt2"
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("data/0", b"\0" * (verify.MODEL_SIZE_LIMIT_BYTES + 1))
    assert "unpacks to" in verify.model_file_problem(bomb)
    # A zip that is no program is loaded in the sandbox and refused there, with torch.export's reason.
    with zipfile.ZipFile(tmp_path / "empty.pt2", "w") as archive:
        archive.writestr("nothing", b"")
    assert "could not be loaded with torch.export.load" in pytorch_heldout_accuracy(tmp_path / "empty.pt2",
                                                                                      "fashion-mnist").reason


@keras_only
def test_measuring_without_the_sandbox_leaves_nothing_in_the_machines_temporary_folder(tmp_path):
    # Without bubblewrap (an instructor's choice) the measuring process shares the machine's /tmp, and it ends
    # without Python's teardown: what TensorFlow writes there while predicting (autograph's generated sources,
    # removed only at a normal exit) must land in the grader's private folder, which close() removes.
    import tensorflow as tf

    model = tf.keras.Sequential([tf.keras.Input((28, 28, 1)), tf.keras.layers.Flatten(),
                                 tf.keras.layers.Dense(10, activation="softmax")])
    model.save(tmp_path / "model.keras")
    before = set(Path("/tmp").glob("__autograph_generated_file*"))
    heldout = verify.HeldoutProcess("fashion-mnist", sandboxed=False)
    measured = heldout.measure(tmp_path, "model.keras", owner_uid=None)
    process = heldout.process
    heldout.close()
    assert measured.reason is None and measured.images == 10000, measured
    assert process.returncode == 0 and not heldout.private_dir.exists()
    assert set(Path("/tmp").glob("__autograph_generated_file*")) <= before
