"""What the lab tests share: executing a notebook with small settings, reading its outputs, generating nbgrader's
student release in a copy of the course, validating, running a quiz's grading cells with chosen answers, and
grading an exercise's test cell against other solutions than the reference."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import NamedTuple

import nbformat
import papermill
import pytest
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_notebook
from nbgrader.api import Gradebook
from nbgrader.validator import Validator
from scalelab import headless

from conftest import PROJECT_ROOT, VENV_BIN, subprocess_env

LABS = PROJECT_ROOT / "labs"
# What nbgrader writes into a course directory; a copy of the course starts without any of it.
NBGRADER_OUTPUTS = ("release", "submitted", "autograded", "feedback", "gradebook.db", ".ipynb_checkpoints")
# No cell of a lab runs this long with the tests' small settings; a cell that does is reported as hung, by name,
# before pytest-timeout stops the whole test.
CELL_TIMEOUT_S = 600


def runs_leftovers() -> set[Path]:
    """What a run of the course's programs may leave in the machine's temporary folder: TensorFlow's autograph
    sources (removed only at a normal exit) and torchrun's folders (never removed)."""
    temp_dir = Path(tempfile.gettempdir())
    return {*temp_dir.glob("__autograph_generated_file*"), *temp_dir.glob("torchelastic_*")}


class Outputs(NamedTuple):
    text: str          # everything printed to stdout
    html: list[str]    # HTML outputs (tables)
    images: int        # image outputs (plots)
    errors: list[str]  # "Name: message" of each error output


@contextlib.contextmanager
def course_environment():
    """The environment a student's kernel has: the venv's tools on PATH, not inside nbgrader's autograder."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in subprocess_env().items():
            patch.setenv(name, value)
        patch.delenv("NBGRADER_EXECUTION", raising=False)
        yield


def execute(notebook: Path, workdir: Path, parameters: dict) -> nbformat.NotebookNode:
    """Run ``notebook`` with papermill in ``workdir`` with the given parameters; return the executed notebook."""
    executed = workdir / f"{notebook.stem}_executed.ipynb"
    with course_environment():
        papermill.execute_notebook(str(notebook), str(executed), parameters=parameters, kernel_name="python3",
                                   cwd=str(workdir), progress_bar=False, execution_timeout=CELL_TIMEOUT_S,
                                   kernel_manager_class=headless.PollingKernelManager)
    return nbformat.read(executed, as_version=4)


def outputs_of(notebook_or_cell: nbformat.NotebookNode) -> Outputs:
    """The outputs of a whole executed notebook, or of one of its cells."""
    cells = notebook_or_cell.cells if "cells" in notebook_or_cell else [notebook_or_cell]
    text, html, images, errors = [], [], 0, []
    for cell in cells:
        for output in cell.get("outputs", []):
            if output.output_type == "stream" and output.name == "stdout":
                text.append(output.text)
            elif output.output_type in ("display_data", "execute_result"):
                if "text/html" in output.data:
                    html.append(output.data["text/html"])
                images += "image/png" in output.data
            elif output.output_type == "error":
                errors.append(f"{output.ename}: {output.evalue}")
    return Outputs("".join(text), html, images, errors)


def code_cell_containing(notebook: nbformat.NotebookNode, fragment: str) -> nbformat.NotebookNode:
    matches = [cell for cell in notebook.cells if cell.cell_type == "code" and fragment in cell.source]
    assert len(matches) == 1, f"expected one code cell containing {fragment!r}, found {len(matches)}"
    return matches[0]


def released_course(tmp_path_factory, assignment: str) -> Path:
    """A temporary copy of the course directory in which `nbgrader generate_assignment ASSIGNMENT` has run."""
    if not (LABS / "nbgrader_config.py").is_file():
        pytest.fail("labs/nbgrader_config.py is missing: the nbgrader course configuration must exist")
    course = tmp_path_factory.mktemp("course") / "labs"
    shutil.copytree(LABS, course, ignore=shutil.ignore_patterns(*NBGRADER_OUTPUTS))
    nbgrader("generate_assignment", assignment, "--force", course=course, timeout=600)
    return course


def nbgrader(*args: str, course: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """Runs the real `nbgrader` command in the course directory (where nbgrader_config.py is) and checks it worked."""
    result = subprocess.run([str(VENV_BIN / "nbgrader"), *args], cwd=course, capture_output=True, text=True,
                            env=subprocess_env(), timeout=timeout)
    assert result.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
    return result


def autograde(course: Path, assignment: str, student: str, notebook: Path) -> tuple[float, float]:
    """Submit ``notebook`` as ``student``'s work on ``assignment`` in a released course, run `nbgrader autograde`
    with the course's configuration, and return the (score, max_score) it stored in the gradebook."""
    submitted = course / "submitted" / student / assignment
    submitted.mkdir(parents=True)
    shutil.copy(notebook, submitted / notebook.name)
    nbgrader("autograde", assignment, "--student", student, "--create", course=course, timeout=600)
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}", course_id="scalelab") as gradebook:
        submission = gradebook.find_submission(assignment, student)
        return submission.score, submission.max_score


