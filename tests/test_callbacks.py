"""The shared callbacks inside a real ``fit``: what they add to the logs, print and write."""

from __future__ import annotations

import csv
import io
import zipfile

import numpy as np
import pytest

from scalelab.environment import KERAS_LEFT_OUT

# The Keras edition's: skipped, with the reason, where `make setup` installed the PyTorch edition alone.
tf = pytest.importorskip("tensorflow", reason=KERAS_LEFT_OUT)

from scalelab import callbacks  # noqa: E402


@pytest.fixture()
def tiny_problem():
    rng = np.random.default_rng(0)
    features = rng.normal(size=(256, 4)).astype("float32")
    labels = (features[:, 0] > 0).astype("int64")
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2, activation="softmax")])
    model.compile(optimizer=tf.keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model, features, labels


def test_reporters_print_one_line_per_epoch_and_log_a_csv(tiny_problem, tmp_path, capsys):
    model, features, labels = tiny_problem
    throughput = callbacks.Throughput(images_per_step=32)
    log = tmp_path / "run.csv"
    model.fit(features, labels, batch_size=32, epochs=3, validation_data=(features, labels), verbose=0,
              callbacks=[throughput, callbacks.TotalTime(), callbacks.EpochPrinter(3),
                         callbacks.CSVTimeLog(log, run_label="tiny")])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch ")]
    assert len(lines) == 3
    assert lines[0].startswith("epoch 1/3  loss ")
    for word in ("accuracy", "val_accuracy", "lr 0.5", "img/s", "elapsed"):
        assert word in lines[-1]
    rows = list(csv.DictReader(log.open()))
    assert [row["epoch"] for row in rows] == ["1", "2", "3"]
    assert rows[0]["run"] == "tiny"
    elapsed = [float(row["elapsed_s"]) for row in rows]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0
    assert all(float(row["images_per_s"]) > 0 for row in rows)
    assert len(throughput.history) == 3


def test_stop_at_accuracy_waits_for_patience_epochs_at_target(tiny_problem):
    model, features, labels = tiny_problem
    stopper = callbacks.StopAtAccuracy(target=0.9, monitor="accuracy", patience=2, verbose=False)
    history = model.fit(features, labels, batch_size=16, epochs=50, verbose=0, callbacks=[stopper])
    accuracy = history.history["accuracy"]
    assert len(accuracy) < 50, "it should have stopped early"
    assert accuracy[-1] >= 0.9 and accuracy[-2] >= 0.9
    assert stopper.stopped_epoch == len(accuracy) - 1


def test_stop_at_accuracy_never_stops_below_target(tiny_problem):
    model, features, labels = tiny_problem
    stopper = callbacks.StopAtAccuracy(target=1.01, monitor="accuracy", patience=1, verbose=False)
    history = model.fit(features, labels, batch_size=64, epochs=4, verbose=0, callbacks=[stopper])
    assert len(history.history["loss"]) == 4 and stopper.stopped_epoch is None


def test_stop_at_accuracy_names_a_missing_metric(tiny_problem):
    model, features, labels = tiny_problem
    with pytest.raises(KeyError, match="val_accuracy"):
        model.fit(features, labels, epochs=1, verbose=0, callbacks=[callbacks.StopAtAccuracy(0.5)])


def test_non_chief_ranks_neither_print_nor_write(tiny_problem, tmp_path, capsys):
    model, features, labels = tiny_problem
    log = tmp_path / "rank1.csv"
    model.fit(features, labels, epochs=1, verbose=0,
              callbacks=[callbacks.EpochPrinter(1, is_chief=False), callbacks.CSVTimeLog(log, is_chief=False),
                         callbacks.TotalTime(is_chief=False)])
    assert capsys.readouterr().out == ""
    assert not log.exists()


def test_models_are_saved_whole_or_not_at_all(tiny_problem, tmp_path):
    model, features, labels = tiny_problem
    path = tmp_path / "output" / "model.keras"
    path.parent.mkdir()
    model.fit(features, labels, batch_size=64, epochs=2, verbose=0, callbacks=[callbacks.SaveModelEachEpoch(path)])
    first = path.stat().st_ino
    with open(path, "rb") as reader:  # a reader of the last version keeps a whole file while the next is saved
        callbacks.save_model_atomically(model, path)
        assert tf.keras.models.load_model(tmp_path / "output" / "model.keras").count_params() == model.count_params()
        kept = reader.read()
    assert path.stat().st_ino != first, "renamed into place, not rewritten"
    with zipfile.ZipFile(io.BytesIO(kept)) as whole:  # the version it opened, whole
        assert whole.testzip() is None
    assert sorted(entry.name for entry in path.parent.iterdir()) == ["model.keras"], "no partial file is left"



SAVE_TOGETHER = """
import sys, time
from pathlib import Path
import tensorflow as tf
from scalelab.callbacks import save_model_atomically
inputs = tf.keras.Input((1000,))
model = tf.keras.Model(inputs, tf.keras.layers.Dense(int(sys.argv[2]))(tf.keras.layers.Dense(1000)(inputs)))
start = float(sys.argv[3])
while time.time() < start:
    time.sleep(0.005)
for _ in range(30):
    save_model_atomically(model, Path(sys.argv[1]))
"""


def test_processes_saving_the_same_model_at_once_each_leave_a_whole_file(tmp_path):
    # The serial script under horovodrun: every rank saves to the same path, none may fail for the others.
    import subprocess
    import sys
    import time

    path = tmp_path / "model.keras"
    start = str(time.time() + 8)
    savers = [subprocess.Popen([sys.executable, "-c", SAVE_TOGETHER, str(path), str(units), start],
                               stderr=subprocess.PIPE, text=True) for units in (3, 5)]
    errors = [saver.communicate(timeout=300)[1] for saver in savers]
    assert [saver.returncode for saver in savers] == [0, 0], errors
    assert tf.keras.models.load_model(path).output_shape in ((None, 3), (None, 5))
    assert [entry.name for entry in tmp_path.iterdir()] == ["model.keras"], "no partial file is left"
