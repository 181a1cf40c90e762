"""Lab 5 (large-batch training): the solved notebook runs end to end on real CIFAR-10 and Fashion-MNIST with small
settings, shows the recorded reference (the small-batch row, steps to a target against the batch size), computes
section 10's figures from the published ImageNet results it lists and from its own local-SGD runs, its quiz explains
wrong answers, and nbgrader's student release fails validation while the source passes."""

from __future__ import annotations

import csv
import re
import shutil

import nbformat
import pytest
from nbclient.exceptions import CellExecutionError

from conftest import keras_only
import labtools
from labtools import LABS, code_cell_containing, execute, outputs_of, run_quiz, validate

LAB_FOLDER = LABS / "source" / "lab5"
SOURCE_NOTEBOOK = LAB_FOLDER / "lab5_large_batch.ipynb"
RECORDED_CSV = LAB_FOLDER / "recorded_batch_sizes.csv"
RECORDED_BATCH_SIZES = [64, 128, 256, 512]
RECORDED_SEEDS = [0, 1, 2]
TARGET_ACCURACY = 0.40
REFERENCE_ROW = "recorded: warmup at batch 64, rate held, 5 epochs, mean of 3 seeds (small-batch reference)"
# One rung (LAMB), plus the notebook's ghost-batch-norm run of the warmup rung (SGD), keeps the smoke test within
# two minutes; the full-settings run, timed by hand, trains every rung.
LADDER = ["lamb"]
SMALL_SETTINGS = dict(DATA_IMAGES=256, NOISE_BATCH_SIZES=[16, 128], NOISE_REPEATS=2, FASHION_IMAGES=512,
                      PHASE_EPOCHS=1, LADDER_VARIANTS=LADDER, LADDER_EPOCHS=2, LADDER_BATCH_SIZE=128,
                      LADDER_TRAIN_IMAGES=256, LADDER_VAL_IMAGES=128, LADDER_NP=1, GHOST_BATCH_SIZE=32,
                      LOCAL_SGD_IMAGES=2048, LOCAL_SGD_STEPS=64, LOCAL_SGD_SEEDS=2)
QUIZ_ANSWERS = {"answer_ghost_batch_norm": '"b"', "answer_generalisation_gap": '{"a", "b", "e"}'}

# The Keras edition's: skipped, with the reason, where `make setup` installed the PyTorch edition alone.
pytestmark = [pytest.mark.slow, keras_only]


@pytest.fixture(scope="module")
def executed_lab5(tmp_path_factory, cifar10_dir):
    # The notebook runs in (a copy of) its own folder, as a student's does: the recorded runs are there.
    workdir = tmp_path_factory.mktemp("lab5") / "lab5"
    shutil.copytree(LAB_FOLDER, workdir)
    return execute(workdir / SOURCE_NOTEBOOK.name, workdir, SMALL_SETTINGS), workdir


def test_lab5_source_is_committed_without_outputs_and_with_a_parameters_cell():
    labtools.check_committed_source(SOURCE_NOTEBOOK, SMALL_SETTINGS)


def test_lab5_runs_without_errors_and_draws_its_plots(executed_lab5):
    text, _, images, errors = outputs_of(executed_lab5[0])
    assert errors == []
    # sharp/flat, scaling rules, warmup, noise covariance, gradient noise, batch schedules, LARS trust ratios,
    # accuracy vs time, the recorded reference, the published records, local SGD
    assert images >= 11
    assert re.search(r"estimated gradient noise scale: -?\d+ images", text)
    assert re.search(r"decay the learning rate: held-out accuracy 0\.\d{4} in 24 steps", text)
    assert re.search(r"increase the batch size: held-out accuracy 0\.\d{4} in 11 steps", text)


def test_lab5_shows_batch_norm_per_rank_under_horovodrun_and_synchronised_across_ranks(executed_lab5):
    text = outputs_of(executed_lab5[0]).text
    assert "tf.keras.layers.BatchNormalization: mean of each rank's normalised batch: [0. 0.]" in text, text
    synchronised = re.search(r"hvd\.SyncBatchNormalization: mean of each rank's normalised batch: "
                             r"\[(-[\d.]+) +([\d.]+)\]", text)
    assert synchronised and float(synchronised.group(1)) < -0.5 and float(synchronised.group(2)) > 0.5, text


def test_lab5_multiplicative_noise_keeps_the_small_batch_noise_shape_and_additive_noise_does_not(executed_lab5):
    text = outputs_of(executed_lab5[0]).text
    rows = {name.strip(): [float(value) for value in numbers] for name, *numbers in re.findall(
        r"^ *(batch [^(]+?) +\(([+-][\d.]+), ([+-][\d.]+)\) +\(([\d.]+), ([\d.]+)\) +([+-][\d.]+)$", text,
        re.MULTILINE)}
    small, multiplicative, additive = rows["batch 8"], rows["batch 512, multiplicative σ² = 63"], \
        rows["batch 512, additive noise"]
    assert abs(multiplicative[4] - small[4]) < 0.1 and abs(additive[4]) < 0.2          # correlation
    assert abs(multiplicative[3] / small[3] - 1) < 0.2 and additive[3] > 2 * small[3]   # spread along w2


