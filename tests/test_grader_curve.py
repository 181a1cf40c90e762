"""The referee's time to accuracy: each snapshot measured on held-out data as it arrives (grader/curve.py), the
first at the target within the budget deciding, whatever the run did after it; the curve's reasons otherwise."""

import time
from pathlib import Path

import pytest

from conftest import needs_tensorflow
from scalelab.grader import curve, launch, pipeline, verify, witness
from scalelab.grader.verdict import new_verdict

# The Keras edition's (its track trains with Keras): skipped, with the reason, on the PyTorch edition.
needs_tensorflow()
from test_grader_contention import TRACK, run_result  # noqa: E402

TOGETHER = witness.TimelineEvidence(ranks_seen=[0, 1], allreduce_count=400, allreduced_tensors=4, active_deciles=10,
                                    span_s=30.0, events=2000)
TRAFFIC = witness.TrafficEvidence(loopback_bytes=10**8, expected_bytes=10**8, steps=100, ratio=1.0)
BUDGET, TARGET = TRACK.time_budget_s, TRACK.target_accuracy


def decided(run: launch.RunResult, model: verify.ModelCheck, points=(), deciding=None, timeline=TOGETHER,
            traffic=TRAFFIC) -> dict:
    verdict = new_verdict(np=2, cpu_contention=run.cpu_contention)
    pipeline.decide(verdict, TRACK, run, model, timeline, traffic, Path("/nonexistent"), list(points), deciding)
    return verdict


def point(index: int, at_s: float, accuracy: float | None) -> dict:
    return curve.Point(index, at_s, accuracy).as_dict()


def test_the_first_snapshot_at_the_target_decides_even_when_the_run_then_stalls_past_the_budget():
    # An honest run that reached the target at 40 s, then hung in its exit until the grader stopped it.
    stalled = run_result(timed_out=True, wall_time_s=BUDGET + TRACK.grace_s, share=0.0)
    good = verify.ModelCheck(TARGET + 0.05, None, 4, trainable_parameters=1000)
    deciding = point(3, 40.0, TARGET + 0.05)
    verdict = decided(stalled, good, [point(1, 20.0, 0.3), point(2, 30.0, TARGET - 0.01), deciding], deciding)
    assert verdict["verdict"] == "pass" and verdict["time_to_accuracy_s"] == 40.0, verdict["reasons"]
    assert "at 40.0 s" in verdict["reasons"][0] and "snapshot 3" in verdict["reasons"][0]
    # Without the curve, the same run is judged by how it ended: out of time.
    assert decided(stalled, good)["verdict"] == "timeout"


def test_a_good_snapshot_still_fails_when_the_ranks_did_not_train_together():
    # A model good from the first snapshot (weights it did not train in this run), one rank, no allreduce.
    alone = witness.TimelineEvidence(ranks_seen=[0], allreduce_count=0, allreduced_tensors=0, active_deciles=0,
                                     span_s=30.0, events=10)
    quiet = witness.TrafficEvidence(loopback_bytes=10**4, expected_bytes=10**8, steps=100, ratio=0.0001)
    stopped = run_result(timed_out=False, wall_time_s=12.0, share=0.0, exit_code=143)
    good = verify.ModelCheck(0.95, None, 4, trainable_parameters=1000)
    deciding = point(1, 10.0, 0.95)
    verdict = decided(stopped, good, [deciding], deciding, timeline=alone, traffic=quiet)
    assert verdict["verdict"] == "fail" and verdict["time_to_accuracy_s"] is None
    assert any("rank" in reason for reason in verdict["reasons"]), verdict["reasons"]


def test_a_curve_still_rising_at_the_budget_says_so():
    run = run_result(timed_out=True, wall_time_s=BUDGET + TRACK.grace_s, share=0.0)
    model = verify.ModelCheck(TARGET - 0.03, None, 4, trainable_parameters=1000)
    rising = [point(1, BUDGET * 0.5, TARGET - 0.2), point(2, BUDGET * 0.7, TARGET - 0.1),
              point(3, BUDGET * 0.9, TARGET - 0.03)]
    verdict = decided(run, model, rising)
    assert verdict["verdict"] == "timeout"
    assert any(f"was {TARGET - 0.03:.2f} at {BUDGET * 0.9:.0f} s and still rising" in reason
               for reason in verdict["reasons"]), verdict["reasons"]


def test_a_curve_that_stalls_below_the_target_says_training_stopped_improving():
    run = run_result(timed_out=False, wall_time_s=BUDGET * 0.6, share=0.0)
    model = verify.ModelCheck(0.31, None, 4, trainable_parameters=1000)
    flat = [point(1, 10.0, 0.25), point(2, 20.0, 0.305), point(3, 30.0, 0.31), point(4, 40.0, 0.309)]
    verdict = decided(run, model, flat)
    assert verdict["verdict"] == "fail"
    assert any("stalled at about 0.31" in reason for reason in verdict["reasons"]), verdict["reasons"]
    assert not any("rising" in reason for reason in verdict["reasons"])


