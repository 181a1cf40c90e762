"""Keras callbacks the course's scripts and notebooks share.

They cooperate through the epoch ``logs`` dict, which Keras hands to every callback in turn:
``Throughput`` adds ``images_per_s``, ``TotalTime`` adds ``elapsed_s``, ``HeldOutEverySteps`` the held-out
``val_loss`` and ``val_accuracy``, and the reporters that come after them (``EpochPrinter``, ``CSVTimeLog``) print
or record those. Under Horovod put ``hvd.callbacks.MetricAverageCallback()`` before them so they see metrics
averaged over ranks, and pass ``is_chief=hvd.rank() == 0`` so only rank 0 prints and writes.
"""

from __future__ import annotations

import csv
import os
import socket
import time
from pathlib import Path

import numpy as np
import tensorflow as tf

from .progress import format_epoch


class Throughput(tf.keras.callbacks.Callback):
    """Measures images per second of each epoch's training steps (validation excluded).

    ``images_per_step`` is the batch size of one step summed over all workers, so under Horovod the
    figure is the whole job's throughput.
    """

    def __init__(self, images_per_step: int):
        super().__init__()
        self.images_per_step = images_per_step
        self.history: list[float] = []

    def on_epoch_begin(self, epoch, logs=None):
        self._steps = 0
        self._started = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self._steps += 1
        self._last_step_end = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        seconds = max(getattr(self, "_last_step_end", self._started) - self._started, 1e-9)
        images_per_s = self._steps * self.images_per_step / seconds
        self.history.append(images_per_s)
        if logs is not None:
            logs["images_per_s"] = images_per_s


class TotalTime(tf.keras.callbacks.Callback):
    """Wall time since training began, added to each epoch's logs as ``elapsed_s``."""

    def __init__(self, is_chief: bool = True, verbose: bool = True):
        super().__init__()
        self.is_chief = is_chief
        self.verbose = verbose
        self.elapsed_s = 0.0

    def on_train_begin(self, logs=None):
        self._started = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.elapsed_s = time.perf_counter() - self._started
        if logs is not None:
            logs["elapsed_s"] = self.elapsed_s

    def on_train_end(self, logs=None):
        self.elapsed_s = time.perf_counter() - self._started
        if self.is_chief and self.verbose:
            print(f"total training time {self.elapsed_s:.1f} s", flush=True)


class StopAtAccuracy(tf.keras.callbacks.Callback):
    """Stops training once ``monitor`` has been at least ``target`` for ``patience`` epochs in a row.

    Under Horovod every rank must take the same decision, so average the metric across ranks first
    (``MetricAverageCallback`` before this callback).
    """

    def __init__(self, target: float, monitor: str = "val_accuracy", patience: int = 1,
                 is_chief: bool = True, verbose: bool = True):
        super().__init__()
        if patience < 1:
            raise ValueError("patience counts epochs at or above the target and must be at least 1")
        self.target, self.monitor, self.patience = target, monitor, patience
        self.is_chief, self.verbose = is_chief, verbose
        self.epochs_at_target = 0
        self.stopped_epoch: int | None = None

    def on_epoch_end(self, epoch, logs=None):
        value = (logs or {}).get(self.monitor)
        if value is None:
            raise KeyError(f"StopAtAccuracy watches '{self.monitor}', which this epoch's logs do not have; "
                           f"they have {sorted(logs or {})}")
        self.epochs_at_target = self.epochs_at_target + 1 if value >= self.target else 0
        if self.epochs_at_target >= self.patience:
            self.stopped_epoch = epoch
            self.model.stop_training = True
            if self.is_chief and self.verbose:
                print(f"{self.monitor} {value:.4f} ≥ {self.target} for {self.patience} epoch(s): stopping "
                      f"after epoch {epoch + 1}", flush=True)


def _learning_rate(model) -> float | None:
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return None
    rate = optimizer.learning_rate
    if isinstance(rate, tf.keras.optimizers.schedules.LearningRateSchedule):
        rate = rate(optimizer.iterations)
    return float(tf.keras.backend.get_value(rate))


