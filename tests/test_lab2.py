"""Lab 2 (Fashion-MNIST and the batch size): the solved notebook trains the course network with small settings,
draws the img/s bar chart from a real sweep, fills the time-to-accuracy table from real runs, and nbgrader's
student release keeps the exercises unsolved (validation fails) while the solved source validates."""

from __future__ import annotations

import re

import nbformat
import pytest

from conftest import keras_only
import labtools
from labtools import LABS, code_cell_containing, execute, outputs_of, validate

# The Keras edition's: skipped, with the reason, where `make setup` installed the PyTorch edition alone.
pytestmark = keras_only

SOURCE_NOTEBOOK = LABS / "source" / "lab2" / "lab2_batch_size.ipynb"
SMALL_SETTINGS = dict(TRAIN_IMAGES=2048, VAL_IMAGES=512, SWEEP_BATCH_SIZES=[32, 128], SWEEP_IMAGES=1024,
                      TTA_BATCH_SIZES=[32, 128], TARGET_ACCURACY=0.6, MAX_EPOCHS=3, FIT_TRAIN_IMAGES=256, FIT_EPOCHS=3,
                      PIPELINE_IMAGES=1024, PIPELINE_FILES=8, PIPELINE_BATCH=128)


@pytest.fixture(scope="module")
def executed_lab2(tmp_path_factory):
    return execute(SOURCE_NOTEBOOK, tmp_path_factory.mktemp("lab2"), SMALL_SETTINGS)


def test_lab2_source_is_committed_without_outputs_and_with_a_parameters_cell():
    notebook = labtools.check_committed_source(SOURCE_NOTEBOOK, SMALL_SETTINGS)
    assert "What you learn" in notebook.cells[0].source


def test_lab2_uses_the_course_library_rather_than_its_own_training_code():
    code = "\n".join(cell.source for cell in nbformat.read(SOURCE_NOTEBOOK, as_version=4).cells
                     if cell.cell_type == "code")
    for name in ("load_fashion_mnist", "small_cnn", "Throughput", "StopAtAccuracy", "TotalTime"):
        assert re.search(rf"^from scalelab\.\w+ import .*\b{name}\b", code, re.MULTILINE), name
    assert "class " not in code and "GradientTape" not in code


@pytest.mark.slow
def test_lab2_runs_without_errors(executed_lab2):
    errors = [error for cell in executed_lab2.cells for error in outputs_of(cell)[3]]
    assert errors == []


@pytest.mark.slow
def test_lab2_sweeps_the_batch_size_and_draws_the_images_per_second_bar_chart(executed_lab2):
    text, _, _, _ = outputs_of(code_cell_containing(executed_lab2, "for batch_size in SWEEP_BATCH_SIZES"))
    measured = {int(batch): float(rate) for batch, rate in re.findall(r"batch +(\d+): +\d+ steps per epoch, "
                                                                      r"img/s ([\d.]+)", text)}
    assert sorted(measured) == SMALL_SETTINGS["SWEEP_BATCH_SIZES"], text
    assert all(rate > 0 for rate in measured.values())
    _, _, images, _ = outputs_of(code_cell_containing(executed_lab2, "bars = axis.bar("))
    assert images == 1, "the throughput bar chart is missing"


@pytest.mark.slow
def test_lab2_fills_the_time_to_accuracy_table_from_real_runs(executed_lab2):
    text, html, images, _ = outputs_of(code_cell_containing(executed_lab2, "axhline(TARGET_ACCURACY"))
    assert images == 1, "the accuracy-against-time plot is missing"
    tables = [fragment for fragment in html if "time to 60% validation accuracy" in fragment]
    assert len(tables) == 1, html
    rows = re.findall(r"<tr><td>(\d+)</td><td>([\d.]+)</td><td>(\d+)</td><td>(\d+)</td><td>([\d.]+)</td>"
                      r"<td>([^<]+)</td></tr>", tables[0])
    assert [int(row[0]) for row in rows] == SMALL_SETTINGS["TTA_BATCH_SIZES"]
    for batch, peak_lr, images_per_s, epochs, accuracy, seconds in rows:
        assert abs(float(peak_lr) - 0.01 * int(batch) / 32) < 1e-6, "the learning rate scales linearly"
        assert int(images_per_s) > 0 and 1 <= int(epochs) <= SMALL_SETTINGS["MAX_EPOCHS"]
        assert 0 < float(accuracy) <= 1
        reached = seconds != "not reached"
        # A run stops early only at the target; one that never reached it used every epoch.
        assert reached == (float(accuracy) >= SMALL_SETTINGS["TARGET_ACCURACY"])
        assert reached or int(epochs) == SMALL_SETTINGS["MAX_EPOCHS"]
        assert not reached or float(seconds) > 0
    printed, _, _, _ = outputs_of(code_cell_containing(executed_lab2, "best = fastest_batch_size("))
    assert re.search(r"fastest to 60% validation accuracy: batch (32|128)\b|no batch size reached", printed), printed
    # Every time-to-accuracy epoch printed the course's one line, with throughput and elapsed time.
    epoch_text, _, _, _ = outputs_of(code_cell_containing(executed_lab2, "for batch_size in TTA_BATCH_SIZES"))
    assert re.search(r"epoch 1/3 .*val_accuracy [\d.]+ .*img/s \d+ +elapsed [\d.]+ s", epoch_text), epoch_text