def test_a_target_claimed_on_validation_but_not_reached_on_held_out_data_is_named():
    run = run_result(timed_out=False, wall_time_s=BUDGET * 0.6, share=0.0)
    run.reported_accuracy = TARGET + 0.2
    model = verify.ModelCheck(TARGET - 0.1, None, 4, trainable_parameters=1000)
    verdict = decided(run, model, [point(1, 10.0, TARGET - 0.1)])
    assert any(f"validation accuracy reached {TARGET + 0.2:.2f}" in reason for reason in verdict["reasons"])
    run.reported_accuracy = TARGET - 0.1  # an honest claim below the target: nothing said of it
    assert not any("validation accuracy" in reason for reason in decided(run, model, [])["reasons"])


def save_models(folder: Path) -> dict[str, Path]:
    """An untrained model and one trained briefly on Fashion-MNIST's training split, as Keras archives."""
    import numpy as np
    import tensorflow as tf

    from scalelab import data

    images, labels = data.load("fashion-mnist", "train", download=False)
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((28, 28)), tf.keras.layers.Rescaling(1 / 255),
                                 tf.keras.layers.Flatten(), tf.keras.layers.Dense(10, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy")
    files = {"untrained": folder / "untrained.keras", "trained": folder / "trained.keras"}
    model.save(files["untrained"])
    model.fit(images[:6000].astype(np.float32), labels[:6000], epochs=2, batch_size=64, verbose=0)
    model.save(files["trained"])
    return files


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return save_models(tmp_path_factory.mktemp("models"))


def test_snapshots_are_measured_in_turn_and_the_first_at_the_target_decides(tmp_path, models):
    corrupt = tmp_path / "corrupt.keras"  # refused before anything loads it
    corrupt.write_bytes(b"PK\x03\x04 not a Keras archive")
    heldout = verify.HeldoutProcess("fashion-mnist")
    heldout.start_ahead()
    live = curve.LiveCurve(heldout, target=0.6, budget_s=100.0)
    try:
        snapshots = [{"index": 1, "at_s": 5.0, "file": str(models["untrained"])},
                     {"index": 2, "at_s": 9.0, "file": str(corrupt)},
                     {"index": 3, "at_s": 12.5, "file": str(models["trained"])},
                     {"index": 4, "at_s": 20.0, "file": str(models["trained"])}]
        started = time.monotonic()
        for snapshot in snapshots[:2]:
            live.add(snapshot)
        assert time.monotonic() - started < 1.0  # handing over never waits for a measurement
        live.finish(snapshots)  # the later ones handed over at the end, as the Slurm backend does
    finally:
        live.abandon()
        heldout.close()
    measured = {p["index"]: p for p in live.curve()}
    assert measured[1]["accuracy"] < 0.3 and measured[3]["accuracy"] >= 0.6, measured
    assert measured[2]["accuracy"] is None and "not a Keras archive" in measured[2]["reason"]
    assert 4 not in measured  # after the deciding snapshot nothing is measured
    assert live.deciding.index == 3 and live.deciding.at_s == 12.5
    assert live.deciding_check().heldout_accuracy == measured[3]["accuracy"]
    assert live.deciding_file() == models["trained"]


def test_snapshots_after_the_budget_never_decide(models):
    heldout = verify.HeldoutProcess("fashion-mnist")
    live = curve.LiveCurve(heldout, target=0.6, budget_s=10.0)
    try:
        live.finish([{"index": 1, "at_s": 11.0, "file": str(models["trained"])}])
    finally:
        heldout.close()
    assert live.deciding is None and live.curve() == []
    assert any("after the time budget were not measured" in note for note in live.notes)


def test_the_panel_plots_the_graders_held_out_points_beside_the_runs_own():
    from scalelab.grader import panel

    printed = [{"elapsed_s": 20.0, "accuracy": 0.4}, {"elapsed_s": 30.0, "accuracy": 0.55}]
    graders = [{"index": 1, "at_s": 21.0, "accuracy": 0.35}, {"index": 2, "at_s": 31.0, "accuracy": 0.47}]
    alone = panel.accuracy_plot_png(printed, 110, 0.5)
    both = panel.accuracy_plot_png(printed, 110, 0.5, graders)
    assert alone and both and alone != both
    assert panel.accuracy_plot_png([], 110, 0.5, graders)  # before the run prints anything
    assert panel.accuracy_plot_png([], 110, 0.5, [{"index": 1, "at_s": 5.0, "accuracy": None}]) is None
