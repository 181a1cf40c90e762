"""scalelab.lab_setup: the student's view of the course (released labs and the assessment, never a solution, never
overwriting the student's work) and the course's kernel. `make lab` end to end is tests/test_make_lab.py."""

from __future__ import annotations

import json
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path

from jupyter_client.kernelspec import KernelSpecManager

from conftest import PROJECT_ROOT
from scalelab import lab_setup

GENERATED = ("release", "submitted", "autograded", "feedback", "gradebook.db", "grades.csv", ".ipynb_checkpoints")
ASSIGNMENTS = sorted(path.name for path in (PROJECT_ROOT / "labs" / "source").iterdir() if path.is_dir())


def course_copy(root: Path) -> Path:
    """The parts of the checkout the view is made from, without anything generated (tests never write into the
    repository's labs/); the instructor's material included, so that leaving it out is what is tested."""
    shutil.copytree(PROJECT_ROOT / "labs", root / "labs", ignore=shutil.ignore_patterns(*GENERATED))
    shutil.copytree(PROJECT_ROOT / "assessment", root / "assessment")
    (root / "student").mkdir()
    shutil.copy(PROJECT_ROOT / "student" / "START.md", root / "student" / "START.md")
    (root / "source_code").mkdir()
    return root


def files_in(view: Path) -> set[str]:
    return {str(path.relative_to(view)) for path in view.rglob("*") if path.is_file() and not path.is_symlink()}


def test_student_view_holds_the_released_labs_and_the_assessment_and_no_solution(tmp_path):
    course, view = course_copy(tmp_path / "course"), tmp_path / "view"
    assert "### BEGIN SOLUTION" in (course / "labs" / "source" / "quiz" / "quiz.ipynb").read_text()

    report = lab_setup.build_student_view(view, course)

    released = {str(Path("labs") / path) for path in lab_setup.course_files(course / "labs" / "release")}
    assert {path.split("/")[1] for path in released} == set(ASSIGNMENTS)
    assert files_in(view) == released | {"START.md", "assessment/assessment.ipynb", "assessment/assessment.py"}
    assert sorted(report["copied"]) == sorted(files_in(view)) and report["kept"] == []
    for path in files_in(view):
        text = (view / path).read_text()
        assert "BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text, path
    assert (view / "assessment" / "assessment.py").read_text() == (course / "assessment" / "assessment.py").read_text()
    assert not (view / "assessment" / "solution").exists() and not (view / "labs" / "source").exists()
    assert (view / "source_code").resolve() == (course / "source_code").resolve()
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
