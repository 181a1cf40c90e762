"""Lab 3 (Horovod step by step, the student converts the script): the solved notebook runs end to end with small
settings next to a converted `fashion_mnist_student.py` (the instructor's, `source_code/fashion_mnist_horovod.py`),
its graded two-rank run really happens, and nbgrader's student release ships the FIXME script and keeps the
exercises unsolved (validation fails) while the solved source validates."""

from __future__ import annotations

import re
import shutil

import pytest

import labtools
from conftest import PROJECT_ROOT, keras_only
from labtools import LABS, execute, outputs_of, validate
from scalelab.grader.labchecks import conversion_hints, conversion_questions

LAB_FOLDER = LABS / "source" / "lab3"
SOURCE_NOTEBOOK = LAB_FOLDER / "lab3_horovod.ipynb"
STUDENT_SCRIPT_NAME = "fashion_mnist_student.py"
SOLUTION_SCRIPT = PROJECT_ROOT / "source_code" / "fashion_mnist_horovod.py"
SMALL_SETTINGS = dict(STEP_EPOCHS=1, STEP_TRAIN_IMAGES=512, VAL_IMAGES=256, SWEEP_EPOCHS=2,
                      SWEEP_TRAIN_IMAGES=1024, NP_LIST=[1, 2], CONTROLLER="--gloo",
                      PRACTICE_EPOCHS=4, PRACTICE_TRAIN_IMAGES=512)
# The exercises and the conversion checks: 6 cells, 8 points, and 10 cells, 12 points.
GRADED_CELLS, POINTS = 16, 20
# "Horovod in practice" at the small settings: 512 images, 64 per step on each of 2 ranks; the first job dies halfway.
PRACTICE_STEPS_PER_EPOCH, KILLED_AFTER = 512 // (64 * 2), 4 // 2
PRACTICE_SCRIPTS = ("resume_demo.py", "elastic_demo.py")

# The Keras edition's: skipped, with the reason, where `make setup` installed the PyTorch edition alone.
pytestmark = [pytest.mark.slow, keras_only]


def solved_lab_folder(parent):
    """A copy of the lab's folder where the student's script is the instructor's conversion."""
    folder = parent / "lab3"
    shutil.copytree(LAB_FOLDER, folder)
    shutil.copy(SOLUTION_SCRIPT, folder / STUDENT_SCRIPT_NAME)
    return folder


@pytest.fixture(scope="module")
def executed_lab3(tmp_path_factory):
    # The notebook runs in (a copy of) its own folder, as a student's does: the script it grades is there.
    folder = solved_lab_folder(tmp_path_factory.mktemp("lab3"))
    return execute(folder / SOURCE_NOTEBOOK.name, folder, SMALL_SETTINGS)


def test_lab3_source_is_committed_without_outputs_and_with_a_parameters_cell():
    labtools.check_committed_source(SOURCE_NOTEBOOK, SMALL_SETTINGS)


def test_lab3_runs_the_students_script_under_horovodrun_without_errors(executed_lab3):
    outputs = outputs_of(executed_lab3)
    assert outputs.errors == []
    text = outputs.text
    assert f"python {STUDENT_SCRIPT_NAME} " in text, "the student's script did not run under horovodrun"
    assert "$ horovodrun -np 2 --gloo" in text
    # The worked solution is released after the lab: the notebook neither diffs nor runs the step files.
    assert "step1_init.py" not in text


def test_lab3_shows_rank0_output_identical_weights_and_a_checkpoint(executed_lab3):
    text = outputs_of(executed_lab3).text
    assert "ranks that printed epoch lines: ['[0]']" in text
    # The step-5 run and the `!horovodrun` run of the finished script.
    assert re.findall(r"same final weights on both ranks: (\w+)", text) == ["True", "True"]
    assert "checkpoint written: True" in text


def test_lab3_grades_a_real_two_rank_run_of_the_students_script(executed_lab3):
    text = outputs_of(executed_lab3).text
    # The report the notebook prints is the graded run's answer for every step: all right for the solved script.
    answers = re.findall(r"^  (ok|NO)  ([a-z0-9 ]+)", text, flags=re.MULTILINE)
    assert "graded two-rank run of fashion_mnist_student.py" in text
    assert [step for _, step in answers] == [step.replace("_", " ") for step in conversion_questions.STEPS]
    assert {answer for answer, _ in answers} == {"ok"}, text


