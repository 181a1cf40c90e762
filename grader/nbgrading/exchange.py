"""nbgrader's collect, made safe for an inbound/ that every student can write.

nbgrader 0.9.6 collects a folder of inbound/ with shutil.copytree, which follows links, takes the owner and the
time in the folder's name on trust, and stops the whole class's collect at the first name it cannot parse. Here each
folder ``<student>+<assignment>+<time>[+<random>]`` is taken only when

- its owner (not following links) is the account it names, and so is every file and folder inside it;
- it holds nothing but regular files with one link each and directories: a symbolic link, hard link, FIFO, device
  or socket refuses the folder as a whole (a submission is all or nothing). It is walked with file descriptors that
  never follow links and copied from the descriptors it checked, so a swap between the check and the open cannot
  redirect it;
- the time in its name is the time it was written: not later than the folder's inode change time (ctime, which a
  student cannot set), and not more than ``name_time_tolerance_s`` before the newest ctime of the folder and what it
  holds (a backdated name, or a folder changed after it was submitted). A restore from a backup resets ctimes:
  raise the tolerance for a collect after one;
- it stays within the limits below, which bound what grading reads. A hard quota on the exchange's disk is the
  operator's (filesystem quotas on the exchange's filesystem); this module cannot stop a student filling it.

Every folder refused is one warning line that says which folder and why, and the rest of the class is collected.
Among a student's folders that pass, nbgrader's own rule chooses (the newest; with --before-duedate the newest
before the due date); --update, the groupshared permissions and timestamp.txt behave as in nbgrader, except that
timestamp.txt is written from the checked name, never copied from the student. The owner check cannot be turned
off (ExchangeCollect.check_owner is not read): it is what makes a folder a student's.

Enable it in nbgrader_config.py:
    c.ExchangeFactory.collect = "scalelab.grader.nbgrading.exchange.SafeExchangeCollect"
"""

from __future__ import annotations

import datetime
import errno
import fnmatch
import logging
import os
import pwd
import secrets
import shutil
import stat
from dataclasses import dataclass, field

from nbgrader.api import Gradebook, MissingEntry
from nbgrader.exchange.default import ExchangeCollect
from nbgrader.utils import check_mode, parse_utc
from traitlets import Integer

DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO swapped in after the check opens at once instead of hanging the collect.
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
COPY_CHUNK_BYTES = 1 << 20


class SkipFolder(Exception):
    """One inbound folder is refused; the message says which entry and why."""


@dataclass
class FolderRules:
    """What a submission folder may hold, and which of it is copied (nbgrader's ignore/include/max_file_size)."""
    owner_uid: int
    owner_name: str
    max_entries: int
    max_total_bytes: int
    max_file_bytes: int = 0  # 0: no limit; larger files are left out with a warning, as nbgrader does
    ignore: list[str] = field(default_factory=list)
    include: list[str] = field(default_factory=lambda: ["*"])
    log: logging.Logger = field(default_factory=lambda: logging.getLogger(__name__))


@dataclass
class FolderWalk:
    """What one walk of a folder saw."""
    entries: int = 0
    total_bytes: int = 0
    newest_ctime: float = 0.0


def account_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def kind_of(mode: int) -> str:
    kinds = [(stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"),
             (stat.S_ISREG, "a regular file")]
    return next((words for test, words in kinds if test(mode)), "of an unknown kind")


def lstat_entry(name: str, dir_fd: int) -> os.stat_result:
    """The entry itself, not what it points to (a hook for the race test)."""
    return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)


def open_entry(name: str, dir_fd: int, path: str, directory: bool) -> int:
    try:
        return os.open(name, DIRECTORY_FLAGS if directory else FILE_FLAGS, dir_fd=dir_fd)
    except OSError as error:
        if error.errno not in (errno.ELOOP, errno.ENOTDIR):  # what O_NOFOLLOW and O_DIRECTORY refuse with
            raise SkipFolder(f"{path} cannot be opened: {error.strerror}") from None
    try:
        now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except OSError:
        raise SkipFolder(f"{path} changed while being read") from None
    if stat.S_ISLNK(now):
        raise SkipFolder(f"{path} is a symbolic link")
    raise SkipFolder(f"{path} changed while being read (it is now {kind_of(now)})")


