"""Lab 3's graded conversion cells, as nbgrader runs them.

Each conversion cell's visible part is a quick hint (`scalelab.grader.labchecks.conversion_hints`: has the step been
started?); its hidden part asks the step's question of one probed two-rank run of the student's script
(`conversion_questions`, tested mistake by mistake in test_lab3_behaviour.py). Here: the cells call the right step,
the instructor's conversion passes every cell, a wrong one loses exactly the cells that ask about its mistakes, the
released script fails every hint, the step files of the worked solution pass the hints of the steps they have made,
and nbgrader's autograde grades the student's script, not the released copy."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import nbformat
import pytest
from nbgrader.api import Gradebook

import labtools
from conftest import PROJECT_ROOT, keras_only
from labtools import LABS, cell_by_grade_id, nbgrader
from scalelab.grader.labchecks import conversion_hints, conversion_questions
from test_lab3_behaviour import WRONG as WRONG_BEHAVIOURS, converted

# The Keras edition's: skipped, with the reason, where `make setup` installed the PyTorch edition alone.
pytestmark = keras_only

NOTEBOOK = LABS / "source" / "lab3" / "lab3_horovod.ipynb"
STUDENT_SCRIPT_NAME = "fashion_mnist_student.py"
RELEASED_SCRIPT = LABS / "source" / "lab3" / STUDENT_SCRIPT_NAME
SOURCE = PROJECT_ROOT / "source_code"
SOLUTION = SOURCE / "fashion_mnist_horovod.py"
HIDDEN_TESTS = "### BEGIN HIDDEN TESTS"
# The graded cell of each structural step (the two-rank cell runs horovodrun and is tested on its own below).
CELLS = {"init": "conv-init-tests", "pin_device": "conv-pin-device-tests", "rank0_output": "conv-rank0-output-tests",
         "scaled_lr": "conv-scaled-lr-tests", "distributed_optimizer": "conv-distributed-optimizer-tests",
         "broadcast": "conv-broadcast-tests", "steps_per_epoch": "conv-steps-per-epoch-tests",
         "metric_average": "conv-metric-average-tests", "rank0_checkpoint": "conv-rank0-checkpoint-tests"}
TWO_RANKS_CELL = "conv-two-ranks-tests"

# The wrong conversion whose graded cells are run here: its mistakes are asked about by these steps.
MISTAKES = "gradients summed with the rate scaled, a printer on every rank, checkpoints on every local rank 0"

# The worked solution's step files: each has made the steps of the files before it and its own.
STEP_FILES = [
    (SOURCE / "fashion_mnist.py", ()),
    (SOURCE / "horovod_steps" / "step1_init.py", ("init",)),
    (SOURCE / "horovod_steps" / "step2_pin_device.py", ("pin_device",)),
    (SOURCE / "horovod_steps" / "step3_rank0_output.py", ("rank0_output",)),
    (SOURCE / "horovod_steps" / "step4_distributed_optimizer.py", ("scaled_lr", "distributed_optimizer")),
    (SOURCE / "horovod_steps" / "step5_broadcast.py", ("broadcast",)),
    (SOURCE / "horovod_steps" / "step6_partition_data.py", ("steps_per_epoch",)),
    (SOURCE / "horovod_steps" / "step7_metric_average.py", ("metric_average",)),
    (SOLUTION, ("rank0_checkpoint",)),
]


def run_cell(source: str, script) -> str | None:
    """Run a graded cell's code as the notebook would, with STUDENT_SCRIPT pointing at ``script``: None when it
    passes, else "ErrorName: message"."""
    namespace = {"conversion_hints": conversion_hints, "conversion_questions": conversion_questions,
                 "STUDENT_SCRIPT": script, "CONTROLLER": "--gloo"}
    try:
        exec(compile(source, "graded cell", "exec"), namespace)
    except Exception as error:      # what nbgrader would record as the cell's failure
        return f"{type(error).__name__}: {error}"
    return None


def graded_cell(grade_id: str) -> tuple[str, str]:
    """(the whole cell, its visible part) of a graded cell of the source notebook."""
    cell = cell_by_grade_id(nbformat.read(NOTEBOOK, as_version=4), grade_id)
    assert cell.metadata.nbgrader["grade"] and cell.metadata.nbgrader["locked"] and cell.metadata.nbgrader["points"]
    assert HIDDEN_TESTS in cell.source, f"{grade_id} has no hidden tests"
    return cell.source, cell.source.split(HIDDEN_TESTS)[0]


def test_each_conversion_step_has_a_graded_cell_and_the_points_add_up():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    graded = {cell.metadata.nbgrader["grade_id"]: cell.metadata.nbgrader["points"] for cell in notebook.cells
              if cell.metadata.get("nbgrader", {}).get("grade")}
    assert {grade_id for grade_id in graded if grade_id.startswith("conv-")} == {*CELLS.values(), TWO_RANKS_CELL}
    assert sum(graded[cell] for cell in CELLS.values()) == 9 and graded[TWO_RANKS_CELL] == 3
    assert sum(graded.values()) == 20, "the conversion's 12 points and the 6 exercises' 8"
    # The hidden tests ask the step's question of the graded run; the visible part only hints.
    for step, grade_id in {**CELLS, "two_ranks": TWO_RANKS_CELL}.items():
        whole, visible = graded_cell(grade_id)
        hidden = whole.split(HIDDEN_TESTS)[1]
        assert f'conversion_questions.check(STUDENT_SCRIPT, "{step}", CONTROLLER)' in hidden, step
        assert "conversion_questions" not in visible and "conversion_hints.check(STUDENT_SCRIPT" in visible, step


@pytest.mark.slow
def test_the_instructors_conversion_passes_every_cell_and_the_released_script_no_hint():
    for grade_id in [*CELLS.values(), TWO_RANKS_CELL]:
        whole, visible = graded_cell(grade_id)
        assert run_cell(whole, SOLUTION) is None, grade_id
        released = run_cell(visible, RELEASED_SCRIPT)
        assert released is not None and released.startswith("AssertionError"), f"{grade_id}: {released}"


def test_the_released_script_is_the_serial_script_with_a_fixme_at_every_step_and_the_same_options():
    text = RELEASED_SCRIPT.read_text()
    for step in range(1, 9):
        assert f"# FIXME(Horovod) step {step}:" in text, step
    assert not conversion_hints.imports_horovod(ast.parse(text)), "Horovod is only named in the FIXMEs"
    assert "BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text
    assert conversion_hints.hints(RELEASED_SCRIPT, "cli") == []
    # The same program as the serial script, statement for statement (docstrings and comments aside), plus only the
    # import of the helpers the FIXMEs name: a change to source_code/fashion_mnist.py must be made here too.
    def statements(source: str, helpers_import: str | None = None) -> list[str]:
        body = ast.parse(source).body[1:]                                   # after the module's docstring
        return [ast.dump(node) for node in body if ast.unparse(node) != helpers_import]
    assert statements(text, "from scalelab.runtime import configure_threads, pin_gpu") == \
        statements((SOURCE / "fashion_mnist.py").read_text())


@pytest.mark.slow
def test_a_wrong_conversion_loses_exactly_the_cells_that_ask_about_its_mistakes(tmp_path):
    mistake = WRONG_BEHAVIOURS[MISTAKES]
    script = converted(mistake.edits, tmp_path)
    outcomes = {step: run_cell(graded_cell(grade_id)[0], script) for step, grade_id in CELLS.items()}
    outcomes["two_ranks"] = run_cell(graded_cell(TWO_RANKS_CELL)[0], script)
    assert {step for step, outcome in outcomes.items() if outcome} == set(mistake.rejected_by), outcomes
    for step, fragment in mistake.rejected_by.items():
        assert outcomes[step].startswith("AssertionError") and fragment in outcomes[step], outcomes[step]
    # Its hints pass: every step was started, and only the run tells what is wrong.
    assert {step: run_cell(graded_cell(grade_id)[1], script) for step, grade_id in CELLS.items()} == \
        {step: None for step in CELLS}


@pytest.mark.parametrize("index", range(len(STEP_FILES)), ids=[path.stem for path, _ in STEP_FILES])
def test_each_step_file_of_the_worked_solution_passes_the_hints_of_the_steps_it_has_made(index):
    path, _ = STEP_FILES[index]
    made = {step for _, steps in STEP_FILES[:index + 1] for step in steps}
    for step in made:
        assert conversion_hints.hints(path, step) == [], f"{path.name}, {step}"
    if index == 0:  # the serial script has started none
        assert all(conversion_hints.hints(path, step) for step in CELLS)


def test_the_hints_follow_other_spellings_and_never_claim_a_step_is_wrong(tmp_path):
    """Aliases and direct imports are found; a hint that finds nothing says so and defers to the graded run."""
    text = SOLUTION.read_text()
    replacements = [
        ("import horovod.tensorflow.keras as hvd\n", "import horovod.tensorflow.keras as horovod\n"
                                                     "from horovod.tensorflow.keras.callbacks import "
                                                     "MetricAverageCallback as AverageTheMetrics\n"),
        ("hvd.callbacks.MetricAverageCallback()", "AverageTheMetrics()"),
        ("hvd.", "horovod."),
    ]
    for old, new in replacements:
        assert old in text, old
        text = text.replace(old, new)
    script = tmp_path / STUDENT_SCRIPT_NAME
    script.write_text(text)
    assert {step: conversion_hints.hints(script, step) for step in CELLS} == {step: [] for step in CELLS}
    unstarted = tmp_path / "unstarted" / STUDENT_SCRIPT_NAME
    unstarted.parent.mkdir()
    unstarted.write_text(text.replace("horovod.callbacks.BroadcastGlobalVariablesCallback(0),\n", ""))
    [hint] = conversion_hints.hints(unstarted, "broadcast")
    assert "nothing of this step was found" in hint and "the graded run judges what your script does" in hint


def test_a_script_that_does_not_parse_or_is_missing_is_reported_not_crashed(tmp_path):
    broken = tmp_path / STUDENT_SCRIPT_NAME
    broken.write_text("import horovod.tensorflow.keras as hvd\nhvd.init(\n")
    assert "does not parse" in conversion_hints.hints(broken, "init")[0]
    assert "is missing" in conversion_hints.hints(tmp_path / "nothing.py", "init")[0]
    with pytest.raises(AssertionError, match="nothing.py is missing"):
        conversion_questions.check(tmp_path / "nothing.py", "init")
    with pytest.raises(ValueError):
        conversion_hints.hints(SOLUTION, "no such step")


@pytest.mark.slow
def test_autograde_grades_the_students_script_not_the_released_copy(tmp_path_factory):
    course = labtools.released_course(tmp_path_factory, "lab3")
    scores = {}
    for student, script in (("converter", SOLUTION), ("idler", RELEASED_SCRIPT)):
        submitted = course / "submitted" / student / "lab3"
        submitted.mkdir(parents=True)
        # The solved notebook for both: only the script differs.
        shutil.copy(course / "source" / "lab3" / NOTEBOOK.name, submitted / NOTEBOOK.name)
        shutil.copy(script, submitted / STUDENT_SCRIPT_NAME)
        nbgrader("autograde", "lab3", "--student", student, "--create", course=course, timeout=900)
        assert (course / "autograded" / student / "lab3" / STUDENT_SCRIPT_NAME).read_bytes() == script.read_bytes()
        with Gradebook(f"sqlite:///{course / 'gradebook.db'}", course_id="scalelab") as gradebook:
            submission = gradebook.find_submission("lab3", student)
            scores[student] = (submission.score, submission.max_score)
    # The idler keeps the exercises' 8 points (the solved notebook) and loses the script's 12.
    assert scores == {"converter": (20.0, 20.0), "idler": (8.0, 20.0)}