def validate(notebook: Path) -> dict:
    """nbgrader's validation of a notebook: {} when every graded cell passes."""
    with course_environment():
        # nbgrader's own steps, with the Execute that survives a lost wake-up (see scalelab.headless).
        steps = headless.with_polling_execute(Validator.class_traits()["preprocessors"].default())
        return Validator(preprocessors=steps).validate(str(notebook))


def run_quiz(notebook: nbformat.NotebookNode, answers: dict[str, str], questions: int) -> None:
    """Execute the quiz's grading cells (hidden tests included) after a cell that sets ``answers``; a wrong
    answer raises nbclient's CellExecutionError carrying the test's explanation."""
    tests = [cell.source for cell in notebook.cells
             if cell.metadata.get("nbgrader", {}).get("grade_id", "").startswith("q")
             and cell.metadata["nbgrader"].get("grade")]
    assert len(tests) == questions
    setup = "\n".join(f"{name} = {value}" for name, value in answers.items())
    cells = [new_code_cell(setup)] + [new_code_cell(source) for source in tests]
    NotebookClient(new_notebook(cells=cells), kernel_name="python3",
                   kernel_manager_class=headless.PollingKernelManager).execute()


def check_committed_source(notebook_path: Path, parameters: dict) -> nbformat.NotebookNode:
    """The source notebook is committed without outputs, has one papermill parameters cell setting every name the
    tests shrink, and says at its top how long it takes on 2 CPU cores."""
    notebook = nbformat.read(notebook_path, as_version=4)
    assert all(not cell.get("outputs") and cell.get("execution_count") is None
               for cell in notebook.cells if cell.cell_type == "code")
    parameter_cells = [cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", [])]
    assert len(parameter_cells) == 1
    for name in parameters:
        assert re.search(rf"^{name} = ", parameter_cells[0].source, re.MULTILINE), name
    assert notebook.cells[0].cell_type == "markdown" and "2 CPU cores" in notebook.cells[0].source
    return notebook


# ------------------------------------------------------------------ the exercises against wrong solutions

SOLUTION_REGION = re.compile(r"^([ \t]*)### BEGIN SOLUTION\n.*?^[ \t]*### END SOLUTION$", re.DOTALL | re.MULTILINE)
HIDDEN_TESTS = "### BEGIN HIDDEN TESTS"
# Runs each program in a fresh namespace, in one process, and writes {name: None or "ErrorName: message"} as JSON.
_RUN_PROGRAMS = """
import json, sys
programs = json.load(open(sys.argv[1]))
results = {}
for name, program in programs.items():
    try:
        exec(compile(program, name, "exec"), {"__name__": "__main__"})
    except Exception as error:
        results[name] = f"{type(error).__name__}: {error}"
    else:
        results[name] = None
json.dump(results, open(sys.argv[2], "w"))
"""


def cell_by_grade_id(notebook: nbformat.NotebookNode, grade_id: str) -> nbformat.NotebookNode:
    matches = [cell for cell in notebook.cells if cell.metadata.get("nbgrader", {}).get("grade_id") == grade_id]
    assert len(matches) == 1, f"expected one cell with grade_id {grade_id!r}, found {len(matches)}"
    return matches[0]


def python_source(cell: nbformat.NotebookNode) -> str:
    """A code cell's source as plain Python: IPython magics (`%matplotlib inline`) are left out."""
    return "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith("%"))


def with_solution(solution_cell: nbformat.NotebookNode, *bodies: str | None) -> str:
    """The solution cell's source with its i-th `### BEGIN SOLUTION` … `### END SOLUTION` region replaced by
    ``bodies[i]`` (indented like the region; None keeps the reference solution): what a student's notebook holds."""
    regions = list(SOLUTION_REGION.finditer(solution_cell.source))
    assert len(regions) == len(bodies), f"the cell has {len(regions)} solution regions, {len(bodies)} bodies given"
    source, end = "", 0
    for region, body in zip(regions, bodies):
        indent = region.group(1)
        replacement = region.group(0) if body is None else textwrap.indent(textwrap.dedent(body).strip(), indent)
        source += solution_cell.source[end:region.start()] + replacement
        end = region.end()
    return source + solution_cell.source[end:]


def grade_exercise(notebook_path: Path, solution_id: str, tests_id: str, setup: str,
                   solutions: dict[str, tuple], workdir: Path) -> dict[str, dict[str, str | None]]:
    """Run the graded test cell ``tests_id`` of the source notebook after each of ``solutions`` (name → the bodies
    of the solution cell's regions, see :func:`with_solution`), each in a fresh namespace after ``setup``.

    Returns, per solution, the outcome of the whole test cell (what nbgrader grades) and of its visible part alone
    (what the student's release runs): None where it passed, else "ErrorName: message"."""
    notebook = nbformat.read(notebook_path, as_version=4)
    solution_cell, tests_cell = cell_by_grade_id(notebook, solution_id), cell_by_grade_id(notebook, tests_id)
    assert solution_cell.metadata.nbgrader["solution"] and tests_cell.metadata.nbgrader["grade"]
    assert HIDDEN_TESTS in tests_cell.source, f"{tests_id} has no hidden tests"
    visible = tests_cell.source.split(HIDDEN_TESTS)[0]
    programs = {}
    for name, bodies in solutions.items():
        solution = with_solution(solution_cell, *bodies)
        programs[f"{name} [graded]"] = "\n\n".join((setup, solution, tests_cell.source))
        programs[f"{name} [visible]"] = "\n\n".join((setup, solution, visible))
    (workdir / "programs.json").write_text(json.dumps(programs))
    result = subprocess.run([sys.executable, "-c", _RUN_PROGRAMS, "programs.json", "results.json"], cwd=workdir,
                            capture_output=True, text=True, env=subprocess_env(MPLBACKEND="Agg"), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = json.loads((workdir / "results.json").read_text())
    return {name: {"graded": outcomes[f"{name} [graded]"], "visible": outcomes[f"{name} [visible]"]}
            for name in solutions}


class Wrong(NamedTuple):
    """A plausible wrong solution of a graded exercise, for :func:`assert_rejected`."""

    bodies: tuple        # the solution regions' code, in order; None keeps the reference for that region
    caught_by: str       # "hidden" or "visible"
    message: str         # a fragment of the assertion message that must explain the mistake


def assert_rejected(notebook_path: Path, solution_id: str, tests_id: str, setup: str, wrong: dict[str, Wrong],
                    workdir: Path) -> None:
    """The graded test cell passes the reference solution and rejects each wrong one: a mistake marked "hidden"
    passes the visible checks and is caught by the hidden tests with its message; one marked "visible" already
    fails the visible checks."""
    solutions = {"reference": (None,) * len(next(iter(wrong.values())).bodies)}
    solutions.update({name: mistake.bodies for name, mistake in wrong.items()})
    outcomes = grade_exercise(notebook_path, solution_id, tests_id, setup, solutions, workdir)

    assert outcomes["reference"] == {"graded": None, "visible": None}
    for name, mistake in wrong.items():
        graded, visible = outcomes[name]["graded"], outcomes[name]["visible"]
        assert graded is not None and graded.startswith("AssertionError"), f"{name!r} was not rejected: {graded}"
        if mistake.caught_by == "hidden":
            assert visible is None, f"{name!r} already fails the visible checks: {visible}"
            assert mistake.message in graded, f"{name!r} was rejected for another reason: {graded}"
        else:
            assert visible is not None and visible.startswith("AssertionError"), name