@pytest.mark.slow
def test_lab2_plots_training_against_validation_for_an_underfit_an_overfit_and_a_regularised_run(executed_lab2):
    _, html, images, _ = outputs_of(code_cell_containing(executed_lab2, "axis.axvline(best + 1"))
    assert images == 1, "the training-against-validation curves are missing"
    tables = [fragment for fragment in html if "training against validation" in fragment]
    assert len(tables) == 1, html
    rows = re.findall(r"<tr><td>([^<]+)</td><td>(\d+)</td>((?:<td>[\d.]+</td>){4})<td>(\d+)</td>"
                      r"<td>([\d.]+)</td></tr>", tables[0])
    assert [row[0].split(":")[0] for row in rows] == ["underfit", "overfit",
                                                      "CNN + augmentation, dropout, early stopping"]
    for name, epochs, figures, best_epoch, best_val_loss in rows:
        accuracy, val_accuracy, loss, val_loss = map(float, re.findall(r"[\d.]+", figures))
        assert 1 <= int(best_epoch) <= int(epochs) <= SMALL_SETTINGS["FIT_EPOCHS"], name
        assert 0 <= accuracy <= 1 and 0 <= val_accuracy <= 1 and loss > 0 and 0 < float(best_val_loss) <= val_loss
    printed, _, _, _ = outputs_of(code_cell_containing(executed_lab2, "FITTING_RUNS = {"))
    assert len(re.findall(r"epochs in \d+ s, accuracy [\d.]+, val_accuracy [\d.]+", printed)) == 3, printed


@pytest.mark.slow
def test_lab2_measures_four_input_pipelines_over_tfrecord_files_and_the_model_beside_them(executed_lab2):
    text, _, _, _ = outputs_of(code_cell_containing(executed_lab2, "for name, options in PIPELINES.items()"))
    measured = re.findall(r"^ *(plain|parallel|\+ prefetch|\+ cache): read +(\d+) img/s \( *(\d+) PNGs decoded\), "
                          r"trained +(\d+) img/s$", text, re.MULTILINE)
    assert [name for name, _, _, _ in measured] == ["plain", "parallel", "+ prefetch", "+ cache"], text
    assert all(int(read) > 0 and int(trained) > 0 for _, read, _, trained in measured), text
    # What cache saves is counted, not timed: its second pass decodes nothing, every other pass decodes every image.
    decoded = {name: int(count) for name, _, count, _ in measured}
    images = SMALL_SETTINGS["PIPELINE_IMAGES"]
    assert decoded == {"plain": images, "parallel": images, "+ prefetch": images, "+ cache": 0}, text
    assert re.search(r"the model alone, from memory: \d+ img/s", text), text
    _, _, images, _ = outputs_of(code_cell_containing(executed_lab2, "axis.axhline(model_speed"))
    assert images == 1, "the pipelines' bar chart is missing"
    written, _, _, _ = outputs_of(code_cell_containing(executed_lab2, "record_files = write_records("))
    assert f"{SMALL_SETTINGS['PIPELINE_IMAGES']} images in {SMALL_SETTINGS['PIPELINE_FILES']} files" in written


@pytest.mark.slow
def test_lab2_sharding_by_files_reads_each_record_once_and_by_records_reads_everything_on_every_rank(executed_lab2):
    cell = code_cell_containing(executed_lab2, "for how in (\"by files\", \"by records\")")
    text, html, _, _ = outputs_of(cell)
    images = SMALL_SETTINGS["PIPELINE_IMAGES"]
    for how in ("by files", "by records"):
        assert f"sharded {how}: ranks disjoint: True, together all {images}: True" in text, text
    [table] = [fragment for fragment in html if "two ranks, each its part" in fragment]
    rows = re.findall(r"<tr><td>(by files|by records)</td><td>(\d)</td><td>(\d+)</td><td>(\d+)</td>", table)
    assert [(how, int(rank)) for how, rank, _, _ in rows] == [("by files", 0), ("by files", 1),
                                                              ("by records", 0), ("by records", 1)], table
    for how, _, read, kept in rows:
        assert int(kept) == images // 2, table
        assert int(read) == (images // 2 if how == "by files" else images), table


@pytest.fixture(scope="module")
def released_course(tmp_path_factory):
    return labtools.released_course(tmp_path_factory, "lab2")


def test_lab2_release_has_no_solutions_and_its_exercises_fail_validation(released_course):
    released = released_course / "release" / "lab2" / "lab2_batch_size.ipynb"
    text = released.read_text()
    assert "### BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text
    assert text.count("raise NotImplementedError") == 3
    results = validate(released)
    failed_cells = [failure["source"] for failure in results.get("failed", [])]
    assert len(failed_cells) == 3, results.keys()
    assert "images_per_second(" in failed_cells[0] and "fastest_batch_size(" in failed_cells[1]
    assert "files_for_rank(" in failed_cells[2]


@pytest.mark.slow
def test_lab2_solved_source_passes_validation(released_course):
    assert validate(released_course / "source" / "lab2" / "lab2_batch_size.ipynb") == {}
