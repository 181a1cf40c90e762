"""P9: a class's notebooks through nbgrader the course's way, against nbgrader's own: the quiz handed in by N
students, then

- `nbgrader collect` with the course's collect (grader/nbgrading/exchange.py: each folder's owner checked against
  the student it names, links and odd files refused, the time in its name parsed) ÷ nbgrader's own collect;
- `nbgrader autograde` with each notebook's kernel in the grading sandbox (grader/nbgrading/kernel_sandbox.py: a
  throw-away uid, no network, no secret, a copy of the notebook's folder) ÷ nbgrader's own kernel, run as the
  instructor.

    PYTHONPATH=source_code .venv/bin/python -m benchmarks.class_notebooks --out DIR [--students 20] [--repeats 2]

As root: it makes N throw-away accounts (the course's collect takes a folder only from the student it names) and
removes them; the sandbox's uids need root too. Each side of each repeat works on a fresh copy of the course (the
quiz released once); half the students hand in the right answers, half the release untouched. The scores both
autogrades store must agree, or the figure is refused: a side that is faster by grading differently measures
nothing. Prints the figures as JSON and writes them to DIR/class_notebooks.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
from nbgrader.api import Gradebook

from . import processes
from .summary import run_in_turn, spread

COURSE_ID = "scalelab"
QUIZ = "quiz"
# What nbgrader wrote into a course directory: a copy starts without it.
GENERATED = ("release", "submitted", "autograded", "feedback", "gradebook.db", "grades.csv", ".ipynb_checkpoints")
COURSES_COLLECT = "scalelab.grader.nbgrading.exchange.SafeExchangeCollect"
NBGRADERS_COLLECT = "nbgrader.exchange.default.collect.ExchangeCollect"
# Appended to a copy's nbgrader_config.py: nbgrader's own autograde steps (its Execute, its kernel) again.
STOCK_AUTOGRADE = ('\nc.Autograde.autograde_preprocessors = '
                   'Autograde.class_traits()["autograde_preprocessors"].default()\n')
SOLUTION_MARKER = re.compile(r"^\s*### (BEGIN|END) SOLUTION\s*$", re.MULTILINE)


def nbgrader(course: Path, log: Path, *arguments: str) -> float:
    """``nbgrader ARGUMENTS`` in the course directory (where its nbgrader_config.py is); its wall seconds."""
    command = [str(Path(sys.executable).with_name("nbgrader")), *arguments]
    return processes.run(command, log, cwd=course, timeout_s=3600).wall_s


def released_course(top: Path, log: Path) -> Path:
    course = top / "released" / "labs"
    shutil.copytree(processes.COURSE_ROOT / "labs", course, ignore=shutil.ignore_patterns(*GENERATED))
    nbgrader(course, log, "generate_assignment", QUIZ, "--force")
    return course


def answered(course: Path):
    """The released quiz with every answer cell as the source's solution: a student who got it all right."""
    solutions = {cell.metadata["nbgrader"]["grade_id"]: SOLUTION_MARKER.sub("", cell.source).strip()
                 for cell in nbformat.read(course / "source" / QUIZ / "quiz.ipynb", as_version=4).cells
                 if cell.metadata.get("nbgrader", {}).get("solution")}
    notebook = nbformat.read(course / "release" / QUIZ / "quiz.ipynb", as_version=4)
    for cell in notebook.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id in solutions:
            cell.source = solutions[grade_id]
    return notebook


def make_accounts(count: int) -> list[str]:
    prefix = f"slb{secrets.token_hex(2)}"
    names = []
    for index in range(count):
        name = f"{prefix}s{index:02d}"
        subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True,
                       capture_output=True)
        names.append(name)
    return names


def remove_accounts(names: list[str]) -> None:
    for name in names:
        subprocess.run(["userdel", name], capture_output=True)


