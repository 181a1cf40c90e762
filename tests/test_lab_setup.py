"""scalelab.lab_setup: the student's view of the course (released labs and the assessment, never a solution, never
overwriting the student's work), the release of a lab's worked solution after the lab, and the course's kernel.
`make lab` end to end is tests/test_make_lab.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import pytest
from jupyter_client.kernelspec import KernelSpecManager

from conftest import PROJECT_ROOT
from scalelab import cli, environment, lab_setup

GENERATED = ("release", "submitted", "autograded", "feedback", "gradebook.db", "grades.csv", ".ipynb_checkpoints")
ASSIGNMENTS = sorted(path.name for path in (PROJECT_ROOT / "labs" / "source").iterdir() if path.is_dir())
LAB3_SOLUTION = ("source_code/fashion_mnist_horovod.py", "source_code/horovod_steps")
# What runs the course (`make bench`), not course material: neither in the view nor a solution to release.
COURSE_TOOLING = {"benchmarks"}


@pytest.fixture(autouse=True)
def whole_course_view(monkeypatch):
    """The view's workings are tested on the whole course whichever edition runs the tests: the PyTorch edition's
    view (the Keras labs left out) has a test of its own."""
    monkeypatch.setattr(lab_setup, "edition", lambda: "all")


def course_copy(root: Path) -> Path:
    """The parts of the checkout the view is made from, without anything generated (tests never write into the
    repository's labs/); the instructor's material included, so that leaving it out is what is tested."""
    shutil.copytree(PROJECT_ROOT / "labs", root / "labs", ignore=shutil.ignore_patterns(*GENERATED))
    shutil.copytree(PROJECT_ROOT / "assessment", root / "assessment")
    (root / "student").mkdir()
    shutil.copy(PROJECT_ROOT / "student" / "START.md", root / "student" / "START.md")
    shutil.copytree(PROJECT_ROOT / "source_code", root / "source_code", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def files_in(view: Path) -> set[str]:
    return {str(path.relative_to(view)) for path in view.rglob("*") if path.is_file() and not path.is_symlink()}


def reachable(view: Path) -> set[Path]:
    """Every real path a walk down ``view`` reaches, each link resolved and each folder (linked or not) entered."""
    reached, entered, folders = set(), {view.resolve()}, [view]
    while folders:
        for entry in folders.pop().iterdir():
            real = entry.resolve()
            reached.add(real)
            if real.is_dir() and real not in entered:
                entered.add(real)
                folders.append(entry)
    return reached


def solutions(course: Path) -> list[Path]:
    """The worked solutions the view must not reach until released: lab 3's and the assessment's reference."""
    return [course / relative for relative in (*LAB3_SOLUTION, "assessment/solution")]


def assert_no_solution_reachable(view: Path, course: Path) -> None:
    held_back = solutions(course)
    solution_texts = {path.read_bytes() for folder in held_back
                      for path in ([folder] if folder.is_file() else folder.rglob("*")) if path.is_file()}
    for real in reachable(view):
        for solution in held_back:
            assert not real.is_relative_to(solution.resolve()), f"the view reaches {solution} at {real}"
        if real.is_file():
            assert real.read_bytes() not in solution_texts, f"{real} is a copy of a worked solution"


def test_the_pytorch_editions_view_leaves_out_the_keras_labs_and_says_so(tmp_path, monkeypatch, capsys):
    course, view = course_copy(tmp_path / "course"), tmp_path / "view"
    monkeypatch.setattr(lab_setup, "edition", lambda: "pytorch")  # `make setup` on Python 3.13: no TensorFlow
    monkeypatch.setattr(lab_setup, "COURSE_ROOT", course)
    monkeypatch.setattr(lab_setup, "install_kernel", lambda: "scalelab (not installed by this test)")
    monkeypatch.setattr(lab_setup, "install_jupyterlab_settings", lambda: "(not written by this test)")
    assert cli.main(["lab-setup", "--student-view", str(view)]) == 0
    assert sorted(path.name for path in (view / "labs").iterdir()) == sorted(
        set(ASSIGNMENTS) - set(lab_setup.KERAS_LABS)) == ["lab3_ddp", "quiz"]
    assert (view / "labs" / "lab3_ddp" / "fashion_mnist_ddp_student.py").is_file()
    assert f"student view    left out: {', '.join(lab_setup.KERAS_LABS)} ({environment.KERAS_LEFT_OUT})" \
        in capsys.readouterr().out.splitlines()
    # What `make hub` leaves out of its students' copy too (containers/hub/hub.sh asks the Hub's venv).
    assert lab_setup.labs_left_out() == lab_setup.KERAS_LABS
    monkeypatch.setattr(lab_setup, "edition", lambda: "all")
    assert lab_setup.labs_left_out() == ()


def test_the_keras_labs_are_those_whose_material_uses_tensorflow():
    tensorflow = re.compile(r"\b(import tensorflow|horovod\.tensorflow|scalelab\.(models|callbacks) import)")
    uses = {lab.name for lab in (PROJECT_ROOT / "labs" / "source").iterdir() if lab.is_dir()
            and any(tensorflow.search(path.read_text()) for path in lab.iterdir() if path.suffix in (".py", ".ipynb"))}
    assert uses == set(lab_setup.KERAS_LABS)


def test_student_view_holds_the_released_labs_and_the_assessment_and_no_solution(tmp_path):
    course, view = course_copy(tmp_path / "course"), tmp_path / "view"
    assert "### BEGIN SOLUTION" in (course / "labs" / "source" / "quiz" / "quiz.ipynb").read_text()

    report = lab_setup.build_student_view(view, course)

    released = {str(Path("labs") / path) for path in lab_setup.course_files(course / "labs" / "release")}
    assert {path.split("/")[1] for path in released} == set(ASSIGNMENTS)
    assert files_in(view) == released | {"START.md", "assessment/assessment.ipynb", "assessment/assessment.py",
                                         "assessment/assessment_pytorch.py"}
    assert sorted(report["copied"]) == sorted(files_in(view)) and report["kept"] == []
    for path in files_in(view):
        text = (view / path).read_text()
        assert "BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text, path
    for script in ("assessment.py", "assessment_pytorch.py"):  # the serial scripts, not the solutions
        assert (view / "assessment" / script).read_text() == (course / "assessment" / script).read_text()
    assert not (view / "assessment" / "solution").exists() and not (view / "labs" / "source").exists()
    assert (view / "source_code").is_dir() and not (view / "source_code").is_symlink()
    assert sorted(path.name for path in (view / "source_code").iterdir()) == sorted(lab_setup.STUDENT_SOURCE)
    for name in lab_setup.STUDENT_SOURCE:
        assert (view / "source_code" / name).resolve() == (course / "source_code" / name).resolve(), name
    assert (view / "assessment" / "tracks.toml").resolve() == (course / "assessment" / "tracks.toml").resolve()
    assert not (course / "labs" / "gradebook.db").exists(), "the instructor's gradebook is left alone"


def test_student_view_keeps_the_students_work_and_brings_back_what_was_deleted(tmp_path):
    course, view = course_copy(tmp_path / "course"), tmp_path / "view"
    lab_setup.build_student_view(view, course)
    answered = view / "labs" / "quiz" / "quiz.ipynb"
    answered.write_text(answered.read_text().replace("YOUR CODE HERE", "my answer"))
    mine = answered.read_text()
    (view / "labs" / "lab1" / "lab1_gradient_descent.ipynb").unlink()
    # The instructor edits lab 1 after the first release: the next view gets the new release of it.
    source = course / "labs" / "source" / "lab1" / "lab1_gradient_descent.ipynb"
    notebook = json.loads(source.read_text())
    notebook["cells"][0]["source"] = ["# Lab 1, revised\n"] + notebook["cells"][0]["source"][1:]
    source.write_text(json.dumps(notebook, indent=1))
    later = time.time() + 5
    os.utime(source, (later, later))

    report = lab_setup.build_student_view(view, course)

    assert answered.read_text() == mine, "the student's answers were overwritten"
    assert report["copied"] == ["labs/lab1/lab1_gradient_descent.ipynb"]
    assert "labs/quiz/quiz.ipynb" in report["kept"]
    restored = json.loads((view / "labs" / "lab1" / "lab1_gradient_descent.ipynb").read_text())
    assert "".join(restored["cells"][0]["source"]).startswith("# Lab 1, revised")


def test_student_view_reaches_no_worked_solution_even_through_its_links(tmp_path):
    course = course_copy(tmp_path / "course")
    for folder in solutions(course):
        assert folder.exists(), folder
    # Outside the course (absolute links, as in the images) and inside it (relative links, as `make lab` makes).
    for view in (tmp_path / "view", course / "student"):
        lab_setup.build_student_view(view, course)

        assert_no_solution_reachable(view, course)


def test_student_view_has_what_the_labs_and_the_assessment_read_from_source_code(tmp_path):
    course, view = course_copy(tmp_path / "course"), tmp_path / "view"
    lab_setup.build_student_view(view, course)

    # The labs name their worked solutions, released after the lab (lab 3's two editions).
    held_back = {Path(relative).name for files in lab_setup.SOLUTIONS.values() for relative in files}
    named = set()
    for path in files_in(view):
        named |= set(re.findall(r"source_code/(\w+(?:\.\w+)*)", (view / path).read_text()))
    assert {"fashion_mnist.py", "cifar10_ladder.py"} <= named, "the labs name the scripts they run"
    for name in named - held_back:
        assert (view / "source_code" / name).exists(), f"the labs read source_code/{name}"
    assert (view / "source_code" / "scalelab" / "__init__.py").is_file(), "the course library, to read"
    assert (view / "source_code" / "scalelab" / "runtime.py").is_file(), "the helpers lab 3's FIXMEs name, to read"
    assert environment.course_source_dir({"SCALELAB_SOURCE_DIR": str(view / "source_code")}) == view / "source_code"


def test_the_labs_find_the_courses_scripts_in_a_checkout_or_where_the_operator_says(tmp_path, monkeypatch):
    assert environment.course_source_dir({}) == PROJECT_ROOT / "source_code"
    staged = tmp_path / "course" / "source_code"
    staged.mkdir(parents=True)
    for name in environment.COURSE_SCRIPTS:
        (staged / name).write_text("# the course's script\n")
    assert environment.course_source_dir({"SCALELAB_SOURCE_DIR": str(staged)}) == staged
    (staged / "cifar10_ladder.py").unlink()
    with pytest.raises(FileNotFoundError, match=r"SCALELAB_SOURCE_DIR=.*missing: cifar10_ladder.py"):
        environment.course_source_dir({"SCALELAB_SOURCE_DIR": str(staged)})
    # A shared install (the Hub's venv) has the library alone: without the setting, a clear error, not a wrong path.
    installed = tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "scalelab" / "environment.py"
    monkeypatch.setattr(environment, "__file__", str(installed))
    with pytest.raises(FileNotFoundError, match="beside the installed scalelab package.*set SCALELAB_SOURCE_DIR"):
        environment.course_source_dir({})


def test_every_entry_of_source_code_is_course_material_a_worked_solution_or_course_tooling():
    entries = {path.name for path in (PROJECT_ROOT / "source_code").iterdir() if path.name != "__pycache__"}
    solution_entries = {Path(relative).name for files in lab_setup.SOLUTIONS.values() for relative in files}

    # A new file in source_code/ must be put in one of them: the view shows nothing by default.
    assert entries == set(lab_setup.STUDENT_SOURCE) | solution_entries | COURSE_TOOLING
    assert not set(lab_setup.STUDENT_SOURCE) & (solution_entries | COURSE_TOOLING)


def test_releasing_lab3_adds_exactly_its_worked_solution_and_nothing_on_a_second_run(tmp_path):
    course, view = course_copy(tmp_path / "course"), tmp_path / "view"
    lab_setup.build_student_view(view, course)
    before = reachable(view)

    released = lab_setup.release_solutions(view, "lab3", course)

    assert released == {"added": list(LAB3_SOLUTION), "kept": []}
    lab3_solution = [course / relative for relative in LAB3_SOLUTION]
    for relative, solution in zip(LAB3_SOLUTION, lab3_solution):
        assert (view / relative).resolve() == solution.resolve()
    newly_reached = reachable(view) - before
    expected = {path.resolve() for solution in lab3_solution for path in [solution, *solution.rglob("*")]}
    assert newly_reached == expected, "lab 3's worked solution and nothing else"
    assert not any(real.is_relative_to((course / "assessment" / "solution").resolve()) for real in reachable(view))

    assert lab_setup.release_solutions(view, "lab3", course) == {"added": [], "kept": list(LAB3_SOLUTION)}
    lab_setup.build_student_view(view, course)
    assert reachable(view) - before == expected, "rebuilding the view keeps a released solution"


def test_release_solutions_command_says_what_it_added_and_refuses_an_unknown_lab(tmp_path, monkeypatch, capsys):
    course, view = course_copy(tmp_path / "course"), tmp_path / "view"
    # The kernel and JupyterLab settings go to the test's folder, not to the venv the suite runs in.
    monkeypatch.setattr(lab_setup, "install_kernel", lambda: tmp_path / "kernel")
    monkeypatch.setattr(lab_setup, "install_jupyterlab_settings", lambda: tmp_path / "settings")
    command = ["lab-setup", "--student-view", str(view), "--course", str(course), "--release-solutions"]

    assert cli.main([*command, "lab3"]) == cli.EXIT_OK
    printed = capsys.readouterr().out
    for relative in LAB3_SOLUTION:
        assert relative in printed
        assert (view / relative).resolve() == (course / relative).resolve()
    assert cli.main([*command, "lab3"]) == cli.EXIT_OK
    assert "already in the view" in capsys.readouterr().out

    with pytest.raises(SystemExit) as unknown:
        cli.main([*command, "lab9"])
    assert unknown.value.code == cli.EXIT_USAGE
    assert "lab9" in capsys.readouterr().err
    assert cli.main(["lab-setup", "--release-solutions", "lab3"]) == cli.EXIT_USAGE
    assert "--student-view" in capsys.readouterr().err


def test_rebuilding_a_view_that_links_the_whole_source_code_replaces_the_link_with_the_students_folder(tmp_path):
    course = course_copy(tmp_path / "course")
    view = course / "student"
    (view / "labs").mkdir()
    mine = view / "labs" / "notes.md"
    mine.write_text("my notes")
    # What the view had before: one relative link to the course's whole source_code/, lab 3's solution included.
    (view / "source_code").symlink_to(Path("..") / "source_code")

    report = lab_setup.build_student_view(view, course)

    assert (view / "source_code").is_dir() and not (view / "source_code").is_symlink()
    assert report["replaced"] == ["source_code"]
    assert (course / "source_code" / "fashion_mnist_horovod.py").is_file(), "the course's own folder is untouched"
    assert_no_solution_reachable(view, course)
    serial_script = Path("source_code") / "fashion_mnist.py"
    assert (view / serial_script).resolve() == (course / serial_script).resolve()
    assert mine.read_text() == "my notes"
    assert lab_setup.build_student_view(view, course)["replaced"] == []


def test_course_kernel_runs_this_python_with_its_scripts_first_on_path_and_the_courses_openmpi_settings(tmp_path):
    directory = lab_setup.install_kernel(prefix=tmp_path, environ={"OMPI_MCA_mpi_yield_when_idle": "0"})

    spec = KernelSpecManager(kernel_dirs=[str(directory.parent)]).get_kernel_spec("scalelab")
    assert spec.argv[:3] == [sys.executable, "-m", "ipykernel_launcher"]
    assert spec.env["PATH"] == f"{sysconfig.get_path('scripts')}{os.pathsep}${{PATH}}"
    assert (Path(sysconfig.get_path("scripts")) / "horovodrun").is_file()
    # The course's settings, each one the installing environment sets (make's command line) taken from there.
    assert spec.env["OMPI_MCA_mpi_yield_when_idle"] == "0"
    assert spec.env["OMPI_MCA_coll_tuned_use_dynamic_rules"] == "1"
    assert Path(spec.env["OMPI_MCA_coll_tuned_dynamic_rules_filename"]).is_file()
    notebook = json.loads((PROJECT_ROOT / "assessment" / "assessment.ipynb").read_text())
    assert notebook["metadata"]["kernelspec"]["name"] == "scalelab"
    for source in (PROJECT_ROOT / "labs" / "source").glob("*/*.ipynb"):
        assert json.loads(source.read_text())["metadata"]["kernelspec"]["name"] == "scalelab", source
