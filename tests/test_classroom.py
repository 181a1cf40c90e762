"""scalelab.grader.classroom without system accounts: the names it accepts and how the course reaches a student's home.
(tests/test_hub.py runs the `scalelab class` commands themselves, as root, with real accounts.)"""

from __future__ import annotations

import pytest

from scalelab.grader.classroom import accounts
from scalelab.grader.classroom.course import copy_course


@pytest.mark.parametrize("name", ["alice", "bob_2", "x", "_svc", "a-b", "a" * 32])
def test_portable_lowercase_user_names_are_accepted(name):
    accounts.check_name(name)


@pytest.mark.parametrize("name", ["Alice", "1st", "-rf", "a.b", "a b", "café", "a" * 33, "", "a\n"])
def test_names_that_are_not_portable_lowercase_user_names_are_refused(name):
    with pytest.raises(accounts.ClassError, match="not a valid user name") as refused:
        accounts.check_name(name)
    assert refused.value.exit_code == accounts.EXIT_BAD_INPUT


@pytest.mark.parametrize("name", ["root", "scalelab", "nobody", "scalelab-students", "scalelab-instructors"])
def test_reserved_names_are_refused(name):
    with pytest.raises(accounts.ClassError, match="is reserved") as refused:
        accounts.check_name(name)
    assert refused.value.exit_code == accounts.EXIT_BAD_INPUT


@pytest.fixture()
def course(tmp_path):
    course = tmp_path / "course"
    (course / "labs" / "lab1").mkdir(parents=True)
    (course / "labs" / "lab1" / "lab1.ipynb").write_text("released lab 1")
    (course / "assessment").mkdir()
    (course / "assessment" / "assessment.py").write_text("serial script")
    return course


def test_the_course_is_copied_into_an_empty_home(course, tmp_path):
    copied = copy_course(course, tmp_path / "home" / "scalelab")
    assert sorted(copied) == ["assessment/assessment.py", "labs/lab1/lab1.ipynb"]
    assert (tmp_path / "home" / "scalelab" / "labs" / "lab1" / "lab1.ipynb").read_text() == "released lab 1"


def test_a_students_file_is_never_overwritten_and_what_is_missing_arrives(course, tmp_path):
    home = tmp_path / "home" / "scalelab"
    copy_course(course, home)
    (home / "assessment" / "assessment.py").write_text("my Horovod version")
    (home / "labs" / "lab1" / "lab1.ipynb").unlink()
    (course / "labs" / "lab2").mkdir()
    (course / "labs" / "lab2" / "lab2.ipynb").write_text("released later")
    copied = copy_course(course, home)
    assert sorted(copied) == ["labs/lab1/lab1.ipynb", "labs/lab2/lab2.ipynb"]
    assert (home / "assessment" / "assessment.py").read_text() == "my Horovod version"


def test_a_link_the_student_left_in_place_of_a_file_is_not_followed(course, tmp_path):
    home = tmp_path / "home" / "scalelab"
    (home / "assessment").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere.py"
    (home / "assessment" / "assessment.py").symlink_to(elsewhere)
    copy_course(course, home)
    assert not elsewhere.exists()
