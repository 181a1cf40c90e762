"""Lab 6 (beyond data parallelism): the graded exercises against wrong solutions, the solved notebook run end to
end with small settings (MultiWorkerMirroredStrategy and `horovodrun` training, and a real `sbatch` on the local
Slurm that test_slurm.py's fixture starts), what it says when no Slurm answers, and nbgrader's student release
failing validation while the solved source passes.

The wrong solutions work as in test_lab_exercises.py: each exercise's solution cell, with the code between
`### BEGIN SOLUTION` and `### END SOLUTION` replaced, runs with its test cell in a fresh namespace. A wrong solution
marked "hidden" passes the checks the student can see and is caught by the hidden tests only; one marked "visible"
is already caught by the visible checks."""

from __future__ import annotations

import re
import shutil

import nbformat
import pytest
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_notebook

from conftest import keras_only
import labtools
from labtools import (LABS, Wrong, assert_rejected, code_cell_containing, execute, outputs_of, python_source,
                      validate)
from scalelab import headless
from test_slurm import slurm_cluster, squeue_lines  # noqa: F401 — the module's fixture: a running one-node Slurm

# The Keras edition's: skipped, with the reason, where `make setup` installed the PyTorch edition alone.
pytestmark = keras_only

LAB_FOLDER = LABS / "source" / "lab6"
SOURCE_NOTEBOOK = LAB_FOLDER / "lab6_beyond_data_parallelism.ipynb"
SCRIPTS = ("mwms_fashion_mnist.py", "horovod_fashion_mnist.py", "ddp_fashion_mnist.py")
SMALL_SETTINGS = dict(TRAIN_IMAGES=1024, BATCH_SIZE=64, SLURM_TRAIN_IMAGES=512, SLURM_WAIT_S=240)
POINTS = {"ex1-tests": 2, "ex2-tests": 1, "ex3-tests": 1, "ex4-tests": 1, "ex5-tests": 2, "ex6-tests": 2}




def schedule_with(forward_step: str, backward_step: str) -> str:
    """A GPipe schedule whose forward and backward passes run at the given steps (expressions in stage, j)."""
    return f"""
        steps = 2 * (micro_batches + stages - 1)
        schedule = [[None] * stages for _ in range(steps + 2)]
        for stage in range(stages):
            for j in range(micro_batches):
                schedule[{forward_step}][stage] = ("F", j)
                schedule[{backward_step}][stage] = ("B", j)
        while schedule and all(task is None for task in schedule[-1]):
            schedule.pop()
        return schedule
        """


GPIPE_BACKWARD = "micro_batches + stages - 1 + (stages - 1 - stage) + (micro_batches - 1 - j)"
SBATCH_LINES = ['"#!/bin/bash"', 'f"#SBATCH --job-name={job_name}"', 'f"#SBATCH --output={job_name}-%j.out"',
                '"#SBATCH --nodes=1"', 'f"#SBATCH --ntasks={ranks}"', '"#SBATCH --cpus-per-task=1"',
                'f"#SBATCH --time={minutes}"', 'f"horovodrun -np {ranks} --gloo {command}"']


def sbatch_body(lines: list[str]) -> str:
    return f'return "\\n".join([{", ".join(lines)}]) + "\\n"'


