"""Lab 3's "Horovod in practice" section, the parts that need no horovodrun (test_lab3.py runs the section's jobs).

Exercise 6's wrong solutions are in test_lab_exercises.py, which checks that each is rejected and, for those only
the hidden tests catch, with which message; here: the visible checks, which catch most mistakes, name the mistake
they catch too. And the checkpoint names the exercise is about are the ones resume_demo.py writes."""

from __future__ import annotations

import re

import nbformat

from conftest import keras_only
from labtools import LABS, cell_by_grade_id, grade_exercise
from test_lab_exercises import EXERCISES, NOTEBOOKS, context_of

# The Keras edition's: skipped, with the reason, where `make setup` installed the PyTorch edition alone.
pytestmark = keras_only

EXERCISE = ("lab3", "ex6-resume-plan", "ex6-tests")
RESUME_SCRIPT = LABS / "source" / "lab3" / "resume_demo.py"


def test_exercise6_visible_checks_name_the_mistake_they_catch(tmp_path):
    caught_visibly = {name: wrong for name, wrong in EXERCISES[EXERCISE].items() if wrong.caught_by == "visible"}
    assert len(caught_visibly) >= 4
    outcomes = grade_exercise(NOTEBOOKS["lab3"], EXERCISE[1], EXERCISE[2], context_of("lab3"),
                              {name: wrong.bodies for name, wrong in caught_visibly.items()}, tmp_path)
    for name, wrong in caught_visibly.items():
        message = outcomes[name]["visible"]
        assert message is not None and message.startswith("AssertionError"), (name, message)
        assert wrong.message in message, f"{name!r} was rejected for another reason: {message}"


def test_exercise6_names_the_checkpoints_as_resume_demo_writes_and_reads_them():
    script = RESUME_SCRIPT.read_text()
    written = re.search(r'^CHECKPOINT_NAME = "([^"]+)"', script, flags=re.MULTILINE).group(1)
    read = re.search(r'^CHECKPOINT_PATTERN = re\.compile\(r"([^"]+)"\)', script, flags=re.MULTILINE).group(1)
    assert re.fullmatch(read, written.format(epoch=2)) and re.fullmatch(read, written.format(epoch=1000))
    solution = cell_by_grade_id(nbformat.read(NOTEBOOKS["lab3"], as_version=4), EXERCISE[1]).source
    assert f'CHECKPOINT_NAME = "{written}"' in solution