class EpochPrinter(tf.keras.callbacks.Callback):
    """Prints :func:`format_epoch` on rank 0; use with ``fit(verbose=0)``."""

    def __init__(self, epochs: int, is_chief: bool = True):
        super().__init__()
        self.epochs, self.is_chief = epochs, is_chief

    def on_epoch_end(self, epoch, logs=None):
        logs = logs if logs is not None else {}
        rate = _learning_rate(self.model)
        if rate is not None:
            logs.setdefault("lr", rate)
        if self.is_chief:
            print(format_epoch(epoch, self.epochs, logs), flush=True)


class CSVTimeLog(tf.keras.callbacks.Callback):
    """Appends one row per epoch (elapsed time, metrics, throughput, learning rate) to a CSV file.

    The file is rewritten at the start of training, so one run is one file; rows are flushed as they come,
    so a run that is stopped early still leaves its curve. Only the chief writes.
    """

    COLUMNS = ("epoch", "elapsed_s", "loss", "accuracy", "val_loss", "val_accuracy", "images_per_s", "lr")

    def __init__(self, path, is_chief: bool = True, run_label: str | None = None):
        super().__init__()
        self.path = Path(path)
        self.is_chief = is_chief
        self.run_label = run_label
        self._started = None

    def _columns(self):
        return (("run",) if self.run_label else ()) + self.COLUMNS

    def on_train_begin(self, logs=None):
        self._started = time.perf_counter()
        if self.is_chief:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("w", newline="") as handle:
                csv.writer(handle).writerow(self._columns())

    def on_epoch_end(self, epoch, logs=None):
        if not self.is_chief:
            return
        logs = dict(logs or {})
        logs.setdefault("elapsed_s", time.perf_counter() - self._started)
        logs.setdefault("lr", _learning_rate(self.model))
        row = {"run": self.run_label, "epoch": epoch + 1, **logs}
        with self.path.open("a", newline="") as handle:
            csv.writer(handle).writerow(["" if row.get(column) is None else row[column]
                                         for column in self._columns()])


