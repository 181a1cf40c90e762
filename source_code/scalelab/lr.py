"""Learning-rate helpers: scaling rules for many workers, a step schedule, and warmup.

``WarmupStepSchedule`` is a Keras ``LearningRateSchedule``, evaluated per step inside the optimizer, so it
needs no callback and behaves the same with one worker or many. The alternative the Horovod lab shows
is Horovod's own callback; :func:`horovod_warmup_callback` builds it with the one setting that works
with TensorFlow 2.15's optimizers.
"""

from __future__ import annotations

import math

import tensorflow as tf

SCALING_RULES = ("linear", "sqrt", "none")


def scaled_learning_rate(base_lr: float, workers: int, rule: str = "linear") -> float:
    """The learning rate for ``workers`` times the batch: ``linear`` (Goyal et al.; what Krizhevsky found to work
    better in practice) or ``sqrt`` (what theory suggests, kept by Hoffer et al. and the LAMB paper)."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, not {workers}")
    if rule == "linear":
        return base_lr * workers
    if rule == "sqrt":
        return base_lr * math.sqrt(workers)
    if rule == "none":
        return base_lr
    raise ValueError(f"unknown scaling rule {rule!r}; choose one of {SCALING_RULES}")


def step_learning_rate(epoch: float, base_lr: float, boundaries=(), factor: float = 0.1) -> float:
    """``base_lr`` multiplied by ``factor`` once for each boundary (in epochs) already passed."""
    return base_lr * factor ** sum(epoch >= boundary for boundary in boundaries)


@tf.keras.utils.register_keras_serializable(package="scalelab")
class WarmupStepSchedule(tf.keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup from ``initial_lr`` to ``peak_lr`` over ``warmup_epochs``, then a step decay.

    Epoch-denominated settings are converted with ``steps_per_epoch``; the step decay multiplies by
    ``factor`` at each of ``boundaries`` (epochs). ``initial_lr`` defaults to ``peak_lr / 10``.
    """

    def __init__(self, peak_lr: float, steps_per_epoch: int, warmup_epochs: float = 0.0, boundaries=(),
                 factor: float = 0.1, initial_lr: float | None = None):
        super().__init__()
        if steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be at least 1, not {steps_per_epoch}")
        self.peak_lr = float(peak_lr)
        self.steps_per_epoch = int(steps_per_epoch)
        self.warmup_epochs = float(warmup_epochs)
        self.boundaries = tuple(float(b) for b in boundaries)
        self.factor = float(factor)
        self.initial_lr = float(peak_lr / 10 if initial_lr is None else initial_lr)

    def __call__(self, step):
        epoch = tf.cast(step, tf.float32) / self.steps_per_epoch
        decayed = tf.constant(self.peak_lr, tf.float32)
        for boundary in self.boundaries:
            decayed = tf.where(epoch >= boundary, decayed * self.factor, decayed)
        if self.warmup_epochs <= 0:
            return decayed
        progress = tf.minimum(epoch / self.warmup_epochs, 1.0)
        warming = self.initial_lr + (self.peak_lr - self.initial_lr) * progress
        return tf.where(epoch < self.warmup_epochs, warming, decayed)

    def get_config(self):
        return {"peak_lr": self.peak_lr, "steps_per_epoch": self.steps_per_epoch,
                "warmup_epochs": self.warmup_epochs, "boundaries": list(self.boundaries),
                "factor": self.factor, "initial_lr": self.initial_lr}


def horovod_warmup_callback(initial_lr: float, warmup_epochs: float, steps_per_epoch: int | None = None,
                            verbose: int = 0):
    """Horovod's ``LearningRateWarmupCallback`` (ramps from ``initial_lr / size`` to ``initial_lr``).

    ``momentum_correction=False`` because its momentum correction fails with TensorFlow 2.15's new
    optimizers (``'float' object has no attribute 'dtype'``).
    """
    import horovod.tensorflow.keras as hvd

    return hvd.callbacks.LearningRateWarmupCallback(initial_lr=initial_lr, warmup_epochs=warmup_epochs,
                                                    steps_per_epoch=steps_per_epoch,
                                                    momentum_correction=False, verbose=verbose)
