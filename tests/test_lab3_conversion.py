"""Lab 3's graded conversion of `fashion_mnist_student.py` against wrong conversions.

The notebook's conversion cells call `scalelab.horovod_checks`: each cell's visible part asks whether a step was
started, its hidden tests whether it was done right. Here every cell runs (as nbgrader runs it) against the
instructor's conversion, `source_code/fashion_mnist_horovod.py`, which passes, and against copies of it with one
plausible mistake each, which the named cell must reject with an AssertionError that explains the mistake. The
step files of the worked solution pass exactly the checks of the steps they have made. The graded two-rank run
tells a conversion whose ranks end with different weights from one whose ranks agree, and nbgrader's autograde
grades the student's script, not the released copy."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path
from typing import NamedTuple

import nbformat
import pytest
from nbgrader.api import Gradebook

import labtools
from conftest import PROJECT_ROOT
from labtools import LABS, cell_by_grade_id, nbgrader
from scalelab import horovod_checks

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

# Lines of the instructor's conversion the wrong versions below change.
INIT = "hvd.init()\n"
BUILD_MODEL = "model = small_cnn(input_shape=(28, 28, 1), num_classes=10, weight_decay=args.wd)\n"
PIN = "pin_gpu(hvd.local_rank())\n"
BROADCAST = "    hvd.callbacks.BroadcastGlobalVariablesCallback(0),\n"
METRIC_AVERAGE = "    hvd.callbacks.MetricAverageCallback(),\n"
WRAP = "optimizer = hvd.DistributedOptimizer(optimizer, groups=1)\n"
SCALE_LR = "peak_lr = scaled_learning_rate(args.base_lr, hvd.size())\n"
STEPS = "steps_per_epoch = len(train_images) // (args.batch_size * hvd.size())\n"
SHARD = "    train_images, train_labels = shard_arrays(train_images, train_labels, hvd.rank(), hvd.size())\n"
CHECKPOINT_GUARD = "if is_chief:\n    # Horovod: only rank 0 writes checkpoints"
CHECKPOINT = "    callbacks.append(tf.keras.callbacks.ModelCheckpoint(str(args.output_dir / \"checkpoint.keras\")))\n"
FINAL_PRINT = "if is_chief:\n    print(f\"final val_accuracy"


class Wrong(NamedTuple):
    edits: tuple          # (old, new) text replacements in the instructor's conversion, each old text found once
    cell: str             # the step whose graded cell must reject it
    caught_by: str        # "hidden": the visible part passes, the hidden tests reject; "visible": already visible
    message: str          # a fragment of the assertion message that must explain the mistake
    also: tuple = ()      # other steps the mistake really breaks too


WRONG = {
    "hvd.init() after the model is built": Wrong(
        ((INIT, ""), (BUILD_MODEL, BUILD_MODEL + INIT)), "init", "hidden", "before the model is built",
        also=("pin_device",)),     # pin_gpu(hvd.local_rank()) now runs before hvd.init()
    "no hvd.init()": Wrong(((INIT, ""),), "init", "visible", "call hvd.init()"),
    "the GPU chosen by the global rank": Wrong(((PIN, "pin_gpu(hvd.rank())\n"),), "pin_device", "visible",
                                               "local rank"),
    "the device pinned after the model is built": Wrong(
        ((PIN, ""), (BUILD_MODEL, BUILD_MODEL + PIN)), "pin_device", "hidden", "before the model is built"),
    "EpochPrinter prints on every rank": Wrong(
        (("EpochPrinter(args.epochs, is_chief=is_chief)", "EpochPrinter(args.epochs)"),), "rank0_output", "hidden",
        "EpochPrinter(...) on line"),
    "a print() on every rank": Wrong(((FINAL_PRINT, "if True:\n    print(f\"final val_accuracy"),), "rank0_output",
                                     "hidden", "runs on every rank"),
    "fit's progress bar on every rank": Wrong(
        (("callbacks=callbacks, verbose=0)", "callbacks=callbacks, verbose=1)"),), "rank0_output", "hidden",
        "must be 0 on every rank but 0"),
    "the learning rate not scaled": Wrong(((SCALE_LR, "peak_lr = args.base_lr\n"),), "scaled_lr", "hidden",
                                          "not multiplied by hvd.size()"),
    "square-root scaling instead of linear": Wrong(
        ((SCALE_LR, "peak_lr = scaled_learning_rate(args.base_lr, hvd.size(), rule=\"sqrt\")\n"),), "scaled_lr",
        "hidden", "scale the learning rate linearly"),
    "compile given the plain optimizer": Wrong(
        ((WRAP, "distributed_optimizer = hvd.DistributedOptimizer(optimizer, groups=1)\n"),),
        "distributed_optimizer", "hidden", "plain optimizer"),
    "no broadcast": Wrong(((BROADCAST, ""),), "broadcast", "visible", "BroadcastGlobalVariablesCallback(0)"),
    "a broadcast from rank 1": Wrong(((BROADCAST, BROADCAST.replace("(0)", "(1)")),), "broadcast", "hidden",
                                     "broadcast from rank 0"),
    "a broadcast on rank 0 only": Wrong(
        ((BROADCAST, ""), (CHECKPOINT_GUARD, "if is_chief:\n    callbacks.insert(0, "
                           "hvd.callbacks.BroadcastGlobalVariablesCallback(0))\n    # Horovod: only rank 0 writes "
                           "checkpoints")), "broadcast", "hidden", "every rank takes part in the broadcast"),
    "the steps per epoch not divided by size": Wrong(
        ((STEPS, "steps_per_epoch = len(train_images) // args.batch_size\n"),), "steps_per_epoch", "hidden",
        "divide the steps per epoch by hvd.size()"),
    "the steps counted from this rank's shard": Wrong(
        ((STEPS, ""), (SHARD, SHARD + "steps_per_epoch = len(train_images) // args.batch_size\n")),
        "steps_per_epoch", "hidden", "the same number of steps"),
    "MetricAverageCallback after EarlyStopping": Wrong(
        ((METRIC_AVERAGE, "    tf.keras.callbacks.EarlyStopping(monitor=\"val_accuracy\", patience=args.patience),\n"
                          + METRIC_AVERAGE),), "metric_average", "hidden", "before EarlyStopping"),
    "MetricAverageCallback appended after the others": Wrong(
        ((METRIC_AVERAGE, ""), (CHECKPOINT_GUARD, "callbacks.append(hvd.callbacks.MetricAverageCallback())\n"
                                                  + CHECKPOINT_GUARD)),
        "metric_average", "hidden", "before StopAtAccuracy"),
    "no metric averaging": Wrong(((METRIC_AVERAGE, ""),), "metric_average", "visible", "MetricAverageCallback()"),
    "checkpoints written by every rank": Wrong(
        ((CHECKPOINT_GUARD, "if True:\n    # Horovod: only rank 0 writes checkpoints"),), "rank0_checkpoint",
        "hidden", "written by every rank"),
    "checkpoints written by local rank 0": Wrong(
        ((CHECKPOINT_GUARD, "if hvd.local_rank() == 0:\n    # Horovod: only rank 0 writes checkpoints"),),
        "rank0_checkpoint", "hidden", "local rank 0 of every machine"),
}

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


def wrong_conversion(mistake: Wrong, folder: Path) -> Path:
    text = SOLUTION.read_text()
    for old, new in mistake.edits:
        assert text.count(old) == 1, f"the instructor's conversion no longer holds {old!r} once"
        text = text.replace(old, new)
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / STUDENT_SCRIPT_NAME
    script.write_text(text)
    return script


def run_cell(source: str, script) -> str | None:
    """Run a graded cell's code as the notebook would, with STUDENT_SCRIPT pointing at ``script``: None when it
    passes, else "ErrorName: message"."""
    namespace = {"horovod_checks": horovod_checks, "STUDENT_SCRIPT": script, "CONTROLLER": "--gloo"}
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
    assert sum(graded.values()) == 18
    # The hidden tests check the step, not that a string occurs: each calls the course library's checker.
    for step, grade_id in CELLS.items():
        whole, visible = graded_cell(grade_id)
        assert f'horovod_checks.check(STUDENT_SCRIPT, "{step}")' in whole.split(HIDDEN_TESTS)[1]


def test_the_instructors_conversion_passes_every_check_and_the_released_script_none(tmp_path):
    for step, grade_id in CELLS.items():
        whole, visible = graded_cell(grade_id)
        assert run_cell(whole, SOLUTION) is None, step
        released = run_cell(visible, RELEASED_SCRIPT)
        assert released is not None and released.startswith("AssertionError"), f"{step}: {released}"
    assert run_cell(graded_cell(TWO_RANKS_CELL)[1], SOLUTION) is None
    assert run_cell(graded_cell(TWO_RANKS_CELL)[1], RELEASED_SCRIPT).startswith("AssertionError")


def test_the_released_script_is_the_serial_script_with_a_fixme_at_every_step_and_the_same_options():
    text = RELEASED_SCRIPT.read_text()
    for step in range(1, 9):
        assert f"# FIXME(Horovod) step {step}:" in text, step
    imported = horovod_checks.Script(text).aliases.values()
    assert not any(module.startswith("horovod") for module in imported), "Horovod is only named in the FIXMEs"
    assert "BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text
    assert horovod_checks.problems(RELEASED_SCRIPT, "cli") == []
    # The same program as the serial script, statement for statement (docstrings and comments aside), plus only the
    # import of the helpers the FIXMEs name: a change to source_code/fashion_mnist.py must be made here too.
    def statements(source: str, helpers_import: str | None = None) -> list[str]:
        body = ast.parse(source).body[1:]                                   # after the module's docstring
        return [ast.dump(node) for node in body if ast.unparse(node) != helpers_import]
    assert statements(text, "from scalelab.runtime import configure_threads, pin_gpu") == \
        statements((SOURCE / "fashion_mnist.py").read_text())


@pytest.mark.parametrize("name", list(WRONG))
def test_the_graded_cell_rejects_the_wrong_conversion(name, tmp_path):
    mistake = WRONG[name]
    script = wrong_conversion(mistake, tmp_path)
    whole, visible = graded_cell(CELLS[mistake.cell])
    graded, seen = run_cell(whole, script), run_cell(visible, script)
    assert graded is not None and graded.startswith("AssertionError"), f"{name!r} was not rejected: {graded}"
    assert mistake.message in graded, f"{name!r} was rejected for another reason: {graded}"
    if mistake.caught_by == "hidden":
        assert seen is None, f"{name!r} already fails the visible check: {seen}"
    else:
        assert seen is not None and seen.startswith("AssertionError"), name


@pytest.mark.parametrize("name", [name for name, mistake in WRONG.items() if mistake.caught_by == "hidden"])
def test_a_wrong_step_costs_only_its_own_points(name, tmp_path):
    mistake = WRONG[name]
    script = wrong_conversion(mistake, tmp_path)
    failing = {step for step, grade_id in CELLS.items() if run_cell(graded_cell(grade_id)[0], script) is not None}
    assert failing == {mistake.cell, *mistake.also}, f"{name!r} fails {sorted(failing)}"


@pytest.mark.parametrize("index", range(len(STEP_FILES)), ids=[path.stem for path, _ in STEP_FILES])
def test_each_step_file_of_the_worked_solution_passes_the_checks_of_the_steps_it_has_made(index):
    path, _ = STEP_FILES[index]
    made = {step for _, steps in STEP_FILES[:index + 1] for step in steps}
    for step in CELLS:
        found = horovod_checks.problems(path, step)
        assert (found == []) == (step in made), f"{path.name}, {step}: {found}"


def test_the_checker_follows_other_spellings_of_a_right_conversion(tmp_path):
    """Aliases, direct imports, an inline wrapper and an in-place scaled rate are as good as the course's style."""
    text = SOLUTION.read_text()
    replacements = [
        ("import horovod.tensorflow.keras as hvd\n", "import horovod.tensorflow.keras as horovod\n"
                                                     "from horovod.tensorflow.keras.callbacks import "
                                                     "MetricAverageCallback\n"),
        ("hvd.callbacks.MetricAverageCallback()", "MetricAverageCallback()"),
        (SCALE_LR, "args.base_lr *= horovod.size()\npeak_lr = args.base_lr\n"),
        (WRAP, ""),
        ('model.compile(optimizer=optimizer,', 'model.compile(optimizer=horovod.DistributedOptimizer(optimizer),'),
        ("is_chief = hvd.rank() == 0", "is_chief = not horovod.rank()"),
        ("hvd.", "horovod."),
    ]
    for old, new in replacements:
        assert old in text, old
        text = text.replace(old, new)
    script = tmp_path / STUDENT_SCRIPT_NAME
    script.write_text(text)
    assert {step: horovod_checks.problems(script, step) for step in CELLS} == {step: [] for step in CELLS}