def hand_in(exchange: Path, students: list[str], right, untouched: Path) -> None:
    """Each student's folder in the exchange's inbound/, named and owned as `nbgrader submit` leaves it."""
    inbound = exchange / COURSE_ID / "inbound"
    inbound.mkdir(parents=True)
    when = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
    for index, student in enumerate(students):
        folder = inbound / f"{student}+{QUIZ}+{when.strftime('%Y-%m-%d %H:%M:%S.%f %Z')}"
        folder.mkdir()
        if index % 2 == 0:
            nbformat.write(right, folder / "quiz.ipynb")
        else:
            shutil.copyfile(untouched, folder / "quiz.ipynb")
        for path in (folder, folder / "quiz.ipynb"):
            shutil.chown(path, student, student)


def grade_one_side(side: str, released: Path, top: Path, students: list[str], logs: Path) -> dict:
    """Collect and autograde on a fresh copy; the seconds of each and the scores stored."""
    work = top / side
    shutil.rmtree(work, ignore_errors=True)
    course = work / "labs"
    shutil.copytree(released, course, ignore=shutil.ignore_patterns("submitted", "autograded", "feedback"))
    if side == "nbgrader":
        with open(course / "nbgrader_config.py", "a") as config:
            config.write(STOCK_AUTOGRADE)
    exchange = work / "exchange"
    hand_in(exchange, students, answered(released), released / "release" / QUIZ / "quiz.ipynb")
    collect_class = COURSES_COLLECT if side == "course" else NBGRADERS_COLLECT
    collect_s = nbgrader(course, logs / f"{side}-collect.log", "collect", QUIZ, f"--Exchange.root={exchange}",
                         f"--ExchangeFactory.collect={collect_class}")
    collected = sorted(path.name for path in (course / "submitted").iterdir())
    if collected != sorted(students):
        raise processes.BenchmarkError(f"{side}: collect took {len(collected)} of {len(students)} students")
    autograde_s = nbgrader(course, logs / f"{side}-autograde.log", "autograde", QUIZ, "--create")
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}", course_id=COURSE_ID) as gradebook:
        scores = {submission.student_id: submission.score for submission in gradebook.assignment_submissions(QUIZ)}
    return {"collect_s": collect_s, "autograde_s": autograde_s, "scores": scores}


def measure(out: Path, students: int, repeats: int) -> dict:
    if os.geteuid() != 0:
        raise processes.BenchmarkError("class_notebooks makes accounts and sandbox uids: run it as root")
    top, logs = out / "class_notebooks", out / "logs" / "class_notebooks"
    shutil.rmtree(top, ignore_errors=True)
    top.mkdir(parents=True)
    top.chmod(0o755)  # the accounts own folders below it
    names = make_accounts(students)
    try:
        released = released_course(top, logs / "release.log")
        turns = []
        for repeat in range(repeats):
            turns.append(run_in_turn({side: (lambda side=side: grade_one_side(side, released, top, names,
                                                                              logs / f"repeat-{repeat}"))
                                      for side in ("course", "nbgrader")}, repeat))
    finally:
        remove_accounts(names)
    for turn in turns:
        if turn["course"]["scores"] != turn["nbgrader"]["scores"]:
            raise processes.BenchmarkError(f"the two autogrades stored different scores: {turn}")
    figures = {"students": students, "repeats": repeats,
               "scores": sorted(turns[0]["course"]["scores"].values())}
    for step in ("collect_s", "autograde_s"):
        figures[f"{step}_course"] = spread(turn["course"][step] for turn in turns)
        figures[f"{step}_nbgrader"] = spread(turn["nbgrader"][step] for turn in turns)
        figures[f"{step}_ratio"] = spread(turn["course"][step] / turn["nbgrader"][step] for turn in turns)
    return figures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--students", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    arguments = parser.parse_args(argv)
    try:
        figures = measure(arguments.out, arguments.students, arguments.repeats)
    except processes.BenchmarkError as error:
        print(f"class_notebooks: {error}", file=sys.stderr)
        return 1
    text = json.dumps(figures, indent=2)
    (arguments.out / "class_notebooks.json").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