def check_opened(fd: int, path: str, rules: FolderRules, walk: FolderWalk, directory: bool) -> os.stat_result:
    """The checks that count, made on what was opened, not on the name."""
    status = os.fstat(fd)
    expected = stat.S_ISDIR if directory else stat.S_ISREG
    if not expected(status.st_mode):
        raise SkipFolder(f"{path} is {kind_of(status.st_mode)} (changed while being read)")
    if status.st_uid != rules.owner_uid:
        raise SkipFolder(f"{path} is owned by {account_name(status.st_uid)}, not {rules.owner_name}")
    if not directory and status.st_nlink != 1:
        raise SkipFolder(f"{path} has {status.st_nlink} hard links")
    walk.newest_ctime = max(walk.newest_ctime, status.st_ctime)
    return status


def copy_file(source_fd: int, status: os.stat_result, name: str, dest_dir_fd: int, path: str) -> None:
    """The bytes of the file we checked, into a file we create; a file that changes meanwhile refuses the folder."""
    dest_fd = os.open(name, NEW_FILE_FLAGS, 0o644, dir_fd=dest_dir_fd)
    with open(dest_fd, "wb") as dest:
        left = status.st_size
        while left > 0:
            chunk = os.read(source_fd, min(left, COPY_CHUNK_BYTES))
            if not chunk:
                break
            dest.write(chunk)
            left -= len(chunk)
    after = os.fstat(source_fd)
    if left or os.read(source_fd, 1) or (after.st_size, after.st_mtime_ns, after.st_ctime_ns) != (
            status.st_size, status.st_mtime_ns, status.st_ctime_ns):
        raise SkipFolder(f"{path} changed while being collected")


def walk_folder(dir_fd: int, rules: FolderRules, dest_dir_fd: int | None = None) -> FolderWalk:
    """Check the folder open at dir_fd (whose own fstat the caller checked) and, given dest_dir_fd, copy it there.
    Raises SkipFolder at the first thing that refuses the folder."""
    walk = FolderWalk(newest_ctime=os.fstat(dir_fd).st_ctime)
    _walk(dir_fd, rules, dest_dir_fd, "", walk)
    return walk


def _walk(dir_fd: int, rules: FolderRules, dest_dir_fd: int | None, relpath: str, walk: FolderWalk) -> None:
    names = []
    with os.scandir(dir_fd) as entries:
        # Counted as listed, ignored names too, so that a huge directory is not even read to its end.
        for entry in entries:
            walk.entries += 1
            if walk.entries > rules.max_entries:
                raise SkipFolder(f"it holds more than {rules.max_entries} files and folders")
            names.append(entry.name)
    for name in sorted(names):
        path = os.path.join(relpath, name)
        if any(fnmatch.fnmatch(name, pattern) for pattern in rules.ignore):
            rules.log.debug("Ignoring excluded file '%s' (see config option CourseDirectory.ignore)", path)
            continue
        mode = lstat_entry(name, dir_fd).st_mode
        if stat.S_ISDIR(mode):
            _walk_directory(name, dir_fd, rules, dest_dir_fd, path, walk)
        elif stat.S_ISREG(mode):
            if not any(fnmatch.fnmatch(name, pattern) for pattern in rules.include):
                rules.log.debug("Ignoring non included file '%s' (see config option CourseDirectory.include)", path)
                continue
            _walk_file(name, dir_fd, rules, dest_dir_fd, path, walk)
        else:
            raise SkipFolder(f"{path} is {kind_of(mode)}")


def _walk_directory(name: str, dir_fd: int, rules: FolderRules, dest_dir_fd: int | None, path: str,
                    walk: FolderWalk) -> None:
    child_fd = open_entry(name, dir_fd, path, directory=True)
    try:
        check_opened(child_fd, path, rules, walk, directory=True)
        if dest_dir_fd is None:
            _walk(child_fd, rules, None, path, walk)
            return
        os.mkdir(name, 0o755, dir_fd=dest_dir_fd)
        child_dest_fd = os.open(name, DIRECTORY_FLAGS, dir_fd=dest_dir_fd)
        try:
            _walk(child_fd, rules, child_dest_fd, path, walk)
        finally:
            os.close(child_dest_fd)
    finally:
        os.close(child_fd)