EXERCISES = {
    ("ex1-schedule", "ex1-tests"): {
        "the backward passes start a step late": Wrong(
            (schedule_with("stage + j", "1 + " + GPIPE_BACKWARD),), "hidden", "as early as the rules allow"),
        "the backward passes in forward order": Wrong(
            (schedule_with("stage + j", "micro_batches + stages - 1 + (stages - 1 - stage) + j"),), "hidden",
            "reverse order"),
        "a stage runs its forward pass in the same step as the stage before": Wrong(
            (schedule_with("stage + j - 1 if stage == stages - 1 > 0 and j == 0 else stage + j", GPIPE_BACKWARD),),
            "hidden", "finished it: it needs that stage's output"),
    },
    ("ex2-bubble", "ex2-tests"): {
        "(p-1)/m, the bubble relative to the useful work": Wrong(
            ("return (stages - 1) / micro_batches",), "hidden", "(p-1)/(m+p-1)"),
        "(p-1)/(m+p), off by one": Wrong(("return (stages - 1) / (micro_batches + stages)",), "hidden",
                                         "(p-1)/(m+p-1)"),
        "p/(m+p-1)": Wrong(("return stages / (micro_batches + stages - 1)",), "visible", ""),
    },
    ("ex3-column", "ex3-tests"): {
        "the slices concatenated along axis 1": Wrong(
            ("whole = np.concatenate(pieces, axis=1)\nreturn [whole.copy() for _ in pieces]", None), "hidden",
            "along the last axis"),
        "one device multiplies the whole matrix": Wrong(
            (None, "return [matmul(x, w) for _ in range(devices)]"), "hidden", "its own block of W's columns"),
        "the slices stacked along the batch axis": Wrong(
            ("whole = np.concatenate(pieces, axis=0)\nreturn [whole.copy() for _ in pieces]", None), "visible", ""),
    },
    ("ex4-row", "ex4-tests"): {
        "no reduction: each device keeps its partial sum": Wrong(("return list(pieces)", None), "visible", ""),
        "the all-reduce averages, as for gradients": Wrong(
            ("total = np.mean(pieces, axis=0)\nreturn [total.copy() for _ in pieces]", None), "visible", ""),
        "X split along axis 1, not its last axis": Wrong((None, """
            rows = np.array_split(np.arange(w.shape[0]), devices)
            return all_reduce_sum([matmul(x[:, part], w[part]) for part in rows])
            """), "hidden", "split X along its last axis"),
        "one device multiplies the whole matrix": Wrong(
            (None, "return all_reduce_sum([matmul(x, w) / devices for _ in range(devices)])"), "hidden",
            "its own rows of W"),
    },
    ("ex5-costs", "ex5-tests"): {
        "data parallel traffic of one device, not of all": Wrong(("""
            parameters = layers * width**2
            split = 16 * parameters / devices
            cuts = (devices - 1) * 2 * 4 * batch_rows * width
            ring = lambda n: 2 * (devices - 1) * n
            return {"data": (16 * parameters, 2 * (devices - 1) / devices * 4 * parameters), "model": (split, cuts),
                    "pipeline": (split, cuts), "tensor": (split, layers * ring(4 * batch_rows * width))}
            """,), "hidden", "2(k-1) x 4P bytes in all"),
        "tensor parallelism keeps all the model states on every device": Wrong(("""
            parameters = layers * width**2
            split = 16 * parameters / devices
            cuts = (devices - 1) * 2 * 4 * batch_rows * width
            ring = lambda n: 2 * (devices - 1) * n
            return {"data": (16 * parameters, ring(4 * parameters)), "model": (split, cuts), "pipeline": (split, cuts),
                    "tensor": (16 * parameters, layers * ring(4 * batch_rows * width))}
            """,), "hidden", "tensor parallelism gives every device 1/devices of the 16 bytes per parameter"),
        "the pipeline sends the activations forward only": Wrong(("""
            parameters = layers * width**2
            split = 16 * parameters / devices
            ring = lambda n: 2 * (devices - 1) * n
            return {"data": (16 * parameters, ring(4 * parameters)),
                    "model": (split, (devices - 1) * 2 * 4 * batch_rows * width),
                    "pipeline": (split, (devices - 1) * 4 * batch_rows * width),
                    "tensor": (split, layers * ring(4 * batch_rows * width))}
            """,), "hidden", "activations forward and their gradients backward"),
        "tensor parallelism all-reduces once per pair of layers": Wrong(("""
            parameters = layers * width**2
            split = 16 * parameters / devices
            cuts = (devices - 1) * 2 * 4 * batch_rows * width
            ring = lambda n: 2 * (devices - 1) * n
            return {"data": (16 * parameters, ring(4 * parameters)), "model": (split, cuts),
                    "pipeline": (split, cuts), "tensor": (split, layers / 2 * ring(4 * batch_rows * width))}
            """,), "hidden", "one ring all-reduce of the activations per layer"),
    },
    ("ex6-sbatch", "ex6-tests"): {
        "two ranks whatever is asked": Wrong((sbatch_body([line.replace("{ranks}", "2") for line in SBATCH_LINES]),),
                                             "hidden", "expected 4"),
        "the directives after the first command": Wrong(
            (sbatch_body(SBATCH_LINES[:1] + ['"cd $SLURM_SUBMIT_DIR"'] + SBATCH_LINES[1:]),), "hidden",
            "before the first command"),
        "no time limit": Wrong((sbatch_body([line for line in SBATCH_LINES if "--time" not in line]),), "hidden",
                               "--time"),
        "the time limit in hours": Wrong(
            (sbatch_body([line.replace("--time={minutes}", "--time={minutes}:00:00") for line in SBATCH_LINES]),),
            "hidden", "#SBATCH --time="),
        "mpirun instead of horovodrun": Wrong(
            (sbatch_body([line.replace("horovodrun -np {ranks} --gloo", "mpirun -np {ranks}") for line in
                          SBATCH_LINES]),), "visible", ""),
    },
}