class HeldOutEverySteps(tf.keras.callbacks.Callback):
    """Measures held-out accuracy every ``every_steps`` training steps and at the end of every epoch, and appends a
    CSV row each time: steps taken, images seen, epochs (a fraction), wall time, the part of it these measurements
    took, held-out loss and accuracy, learning rate. Use it instead of ``fit(validation_data=...)`` when a curve
    sampled only at epoch ends is too coarse (steps to a target accuracy, say); each epoch's logs still get its
    ``val_loss`` and ``val_accuracy``, measured after the epoch's last step.

    For a softmax classifier with integer labels (every course model): the loss is the cross-entropy plus the
    model's regularisation losses, as Keras reports it. Under Horovod give each rank its shard of ``val_data`` and
    ``sum_over_workers`` (the summed counts make the accuracy exact however the shards split); only the chief
    writes. The file is rewritten at the start of training, so one run is one file. With ``stop_at`` training stops
    at the first measurement at or above that accuracy (steps to a target need nothing after it).
    """

    COLUMNS = ("steps", "images", "epoch", "elapsed_s", "eval_s", "val_loss", "val_accuracy", "lr")

    def __init__(self, val_data, every_steps: int, images_per_step: int, path=None, is_chief: bool = True,
                 run_label: str | None = None, sum_over_workers=None, stop_at: float | None = None,
                 verbose: bool = True):
        super().__init__()
        if every_steps < 1:
            raise ValueError(f"every_steps must be at least 1, not {every_steps}")
        self.val_data, self.every_steps, self.images_per_step = val_data, every_steps, images_per_step
        self.path = None if path is None else Path(path)
        self.is_chief, self.run_label, self.sum_over_workers = is_chief, run_label, sum_over_workers
        self.stop_at, self.verbose = stop_at, verbose
        self.stopped_at_steps: int | None = None
        self.steps = 0
        self.eval_s = 0.0
        self.rows: list[dict] = []
        self._predict = None

    def _columns(self):
        return (("run",) if self.run_label else ()) + self.COLUMNS

    def on_train_begin(self, logs=None):
        self._started = time.perf_counter()
        self._predict = tf.function(self._forward, reduce_retracing=True)
        if self.is_chief and self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("w", newline="") as handle:
                csv.writer(handle).writerow(self._columns())

    def _forward(self, images):
        return self.model(images, training=False)

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps % self.every_steps == 0:
            self._measure()

    def on_epoch_end(self, epoch, logs=None):
        if not self.rows or self.rows[-1]["steps"] != self.steps:
            self._measure()
        if logs is not None:
            logs.update(val_loss=self.rows[-1]["val_loss"], val_accuracy=self.rows[-1]["val_accuracy"])

    def _measure(self):
        started = time.perf_counter()
        correct, loss_sum, count = 0.0, 0.0, 0.0
        for images, labels in self.val_data:
            probabilities = self._predict(images)
            labels = tf.reshape(labels, [-1])
            correct += float(tf.reduce_sum(tf.cast(tf.argmax(probabilities, axis=-1) == tf.cast(labels, tf.int64),
                                                   tf.float32)))
            loss_sum += float(tf.reduce_sum(tf.keras.losses.sparse_categorical_crossentropy(labels, probabilities)))
            count += float(labels.shape[0])
        totals = np.array([correct, loss_sum, count])
        if self.sum_over_workers is not None:
            totals = np.asarray(self.sum_over_workers(totals))
        regularisation = float(tf.add_n(self.model.losses)) if self.model.losses else 0.0
        self.eval_s += time.perf_counter() - started
        steps_per_epoch = self.params.get("steps") if self.params else None
        row = {"run": self.run_label, "steps": self.steps, "images": self.steps * self.images_per_step,
               "epoch": round(self.steps / steps_per_epoch, 4) if steps_per_epoch else None,
               "elapsed_s": round(time.perf_counter() - self._started, 3), "eval_s": round(self.eval_s, 3),
               "val_loss": totals[1] / totals[2] + regularisation, "val_accuracy": totals[0] / totals[2],
               "lr": _learning_rate(self.model)}
        self.rows.append(row)
        if self.is_chief and self.path is not None:
            with self.path.open("a", newline="") as handle:
                csv.writer(handle).writerow(["" if row.get(column) is None else row[column]
                                             for column in self._columns()])
        # Every rank has the same summed counts, so every rank takes the same decision.
        if self.stop_at is not None and row["val_accuracy"] >= self.stop_at:
            self.stopped_at_steps = self.steps
            self.model.stop_training = True
            if self.is_chief and self.verbose:
                print(f"val_accuracy {row['val_accuracy']:.4f} ≥ {self.stop_at} after {self.steps} steps: stopping",
                      flush=True)


def save_model_atomically(model: tf.keras.Model, path: Path | str) -> Path:
    """Save ``model`` to ``path`` whole or not at all: written beside it, then renamed over it, so that a reader
    (the grader, which copies every version while the run goes) never sees a half-written file. The partial file
    is this process's own, so that processes saving the same model at once (the serial script under horovodrun,
    where every rank thinks it is the only one) replace each other's whole files instead of failing."""
    path = Path(path)
    # Keras picks the format by the suffix.
    partial = path.with_name(f".{path.stem}.{socket.gethostname()}-{os.getpid()}.partial{path.suffix}")
    model.save(partial)
    partial.replace(path)
    return path


class SaveModelEachEpoch(tf.keras.callbacks.Callback):
    """Save the model at the end of every epoch with :func:`save_model_atomically`."""

    def __init__(self, path: Path | str):
        super().__init__()
        self.path = Path(path)

    def on_epoch_end(self, epoch, logs=None):
        save_model_atomically(self.model, self.path)