def test_a_script_that_does_not_parse_or_is_missing_is_reported_not_crashed(tmp_path):
    broken = tmp_path / STUDENT_SCRIPT_NAME
    broken.write_text("import horovod.tensorflow.keras as hvd\nhvd.init(\n")
    assert "does not parse" in horovod_checks.problems(broken, "init")[0]
    assert "is missing" in horovod_checks.problems(tmp_path / "nothing.py", "init")[0]
    with pytest.raises(ValueError):
        horovod_checks.problems(SOLUTION, "no such step")


# ------------------------------------------------------------------ the graded two-rank run (slow)

@pytest.mark.slow
@pytest.mark.parametrize("removed", [(BROADCAST, WRAP), (BROADCAST,)], ids=["no broadcast nor DistributedOptimizer",
                                                                          "no broadcast"])
def test_the_graded_two_rank_run_rejects_ranks_that_end_with_different_weights(removed, tmp_path):
    edits = tuple((line, "") for line in removed)      # without the wrap, compile takes the plain SGD
    script = wrong_conversion(Wrong(edits, "", "", ""), tmp_path / "script")
    run = horovod_checks.run_two_ranks(script, tmp_path / "run")
    assert run.returncode == 0, run.output
    assert sorted(run.records) == [0, 1] and run.same_weights is False
    assert run.records[0]["sha256"] != run.records[1]["sha256"]
    if WRAP in removed:
        # The hidden test itself, as nbgrader runs it.
        outcome = run_cell(graded_cell(TWO_RANKS_CELL)[0], script)
        assert outcome is not None and "different weights" in outcome, outcome


@pytest.mark.slow
def test_the_graded_two_rank_run_of_the_released_script_explains_what_is_missing(tmp_path):
    run = horovod_checks.run_two_ranks(RELEASED_SCRIPT, tmp_path)
    assert run.returncode == 0, run.output
    assert run.problems and "name the digest files by hvd.rank()" in run.problems[0]


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
    assert scores == {"converter": (18.0, 18.0), "idler": (6.0, 18.0)}