def test_lab5_logs_both_batch_schedules_to_csv_per_phase(executed_lab5):
    _, workdir = executed_lab5
    # 512 images: 8 steps per phase at batch 64; then ceil(512 / 320) = 2 and 1 step at batches 320 and 1600.
    for name, batch_sizes, steps in (("decay_the_learning_rate", ["64", "64", "64"], ["8", "16", "24"]),
                                     ("increase_the_batch_size", ["64", "320", "1600"], ["8", "10", "11"])):
        with (workdir / "lab5_runs" / f"{name}.csv").open() as handle:
            rows = list(csv.DictReader(handle))
        assert [row["batch_size"] for row in rows] == batch_sizes
        assert [row["steps"] for row in rows] == steps
        elapsed = [float(row["elapsed_s"]) for row in rows]
        assert elapsed == sorted(elapsed) and elapsed[0] > 0
        assert all(0 <= float(row["val_accuracy"]) <= 1 for row in rows)


def test_lab5_ladder_runs_every_variant_and_fills_the_table_from_its_csv_logs(executed_lab5):
    notebook, workdir = executed_lab5
    text, html, _, _ = outputs_of(notebook)
    for variant in LADDER:
        assert re.search(rf"^variant {variant}: ", text, re.MULTILINE), variant
        csv_log = workdir / "lab5_runs" / f"{variant}.csv"
        assert len(csv_log.read_text().splitlines()) == 1 + SMALL_SETTINGS["LADDER_EPOCHS"]
    assert (workdir / "lab5_runs" / "warmup_ghost_bn.csv").is_file()
    tables = [fragment for fragment in html if "<th>run</th><th>final val_accuracy</th>" in fragment]
    assert len(tables) == 1
    rows = re.findall(r"<tr><td>([^<]+)</td><td>(0\.\d{4})</td><td>(0\.\d{4})</td><td>(\d+)</td><td>(\d+)</td></tr>",
                      tables[0])
    assert [row[0] for row in rows] == LADDER + ["warmup + ghost BN", REFERENCE_ROW]
    assert all(int(row[4]) > 0 for row in rows)


def recorded_runs() -> dict[tuple[int, int], dict[str, list[float]]]:
    """The recorded runs straight from their CSV: (batch size, seed) -> columns, in the order of the steps."""
    with RECORDED_CSV.open() as handle:
        rows = sorted(csv.DictReader(handle), key=lambda row: int(row["steps"]))
    runs: dict[tuple[int, int], dict[str, list[float]]] = {}
    for row in rows:
        run = runs.setdefault((int(row["batch_size"]), int(row["seed"])), {})
        for column in ("steps", "epoch", "val_accuracy"):
            run.setdefault(column, []).append(float(row[column]))
    return runs


def first_steps_at(run: dict[str, list[float]], target: float) -> int | None:
    return next((int(steps) for steps, accuracy in zip(run["steps"], run["val_accuracy"]) if accuracy >= target), None)


def test_lab5_recorded_runs_have_three_seeds_per_batch_size_each_reaching_the_target_between_close_measurements():
    runs = recorded_runs()
    assert sorted(runs) == [(batch, seed) for batch in RECORDED_BATCH_SIZES for seed in RECORDED_SEEDS]
    for (batch, seed), run in runs.items():
        steps_to_target = first_steps_at(run, TARGET_ACCURACY)
        assert steps_to_target is not None, f"batch {batch}, seed {seed} never reaches {TARGET_ACCURACY}"
        interval = min(later - earlier for earlier, later in zip(run["steps"], run["steps"][1:]))
        assert interval <= 0.13 * steps_to_target, (batch, seed, interval, steps_to_target)   # about a tenth
    # the train-longer reading: batch 64 to 4 epochs at least, batch 512 to 8
    assert all(max(runs[64, seed]["epoch"]) >= 4 and max(runs[512, seed]["epoch"]) == 8 for seed in RECORDED_SEEDS)


