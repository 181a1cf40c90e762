"""Lab 3 (Horovod step by step): the solved notebook runs end to end with small settings, and nbgrader's
student release keeps the exercises unsolved (validation fails) while the solved source validates."""

from __future__ import annotations

import re

import pytest

import labtools
from labtools import LABS, execute, outputs_of, validate

SOURCE_NOTEBOOK = LABS / "source" / "lab3" / "lab3_horovod.ipynb"
SMALL_SETTINGS = dict(STEP_EPOCHS=1, STEP_TRAIN_IMAGES=512, VAL_IMAGES=256, SWEEP_EPOCHS=2,
                      SWEEP_TRAIN_IMAGES=1024, NP_LIST=[1, 2], CONTROLLER="--gloo")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def executed_lab3(tmp_path_factory):
    return execute(SOURCE_NOTEBOOK, tmp_path_factory.mktemp("lab3"), SMALL_SETTINGS)


def test_lab3_source_is_committed_without_outputs_and_with_a_parameters_cell():
    labtools.check_committed_source(SOURCE_NOTEBOOK, SMALL_SETTINGS)


def test_lab3_runs_every_step_under_horovodrun_without_errors(executed_lab3):
    outputs = outputs_of(executed_lab3)
    assert outputs.errors == []
    text = outputs.text
    for script in ("step1_init.py", "step2_pin_device.py", "step3_rank0_output.py", "step4_distributed_optimizer.py",
                   "step5_broadcast.py", "step6_partition_data.py", "step7_metric_average.py",
                   "fashion_mnist_horovod.py"):
        assert f"+++ {script}" in text, f"the diff of {script} is not shown"
        assert f"python {script} " in text, f"{script} did not run under horovodrun"
    assert "--data-partition shard" in text and "--data-partition shuffle" in text


def test_lab3_shows_what_each_horovod_step_changes(executed_lab3):
    text = outputs_of(executed_lab3).text
    # Before step 3 both ranks print; from step 3 on only rank 0.
    assert re.search(r"^\[1\] epoch 1/1 ", text, re.MULTILINE)
    assert "ranks that printed epoch lines: ['[0]']" in text
    # Step 4 alone leaves different initial weights; the broadcast (step 5) makes the ranks agree.
    assert re.findall(r"same final weights on both ranks: (\w+)", text) == ["False", "True", "True"]
    assert "checkpoint written: True" in text


def test_lab3_fills_the_scaling_efficiency_table_from_real_runs(executed_lab3):
    html = outputs_of(executed_lab3).html
    tables = [fragment for fragment in html if "scaling efficiency" in fragment]
    assert len(tables) == 1
    rows = re.findall(r"<tr><td>(\d+)</td><td>(\d+)</td><td>([\d.]+)</td><td>([\d.]+)</td></tr>", tables[0])
    assert [row[0] for row in rows] == ["1", "2"]
    assert all(int(row[1]) > 0 for row in rows)
    assert rows[0][3] == "1.00" and 0 < float(rows[1][3]) <= 1.5


def test_lab3_gpu_section_runs_nvidia_smi_or_shows_the_recorded_example(executed_lab3):
    text = outputs_of(executed_lab3).text
    assert "GPUs on this machine" in text or ("No GPU here" in text and "NVIDIA H100" in text)


@pytest.fixture(scope="module")
def released_course(tmp_path_factory):
    return labtools.released_course(tmp_path_factory, "lab3")


def test_lab3_release_has_no_solutions_and_its_exercises_fail_validation(released_course):
    released = released_course / "release" / "lab3" / "lab3_horovod.ipynb"
    text = released.read_text()
    assert "### BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text
    assert "raise NotImplementedError" in text
    results = validate(released)
    assert len(results.get("failed", [])) == 5, results.keys()


def test_lab3_solved_source_passes_validation(released_course):
    assert validate(released_course / "source" / "lab3" / "lab3_horovod.ipynb") == {}