def test_lab3_fills_the_scaling_efficiency_table_from_real_runs(executed_lab3):
    html = outputs_of(executed_lab3).html
    tables = [fragment for fragment in html if "<th>scaling efficiency</th>" in fragment]
    assert len(tables) == 1
    rows = re.findall(r"<tr><td>(\d+)</td><td>(\d+)</td><td>([\d.]+)</td><td>([\d.]+)</td></tr>", tables[0])
    assert [row[0] for row in rows] == ["1", "2"]
    assert all(int(row[1]) > 0 for row in rows)
    assert rows[0][3] == "1.00" and 0 < float(rows[1][3]) <= 1.5


def test_lab3_shows_recorded_tables_and_plots_labelled_as_recorded(executed_lab3):
    outputs = outputs_of(executed_lab3)
    recorded = [fragment for fragment in outputs.html if "<caption>recorded" in fragment]
    assert len(recorded) == 2, "the recorded scaling (CPU and GPU) and the recorded full run"
    cpu = re.findall(r"<tr><td>2 CPU cores \(this course\)</td><td>FP32</td><td>(\d)</td><td>(\d+)</td>"
                     r"<td>([\d.]+)</td>", recorded[0])
    assert [row[0] for row in cpu] == ["1", "2"] and cpu[0][2] == "1.00" and all(int(row[1]) > 0 for row in cpu)
    gpu = re.findall(r"<tr><td>DGX-1 \(8x V100 16GB\)</td><td>FP32 \+ XLA</td><td>(\d)</td><td>([\d,]+)</td>"
                     r"<td>([\d.]+)</td>", recorded[0])
    assert gpu == [("1", "412", "1.00"), ("8", "3,170", "0.96")]          # 3170 / (8 x 412)
    assert recorded[1].count("<tr><td>") >= 2, "the recorded full run's epochs"
    assert outputs.images >= 2, "the scaling-efficiency plot and the full run's curves"


def test_lab3_gpu_section_runs_nvidia_smi_or_shows_the_recorded_example(executed_lab3):
    text = outputs_of(executed_lab3).text
    assert "GPUs on this machine" in text or ("No GPU here" in text and "NVIDIA H100" in text)


def test_lab3_resumes_the_killed_job_at_the_epoch_of_its_newest_checkpoint(executed_lab3):
    text = outputs_of(executed_lab3).text
    assert f"the last rank dies after epoch {KILLED_AFTER}" in text
    assert re.search(r"horovodrun exited with status [1-9]", text), "the killed job must fail"
    # Rank 0 wrote a checkpoint of each finished epoch, and nothing of the one the job died in.
    assert "left in resume_killed/: checkpoint-epoch001.keras, checkpoint-epoch002.keras, history.jsonl" in text
    assert (f"resuming from checkpoint-epoch002.keras: epoch 2 of 4 done, optimizer step "
            f"{KILLED_AFTER * PRACTICE_STEPS_PER_EPOCH}; the same epoch, step and weights on all 2 ranks: True") in text
    resumed_job = text.split("resuming from", 1)[1].split("$ horovodrun", 1)[0]
    assert re.findall(r"epoch (\d)/4 ", resumed_job) == ["3", "4"], "the resumed job trains the epochs left, only"


def test_lab3_resumed_job_ends_exactly_where_the_straight_one_does(executed_lab3):
    outputs = outputs_of(executed_lab3)
    [table] = [fragment for fragment in outputs.html if "<caption>killed and resumed" in fragment]
    rows = re.findall(r"<tr><td>(\d+)</td><td>(killed job|resumed job)</td><td>(\d+)</td><td>([\d.e-]+)</td>"
                      r"<td>([\d.]+)</td><td>([\d.]+)</td><td>(True|False)</td></tr>", table)
    assert [(epoch, by) for epoch, by, *_ in rows] == [("1", "killed job"), ("2", "killed job"), ("3", "resumed job"),
                                                       ("4", "resumed job")]
    assert [int(row[2]) for row in rows] == [PRACTICE_STEPS_PER_EPOCH * epoch for epoch in (1, 2, 3, 4)]
    assert {row[6] for row in rows} == {"True"}, "every epoch's figures equal the straight job's"
    rates = [float(row[3]) for row in rows]
    # The schedule went on (a step decay after epoch 2) instead of starting its warmup again (back up to the peak).
    assert rates[2] < rates[1] and rates[3] < rates[2]
    assert "resumed job: rank 0 and rank 1 end with identical weights: True" in outputs.text
    assert "resumed job against straight job, weight for weight: identical True (largest difference 0)" in outputs.text
    assert outputs.images >= 4, "the two plots of Horovod in practice, after the two before"


