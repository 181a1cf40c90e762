"""Lab 3 (Horovod step by step): the solved notebook runs end to end with small settings, and nbgrader's
student release keeps the exercises unsolved (validation fails) while the solved source validates."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import nbformat
import papermill
import pytest
from nbgrader.validator import Validator

from conftest import PROJECT_ROOT, VENV_BIN, subprocess_env

LABS = PROJECT_ROOT / "labs"
SOURCE_NOTEBOOK = LABS / "source" / "lab3" / "lab3_horovod.ipynb"
SMALL_SETTINGS = dict(STEP_EPOCHS=1, STEP_TRAIN_IMAGES=512, VAL_IMAGES=256, SWEEP_EPOCHS=2,
                      SWEEP_TRAIN_IMAGES=1024, NP_LIST=[1, 2], CONTROLLER="--gloo")

pytestmark = pytest.mark.slow


def outputs_of(notebook) -> tuple[str, list[str], list[str]]:
    """All printed text, the HTML outputs, and the errors of an executed notebook."""
    text, html, errors = [], [], []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if output.output_type == "stream" and output.name == "stdout":
                text.append(output.text)
            elif output.output_type in ("display_data", "execute_result") and "text/html" in output.data:
                html.append(output.data["text/html"])
            elif output.output_type == "error":
                errors.append(f"{output.ename}: {output.evalue}")
    return "".join(text), html, errors


@pytest.fixture(scope="module")
def executed_lab3(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("lab3")
    with pytest.MonkeyPatch.context() as patch:
        for name, value in subprocess_env().items():
            patch.setenv(name, value)
        patch.delenv("NBGRADER_EXECUTION", raising=False)
        papermill.execute_notebook(str(SOURCE_NOTEBOOK), str(workdir / "lab3_executed.ipynb"),
                                   parameters=SMALL_SETTINGS, kernel_name="python3", cwd=str(workdir),
                                   progress_bar=False)
    return nbformat.read(workdir / "lab3_executed.ipynb", as_version=4)


def test_lab3_source_is_committed_without_outputs_and_with_a_parameters_cell():
    notebook = nbformat.read(SOURCE_NOTEBOOK, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code")
    parameter_cells = [cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", [])]
    assert len(parameter_cells) == 1
    for name in SMALL_SETTINGS:
        assert re.search(rf"^{name} = ", parameter_cells[0].source, re.MULTILINE), name
    assert notebook.cells[0].cell_type == "markdown" and "2 CPU cores" in notebook.cells[0].source


def test_lab3_runs_every_step_under_horovodrun_without_errors(executed_lab3):
    text, _, errors = outputs_of(executed_lab3)
    assert errors == []
    for script in ("step1_init.py", "step2_pin_device.py", "step3_rank0_output.py", "step4_distributed_optimizer.py",
                   "step5_broadcast.py", "step6_partition_data.py", "step7_metric_average.py",
                   "fashion_mnist_horovod.py"):
        assert f"+++ {script}" in text, f"the diff of {script} is not shown"
        assert f"python {script} " in text, f"{script} did not run under horovodrun"
    assert "--data-partition shard" in text and "--data-partition shuffle" in text


def test_lab3_shows_what_each_horovod_step_changes(executed_lab3):
    text, _, _ = outputs_of(executed_lab3)
    # Before step 3 both ranks print; from step 3 on only rank 0.
    assert re.search(r"^\[1\] epoch 1/1 ", text, re.MULTILINE)
    assert "ranks that printed epoch lines: ['[0]']" in text
    # Step 4 alone leaves different initial weights; the broadcast (step 5) makes the ranks agree.
    assert re.findall(r"same final weights on both ranks: (\w+)", text) == ["False", "True", "True"]
    assert "checkpoint written: True" in text


def test_lab3_fills_the_scaling_efficiency_table_from_real_runs(executed_lab3):
    _, html, _ = outputs_of(executed_lab3)
    tables = [fragment for fragment in html if "scaling efficiency" in fragment]
    assert len(tables) == 1
    rows = re.findall(r"<tr><td>(\d+)</td><td>(\d+)</td><td>([\d.]+)</td><td>([\d.]+)</td></tr>", tables[0])
    assert [row[0] for row in rows] == ["1", "2"]
    assert all(int(row[1]) > 0 for row in rows)
    assert rows[0][3] == "1.00" and 0 < float(rows[1][3]) <= 1.5


def test_lab3_gpu_section_runs_nvidia_smi_or_shows_the_recorded_example(executed_lab3):
    text, _, _ = outputs_of(executed_lab3)
    assert "GPUs on this machine" in text or ("No GPU here" in text and "NVIDIA H100" in text)


@pytest.fixture(scope="module")
def released_course(tmp_path_factory):
    """A temporary copy of the course directory in which `nbgrader generate_assignment lab3` has run."""
    if not (LABS / "nbgrader_config.py").is_file():
        pytest.fail("labs/nbgrader_config.py is missing: the nbgrader course configuration must exist")
    course = tmp_path_factory.mktemp("course") / "labs"
    shutil.copytree(LABS, course, ignore=shutil.ignore_patterns("release", "submitted", "autograded", "feedback",
                                                                "gradebook.db", ".ipynb_checkpoints"))
    result = subprocess.run([str(VENV_BIN / "nbgrader"), "generate_assignment", "lab3", "--force"], cwd=course,
                            capture_output=True, text=True, env=subprocess_env(), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return course


def validate(notebook_path) -> dict:
    with pytest.MonkeyPatch.context() as patch:
        for name, value in subprocess_env().items():
            patch.setenv(name, value)
        return Validator().validate(str(notebook_path))


def test_lab3_release_has_no_solutions_and_its_exercises_fail_validation(released_course):
    released = released_course / "release" / "lab3" / "lab3_horovod.ipynb"
    text = released.read_text()
    assert "### BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text
    assert "raise NotImplementedError" in text
    results = validate(released)
    assert len(results.get("failed", [])) == 5, results.keys()


def test_lab3_solved_source_passes_validation(released_course):
    assert validate(released_course / "source" / "lab3" / "lab3_horovod.ipynb") == {}
