"""Reading a file that a graded run wrote, without trusting anything about it.

The run controls every name in its job directory: a file may be a symbolic link (to another student's model,
to ``/dev/zero``), a named pipe (an open that never returns), a device, or grow without end. So each path
component is opened relative to the one before with ``O_NOFOLLOW`` (a link anywhere on the way is refused),
the file itself also with ``O_NONBLOCK`` (a pipe cannot stall the open), and only a regular file owned by the
run's uid, of at most ``limit_bytes``, is read; reading a regular file never blocks.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class UntrustedFile(Exception):
    """The file is missing or is not one the grader will read; the message says why, for the student."""


def _open_beneath(root: Path | int, relative: str) -> int:
    """A descriptor of ``root / relative`` opened component by component, following no link (``root``: a path, or
    a descriptor of the folder already open)."""
    parts = Path(relative).parts
    if not parts or Path(relative).is_absolute() or ".." in parts:
        raise ValueError(f"not a plain relative path: {relative!r}")
    directory = os.dup(root) if isinstance(root, int) else os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for part in parts[:-1]:
            following = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=directory)
            os.close(directory)
            directory = following
        return os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=directory)
    finally:
        os.close(directory)


def _checked_chunks(root: Path | int, relative: str, owner_uid: int | None, limit_bytes: int):
    """The content of ``root/relative`` in chunks, after the checks of :func:`read_regular_file`."""
    shown = relative
    try:
        descriptor = _open_beneath(root if isinstance(root, int) else Path(root), relative)
    except FileNotFoundError:
        raise UntrustedFile(f"{shown} does not exist") from None
    except NotADirectoryError:
        raise UntrustedFile(f"{shown}: a folder on its path is not a folder") from None
    except OSError as error:  # ELOOP: a symbolic link where a file or folder should be
        raise UntrustedFile(f"{shown} is a symbolic link or cannot be opened ({error.strerror}); "
                            f"the grader reads only plain files the run wrote") from None
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise UntrustedFile(f"{shown} is not a regular file (a pipe, device or folder); "
                                f"the grader reads only plain files the run wrote")
        if owner_uid is not None and info.st_uid != owner_uid:
            raise UntrustedFile(f"{shown} was not written by the run (owner uid {info.st_uid})")
        if info.st_size > limit_bytes:
            raise UntrustedFile(f"{shown} is {info.st_size} bytes, over the {limit_bytes} byte limit")
        read = 0
        while True:
            chunk = os.read(descriptor, 1 << 20)
            if not chunk:
                after = os.fstat(descriptor)
                # Written to while it was read (a run still saving into it): what was read may be torn.
                if (after.st_size, after.st_mtime_ns) != (info.st_size, info.st_mtime_ns) or read != info.st_size:
                    raise UntrustedFile(f"{shown} changed while the grader read it (the run was still writing it)")
                return
            read += len(chunk)
            if read > limit_bytes:  # grew while being read
                raise UntrustedFile(f"{shown} grew past the {limit_bytes} byte limit while it was read")
            yield chunk
    finally:
        os.close(descriptor)


def read_regular_file(root: Path | int, relative: str, *, owner_uid: int | None, limit_bytes: int) -> bytes:
    """The bytes of ``root/relative`` (``root``: a path or an open folder's descriptor) if it is a regular file (no
    link on the way) of at most ``limit_bytes``, owned by ``owner_uid`` (None: any owner); else
    :class:`UntrustedFile` saying what is wrong."""
    return b"".join(_checked_chunks(root, relative, owner_uid, limit_bytes))


def copy_regular_file(root: Path, relative: str, destination: Path, *, owner_uid: int | None,
                      limit_bytes: int) -> Path:
    """Copy a file the run wrote (checked as in :func:`read_regular_file`) to a new file of the grader's."""
    destination = Path(destination)
    chunks = _checked_chunks(root, relative, owner_uid, limit_bytes)
    first = next(chunks, b"")  # the checks run before anything is created
    descriptor = os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        # 0644 whatever the grader's umask (the Hub's service runs with 077): the measuring process is another uid.
        os.fchmod(descriptor, 0o644)
        with os.fdopen(descriptor, "wb") as stream:
            stream.write(first)
            for chunk in chunks:
                stream.write(chunk)
    except BaseException:
        destination.unlink(missing_ok=True)
        raise
    return destination


def read_tail(root: Path, relative: str, *, owner_uid: int | None, limit_bytes: int) -> tuple[bytes, int]:
    """The last ``limit_bytes`` of ``root/relative`` (opened and checked as in :func:`read_regular_file`, but of
    any size), and how many bytes before them were left out."""
    try:
        descriptor = _open_beneath(Path(root), relative)
    except FileNotFoundError:
        raise UntrustedFile(f"{relative} does not exist") from None
    except OSError as error:
        raise UntrustedFile(f"{relative} is a symbolic link or cannot be opened ({error.strerror})") from None
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise UntrustedFile(f"{relative} is not a regular file (a pipe, device or folder)")
        if owner_uid is not None and info.st_uid != owner_uid:
            raise UntrustedFile(f"{relative} was not written by the grader (owner uid {info.st_uid})")
        skipped = max(0, info.st_size - limit_bytes)
        os.lseek(descriptor, skipped, os.SEEK_SET)
        chunks, read = [], 0
        while read < limit_bytes:  # bounded even if the file grows meanwhile
            chunk = os.read(descriptor, min(1 << 20, limit_bytes - read))
            if not chunk:
                break
            chunks.append(chunk)
            read += len(chunk)
        return b"".join(chunks), skipped
    finally:
        os.close(descriptor)


def list_folder(root: Path, relative: str) -> list[str]:
    """The names in the folder ``root/relative``, reached without following a link; [] when there is none."""
    parts = Path(relative).parts
    if not parts or Path(relative).is_absolute() or ".." in parts:
        raise ValueError(f"not a plain relative path: {relative!r}")
    try:
        directory = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return []
    try:
        for part in parts:
            following = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=directory)
            os.close(directory)
            directory = following
        return sorted(os.listdir(directory))
    except OSError:
        return []
    finally:
        os.close(directory)