def test_lab3_shows_hvd_load_model_failing_on_the_checkpoint_as_the_text_says(executed_lab3):
    text = outputs_of(executed_lab3).text
    assert re.search(r"hvd\.load_model\(checkpoint-epoch002\.keras\) fails with Horovod 0\.28\.\S+ and TensorFlow "
                     r"2\.15\.\d+:\n +TypeError: Could not locate class 'SGD'", text)


def test_lab3_applies_the_students_resume_plan_to_the_killed_jobs_folder(executed_lab3):
    text = outputs_of(executed_lab3).text
    step = KILLED_AFTER * PRACTICE_STEPS_PER_EPOCH
    assert (f"your plan, rank 0: {{'load': 'checkpoint-epoch002.keras', 'initial_epoch': 2, 'initial_step': {step}}}"
            in text)
    assert f"your plan, rank 1: {{'load': None, 'initial_epoch': 2, 'initial_step': {step}}}" in text
    assert "your plan agrees with what the script did: True" in text


def test_lab3_elastic_job_loses_a_worker_and_goes_on_from_the_last_commit(executed_lab3):
    outputs = outputs_of(executed_lab3)
    text = outputs.text
    assert "--network-interface lo python elastic_demo.py" in text
    assert f"epoch {KILLED_AFTER} done: waiting up to" in text
    assert "localhost[1] has been removed from elastic job" in text
    assert (f"reset: the job now has 1 rank(s); training goes on from the last commit (epoch {KILLED_AFTER} done, "
            "batch 0 of the next)") in text
    assert re.findall(r"epoch (\d)/4  ranks (\d)", text) == [("1", "2"), ("2", "2"), ("3", "1"), ("4", "1")]
    assert "done: 4 epochs, 1 rank(s) at the end" in text
    [table] = [fragment for fragment in outputs.html if "<caption>elastic job" in fragment]
    rows = re.findall(r"<tr><td>([\d.]+)</td><td>(\w+)</td><td>(\d+)</td><td>(\d)</td><td>(\d*)</td><td>([\d.]*)</td>",
                      table)
    assert [(event, done, ranks) for _, event, done, ranks, *_ in rows] == [
        ("start", "0", "2"), ("epoch", "1", "2"), ("epoch", "2", "2"), ("reset", "2", "1"), ("epoch", "3", "1"),
        ("epoch", "4", "1")]
    # One rank left: each epoch takes it twice the steps.
    steps = [int(row[4]) for row in rows if row[1] == "epoch"]
    assert steps == [PRACTICE_STEPS_PER_EPOCH] * 2 + [2 * PRACTICE_STEPS_PER_EPOCH] * 2
    seconds = [float(row[0]) for row in rows]
    assert seconds == sorted(seconds)


@pytest.fixture(scope="module")
def released_course(tmp_path_factory):
    return labtools.released_course(tmp_path_factory, "lab3")


def test_lab3_release_ships_the_fixme_script_has_no_solutions_and_its_checks_fail_validation(released_course):
    released = released_course / "release" / "lab3"
    script = released / STUDENT_SCRIPT_NAME
    assert script.read_bytes() == (LAB_FOLDER / STUDENT_SCRIPT_NAME).read_bytes()
    assert script.read_text().count("FIXME(Horovod)") >= 9
    assert conversion_hints.hints(script, "init"), "the released script is not converted yet"
    text = (released / "lab3_horovod.ipynb").read_text()
    assert "### BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text
    assert "conversion_questions.check(" not in text, "the graded run is a hidden test"
    assert "raise NotImplementedError" in text
    results = validate(released / "lab3_horovod.ipynb")
    # Every exercise and every conversion check fails on the unsolved notebook and the FIXME script.
    assert len(results.get("failed", [])) == GRADED_CELLS, results.keys()


def test_lab3_release_ships_the_scripts_of_horovod_in_practice(released_course):
    for name in PRACTICE_SCRIPTS:
        assert (released_course / "release" / "lab3" / name).read_bytes() == (LAB_FOLDER / name).read_bytes()


def test_lab3_solved_source_passes_validation(released_course):
    source = released_course / "source" / "lab3"
    shutil.copy(SOLUTION_SCRIPT, source / STUDENT_SCRIPT_NAME)
    assert validate(source / "lab3_horovod.ipynb") == {}
