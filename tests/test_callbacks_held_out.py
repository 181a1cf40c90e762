"""HeldOutEverySteps inside a real ``fit``: when it measures, that it measures what Keras's own validation does, and
that it leaves the training metrics alone."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from scalelab.environment import KERAS_LEFT_OUT

# The Keras edition's: skipped, with the reason, where `make setup` installed the PyTorch edition alone.
tf = pytest.importorskip("tensorflow", reason=KERAS_LEFT_OUT)

from scalelab.callbacks import HeldOutEverySteps  # noqa: E402


def tiny_problem(seed: int = 0):
    rng = np.random.default_rng(0)
    features = rng.normal(size=(256, 4)).astype("float32")
    labels = (features[:, 0] + 0.5 * rng.normal(size=256) > 0).astype("int64")
    tf.keras.utils.set_random_seed(seed)
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(
        2, activation="softmax", kernel_regularizer=tf.keras.regularizers.L2(0.01))])
    model.compile(optimizer=tf.keras.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    held_out = tf.data.Dataset.from_tensor_slices((features[:100], labels[:100])).batch(32)
    return model, features, labels, held_out


def test_held_out_every_steps_logs_a_row_every_n_steps_and_at_each_epoch_end(tmp_path):
    model, features, labels, held_out = tiny_problem()
    log = tmp_path / "steps.csv"
    measure = HeldOutEverySteps(held_out, every_steps=3, images_per_step=32, path=log, run_label="tiny")
    history = model.fit(features, labels, batch_size=32, epochs=2, verbose=0, shuffle=False, callbacks=[measure])
    with log.open() as handle:
        rows = list(csv.DictReader(handle))
    # 8 steps per epoch: every 3 steps and each epoch's end.
    assert [int(row["steps"]) for row in rows] == [3, 6, 8, 9, 12, 15, 16]
    assert [int(row["images"]) for row in rows] == [96, 192, 256, 288, 384, 480, 512]
    assert [float(row["epoch"]) for row in rows] == [0.375, 0.75, 1.0, 1.125, 1.5, 1.875, 2.0]
    assert {row["run"] for row in rows} == {"tiny"}
    # the epoch's logs get the measurement of its last step
    assert history.history["val_accuracy"] == pytest.approx([float(rows[2]["val_accuracy"]),
                                                              float(rows[-1]["val_accuracy"])])
    loss, accuracy = model.evaluate(held_out, verbose=0)
    assert float(rows[-1]["val_accuracy"]) == pytest.approx(accuracy)
    assert float(rows[-1]["val_loss"]) == pytest.approx(loss, rel=1e-5)   # regularisation included, as Keras does


def test_held_out_every_steps_leaves_the_training_metrics_as_they_were():
    model, features, labels, held_out = tiny_problem()
    plain = model.fit(features, labels, batch_size=32, epochs=2, verbose=0, shuffle=False).history
    model, features, labels, held_out = tiny_problem()
    measured = model.fit(features, labels, batch_size=32, epochs=2, verbose=0, shuffle=False,
                         callbacks=[HeldOutEverySteps(held_out, every_steps=1, images_per_step=32)]).history
    assert measured["loss"] == pytest.approx(plain["loss"]) and measured["accuracy"] == pytest.approx(plain["accuracy"])


def test_held_out_every_steps_sums_the_counts_of_every_worker():
    model, features, labels, held_out = tiny_problem()
    # A stand-in for Horovod's sum over ranks: a second worker whose 50 held-out images were all right.
    measure = HeldOutEverySteps(held_out, every_steps=8, images_per_step=32,
                                sum_over_workers=lambda totals: totals + np.array([50.0, 0.0, 50.0]))
    model.fit(features, labels, batch_size=32, epochs=1, verbose=0, callbacks=[measure])
    _, accuracy = model.evaluate(held_out, verbose=0)
    assert measure.rows[-1]["val_accuracy"] == pytest.approx((100 * accuracy + 50) / 150)


def test_held_out_every_steps_stops_training_at_the_first_measurement_at_the_target(capsys):
    model, features, labels, held_out = tiny_problem()
    measure = HeldOutEverySteps(held_out, every_steps=2, images_per_step=32, stop_at=0.75)
    history = model.fit(features, labels, batch_size=32, epochs=20, verbose=0, callbacks=[measure])
    accuracies = [row["val_accuracy"] for row in measure.rows]
    assert accuracies[-1] >= 0.75 and all(accuracy < 0.75 for accuracy in accuracies[:-1])
    assert measure.stopped_at_steps == measure.rows[-1]["steps"] < 20 * 8 and len(history.history["loss"]) < 20
    assert f"after {measure.stopped_at_steps} steps: stopping" in capsys.readouterr().out


def test_held_out_every_steps_refuses_a_period_below_one_step():
    with pytest.raises(ValueError, match="every_steps must be at least 1"):
        HeldOutEverySteps(None, every_steps=0, images_per_step=32)