def test_lab5_shows_the_recorded_steps_to_target_of_every_seed_and_fits_only_what_the_spread_allows(executed_lab5):
    notebook, _ = executed_lab5
    text, html, images, errors = outputs_of(code_cell_containing(notebook, "def steps_to_target("))
    assert errors == [] and images == 1
    assert any("Recorded (not run here)" in fragment for fragment in html)
    runs = recorded_runs()
    expected = {batch: [first_steps_at(runs[batch, seed], TARGET_ACCURACY) for seed in RECORDED_SEEDS]
                for batch in RECORDED_BATCH_SIZES}
    table = next(fragment for fragment in html if "steps to 0.40: each seed" in fragment)
    rows = re.findall(r"<tr><td>(\d+)</td><td>(\d+)</td><td>(\d+)</td><td>([\d ]+)</td><td>(\d+)</td>"
                      r"<td>(\d+)–(\d+)</td><td>([\d,]+)</td><td>(\d+)</td></tr>", table)
    assert [int(row[0]) for row in rows] == RECORDED_BATCH_SIZES
    for batch, seeds, _, each_seed, mean, low, high, images_to_target, _ in rows:
        steps = expected[int(batch)]
        assert int(seeds) == 3 and [int(value) for value in each_seed.split()] == steps
        assert int(mean) == round(sum(steps) / 3) and (int(low), int(high)) == (min(steps), max(steps))
        assert int(images_to_target.replace(",", "")) == round(sum(steps) / 3 * int(batch))
    # What the text after the plot says: every doubling of the batch takes fewer steps, but never half as many, so
    # more images.
    means = [sum(expected[batch]) / 3 for batch in RECORDED_BATCH_SIZES]
    assert all(0.5 < later / earlier < 1 for earlier, later in zip(means, means[1:])), means
    listed = re.search(r"recorded steps to 0\.40 \(mean of the seeds, min–max\): batch 64: \d+ \((\d+)–(\d+)\), "
                       r"batch 128: \d+ \((\d+)–(\d+)\), batch 256: \d+ \((\d+)–(\d+)\), "
                       r"batch 512: \d+ \((\d+)–(\d+)\)", text)
    assert listed and [int(value) for value in listed.groups()] == [
        bound for batch in RECORDED_BATCH_SIZES for bound in (min(expected[batch]), max(expected[batch]))]
    # The curve S_min (1 + B_noise / B) is fitted only if the steps fall from each batch size to the next by more
    # than the seeds' spread; otherwise the notebook says which batch sizes overlap.
    supported = all(max(expected[large]) < min(expected[small])
                    for small, large in zip(RECORDED_BATCH_SIZES, RECORDED_BATCH_SIZES[1:]))
    fitted = re.search(r"fitted S\(B\) = S_min \(1 \+ B_noise / B\): S_min = (\d+) steps", text)
    refused = re.search(r"^no fit: .+ overlap those at batch \d+ .+too little to fit$", text, re.MULTILINE)
    assert (fitted is not None, refused is not None) == (supported, not supported), text
    assert not supported   # the recorded seeds overlap: what the text after the plot says
    assert re.search(r"gradient noise scale measured in section 2: -?\d+ images", text)


def test_lab5_shows_the_recorded_large_batch_trained_longer_beside_the_small_batch(executed_lab5):
    notebook, _ = executed_lab5
    text = outputs_of(code_cell_containing(notebook, "def steps_to_target(")).text
    runs = recorded_runs()

    def over_epoch(batch: int, epoch: int) -> float:
        """Mean over the seeds of each run's mean held-out accuracy over the epoch that ends at ``epoch``."""
        means = []
        for seed in RECORDED_SEEDS:
            run = runs[batch, seed]
            window = [accuracy for at, accuracy in zip(run["epoch"], run["val_accuracy"]) if epoch - 1 < at <= epoch]
            means.append(sum(window) / len(window))
        return sum(means) / len(means)

    shown = re.search(r"train longer, held-out accuracy over the last epoch \(mean of the seeds\): "
                      r"batch 64, 4 epochs \(320 steps\): (0\.\d{4}); batch 512, 4 epochs \(40 steps\): (0\.\d{4}); "
                      r"batch 512, 8 epochs \(80 steps\): (0\.\d{4})$", text, re.MULTILINE)
    assert shown, text
    small, large, longer = (float(value) for value in shown.groups())
    assert [small, large, longer] == pytest.approx([over_epoch(64, 4), over_epoch(512, 4), over_epoch(512, 8)],
                                                   abs=1e-4)
    # what the text says: at equal epochs the large batch lags far behind; twice the epochs bring it about level
    assert large < small - 0.1 and abs(longer - small) < 0.02


# Section 10's published results, (work, accelerators, time to train in seconds, top-1 %), as the papers state them.
PUBLISHED = [("He et al. 2016 (timed by Goyal et al.)", 8, 29 * 3600, 75.3), ("Goyal et al. 2017", 256, 3600, 76.3),
             ("You et al. 2018", 2048, 1200, 75.4), ("Akiba et al. 2017", 1024, 900, 74.9),
             ("Jia et al. 2018", 2048, 396, 75.8), ("Mikami et al. 2018", 2176, 224, 75.03),
             ("Yamazaki et al. 2019", 2048, 74.7, 75.08)]