def _walk_file(name: str, dir_fd: int, rules: FolderRules, dest_dir_fd: int | None, path: str,
               walk: FolderWalk) -> None:
    file_fd = open_entry(name, dir_fd, path, directory=False)
    try:
        status = check_opened(file_fd, path, rules, walk, directory=False)
        if rules.max_file_bytes and status.st_size > rules.max_file_bytes:
            rules.log.warning("Ignoring file too large '%s' (see config option CourseDirectory.max_file_size)", path)
            return
        walk.total_bytes += status.st_size
        if walk.total_bytes > rules.max_total_bytes:
            raise SkipFolder(f"it holds more than {rules.max_total_bytes} bytes "
                             "(see config option CourseDirectory.max_dir_size)")
        if dest_dir_fd is not None:
            copy_file(file_fd, status, name, dest_dir_fd, path)
    finally:
        os.close(file_fd)


def utc_of(seconds: float) -> datetime.datetime:
    """A file time as parse_utc gives the name's time: naive, in UTC."""
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).replace(tzinfo=None)


class SafeExchangeCollect(ExchangeCollect):
    """nbgrader's collect that refuses, folder by folder, what a student cannot have submitted honestly."""

    max_folders_per_student = Integer(
        20, help="How many of one student's inbound folders for an assignment are considered (the newest)."
    ).tag(config=True)

    max_files_per_folder = Integer(
        200, help="How many files and folders one inbound folder may hold; a folder with more is skipped."
    ).tag(config=True)

    name_time_tolerance_s = Integer(
        600, help="How long before a folder was last written (its newest inode change time) the time in its name "
                  "may lie; an older name is a backdated one, or the folder changed after it was submitted."
    ).tag(config=True)

    clock_slack_s = Integer(
        60, help="How much later than the folder's own inode change time the time in its name may be (clocks)."
    ).tag(config=True)

    def start(self):
        self.collected = self.skipped = 0
        try:
            super().start()
        finally:
            if getattr(self, "inbound_fd", None) is not None:
                os.close(self.inbound_fd)
                self.inbound_fd = None
        self.log.info("Collected %d submissions of '%s', skipped %d inbound folders",
                      self.collected, self.coursedir.assignment_id, self.skipped)

    def init_src(self):
        if self.coursedir.course_id == '':
            self.fail("No course id specified. Re-run with --course flag.")
        self.course_path = os.path.join(self.root, self.coursedir.course_id)
        self.inbound_path = os.path.join(self.course_path, 'inbound')
        if not os.path.isdir(self.inbound_path):
            self.fail("Course not found: {}".format(self.inbound_path))
        if not check_mode(self.inbound_path, read=True, execute=True):
            self.fail("You don't have read permissions for the directory: {}".format(self.inbound_path))
        self.inbound_fd = os.open(self.inbound_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

        with Gradebook(self.coursedir.db_url, self.coursedir.course_id) as gb:
            try:
                self.duedate = gb.find_assignment(self.coursedir.assignment_id).duedate
            except MissingEntry:
                self.duedate = None

        by_student: dict[str, list[dict]] = {}
        for record in self._owned_records():
            by_student.setdefault(record['username'], []).append(record)
        self.src_records = []
        for student, records in sorted(by_student.items()):
            records = self._sort_by_timestamp(records)
            if len(records) > self.max_folders_per_student:
                older = records[self.max_folders_per_student:]
                self.log.warning("skipped %d older inbound folders of %s: only the newest %d are considered",
                                 len(older), student, self.max_folders_per_student)
                self.skipped += len(older)
                records = records[:self.max_folders_per_student]
            valid = [record for record in records if self._folder_passes(record)]
            if valid:
                self.src_records.append(self._choose(valid))

    def _owned_records(self) -> list[dict]:
        """The folders named for this assignment whose name parses and whose owner is the student they name."""
        student_pattern = self.coursedir.student_id or '*'
        pattern = '{}+{}+*'.format(student_pattern, self.coursedir.assignment_id)
        records = []
        for filename in sorted(os.listdir(self.inbound_fd)):
            if filename.startswith('.') or not fnmatch.fnmatch(filename, pattern):
                continue
            try:
                records.append(self._checked_record(filename))
            except SkipFolder as problem:
                self._skip(filename, str(problem))
        return records

    def _checked_record(self, filename: str) -> dict:
        # As nbgrader: split from the right, so that a username may hold '+'.
        parts = filename.rsplit('+', 3)
        if len(parts) < 3 or parts[1] != self.coursedir.assignment_id:
            raise SkipFolder("not a <student>+<assignment>+<time> name")
        username, timestamp_text = parts[0], parts[2]
        try:
            timestamp = parse_utc(timestamp_text)
        except (ValueError, OverflowError, TypeError):  # dateutil's ways of refusing a string
            raise SkipFolder(f"its time '{timestamp_text}' does not parse") from None
        try:
            account = pwd.getpwnam(username)
        except KeyError:
            raise SkipFolder(f"there is no account {username}") from None
        try:
            status = os.stat(filename, dir_fd=self.inbound_fd, follow_symlinks=False)
        except OSError as error:
            raise SkipFolder(error.strerror) from None
        if not stat.S_ISDIR(status.st_mode):
            raise SkipFolder(f"it is {kind_of(status.st_mode)}, not a directory")
        if status.st_uid != account.pw_uid:
            raise SkipFolder(f"owned by {account_name(status.st_uid)}, not {username}")
        return {'username': username, 'filename': filename, 'timestamp': timestamp,
                'timestamp_text': timestamp_text, 'uid': account.pw_uid}

    def _choose(self, valid: list[dict]) -> dict:
        """nbgrader's rule, among the folders that passed (newest first)."""
        if self.duedate is not None and self.before_duedate:
            on_time = [record for record in valid if record['timestamp'] <= self.duedate]
            if on_time:
                return on_time[0]
        return valid[0]

    def _skip(self, filename: str, reason: str) -> None:
        self.log.warning("skipped inbound/%s: %s", filename, reason)
        self.skipped += 1

    def _rules(self, record: dict) -> FolderRules:
        return FolderRules(owner_uid=record['uid'], owner_name=record['username'],
                           max_entries=self.max_files_per_folder,
                           max_total_bytes=1000 * self.coursedir.max_dir_size,
                           max_file_bytes=1000 * (self.coursedir.max_file_size or 0),
                           ignore=list(self.coursedir.ignore), include=list(self.coursedir.include), log=self.log)

    def _read_folder(self, record: dict, dest_dir_fd: int | None = None) -> FolderWalk:
        """Check the folder (and copy it, given dest_dir_fd); raises SkipFolder."""
        folder_fd = open_entry(record['filename'], self.inbound_fd, record['filename'], directory=True)
        try:
            folder = os.fstat(folder_fd)
            if folder.st_uid != record['uid']:
                raise SkipFolder(f"owned by {account_name(folder.st_uid)}, not {record['username']}")
            walk = walk_folder(folder_fd, self._rules(record), dest_dir_fd)
        except OSError as error:  # e.g. a folder inside it that the instructor may not read
            where = f"{error.filename}: " if error.filename is not None else ""
            raise SkipFolder(f"{where}{error.strerror}") from None
        finally:
            os.close(folder_fd)
        self._check_time(record, folder.st_ctime, walk.newest_ctime)
        return walk

    def _check_time(self, record: dict, folder_ctime: float, newest_ctime: float) -> None:
        named, written, last_written = record['timestamp'], utc_of(folder_ctime), utc_of(newest_ctime)
        if named > written + datetime.timedelta(seconds=self.clock_slack_s):
            raise SkipFolder(f"its time {named} UTC is later than the folder was written ({written:%Y-%m-%d %H:%M:%S}"
                             " UTC)")
        if named < last_written - datetime.timedelta(seconds=self.name_time_tolerance_s):
            raise SkipFolder(f"its time {named} UTC is more than {self.name_time_tolerance_s} s before it was last "
                             f"written ({last_written:%Y-%m-%d %H:%M:%S} UTC): backdated, or changed after submission")

    def _folder_passes(self, record: dict) -> bool:
        try:
            self._read_folder(record)
            return True
        except SkipFolder as problem:
            self._skip(record['filename'], str(problem))
            return False

    def copy_files(self):
        if len(self.src_records) == 0:
            self.log.warning("No submissions of '{}' for course '{}' to collect".format(
                self.coursedir.assignment_id, self.coursedir.course_id))
        else:
            self.log.info("Processing {} submissions of '{}' for course '{}'".format(
                len(self.src_records), self.coursedir.assignment_id, self.coursedir.course_id))

        for record in self.src_records:
            student_id = record['username']
            dest_path = self.coursedir.format_path(
                self.coursedir.submitted_directory, student_id, self.coursedir.assignment_id)
            os.makedirs(os.path.dirname(dest_path), exist_ok=True)

            # nbgrader's rule for an existing submission (--update, --before-duedate).
            copy = updating = False
            if os.path.isdir(dest_path):
                existing_timestamp = self.coursedir.get_existing_timestamp(dest_path)
                new_timestamp = record['timestamp']
                if self.update and (existing_timestamp is None or new_timestamp > existing_timestamp):
                    copy = updating = True
                elif self.before_duedate and existing_timestamp != new_timestamp:
                    copy = updating = True
            else:
                copy = True

            if not copy:
                if self.update:
                    self.log.info("No newer submission to collect: {} {}".format(
                        student_id, self.coursedir.assignment_id))
                else:
                    self.log.info("Submission already exists, use --update to update: {} {}".format(
                        student_id, self.coursedir.assignment_id))
                continue
            self.log.info("{} submission: {} {}".format(
                "Updating" if updating else "Collecting", student_id, self.coursedir.assignment_id))
            try:
                self._copy_submission(record, dest_path)
            except SkipFolder as problem:
                self._skip(record['filename'], str(problem))
            else:
                self.collected += 1

    def _copy_submission(self, record: dict, dest_path: str) -> None:
        """Copy into a fresh folder beside dest_path, then put it in place: a refused copy leaves the old one."""
        staging = os.path.join(os.path.dirname(dest_path),
                               ".{}.collecting-{}".format(os.path.basename(dest_path), secrets.token_hex(4)))
        os.mkdir(staging, 0o755)
        try:
            staging_fd = os.open(staging, DIRECTORY_FLAGS)
            try:
                self._read_folder(record, staging_fd)
                # The time nbgrader grades lateness by: the checked name's, not a file the student wrote.
                try:
                    timestamp_fd = os.open('timestamp.txt', os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                                           0o644, dir_fd=staging_fd)
                except OSError as error:
                    raise SkipFolder(f"timestamp.txt: {error.strerror}") from None
                with open(timestamp_fd, 'w') as timestamp_file:
                    timestamp_file.write(record['timestamp_text'])
            finally:
                os.close(staging_fd)
            if self.coursedir.groupshared:
                self._make_groupshared(staging)
            if os.path.isdir(dest_path):
                replaced = staging + '-old'
                os.rename(dest_path, replaced)
                os.rename(staging, dest_path)
                shutil.rmtree(replaced)
            else:
                os.rename(staging, dest_path)
        finally:
            if os.path.isdir(staging):
                shutil.rmtree(staging)

    def _make_groupshared(self, path: str) -> None:
        """As nbgrader does after copying: directories ug+rwx and setgid, files ug+rw."""
        for dirname, _, filenames in os.walk(path):
            self._add_mode(dirname, 0o2770, 0o2777)
            for filename in filenames:
                self._add_mode(os.path.join(dirname, filename), 0o660, 0o777)

    def _add_mode(self, path: str, bits: int, mask: int) -> None:
        mode = os.lstat(path).st_mode
        if mode & bits != bits:
            try:
                os.chmod(path, (mode | bits) & mask)
            except PermissionError:
                self.log.warning("Could not update permissions of %s to make it groupshared", path)
