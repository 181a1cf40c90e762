"""The quiz notebook (labs/source/quiz/quiz.ipynb): every question has an answer cell and a graded test cell with
hidden tests; the solutions pass; every wrong option is explained; malformed answers are caught by the visible
check; the student release hides solutions and hidden tests, fails `nbgrader validate`, and the source passes."""

from __future__ import annotations

import re
import string

import nbformat
import pytest

from test_nbgrader_cycle import LABS, MAX_SCORE, QUIZ, RIGHT_ANSWERS, nbgrader, released_course

SOURCE_NOTEBOOK = LABS / "source" / QUIZ / "quiz.ipynb"
HIDDEN = "### BEGIN HIDDEN TESTS"
# The course's questions, by the words each question's title holds.
TOPICS = {1: "data parallelism", 2: "model parallelism", 3: "asynchronous SGD", 4: "1024", 5: "high training error",
          6: "high validation error", 7: "linear scaling", 8: "warmup"}


def cells_by_grade_id() -> dict[str, nbformat.NotebookNode]:
    notebook = nbformat.read(SOURCE_NOTEBOOK, as_version=4)
    return {cell.metadata["nbgrader"]["grade_id"]: cell for cell in notebook.cells}


def options_of(number: int) -> list[str]:
    return re.findall(r"^- \(([a-z])\) ", cells_by_grade_id()[f"q{number}-md"].source, re.MULTILINE)


def run_test_cell(number: int, answer, *, visible_only: bool = False) -> str | None:
    """Executes question `number`'s test cell against `answer`; returns the assertion message, or None if it passes."""
    source = cells_by_grade_id()[f"q{number}-tests"].source
    if visible_only:  # what the student's release runs
        source = source.split(HIDDEN)[0]
    try:
        exec(compile(source, f"q{number}-tests", "exec"), {f"ANSWER_Q{number}": answer})
    except AssertionError as failure:
        return str(failure)
    return None


def test_quiz_source_is_committed_without_outputs_and_says_what_it_checks():
    notebook = nbformat.read(SOURCE_NOTEBOOK, as_version=4)
    assert all(not cell.get("outputs") and cell.get("execution_count") is None
               for cell in notebook.cells if cell.cell_type == "code")
    assert notebook.cells[0].cell_type == "markdown" and "2 CPU cores" in notebook.cells[0].source
    assert all("nbgrader" in cell.metadata for cell in notebook.cells)


def test_every_course_question_has_an_answer_cell_and_a_graded_test_cell_with_hidden_tests():
    cells = cells_by_grade_id()
    questions = sorted(int(grade_id[1:-3]) for grade_id in cells if re.fullmatch(r"q\d+-md", grade_id))
    assert questions == sorted(TOPICS)
    for number, topic in TOPICS.items():
        assert topic in cells[f"q{number}-md"].source.split("\n")[0], (number, topic)
        answer, tests = cells[f"q{number}-answer"], cells[f"q{number}-tests"]
        assert answer.metadata.nbgrader["solution"] and not answer.metadata.nbgrader["grade"]
        assert f"ANSWER_Q{number} = " in answer.source and "### BEGIN SOLUTION" in answer.source
        assert tests.metadata.nbgrader["grade"] and tests.metadata.nbgrader["locked"]
        assert HIDDEN in tests.source and "### END HIDDEN TESTS" in tests.source
        expected_points = 2 if isinstance(RIGHT_ANSWERS[number], set) else 1
        assert tests.metadata.nbgrader["points"] == expected_points
        assert f"({expected_points} point" in cells[f"q{number}-md"].source
    assert sum(cell.metadata.nbgrader.get("points", 0) for cell in cells.values()) == MAX_SCORE


@pytest.mark.parametrize("number", sorted(RIGHT_ANSWERS))
def test_the_right_answer_passes_and_is_the_one_in_the_solution_cell(number):
    namespace: dict = {}
    exec(cells_by_grade_id()[f"q{number}-answer"].source, namespace)
    assert namespace[f"ANSWER_Q{number}"] == RIGHT_ANSWERS[number]
    assert run_test_cell(number, RIGHT_ANSWERS[number]) is None


