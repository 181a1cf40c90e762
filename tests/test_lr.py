"""Learning-rate scaling, the step schedule and warmup, checked against values worked out by hand."""

from __future__ import annotations

import math

import pytest

from scalelab.environment import KERAS_LEFT_OUT

# The Keras edition's: skipped, with the reason, where `make setup` installed the PyTorch edition alone.
tf = pytest.importorskip("tensorflow", reason=KERAS_LEFT_OUT)

from scalelab import lr  # noqa: E402


def test_scaling_rules():
    assert lr.scaled_learning_rate(0.1, 8, "linear") == pytest.approx(0.8)
    assert lr.scaled_learning_rate(0.1, 16, "sqrt") == pytest.approx(0.4)
    assert lr.scaled_learning_rate(0.1, 16, "none") == pytest.approx(0.1)
    with pytest.raises(ValueError, match="unknown scaling rule"):
        lr.scaled_learning_rate(0.1, 2, "cubic")
    with pytest.raises(ValueError):
        lr.scaled_learning_rate(0.1, 0)


def test_step_learning_rate_drops_at_each_boundary():
    values = [lr.step_learning_rate(epoch, 1.0, boundaries=(3, 6), factor=0.1) for epoch in range(8)]
    assert values == pytest.approx([1, 1, 1, 0.1, 0.1, 0.1, 0.01, 0.01])


def test_warmup_ramps_linearly_then_follows_the_steps():
    schedule = lr.WarmupStepSchedule(peak_lr=1.0, steps_per_epoch=10, warmup_epochs=2, boundaries=(5,),
                                     factor=0.5, initial_lr=0.2)
    at = lambda step: float(schedule(tf.constant(step)))  # noqa: E731
    assert at(0) == pytest.approx(0.2)
    assert at(10) == pytest.approx(0.6)  # halfway through the 20 warmup steps
    assert at(19) == pytest.approx(0.2 + 0.8 * 19 / 20)
    assert at(20) == pytest.approx(1.0)
    assert at(49) == pytest.approx(1.0)
    assert at(50) == pytest.approx(0.5)


def test_warmup_schedule_survives_serialisation_inside_an_optimizer():
    schedule = lr.WarmupStepSchedule(0.4, steps_per_epoch=7, warmup_epochs=1.5, boundaries=(3, 9))
    optimizer = tf.keras.optimizers.SGD(learning_rate=schedule, momentum=0.9)
    clone = tf.keras.optimizers.SGD.from_config(
        tf.keras.optimizers.serialize(optimizer)["config"])
    restored = clone._learning_rate  # the public property reports the current value, not the schedule
    assert isinstance(restored, lr.WarmupStepSchedule)
    for step in (0, 5, 11, 30, 70):
        assert math.isclose(float(restored(step)), float(schedule(step)), rel_tol=1e-6)


def test_horovod_warmup_callback_is_built_without_momentum_correction():
    callback = lr.horovod_warmup_callback(initial_lr=0.4, warmup_epochs=3)
    assert callback.momentum_correction is False
    assert (callback.start_epoch, callback.end_epoch, callback.initial_lr) == (0, 3, 0.4)