def test_lab5_tabulates_the_published_records_and_computes_accelerator_hours_and_speed_ups(executed_lab5):
    notebook, _ = executed_lab5
    text, html, images, errors = outputs_of(code_cell_containing(notebook, "PUBLISHED_RESULTS = "))
    assert errors == [] and images == 1
    table = next(fragment for fragment in html if "<th>accelerator-hours</th>" in fragment)
    rows = re.findall(r"<tr><td>([^<]+)</td><td>[^<]+</td><td>([\d,]+) [^<]+</td><td>[^<]+</td><td>([\d.]+)</td>"
                      r"<td>(\d+)</td><td>([\d,]+)×</td></tr>", table)
    assert [row[0] for row in rows] == [work for work, *_ in PUBLISHED]
    for (work, accelerators, seconds, top1), (_, shown_count, shown_top1, hours, speed_up) in zip(PUBLISHED, rows):
        assert int(shown_count.replace(",", "")) == accelerators and float(shown_top1) == top1, work
        assert int(hours) == round(accelerators * seconds / 3600), work
        assert int(speed_up.replace(",", "")) == round(29 * 3600 / seconds), work
    # What the text after the table says: about 1,400 times less time, only about 5 times fewer accelerator-hours,
    # and every batch beyond 8K 0.5 to 1.4 points below Goyal et al.
    assert "Yamazaki et al. 2019 74.7 s: 1,398 times shorter" in text, text
    assert "232 for He et al. 2016 (timed by Goyal et al.), 42.5 for Yamazaki et al. 2019: 5.5 times fewer" in text
    assert "top-1 74.9 to 75.8 %, 0.5 to 1.4 points below Goyal et al.'s 76.3 %" in text


def test_lab5_local_sgd_runs_count_one_round_per_h_steps_and_post_local_keeps_minibatch_sgds_loss(executed_lab5):
    notebook, _ = executed_lab5
    text, _, images, errors = outputs_of(code_cell_containing(notebook, "LOCAL_SGD_VARIANTS = "))
    assert errors == [] and images == 1
    runs = {name: (int(rounds), float(loss)) for name, rounds, loss in re.findall(
        r"^ *(.+?): +(\d+) rounds, held-out loss (\d\.\d{3}) \(", text, re.MULTILINE)}
    steps, half = SMALL_SETTINGS["LOCAL_SGD_STEPS"], SMALL_SETTINGS["LOCAL_SGD_STEPS"] // 2
    assert {name: rounds for name, (rounds, _) in runs.items()} == {
        "H = 1 (minibatch SGD)": steps, "H = 2": steps // 2, "H = 4": steps // 4, "H = 8": steps // 8,
        "post-local: H = 1, then 8": half + half // 8}
    # What the text says: the more local steps throughout, the higher the loss at equal steps; post-local SGD ends
    # where minibatch SGD does.
    losses = [runs[name][1] for name in ("H = 1 (minibatch SGD)", "H = 2", "H = 4", "H = 8")]
    assert losses == sorted(losses) and losses[-1] > losses[0] + 0.02, losses
    assert abs(runs["post-local: H = 1, then 8"][1] - losses[0]) < (losses[-1] - losses[0]) / 4, runs


def test_lab5_quiz_accepts_the_right_answers_and_explains_wrong_ones():
    source = nbformat.read(SOURCE_NOTEBOOK, as_version=4)
    run_quiz(source, QUIZ_ANSWERS, questions=2)

    wrong = dict(QUIZ_ANSWERS, answer_ghost_batch_norm='"a"')
    with pytest.raises(CellExecutionError, match=r"never the batch statistics"):
        run_quiz(source, wrong, questions=2)
    wrong = dict(QUIZ_ANSWERS, answer_generalisation_gap='{"a", "b", "c", "e"}')
    with pytest.raises(CellExecutionError, match=r"does not have that covariance structure"):
        run_quiz(source, wrong, questions=2)


@pytest.fixture(scope="module")
def released_course(tmp_path_factory):
    return labtools.released_course(tmp_path_factory, "lab5")


def test_lab5_release_has_no_solutions_and_fails_validation(released_course, cifar10_dir):
    released = released_course / "release" / "lab5" / "lab5_large_batch.ipynb"
    text = released.read_text()
    assert "### BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text
    assert (released.parent / "recorded_batch_sizes.csv").is_file(), "the recorded reference ships with the lab"
    results = validate(released)
    # four exercises and two quiz questions, each unanswered
    assert len(results.get("failed", [])) == 6, results.keys()


def test_lab5_solved_source_passes_validation(released_course, cifar10_dir):
    assert validate(released_course / "source" / "lab5" / "lab5_large_batch.ipynb") == {}