@pytest.mark.parametrize("number", sorted(RIGHT_ANSWERS))
def test_every_wrong_option_fails_with_an_explanation_of_that_option(number):
    right = RIGHT_ANSWERS[number]
    explanations = set()
    for letter in options_of(number):
        if isinstance(right, str):
            if letter == right:
                continue
            message = run_test_cell(number, letter)
            assert message and message.startswith(f"Not quite. You chose ({letter}): ")
            assert f"The answer is ({right}): " in message
        else:
            wrong = right ^ {letter}  # one option toggled: a wrong pick or a right one left out
            if not wrong:
                continue
            message = run_test_cell(number, wrong)
            verdict = "true" if letter in right else "false"
            assert message and message.startswith(f"Not quite. ({letter}) is {verdict}: "), message
            assert message.count(") is ") == 1, "only the option that is wrong is explained"
        explanation = message.split(": ", 1)[1]
        assert len(explanation) > 60, "the feedback must say why, not only that it is wrong"
        explanations.add(explanation)
    assert len(explanations) == len(options_of(number)) - (1 if isinstance(right, str) else 0)


@pytest.mark.parametrize("number", sorted(RIGHT_ANSWERS))
def test_answers_are_read_the_way_students_write_them(number):
    right = RIGHT_ANSWERS[number]
    variants = [f" {right.upper()} "] if isinstance(right, str) else \
        [sorted(right), tuple(right), frozenset(letter.upper() for letter in right)]
    for variant in variants:
        assert run_test_cell(number, variant) is None, variant


@pytest.mark.parametrize("number", sorted(RIGHT_ANSWERS))
def test_the_visible_check_catches_malformed_answers_without_grading_them(number):
    options = options_of(number)
    not_an_option = string.ascii_lowercase[len(options)]
    if isinstance(RIGHT_ANSWERS[number], str):
        malformed = [{options[0]}, not_an_option, 2, ""]
        expected = "answer with one letter"
    else:
        malformed = [options[0], set(), 3]
        expected = "answer with a set of one or more letters"
    for answer in malformed:
        message = run_test_cell(number, answer, visible_only=True)
        assert message and message.startswith(expected), (answer, message)
    if not isinstance(RIGHT_ANSWERS[number], str):
        assert run_test_cell(number, {options[0], not_an_option}, visible_only=True) == \
            f"use only the letters a to {options[-1]}"
    # A well-formed wrong answer passes the visible check: it reveals nothing about the right answer.
    wrong = next(letter for letter in options if letter not in RIGHT_ANSWERS[number])
    well_formed = wrong if isinstance(RIGHT_ANSWERS[number], str) else {wrong}
    assert run_test_cell(number, well_formed, visible_only=True) is None
    assert run_test_cell(number, well_formed) is not None


@pytest.fixture(scope="module")
def course_with_release(tmp_path_factory):
    return released_course(tmp_path_factory.mktemp("quiz"))


def test_release_has_no_solutions_no_hidden_tests_and_no_answers(course_with_release):
    released = nbformat.read(course_with_release / "release" / QUIZ / "quiz.ipynb", as_version=4)
    text = nbformat.writes(released)
    assert "BEGIN SOLUTION" not in text and "HIDDEN TESTS" not in text and "Not quite" not in text
    answer_cells = [cell for cell in released.cells if cell.metadata["nbgrader"]["grade_id"].endswith("-answer")]
    assert len(answer_cells) == len(RIGHT_ANSWERS)
    assert all("raise NotImplementedError" in cell.source and "ANSWER_Q" not in cell.source for cell in answer_cells)


def validation_report(course, notebook) -> str:
    return " ".join(nbgrader("validate", str(notebook), course=course).stdout.split())


def test_unsolved_release_fails_nbgrader_validate_on_every_question(course_with_release):
    report = validation_report(course_with_release, course_with_release / "release" / QUIZ / "quiz.ipynb")
    assert f"VALIDATION FAILED ON {len(RIGHT_ANSWERS)} CELL(S)" in report, report[-2000:]


def test_solved_source_passes_nbgrader_validate(course_with_release):
    report = validation_report(course_with_release, course_with_release / "source" / QUIZ / "quiz.ipynb")
    assert "Success! Your notebook passes all the tests." in report, report[-2000:]
