"""The course's collect (grader/nbgrading/exchange.py) against what a student can write into nbgrader's inbound/,
with real accounts: students submit with `nbgrader submit` or write folders by hand, as themselves, and the
instructor, a member of the course's group, runs `nbgrader collect`. The exchange has the modes hub.sh gives it.
One test runs two of the attacks against nbgrader's own collect, to document the holes the course's closes.
Runs as root: it makes throw-away accounts and removes them afterwards."""

from __future__ import annotations

import datetime
import json
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from nbgrader.api import Gradebook

from conftest import VENV_BIN
from hubtools import remove_account
from scalelab.grader.nbgrading import exchange

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="makes accounts: run as root"),
              pytest.mark.timeout(300)]

SAFE_COLLECT = "scalelab.grader.nbgrading.exchange.SafeExchangeCollect"
COURSE_ID = "testcourse"
ASSIGNMENT = "quiz"
SECRET = "secret_answer = 'instructor-only-4b1d9'"


def notebook_text(source: str) -> str:
    return json.dumps({"cells": [{"cell_type": "code", "execution_count": None, "id": "answer", "metadata": {},
                                  "outputs": [], "source": source}],
                       "metadata": {}, "nbformat": 4, "nbformat_minor": 5})


def name_time(shift: datetime.timedelta = datetime.timedelta()) -> str:
    """A time as nbgrader submit writes it into a folder's name."""
    return (datetime.datetime.now(datetime.timezone.utc) + shift).strftime("%Y-%m-%d %H:%M:%S.%f %Z")


def make_group(name: str) -> None:
    subprocess.run(["groupadd", name], check=True, capture_output=True)


@pytest.fixture(scope="module")
def accounts():
    """An instructor in the course's group, and three students."""
    prefix = f"slx{secrets.token_hex(3)}"
    names = {"group": prefix, "instructor": f"{prefix}i", "alice": f"{prefix}a", "bob": f"{prefix}b",
             "carol": f"{prefix}c"}
    try:
        make_group(names["group"])
        subprocess.run(["useradd", "-m", "-G", names["group"], names["instructor"]], check=True, capture_output=True)
        for student in ("alice", "bob", "carol"):
            subprocess.run(["useradd", "-m", names[student]], check=True, capture_output=True)
        yield names
    finally:
        for role in ("instructor", "alice", "bob", "carol"):
            remove_account(names[role])
        subprocess.run(["groupdel", names["group"]], capture_output=True)


