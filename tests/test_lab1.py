"""Lab 1 (gradient descent, SGD, minibatches): the solved notebook runs with small settings and draws its plots,
every method ends near the line it fits, moving the sliders redraws the path, and nbgrader's student release keeps the
exercises unsolved (validation fails, autograde scores nothing) while the solved source validates and scores full
marks."""

from __future__ import annotations

import re

import nbformat
import pytest
from nbformat.v4 import new_code_cell

import labtools
from labtools import LABS, code_cell_containing, execute, outputs_of, validate

SOURCE_NOTEBOOK = LABS / "source" / "lab1" / "lab1_gradient_descent.ipynb"
# GD makes one update per epoch and needs ~270 of them at learning rate 0.1; an epoch costs milliseconds.
SMALL_SETTINGS = dict(NUM_POINTS=500, MAX_EPOCHS=300)
BATCH_SIZES = [16, 32, 64, 128]


# Appended to a copy of the notebook: sets the sliders' values as the browser does when a student lets go of them
# (a change of each slider's `value`), after the explorer was drawn with its defaults.
MOVE_THE_SLIDERS = """
sliders = {control.description: control for control in explorer.kwargs_widgets}
sliders["learning rate"].value = 0.01
sliders["batch size"].value = 1
"""


@pytest.fixture(scope="module")
def executed_lab1(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("lab1")
    notebook = nbformat.read(SOURCE_NOTEBOOK, as_version=4)
    notebook.cells.append(new_code_cell(MOVE_THE_SLIDERS))
    with_slider_moves = workdir / SOURCE_NOTEBOOK.name
    nbformat.write(notebook, with_slider_moves)
    return execute(with_slider_moves, workdir, SMALL_SETTINGS)


def test_lab1_source_is_committed_without_outputs_and_with_a_parameters_cell():
    notebook = labtools.check_committed_source(SOURCE_NOTEBOOK, SMALL_SETTINGS)
    parameters = next(cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", []))
    assert re.search(r"^BATCH_SIZES = \[16, 32, 64, 128\]", parameters.source, re.MULTILINE)


@pytest.mark.slow
def test_lab1_runs_without_errors_and_draws_the_loss_curves_and_surfaces(executed_lab1):
    errors = [error for cell in executed_lab1.cells for error in outputs_of(cell)[3]]
    assert errors == []
    for plot in ('title="loss per epoch"', "loss surface (contours)", 'projection="3d"'):
        _, _, images, _ = outputs_of(code_cell_containing(executed_lab1, plot))
        assert images == 1, f"the cell drawing {plot} shows no plot"


@pytest.mark.slow
def test_lab1_computes_what_gpt3_costs_on_1_to_8192_gpus_and_draws_the_scaling_laws(executed_lab1):
    cell = code_cell_containing(executed_lab1, "growth_for_10_percent = ")
    text, _, images, _ = outputs_of(cell)
    assert "GPT-3: 6ND = 3.15e+23 operations" in text, text
    days = {int(gpus): float(days) for gpus, days in re.findall(r"^ *(\d+) GPUs: +([\d.]+) days", text, re.MULTILINE)}
    assert sorted(days) == [1, 8, 64, 1024, 8192], text
    assert days[1024] == 28.5 and round(days[1] / 365) == 80, text  # 3.15e23 / (1024 x 312e12 x 0.4) s
    assert all(abs(days[gpus] * gpus - days[1]) < 0.01 * days[1] for gpus in days), "days must fall as 1/GPUs"
    assert "10 % lower loss takes 4.0x the parameters, or 3.0x the data" in text, text
    assert images == 1, "the scaling laws' plot is missing"


@pytest.mark.slow
def test_lab1_every_method_ends_near_w10_b2_with_a_partial_last_minibatch(executed_lab1):
    text, html, _, _ = outputs_of(code_cell_containing(executed_lab1, "runs = {name: train("))
    optimum = re.search(r"least-squares optimum: loss ([\d.]+), w = ([\d.-]+), b = ([\d.-]+)", text)
    assert optimum, text
    best_w, best_b = float(optimum.group(2)), float(optimum.group(3))
    assert abs(best_w - 10) < 0.6 and abs(best_b - 2) < 0.4, "the toy data must follow y = 10(x + noise) + 2"
    rows = re.findall(r"<tr><td>([^<]+)</td><td>(\d+)</td><td>(\d+)</td><td>(\d+)</td><td>([^<]+)</td>"
                      r"<td>(\d+)</td><td>([\d.]+)</td><td>([\d.-]+)</td><td>([\d.-]+)</td></tr>", html[0])
    methods = {row[0]: row for row in rows}
    assert list(methods) == ["GD (full batch)", "SGD (batch 1)"] + [f"minibatch {size}" for size in BATCH_SIZES]
    num_points = SMALL_SETTINGS["NUM_POINTS"]
    for name, batch, updates_per_epoch, last_batch, epochs, updates, final_loss, w, b in rows:
        batch = int(batch)
        assert int(updates_per_epoch) == -(-num_points // batch), name
        assert int(last_batch) == num_points - (int(updates_per_epoch) - 1) * batch, name
        assert int(updates) <= int(updates_per_epoch) * int(epochs.split()[0]), name
        # Near the line the data follow. With a constant learning rate batch-1 SGD keeps jittering around it.
        tolerance = 0.8 if name == "SGD (batch 1)" else 0.4
        assert abs(float(w) - 10) < tolerance and abs(float(b) - 2) < tolerance, f"{name} ended at w={w}, b={b}"
        assert abs(float(w) - best_w) < tolerance and abs(float(b) - best_b) < tolerance, name
        assert "not converged" not in epochs or name == "SGD (batch 1)", f"{name} did not converge: {epochs}"
    assert methods["minibatch 64"][3] == str(num_points % 64), "500 examples in batches of 64 leave 52"


@pytest.mark.slow
def test_lab1_moving_the_learning_rate_and_batch_size_sliders_redraws_the_path(executed_lab1):
    # The executed notebook keeps its widgets' state: the two sliders and the Output widget that interactive()
    # redraws into, which after the moves holds the path for learning rate 0.01 and batch 1.
    widget_state = executed_lab1.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    models = list(widget_state.values())
    sliders = {model["state"].get("description"): model["state"] for model in models
               if model["model_name"] in ("FloatLogSliderModel", "SelectionSliderModel")}
    assert set(sliders) == {"learning rate", "batch size"}
    assert sliders["batch size"]["_options_labels"] == ["1", *map(str, BATCH_SIZES), str(SMALL_SETTINGS["NUM_POINTS"])]
    assert sliders["batch size"]["index"] == 0 and sliders["learning rate"]["value"] == pytest.approx(0.01)
    outputs = [output for model in models if model["model_name"] == "OutputModel"
               for output in model["state"].get("outputs", [])]
    printed = "".join(output.get("text", "") for output in outputs if output.get("output_type") == "stream")
    # 500 points in batches of 1 for 5 epochs: 2,500 updates; only the last redraw is left in the Output widget.
    assert re.fullmatch(r"lr 0\.01, batch 1: 2500 updates, loss [\d.]+, ends at w = [\d.-]+, b = [\d.-]+\n", printed), \
        printed
    assert sum("image/png" in output.get("data", {}) for output in outputs) == 1, "the redrawn path is not plotted"


@pytest.fixture(scope="module")
def released_course(tmp_path_factory):
    return labtools.released_course(tmp_path_factory, "lab1")


def test_lab1_release_has_no_solutions_and_its_exercises_fail_validation(released_course):
    released = released_course / "release" / "lab1" / "lab1_gradient_descent.ipynb"
    text = released.read_text()
    assert "### BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text
    # training_days, loss, gradient, has_converged, minibatch_indices
    assert text.count("raise NotImplementedError") == 5
    results = validate(released)
    failed_cells = {failure["source"].splitlines()[0] for failure in results.get("failed", [])}
    assert len(results.get("failed", [])) == 4, results.keys()
    assert any("GPT-3 on 1,024 A100s" in line for line in failed_cells), failed_cells
    assert any("loss(10.0, 2.0" in line for line in failed_cells), failed_cells
    assert any("has_converged" in line for line in failed_cells), failed_cells
    assert any("minibatch_indices" in line for line in failed_cells), failed_cells


@pytest.mark.slow
def test_lab1_solved_source_passes_validation(released_course):
    assert validate(released_course / "source" / "lab1" / "lab1_gradient_descent.ipynb") == {}


@pytest.mark.slow
def test_lab1_autograded_by_nbgrader_scores_the_solved_notebook_full_marks_and_the_release_none(released_course):
    # nbgrader autograde runs the notebooks headless with the course's configuration (scalelab.headless.Execute).
    name = SOURCE_NOTEBOOK.name
    solved = labtools.autograde(released_course, "lab1", "solver", released_course / "source" / "lab1" / name)
    untouched = labtools.autograde(released_course, "lab1", "idler", released_course / "release" / "lab1" / name)
    assert solved[1] > 0 and solved == (solved[1], solved[1])
    assert untouched == (0, solved[1])
