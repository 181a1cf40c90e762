"""The account a root helper of the grader acts for, and what that account could do itself.

Two helpers run as root on behalf of an account that is not: the grading kernel (``nbgrading/kernel_sandbox.py``,
for instructors) and the graded run of the Hub's service (``assess_helper.py``, for the service's account).
``sudo`` starts them and says who asked (``$SUDO_UID``). They trust the caller no further than its own rights:
a directory they act in must be the caller's, and a file or folder they read for it is read as the caller.
"""

from __future__ import annotations

import os
import pwd
import stat
import sys


class Refused(Exception):
    """An argument the helper will not act on; the message says why."""


def caller_uid() -> int:
    """Whose request this is: sudo's caller when sudo started the helper, else whoever runs it."""
    if os.geteuid() == 0 and os.environ.get("SUDO_UID", "").isdigit():
        return int(os.environ["SUDO_UID"])
    return os.getuid()


def open_callers_directory(path: str, uid: int, private: bool = False) -> int:
    """An fd on ``path``, a directory (not a link) that belongs to ``uid``; with ``private``, one no other account
    may enter (no group or other permission bits)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        raise Refused(f"{path}: not a directory of yours ({error.strerror})") from None
    info = os.fstat(fd)
    if info.st_uid != uid:
        os.close(fd)
        raise Refused(f"{path} does not belong to the caller (uid {uid})")
    if private and stat.S_IMODE(info.st_mode) & 0o077:
        os.close(fd)
        raise Refused(f"{path} is open to other accounts (mode {stat.S_IMODE(info.st_mode):04o}); make it 0700")
    return fd


def become(uid: int) -> None:
    """Drop this process to ``uid`` for good: its groups, its group, then the uid itself."""
    account = pwd.getpwuid(uid)
    os.setgroups(os.getgrouplist(account.pw_name, account.pw_gid))
    os.setgid(account.pw_gid)
    os.setuid(uid)


def start_as(uid: int, action) -> int:
    """``action()`` in a child process dropped to ``uid``; returns the child's pid (exit status 0 when it returned)."""
    child = os.fork()
    if child == 0:
        status = 1
        try:
            become(uid)
            action()
            status = 0
        except BaseException as error:  # the parent reports it; the child must never return into the caller's code
            print(f"as uid {uid}: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        finally:
            os._exit(status)
    return child


def wait_for(child: int) -> int:
    _pid, status = os.waitpid(child, 0)
    return os.waitstatus_to_exitcode(status)


def run_as(uid: int, action) -> int:
    """``action()`` in a child process dropped to ``uid``; the child's exit status (0 when it returned)."""
    return wait_for(start_as(uid, action))


def read_as(uid: int, path: str, limit_bytes: int) -> bytes:
    """The bytes of ``path`` as ``uid`` may read them (a regular file of at most ``limit_bytes``); else
    :class:`Refused`. Whatever the caller names, root reads nothing the caller could not."""
    reader, writer = os.pipe()

    def read_and_send() -> None:
        os.close(reader)
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a pipe cannot stall the open
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit_bytes:
            raise ValueError("not a regular file of at most the limit")
        with os.fdopen(descriptor, "rb") as source, os.fdopen(writer, "wb") as sink:
            sink.write(source.read(limit_bytes + 1))

    child = start_as(uid, read_and_send)
    os.close(writer)
    with os.fdopen(reader, "rb") as received:  # read to the end before waiting: the pipe holds only 64 KiB
        data = received.read(limit_bytes + 1)
    if wait_for(child) != 0 or len(data) > limit_bytes:
        raise Refused(f"{path}: not a regular file of at most {limit_bytes} bytes that uid {uid} may read")
    return data


def can_list(uid: int, path: str) -> bool:
    """Whether ``uid`` may list the directory ``path``."""
    return run_as(uid, lambda: os.listdir(path)) == 0