@pytest.fixture(scope="module")
def gradebook(tmp_path_factory) -> tuple[Path, datetime.datetime]:
    """A gradebook with the assignment, made once (nbgrader runs alembic for it), and the assignment's due date.
    The due date passed an hour ago: a backdated name is what a late student would want."""
    path = tmp_path_factory.mktemp("gradebook") / "gradebook.db"
    due = datetime.datetime.utcnow() - datetime.timedelta(hours=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PATH", f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
        with Gradebook(f"sqlite:///{path}", COURSE_ID) as book:
            book.add_assignment(ASSIGNMENT, duedate=due)
    return path, due


class Course:
    """An exchange and a course directory laid out as hub.sh lays them out, and the accounts that use them."""

    def __init__(self, top: Path, accounts: dict, gradebook: tuple[Path, datetime.datetime],
                 collect_class: str | None):
        self.top, self.accounts = top, accounts
        self.exchange = top / "exchange"
        self.inbound = self.exchange / COURSE_ID / "inbound"
        self.course_dir = top / "course"
        self.submitted = self.course_dir / "submitted"
        self.config_dir = top / "jupyter"
        gradebook_path, self.due = gradebook
        group = accounts["group"]

        def shared_dir(path: Path, mode: int, group_name: str = group) -> None:
            path.mkdir(parents=True, exist_ok=True)
            shutil.chown(path, "root", group_name)
            os.chmod(path, mode)

        shared_dir(self.exchange, 0o1777, "root")
        shared_dir(self.exchange / COURSE_ID, 0o2775)
        shared_dir(self.inbound, 0o2773)
        shared_dir(self.exchange / COURSE_ID / "outbound", 0o2775)
        shared_dir(self.exchange / COURSE_ID / "feedback", 0o2771)
        release = self.exchange / COURSE_ID / "outbound" / ASSIGNMENT
        shared_dir(release, 0o2775)
        (release / "quiz.ipynb").write_text(notebook_text("answer = None"))

        # The instructor's course directory (the group's alone), with the solution in source/.
        source = self.course_dir / "source" / ASSIGNMENT
        source.mkdir(parents=True)
        (source / "quiz.ipynb").write_text(notebook_text(SECRET))
        shutil.copy(gradebook_path, self.course_dir / "gradebook.db")
        for path in [self.course_dir, *self.course_dir.rglob("*")]:
            shutil.chown(path, accounts["instructor"], group)
            os.chmod(path, 0o2770 if path.is_dir() else 0o660)

        self.config_dir.mkdir()
        factory = f"c.ExchangeFactory.collect = {collect_class!r}\n" if collect_class else ""
        (self.config_dir / "nbgrader_config.py").write_text(
            "c = get_config()\n"
            f"c.CourseDirectory.course_id = {COURSE_ID!r}\n"
            f"c.CourseDirectory.root = {str(self.course_dir)!r}\n"
            f"c.Exchange.root = {str(self.exchange)!r}\n" + factory)

    def run_as(self, role: str, *command: str, cwd: Path | None = None, timeout: int = 60):
        """``command`` as the account, with nothing of root's environment but the course's nbgrader config."""
        name = self.accounts[role]
        home = pwd.getpwnam(name).pw_dir
        return subprocess.run(
            ["runuser", "-u", name, "--", "env", "-i", f"HOME={home}", f"USER={name}", f"LOGNAME={name}",
             f"PATH={VENV_BIN}:/usr/bin:/bin", "LANG=C.UTF-8", f"JUPYTER_CONFIG_DIR={self.config_dir}", *command],
            cwd=cwd or home, capture_output=True, text=True, timeout=timeout)

    def submit(self, role: str, answer: str) -> None:
        """The honest way: the notebook in the student's home, `nbgrader submit` as the student."""
        account = pwd.getpwnam(self.accounts[role])
        work = Path(account.pw_dir) / ASSIGNMENT
        work.mkdir(exist_ok=True)
        (work / "quiz.ipynb").write_text(notebook_text(answer))
        for path in (work, work / "quiz.ipynb"):
            os.chown(path, account.pw_uid, account.pw_gid)
        done = self.run_as(role, str(VENV_BIN / "nbgrader"), "submit", ASSIGNMENT)
        assert done.returncode == 0, done.stdout + done.stderr

    def write_folder(self, role: str, folder: str, script: str, *arguments: str) -> None:
        """A folder in inbound/ written by hand as the account: ``script`` runs in sh with $1 the folder's path."""
        done = self.run_as(role, "sh", "-euc", script, "sh", str(self.inbound / folder), *arguments)
        assert done.returncode == 0, done.stderr

    def forged_notebook(self, role: str, folder: str, answer: str) -> None:
        self.write_folder(role, folder, 'mkdir "$1" && printf %s "$2" > "$1/quiz.ipynb"', notebook_text(answer))

    def collect(self, *flags: str) -> subprocess.CompletedProcess:
        return self.run_as("instructor", str(VENV_BIN / "nbgrader"), "collect", ASSIGNMENT, *flags,
                           cwd=self.course_dir)

    def collected(self, role: str) -> str | None:
        notebook = self.submitted / self.accounts[role] / ASSIGNMENT / "quiz.ipynb"
        return notebook.read_text() if notebook.exists() else None

    def anything_under_submitted_holds(self, text: str) -> bool:
        return any(text in path.read_text(errors="replace") for path in self.submitted.rglob("*") if path.is_file())


@pytest.fixture
def course(accounts, gradebook, request):
    """A fresh exchange and course; the collect class is the course's unless a test passes another (None: stock)."""
    top = Path(tempfile.mkdtemp(dir="/tmp", prefix="exchange-collect-"))
    os.chmod(top, 0o755)
    try:
        yield Course(top, accounts, gradebook, getattr(request, "param", SAFE_COLLECT))
    finally:
        shutil.rmtree(top)


def collect_ok(course: Course, *flags: str) -> str:
    done = course.collect(*flags)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


def skip_line(output: str, folder: str) -> str:
    lines = [line for line in output.splitlines() if f"skipped inbound/{folder}:" in line]
    assert len(lines) == 1, f"no single skip line for {folder}:\n{output}"
    return lines[0]


def symlink_to_source(course: Course) -> str:
    folder = f"{course.accounts['alice']}+{ASSIGNMENT}+{name_time()}+x"
    course.write_folder("alice", folder, 'mkdir "$1" && ln -s "$2" "$1/quiz.ipynb"',
                        str(course.course_dir / "source" / ASSIGNMENT / "quiz.ipynb"))
    return folder


def garbage_name(course: Course) -> str:
    folder = f"x+{ASSIGNMENT}+garbage+y"
    course.forged_notebook("alice", folder, "answer = 'garbage'")
    return folder


def test_a_link_to_the_instructors_source_is_skipped_and_the_class_collected(course):
    course.submit("bob", "answer = 'bob-honest'")
    folder = symlink_to_source(course)
    output = collect_ok(course)
    assert not course.anything_under_submitted_holds("instructor-only")
    assert course.collected("alice") is None
    assert "bob-honest" in course.collected("bob")
    assert "quiz.ipynb is a symbolic link" in skip_line(output, folder)
    assert "Collected 1 submissions of 'quiz', skipped 1 inbound folders" in output


def test_fifos_and_hard_links_refuse_the_whole_folder_without_hanging(course):
    foreign = course.top / "notes.txt"  # the instructor's, writable by all: a hard link to it is allowed
    foreign.write_text(notebook_text(SECRET))
    shutil.chown(foreign, course.accounts["instructor"])
    os.chmod(foreign, 0o666)
    fifo = f"{course.accounts['alice']}+{ASSIGNMENT}+{name_time()}+x"
    course.write_folder("alice", fifo, 'mkdir "$1" && echo {} > "$1/quiz.ipynb" && mkfifo "$1/pipe"')
    foreign_link = f"{course.accounts['bob']}+{ASSIGNMENT}+{name_time()}+x"
    course.write_folder("bob", foreign_link, 'mkdir "$1" && ln "$2" "$1/quiz.ipynb"', str(foreign))
    own_link = f"{course.accounts['carol']}+{ASSIGNMENT}+{name_time()}+x"
    course.write_folder("carol", own_link, 'mkdir "$1" && echo {} > "$1/quiz.ipynb" && ln "$1/quiz.ipynb" "$1/also"')

    output = collect_ok(course)  # a FIFO opened for reading would hang it: run_as's timeout stops that

    assert "pipe is a FIFO" in skip_line(output, fifo)
    assert f"quiz.ipynb is owned by {course.accounts['instructor']}, not {course.accounts['bob']}" in \
        skip_line(output, foreign_link)
    assert "also has 2 hard links" in skip_line(output, own_link)
    assert not course.submitted.exists() or not any(course.submitted.iterdir())


def test_a_folder_named_for_another_student_is_skipped(course):
    course.submit("bob", "answer = 'bob-honest'")
    forged = f"{course.accounts['bob']}+{ASSIGNMENT}+{name_time(datetime.timedelta(seconds=1))}+x"
    course.forged_notebook("alice", forged, "answer = 'forged-by-alice'")
    output = collect_ok(course)
    assert "bob-honest" in course.collected("bob")
    assert f"owned by {course.accounts['alice']}, not {course.accounts['bob']}" in skip_line(output, forged)


def test_names_that_do_not_parse_or_lie_in_the_future_are_skipped_and_the_rest_collected(course):
    course.submit("bob", "answer = 'bob-honest'")
    garbage = garbage_name(course)
    future = f"{course.accounts['alice']}+{ASSIGNMENT}+2099-01-01 00:00:00.000000 UTC+z"
    course.forged_notebook("alice", future, "answer = 'from-the-future'")
    output = collect_ok(course)
    assert "its time 'garbage' does not parse" in skip_line(output, garbage)
    assert "later than the folder was written" in skip_line(output, future)
    assert "bob-honest" in course.collected("bob")
    assert course.collected("alice") is None


def test_a_backdated_name_is_skipped_and_the_honest_late_submission_collected(course):
    course.submit("alice", "answer = 'alice-late'")
    backdated = f"{course.accounts['alice']}+{ASSIGNMENT}+{name_time(-datetime.timedelta(days=1))}+x"
    course.forged_notebook("alice", backdated, "answer = 'alice-backdated'")
    output = collect_ok(course, "--before-duedate")
    assert "alice-late" in course.collected("alice")
    timestamp = (course.submitted / course.accounts["alice"] / ASSIGNMENT / "timestamp.txt").read_text()
    assert exchange.parse_utc(timestamp) > course.due
    assert "backdated" in skip_line(output, backdated)


def test_folders_over_the_limits_are_skipped_and_only_the_newest_are_considered(course):
    crowded = f"{course.accounts['alice']}+{ASSIGNMENT}+{name_time()}+x"
    course.write_folder("alice", crowded, 'mkdir "$1" && for n in 1 2 3 4 5 6; do echo > "$1/extra$n"; done')
    large = f"{course.accounts['carol']}+{ASSIGNMENT}+{name_time()}+x"
    course.write_folder("carol", large, 'mkdir "$1" && head -c 3000 /dev/zero > "$1/quiz.ipynb"')
    bobs = [f"{course.accounts['bob']}+{ASSIGNMENT}+{name_time(datetime.timedelta(seconds=n - 3))}+{n}"
            for n in range(3)]
    for version, folder in enumerate(bobs):
        course.forged_notebook("bob", folder, f"answer = 'bob-v{version}'")

    output = collect_ok(course, "--SafeExchangeCollect.max_files_per_folder=5",
                        "--SafeExchangeCollect.max_folders_per_student=2", "--CourseDirectory.max_dir_size=2")

    assert "more than 5 files and folders" in skip_line(output, crowded)
    assert "more than 2000 bytes" in skip_line(output, large)
    assert f"skipped 1 older inbound folders of {course.accounts['bob']}: only the newest 2" in output
    assert "bob-v2" in course.collected("bob")


def test_update_puts_a_newer_submission_in_place_with_groupshared_permissions(course):
    bob = course.accounts["bob"]
    course.forged_notebook("bob", f"{bob}+{ASSIGNMENT}+{name_time(-datetime.timedelta(seconds=1))}+1",
                           "answer = 'bob-v1'")
    collect_ok(course)
    course.forged_notebook("bob", f"{bob}+{ASSIGNMENT}+{name_time()}+2", "answer = 'bob-v2'")
    output = collect_ok(course, "--update", "--CourseDirectory.groupshared=True")
    assert f"Updating submission: {bob} {ASSIGNMENT}" in output
    assert "bob-v2" in course.collected("bob")
    assert [path.name for path in (course.submitted / bob).iterdir()] == [ASSIGNMENT]  # nothing left of the copy
    assert os.stat(course.submitted / bob / ASSIGNMENT).st_mode & 0o2770 == 0o2770
    assert os.stat(course.submitted / bob / ASSIGNMENT / "quiz.ipynb").st_mode & 0o660 == 0o660


@pytest.mark.parametrize("course", [None], indirect=True, ids=["nbgrader's own collect"])
@pytest.mark.parametrize("attack", ["link to the source", "garbage name"])
def test_documents_the_holes_in_nbgraders_own_collect(course, attack):
    """Not the course's behaviour: what nbgrader 0.9.6's collect does with the same folders."""
    course.submit("bob", "answer = 'bob-honest'")
    if attack == "link to the source":
        symlink_to_source(course)
        collect_ok(course)
        assert SECRET in course.collected("alice"), "nbgrader's collect no longer follows the link"
    else:
        garbage_name(course)
        done = course.collect()
        assert done.returncode != 0, "nbgrader's collect no longer stops at a name it cannot parse"
        assert course.collected("bob") is None


SWAPS = {
    "a directory for a link to another": ("sub", "a symbolic link"),
    "a file for a link to another": ("file", "a symbolic link"),
    "a file for a FIFO": ("file", "a FIFO"),
}


@pytest.mark.parametrize("swap", SWAPS)
def test_an_entry_swapped_after_its_check_is_never_followed(tmp_path, monkeypatch, swap):
    """The race the descriptors close: the entry changes between the lstat that classifies it and the open."""
    name, refused_as = SWAPS[swap]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "secret.txt").write_text("instructor-only")
    folder, dest = tmp_path / "folder", tmp_path / "dest"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "ok.txt").write_text("mine")
    (folder / "file").write_text("mine")
    dest.mkdir()

    real_lstat = exchange.lstat_entry

    def lstat_then_swap(entry: str, dir_fd: int):
        status = real_lstat(entry, dir_fd)
        if entry == name:
            (folder / name).rename(folder / f"{name}-moved")
            if refused_as == "a FIFO":
                os.mkfifo(folder / name)
            else:
                (folder / name).symlink_to(elsewhere if name == "sub" else elsewhere / "secret.txt")
        return status

    monkeypatch.setattr(exchange, "lstat_entry", lstat_then_swap)
    rules = exchange.FolderRules(owner_uid=os.getuid(), owner_name="root", max_entries=10, max_total_bytes=10_000)
    folder_fd, dest_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY), os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(exchange.SkipFolder, match=f"{name} is {refused_as}"):
            exchange.walk_folder(folder_fd, rules, dest_fd)
    finally:
        os.close(folder_fd)
        os.close(dest_fd)
    assert not any("instructor-only" in path.read_text() for path in dest.rglob("*") if path.is_file())