def context_for(solution_id: str) -> str:
    """What runs before the solution cell: the parameters cell, the setup cell's imports, and for the bubble the
    (reference) schedule it counts on."""
    notebook = nbformat.read(SOURCE_NOTEBOOK, as_version=4)
    parameters = next(cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", []))
    setup = python_source(code_cell_containing(notebook, "from scalelab import environment"))
    imports = "\n".join(line for line in setup.splitlines() if re.match(r"(import|from) \w", line))
    context = [parameters.source, imports]
    if solution_id == "ex2-bubble":
        context.append(labtools.cell_by_grade_id(notebook, "ex1-schedule").source)
    return "\n\n".join(context)


# ------------------------------------------------------------------ the exercises (fast: nothing trains)

def test_lab6_source_is_committed_without_outputs_and_with_a_parameters_cell():
    notebook = labtools.check_committed_source(SOURCE_NOTEBOOK, SMALL_SETTINGS)
    assert notebook.metadata.kernelspec == {"display_name": "Python 3 (ScaleLab)", "language": "python",
                                            "name": "scalelab"}
    graded = {cell.metadata.nbgrader["grade_id"]: cell.metadata.nbgrader["points"] for cell in notebook.cells
              if cell.metadata.get("nbgrader", {}).get("grade")}
    assert graded == POINTS
    assert "9 points" in notebook.cells[0].source


def test_every_graded_exercise_of_lab6_has_wrong_solutions_here():
    notebook = nbformat.read(SOURCE_NOTEBOOK, as_version=4)
    exercises = {cell.metadata.nbgrader["grade_id"] for cell in notebook.cells
                 if cell.metadata.get("nbgrader", {}).get("solution")}
    assert exercises == {solution for solution, _ in EXERCISES}


@pytest.mark.parametrize("solution_id, tests_id", list(EXERCISES), ids=[solution for solution, _ in EXERCISES])
def test_lab6_graded_tests_pass_the_reference_and_reject_each_wrong_solution(solution_id, tests_id, tmp_path):
    assert_rejected(SOURCE_NOTEBOOK, solution_id, tests_id, context_for(solution_id), EXERCISES[solution_id, tests_id],
                    tmp_path)


def test_lab6_scripts_mark_every_strategy_line_and_share_the_course_library():
    mwms, horovod, ddp = ((LAB_FOLDER / script).read_text() for script in SCRIPTS)
    assert "tf.distribute.MultiWorkerMirroredStrategy()" in mwms and "hvd.DistributedOptimizer" in horovod
    assert "DistributedDataParallel(model)" in ddp
    for text, marker, specific in ((mwms, "# MWMS:", ('os.environ["TF_CONFIG"]', "strategy.scope()",
                                                      "AutoShardPolicy.OFF")),
                                   (horovod, "# Horovod:", ("hvd.init()", "hvd.DistributedOptimizer",
                                                            "BroadcastGlobalVariablesCallback")),
                                   (ddp, "# DDP:", ('dist.init_process_group("gloo")', "DistributedSampler(",
                                                    "set_epoch(", "DistributedDataParallel(model)",
                                                    "dist.all_reduce("))):
        lines = text.splitlines()
        for fragment in specific:
            number = next(i for i, line in enumerate(lines) if fragment in line and not line.lstrip().startswith("#"))
            above = [line.strip() for line in lines[max(0, number - 3):number + 1]]
            assert any(line.startswith(marker) for line in above), f"{fragment} has no {marker} comment above it"
        for library in ("from scalelab.data import", "small_cnn" if marker != "# DDP:" else "SmallCNN"):
            assert library in text


# ------------------------------------------------------------------ the notebook (slow)

def table_rows(fragment: str) -> list[list[str]]:
    return [re.findall(r"<td>([^<]*)</td>", row) for row in re.findall(r"<tr>(<td>.*?)</tr>", fragment)]


@pytest.fixture(scope="module")
def executed_lab6(tmp_path_factory, slurm_cluster):  # noqa: F811 — test_slurm's fixture, imported above
    # The notebook runs in (a copy of) its own folder, as a student's does: the two training scripts are there.
    workdir = tmp_path_factory.mktemp("lab6") / "lab6"
    shutil.copytree(LAB_FOLDER, workdir)
    return execute(workdir / SOURCE_NOTEBOOK.name, workdir, SMALL_SETTINGS), workdir


@pytest.mark.slow
def test_lab6_runs_without_errors_and_draws_its_plots(executed_lab6):
    text, html, images, errors = outputs_of(executed_lab6[0])
    assert errors == []
    assert images >= 1   # the schedule and the bubble curves
    assert "p = 4, m = 8: bubble 0.273 = (p-1)/(m+p-1) = 3/11" in text
    assert "Megatron MLP (columns, ReLU, rows, one all-reduce) == one device: True" in text
    assert "column-parallel layer == X @ W: True" in text and "row-parallel layer    == X @ W: True" in text
    costs = next(fragment for fragment in html if "GB over the network per step" in fragment)
    rows = {row[0]: row for row in table_rows(costs)}
    assert list(rows) == ["data", "model", "pipeline", "tensor"]
    assert rows["data"][1] == "51.5" and rows["tensor"][1] == "6.4"
    assert float(rows["tensor"][2]) > float(rows["data"][2]) > float(rows["pipeline"][2])


@pytest.mark.slow
def test_lab6_mwms_and_horovod_both_end_with_identical_weights_on_both_workers(executed_lab6):
    notebook, workdir = executed_lab6
    text, html, _, _ = outputs_of(notebook)
    for name in ("MultiWorkerMirroredStrategy", "Horovod", "DDP"):
        assert f"{name}: the 2 workers' weights are identical: True" in text
    assert re.search(r"MultiWorkerMirroredStrategy and Horovod ended with the same weights as each other: (True|False)",
                     text)
    assert "$ horovodrun -np 2 --gloo python horovod_fashion_mnist.py" in text
    assert "$ torchrun --standalone --nproc_per_node 2 ddp_fashion_mnist.py" in text
    assert re.search(r"TF_CONFIG='\{\"cluster\": \{\"worker\": \[\"127\.0\.0\.1:\d+\", \"127\.0\.0\.1:\d+\"\]\}", text)
    # Each strategy's own first line: 2 workers, 1024 images split between them, 8 steps of 64 x 2.
    for name in ("MultiWorkerMirroredStrategy", "Horovod", "DDP"):
        assert f"{name}: 2 workers, 512 images each, batch 64 x 2, 8 steps per epoch" in text
    table = next(fragment for fragment in html if "weights identical on both workers" in fragment)
    rows = table_rows(table)
    assert [row[0] for row in rows] == ["MultiWorkerMirroredStrategy", "Horovod", "DDP"]
    # launch to exit > training > 0; the time per step is the training time over the 8 steps (in ms, rounded).
    assert all(row[-1] == "True" and float(row[1]) > float(row[2]) > 0 for row in rows)
    assert all(abs(float(row[3]) - 1000 * float(row[2]) / 8) <= 0.5 + 1e-9 for row in rows)
    for strategy in ("multiworkermirroredstrategy", "horovod", "ddp"):
        assert sorted(path.name for path in (workdir / "lab6_runs" / f"weights_{strategy}").iterdir()) == [
            "weights_rank0.json", "weights_rank0.npz", "weights_rank1.json", "weights_rank1.npz"]


@pytest.mark.slow
def test_lab6_submits_its_sbatch_script_to_the_local_slurm_and_shows_the_jobs_output(executed_lab6):
    notebook, workdir = executed_lab6
    text, _, _, _ = outputs_of(notebook)
    job_id = re.search(r"Submitted batch job (\d+)", text).group(1)
    assert re.search(rf"job {job_id}: COMPLETED after \d+ s", text)
    assert "Horovod: 2 workers, 256 images each, batch 64 x 2, 4 steps per epoch" in text   # the job's own output
    assert "the 2 ranks' weights are identical: True" in text
    script = (workdir / "lab6_runs" / "lab6_horovod.sbatch").read_text()
    assert "#SBATCH --ntasks=2" in script.splitlines()
    assert (workdir / "lab6_runs" / f"lab6-horovod-{job_id}.out").is_file()
    assert squeue_lines("--jobs", job_id) == []


@pytest.mark.slow
def test_lab6_says_so_and_shows_the_script_when_no_slurm_answers(tmp_path, monkeypatch):
    # The setup, the sbatch exercise and the submitting cell alone, with Slurm's commands pointed at no cluster.
    source = nbformat.read(SOURCE_NOTEBOOK, as_version=4)
    parameters = next(cell for cell in source.cells if "parameters" in cell.metadata.get("tags", []))
    cells = [parameters.source, code_cell_containing(source, "from scalelab import environment").source,
             labtools.cell_by_grade_id(source, "ex6-sbatch").source,
             code_cell_containing(source, "def weights_of").source.split("comparison = {}")[0],
             code_cell_containing(source, "SLURM_SCRIPT = ").source]
    notebook = new_notebook(cells=[new_code_cell(cell) for cell in cells])
    # A cluster whose controller nobody runs: `scontrol ping` says DOWN at once.
    (tmp_path / "slurm.conf").write_text("ClusterName=nowhere\nSlurmctldHost=localhost\nSlurmctldPort=6999\n"
                                         "AuthType=auth/munge\nNodeName=localhost CPUs=1 State=UNKNOWN\n"
                                         "PartitionName=debug Nodes=localhost Default=YES State=UP\n")
    with labtools.course_environment():
        monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
        monkeypatch.chdir(tmp_path)
        NotebookClient(notebook, kernel_name="python3", kernel_manager_class=headless.PollingKernelManager,
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
    text, _, _, errors = outputs_of(notebook)
    assert errors == []
    assert "No Slurm controller answers on this machine" in text and "sbatch lab6_horovod.sbatch" in text
    assert "#SBATCH --ntasks=2" in text and "horovodrun -np 2 --gloo" in text
    assert "Submitted batch job" not in text


@pytest.fixture(scope="module")
def released_course(tmp_path_factory):
    return labtools.released_course(tmp_path_factory, "lab6")


@pytest.mark.slow
def test_lab6_release_ships_the_scripts_has_no_solutions_and_fails_validation(released_course):
    released = released_course / "release" / "lab6"
    assert all((released / script).is_file() for script in SCRIPTS)
    text = (released / SOURCE_NOTEBOOK.name).read_text()
    assert "### BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text
    assert "raise NotImplementedError" in text
    results = validate(released / SOURCE_NOTEBOOK.name)
    assert len(results.get("failed", [])) == len(POINTS), results.keys()


@pytest.mark.slow
def test_lab6_solved_source_passes_validation(released_course):
    assert validate(released_course / "source" / "lab6" / SOURCE_NOTEBOOK.name) == {}


def test_make_release_and_the_hubs_staging_take_every_assignment_in_source_so_lab6_too():
    # Neither lists the labs: the Makefile loops over source/*/ and the Hub (scalelab.lab_setup) releases "*".
    makefile = (LABS.parent / "Makefile").read_text()
    assert "for assignment in $$(cd source && ls -d */ | tr -d /)" in makefile
    assert '"generate_assignment", "*"' in (LABS.parent / "source_code" / "scalelab" / "lab_setup.py").read_text()
    assert (LABS / "source" / "lab6" / SOURCE_NOTEBOOK.name).is_file()


@pytest.mark.slow
def test_lab6_autograde_gives_the_solved_notebook_every_point_and_the_untouched_release_none(released_course):
    solved = labtools.autograde(released_course, "lab6", "solver", released_course / "source" / "lab6" /
                                SOURCE_NOTEBOOK.name)
    untouched = labtools.autograde(released_course, "lab6", "idler", released_course / "release" / "lab6" /
                                   SOURCE_NOTEBOOK.name)
    assert solved == (9.0, 9.0) and untouched == (0.0, 9.0)
