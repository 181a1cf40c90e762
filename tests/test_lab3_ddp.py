"""Lab 3, PyTorch edition (DDP): the serial script learns, the worked solution passes every step's question of a
probed two-rank torchrun run, each wrong conversion (the solution with one step undone or done wrong) is rejected by
its own step's question with a sentence that names the mistake (and by no other step, except those that cannot be
answered once the run has failed), the released script is the serial script with a FIXME at every step, the
exercises reject wrong answers, and the solved notebook runs with small settings."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import nbformat
import pytest
from nbgrader.api import Gradebook

import labtools
from conftest import PROJECT_ROOT, subprocess_env
from labtools import LABS, Wrong, assert_rejected, cell_by_grade_id, execute, nbgrader, outputs_of
from scalelab.grader.labchecks import ddp_hints, ddp_questions, ddp_run

SOURCE = PROJECT_ROOT / "source_code"
SERIAL = SOURCE / "fashion_mnist_pytorch.py"
SOLUTION = SOURCE / "fashion_mnist_ddp.py"
LAB_FOLDER = LABS / "source" / "lab3_ddp"
NOTEBOOK = LAB_FOLDER / "lab3_ddp.ipynb"
STUDENT_SCRIPT_NAME = "fashion_mnist_ddp_student.py"
RELEASED_SCRIPT = LAB_FOLDER / STUDENT_SCRIPT_NAME
SMALL_SETTINGS = dict(RUN_EPOCHS=1, TRAIN_IMAGES=512, VAL_IMAGES=256)
# A hang is stopped sooner here than in the notebook (45 s): the ranks report something new every second or so.
STALL_S = 20
HIDDEN_TESTS = "### BEGIN HIDDEN TESTS"
CELLS = {"init": "conv-init-tests", "sampler": "conv-sampler-tests", "ddp": "conv-ddp-tests",
         "scaled_lr": "conv-scaled-lr-tests", "metrics": "conv-metrics-tests",
         "rank0_writes": "conv-rank0-writes-tests", "two_ranks": "conv-two-ranks-tests"}
EPOCH_LINE = re.compile(r"^epoch (\d+)/(\d+)  loss (\d+\.\d{4})  accuracy (\d\.\d{4})  val_loss \d+\.\d{4}  "
                        r"val_accuracy (\d\.\d{4})  lr [0-9.e-]+  img/s \d+  elapsed \d+\.\d s$")

INIT = 'dist.init_process_group("gloo")\n'
SET_EPOCH = "    train_sampler.set_epoch(epoch)\n"
WRAP = "model = DistributedDataParallel(model)\n"
SAVE_MODULE = "torch.save(model.module.state_dict()"
DIGEST_MODULE = "for tensor in model.module.state_dict().values()"
SCALED_LR = "lr=args.lr * world_size"
METRIC_REDUCE = "    dist.all_reduce(totals, op=dist.ReduceOp.SUM)\n"
EPOCH_PRINT_GUARD = "    if is_chief:\n        print(format_epoch("
# Once the run has failed, these steps can only say where it stopped.
STEPS_AFTER_INIT = ("sampler", "ddp", "scaled_lr", "metrics", "rank0_writes")


class Conversion(NamedTuple):
    edits: tuple                   # (old, new) replacements in the worked solution, each old text once
    rejected_by: dict              # step -> a fragment of its message; every other step must pass


WRONG = {
    "the NCCL backend on CPUs": Conversion(((INIT, 'dist.init_process_group("nccl")\n'),), {
        "init": "'nccl' backend, which needs a GPU", "two_ranks": "failed"}
        | {step: "stopped before" for step in STEPS_AFTER_INIT}),
    "no set_epoch": Conversion(((SET_EPOCH, ""),), {"sampler": "was at epoch [0, 0] in the 2 epochs"}),
    "no DDP wrapper": Conversion(((WRAP, ""), (SAVE_MODULE, "torch.save(model.state_dict()"),
                                  (DIGEST_MODULE, "for tensor in model.state_dict().values()")),
                                 {"ddp": "without DistributedDataParallel", "two_ranks": "different weights"}),
    "the learning rate not scaled": Conversion(((SCALED_LR, "lr=args.lr"),), {"scaled_lr": "the same as --lr"}),
    "the metrics not all-reduced": Conversion(((METRIC_REDUCE, ""),), {"metrics": "all-reduced nothing in epoch 1"}),
    "every rank prints and saves": Conversion(((EPOCH_PRINT_GUARD, "    if True:\n        print(format_epoch("),),
                                              {"rank0_writes": "rank 1 wrote checkpoint.pt too"}),
}


def recorded_rank(rank: int) -> dict:
    """What the probe records of one rank of the worked solution's graded run (two epochs of 4 steps; a training
    pass and a validation pass each epoch; two all-reduces each epoch)."""
    order = {epoch: [(index * 37 + epoch * 11) % 256 for index in range(256)] for epoch in (0, 1)}
    training = [{"sampler": "DistributedSampler", "distributed": True, "sampler_epoch": epoch, "dataset_size": 256,
                 "indices": order[epoch][rank::2], "batches": 4, "steps": 4, "num_replicas": 2, "sampler_rank": rank,
                 "shuffle": True} for epoch in (0, 1)]
    validation = {"sampler": "SequentialSampler", "distributed": False, "sampler_epoch": None, "dataset_size": 64,
                  "indices": None, "batches": 1, "steps": 0}
    chief = rank == 0
    return {"rank": rank, "stage": "finished", "error": None, "steps": 8, "peak_lr": 0.02,
            "init": {"backend_asked": "gloo", "calls": 1, "backend": "gloo", "rank": rank, "world_size": 2},
            "passes": [training[0], dict(validation), training[1], dict(validation)],
            "ddp": [{"module": "SmallCNN", "group_ready": True}], "ddp_training_forwards": 8,
            "all_reduces": [{"shape": [3], "dtype": "torch.float64", "op": "SUM", "passes_started": started,
                             "steps": 4 * (started > 2)} for started in (1, 2, 3, 4)],
            "writes": [{"how": "torch.save", "path": "/run/output/checkpoint.pt"}] * 2 if chief else [],
            "printed": [f"epoch {epoch}/2  loss 1.9000  accuracy 0.3100  val_loss 1.7000  val_accuracy 0.4000"
                        for epoch in (1, 2)] if chief else [],
            "weights": {"first_step": "a", "after_passes": ["b", "c"], "end": "c"}}


def recorded_run(change=None, finished: bool = True) -> ddp_run.DDPRun:
    records = {rank: recorded_rank(rank) for rank in (0, 1)}
    if change is not None:
        change(records)
    return ddp_run.DDPRun(0 if finished else None, None if finished else "no rank did anything new for 45 s",
                          records=records)


def rank_one(change):
    return lambda records: change(records[1])


def both_ranks(change):
    return lambda records: [change(record) for record in records.values()]


def training_of(record: dict) -> list[dict]:
    return [entry for entry in record["passes"] if entry["steps"]]


# Records a mistake leaves -> {step: a fragment of its message}; every other step must pass.
RECORDED_MISTAKES = {
    "a group of one process per rank": (both_ranks(lambda record: record["init"].update(world_size=1)),
                                        {"init": "has 1 process(es), but torchrun started 2"}),
    "a DataLoader that shuffles by itself": (
        both_ranks(lambda record: [entry.update(sampler="RandomSampler", distributed=False, indices=None)
                                   for entry in training_of(record)]),
        {"sampler": "with a RandomSampler, not a DistributedSampler"}),
    "rank 0's share on every rank": (
        rank_one(lambda record: [entry.update(sampler_rank=0) for entry in training_of(record)]),
        {"sampler": "rank 1's DistributedSampler hands it share 0"}),
    "a seed per rank": (rank_one(lambda record: training_of(record)[0].update(indices=list(range(0, 256, 2)))),
                        {"sampler": "of the same images as rank 0"}),
    "shuffle=False": (both_ranks(lambda record: [
        entry.update(shuffle=False, indices=list(range(record["rank"], 256, 2))) for entry in training_of(record)]),
        {"sampler": "shuffle=False"}),
    "the plain model trained": (both_ranks(lambda record: record.update(ddp_training_forwards=0)),
                                {"ddp": "trained the plain model"}),
    "the rate scaled twice": (both_ranks(lambda record: record.update(peak_lr=0.04)),
                              {"scaled_lr": "multiplied by the world size twice"}),
    "accuracies summed": (lambda records: records[0].update(printed=["epoch 1/2  loss 1.9000  accuracy 1.3100"]),
                          {"metrics": "printed accuracy 1.31, more than 1"}),
    "the all-reduce of rank 1 missing in epoch 2": (rank_one(lambda record: record.update(
        all_reduces=record["all_reduces"][:2])), {"metrics": "rank 1 all-reduced nothing in epoch 2"}),
    "rank 1 prints": (rank_one(lambda record: record.update(printed=["training on 256 images"])),
                      {"rank0_writes": "rank 1 printed 1 line(s)"}),
    "no checkpoint": (lambda records: records[0].update(writes=[]), {"rank0_writes": "rank 0 wrote no checkpoint"}),
    "ranks apart": (rank_one(lambda record: record["weights"].update(end="d")), {"two_ranks": "different weights"}),
}


def test_the_questions_pass_the_records_of_a_right_conversion():
    run = recorded_run()
    assert {step: ddp_questions.problems(run, step) for step in ddp_questions.STEPS} == {
        step: [] for step in ddp_questions.STEPS}


@pytest.mark.parametrize("name", RECORDED_MISTAKES)
def test_each_recorded_mistake_is_named_by_its_own_step_only(name):
    change, rejected_by = RECORDED_MISTAKES[name]
    run = recorded_run(change)
    found = {step: ddp_questions.problems(run, step) for step in ddp_questions.STEPS}
    assert {step for step, said in found.items() if said} == set(rejected_by), found
    for step, fragment in rejected_by.items():
        assert fragment in "; ".join(found[step]), found[step]


def test_a_run_stopped_before_training_says_where_it_stopped_instead_of_guessing():
    def stuck(records):
        records[1] = {**recorded_rank(1), "stage": "init_process_group", "steps": 0, "passes": [], "writes": [],
                      "printed": [], "all_reduces": [], "ddp": [], "init": {"backend_asked": "gloo", "calls": 1}}
    found = {step: ddp_questions.problems(recorded_run(stuck, finished=False), step) for step in ddp_questions.STEPS}
    for step in ("init", "sampler", "ddp", "scaled_lr", "metrics"):
        assert found[step] and "stopped before this could be seen (rank 0: finished; rank 1: init_process_group)" \
            in found[step][0], (step, found[step])
    assert found["two_ranks"] == ["the two-rank run was stopped: no rank did anything new for 45 s (rank 0: finished; "
                                  "rank 1: init_process_group)"]


def converted(edits: tuple, folder: Path) -> Path:
    text = SOLUTION.read_text()
    for old, new in edits:
        assert text.count(old) == 1, f"the worked solution no longer holds {old!r} once"
        text = text.replace(old, new)
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / STUDENT_SCRIPT_NAME
    script.write_text(text)
    return script


def answers(script: Path) -> tuple[ddp_run.DDPRun, dict[str, list[str]]]:
    before = labtools.runs_leftovers()
    run = ddp_questions.graded_run(script, stall_s=STALL_S)
    assert labtools.runs_leftovers() <= before, "the probed run, stopped or not, leaves nothing in the temporary folder"
    return run, {step: ddp_questions.problems(run, step) for step in ddp_questions.STEPS}


@pytest.mark.slow
def test_the_serial_script_learns_prints_one_line_per_epoch_and_writes_a_checkpoint(tmp_path):
    result = subprocess.run([sys.executable, str(SERIAL), "--epochs", "2", "--train-images", "2048", "--val-images",
                             "512", "--output-dir", str(tmp_path / "output")], capture_output=True, text=True,
                            timeout=300, env=subprocess_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    epochs = [EPOCH_LINE.match(line) for line in result.stdout.splitlines() if line.startswith("epoch ")]
    assert all(epochs) and [(match[1], match[2]) for match in epochs] == [("1", "2"), ("2", "2")], result.stdout
    assert float(epochs[1][3]) < float(epochs[0][3]), "the training loss falls"
    # Seeded: 0.328 here after these 32 steps (the first epoch hardly leaves chance, 0.1).
    assert float(epochs[1][5]) > 0.25, f"the model learns: {result.stdout}"
    assert "training on 2048 images, batch 128, 16 steps per epoch" in result.stdout
    assert (tmp_path / "output" / "checkpoint.pt").is_file()


@pytest.mark.slow
def test_the_worked_solution_passes_every_step_and_its_ranks_are_recorded():
    run, found = answers(SOLUTION)
    assert found == {step: [] for step in ddp_questions.STEPS}, run.tail
    assert run.finished and set(run.records) == {0, 1}
    steps_per_epoch = ddp_run.TRAIN_IMAGES // (ddp_run.BATCH_SIZE * ddp_run.SIZE)
    for rank, record in run.records.items():
        assert record["init"] == {"backend_asked": "gloo", "calls": 1, "backend": "gloo", "rank": rank,
                                  "world_size": 2}
        assert [entry["sampler_epoch"] for _, entry in ddp_questions.training_passes(record)] == [0, 1]
        assert [entry["steps"] for _, entry in ddp_questions.training_passes(record)] == [steps_per_epoch] * 2
        assert record["ddp"] == [{"module": "SmallCNN", "group_ready": True}]
        assert record["ddp_training_forwards"] == 2 * steps_per_epoch
        assert record["optimizers"] == [{"type": "SGD", "lrs": [2 * ddp_run.LR]}]
        # The script's own all-reduces only (DDP's gradient buckets go through its C++ reducer): two per epoch.
        assert [(call["shape"], call["dtype"], call["op"]) for call in record["all_reduces"]] == \
            [([3], "torch.float64", "SUM")] * 4
    first, second = (run.records[rank]["weights"] for rank in (0, 1))
    assert first["first_step"] == second["first_step"], "DDP starts every rank from rank 0's weights"
    assert first["after_passes"] == second["after_passes"] and first["end"] == second["end"]
    epoch_one = [set(ddp_questions.training_passes(run.records[rank])[0][1]["indices"]) for rank in (0, 1)]
    assert len(epoch_one[0]) == len(epoch_one[1]) == ddp_run.TRAIN_IMAGES // 2 and not epoch_one[0] & epoch_one[1]
    assert {Path(write["path"]).name for write in run.records[0]["writes"]} == {"checkpoint.pt"}
    assert run.records[1]["writes"] == [] and run.records[1]["printed"] == []
    assert sum(line.startswith("epoch ") for line in run.records[0]["printed"]) == ddp_run.EPOCHS


@pytest.mark.slow
@pytest.mark.parametrize("name", WRONG)
def test_each_mistake_is_rejected_by_its_own_step_with_a_sentence_that_names_it(name, tmp_path):
    mistake = WRONG[name]
    run, found = answers(converted(mistake.edits, tmp_path / "script"))
    rejected = {step for step, said in found.items() if said}
    assert rejected == set(mistake.rejected_by), (found, run.tail)
    for step, fragment in mistake.rejected_by.items():
        assert fragment in "; ".join(found[step]), (step, found[step])


def test_the_released_script_is_the_serial_script_with_a_fixme_at_every_step():
    text = RELEASED_SCRIPT.read_text()
    for step in range(1, 7):
        assert f"# FIXME(DDP) step {step}:" in text, step
    assert "BEGIN SOLUTION" not in text and "torch.distributed" not in ast.unparse(ast.parse(text))
    assert ddp_hints.hints(RELEASED_SCRIPT, "cli") == []
    assert all(ddp_hints.hints(RELEASED_SCRIPT, step) for step in ddp_hints.STARTED_BY), "nothing is converted yet"
    assert all(ddp_hints.hints(SOLUTION, step) == [] for step in ddp_hints.STEPS)

    # The serial program, statement for statement (docstrings and comments aside), plus the import of the helper a
    # FIXME names: a change to source_code/fashion_mnist_pytorch.py must be made here too.
    def statements(source: str, helper_import: str | None = None) -> list[str]:
        return [ast.dump(node) for node in ast.parse(source).body[1:] if ast.unparse(node) != helper_import]
    assert statements(text, "from scalelab.runtime import usable_cores") == statements(SERIAL.read_text())


def test_every_change_of_the_worked_solution_is_marked_for_the_student():
    marked = [line for line in SOLUTION.read_text().splitlines() if line.lstrip().startswith("# DDP:")]
    assert len(marked) >= 10
    for needed in ('dist.init_process_group("gloo")', "DistributedSampler(", "set_epoch(", WRAP.strip(), SCALED_LR,
                   "dist.all_reduce(", "torch.save(model.module"):
        assert needed in SOLUTION.read_text(), needed


def test_each_step_has_a_graded_cell_whose_hidden_part_asks_the_steps_question():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    graded = {cell.metadata.nbgrader["grade_id"]: cell.metadata.nbgrader["points"] for cell in notebook.cells
              if cell.metadata.get("nbgrader", {}).get("grade")}
    assert {grade_id for grade_id in graded if grade_id.startswith("conv-")} == set(CELLS.values())
    assert sum(graded[cell] for cell in CELLS.values()) == 8 and sum(graded.values()) == 12
    for step, grade_id in CELLS.items():
        cell = cell_by_grade_id(notebook, grade_id)
        assert cell.metadata.nbgrader["locked"] and HIDDEN_TESTS in cell.source
        visible, hidden = cell.source.split(HIDDEN_TESTS)
        assert f'ddp_questions.check(STUDENT_SCRIPT, "{step}")' in hidden, step
        assert "ddp_questions" not in visible and "ddp_hints.check(STUDENT_SCRIPT" in visible, step


def test_lab3_ddp_source_is_committed_without_outputs_and_with_a_parameters_cell():
    labtools.check_committed_source(NOTEBOOK, SMALL_SETTINGS)


SETUP = "import numpy as np"
EXERCISES = {
    ("ex1-sampler-indices", "ex1-tests"): {
        "no padding": Wrong(("return list(range(rank, num_images, world_size))",), "hidden", "pads the list"),
        "contiguous blocks": Wrong(("per_rank = num_images // world_size\n"
                                    "return list(range(rank * per_rank, (rank + 1) * per_rank))",), "visible", ""),
    },
    ("ex2-scaled-lr", "ex2-tests"): {
        "square-root scaling": Wrong(("return base_lr * world_size ** 0.5",), "visible", ""),
    },
    ("ex3-accuracy", "ex3-tests"): {
        "the mean of the ranks' accuracies": Wrong((
            "return sum(c / n for c, n in zip(correct_per_rank, count_per_rank)) / len(count_per_rank)",),
            "hidden", "add up the correct answers and the counts"),
    },
}


@pytest.mark.parametrize("exercise", EXERCISES, ids=[solution for solution, _ in EXERCISES])
def test_each_exercise_passes_the_reference_and_rejects_wrong_answers(exercise, tmp_path):
    solution_id, tests_id = exercise
    assert_rejected(NOTEBOOK, solution_id, tests_id, SETUP, EXERCISES[exercise], tmp_path)


def test_a_missing_script_and_an_unknown_step_are_refused_clearly(tmp_path):
    with pytest.raises(AssertionError, match="nothing.py is missing"):
        ddp_questions.check(tmp_path / "nothing.py", "init")
    with pytest.raises(ValueError, match="unknown step"):
        ddp_questions.problems(ddp_run.DDPRun(0, None), "no such step")
    assert "is missing" in ddp_hints.hints(tmp_path / "nothing.py", "init")[0]


@pytest.mark.slow
def test_the_solved_notebook_runs_its_scripts_and_reports_every_step_ok(tmp_path):
    folder = tmp_path / "lab3_ddp"
    shutil.copytree(LAB_FOLDER, folder)
    shutil.copy(SOLUTION, folder / STUDENT_SCRIPT_NAME)
    outputs = outputs_of(execute(folder / NOTEBOOK.name, folder, SMALL_SETTINGS))
    assert outputs.errors == []
    assert "training on 512 images, batch 128, 4 steps per epoch" in outputs.text, "the serial run"
    assert "training on 512 images, batch 128 per rank on 2 ranks, 2 steps per epoch" in outputs.text
    assert "same final weights on both ranks: True" in outputs.text
    assert "checkpoint written: True" in outputs.text
    answers_printed = re.findall(r"^  (ok|NO)  ([a-z0-9 ]+)", outputs.text, flags=re.MULTILINE)
    assert [step for _, step in answers_printed] == [step.replace("_", " ") for step in ddp_questions.STEPS]
    assert {answer for answer, _ in answers_printed} == {"ok"}, outputs.text


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    return labtools.released_course(tmp_path_factory, "lab3_ddp")


@pytest.mark.slow
def test_the_release_ships_the_fixme_script_and_no_solution(released):
    folder = released / "release" / "lab3_ddp"
    assert (folder / STUDENT_SCRIPT_NAME).read_bytes() == RELEASED_SCRIPT.read_bytes()
    text = (folder / NOTEBOOK.name).read_text()
    assert "### BEGIN SOLUTION" not in text and HIDDEN_TESTS not in text and "ddp_questions.check(" not in text
    assert "raise NotImplementedError" in text


@pytest.mark.slow
def test_autograde_in_the_sandbox_grades_the_students_script_not_the_released_copy(released):
    scores = {}
    for student, script in (("converter", SOLUTION), ("idler", RELEASED_SCRIPT)):
        submitted = released / "submitted" / student / "lab3_ddp"
        submitted.mkdir(parents=True)
        # The solved notebook for both: only the script differs.
        shutil.copy(released / "source" / "lab3_ddp" / NOTEBOOK.name, submitted / NOTEBOOK.name)
        shutil.copy(script, submitted / STUDENT_SCRIPT_NAME)
        nbgrader("autograde", "lab3_ddp", "--student", student, "--create", course=released, timeout=900)
        with Gradebook(f"sqlite:///{released / 'gradebook.db'}", course_id="scalelab") as gradebook:
            submission = gradebook.find_submission("lab3_ddp", student)
            scores[student] = (submission.score, submission.max_score)
    # The graded two-rank torchrun ran in the grading sandbox: the converter gets the script's 8 points, the idler
    # keeps the exercises' 4 (the solved notebook) and loses the script's.
    assert scores == {"converter": (12.0, 12.0), "idler": (4.0, 12.0)}
