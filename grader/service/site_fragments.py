"""The site's own additions to the class's Hub (HUB_CONFIG_D, /etc/scalelab/hub.d): files the Hub executes as root,
so only files no other account could have written, or swapped, are read.

A fragment is read when every folder from ``/`` down to it is root's and writable by root alone (or sticky, as
``/tmp``, where nobody else may rename root's entries), and the file itself, opened without following a link, is a
regular file of root's, writable by root alone, of bounded size. The checks are made on what was opened, so a link
or a file swapped in between is refused, never read.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

MAX_FRAGMENT_BYTES = 1 << 20


class UntrustedFragment(RuntimeError):
    """A fragment (or a folder above it) that another account could change; the message says which and why."""


def _loose(status: os.stat_result) -> bool:
    return status.st_uid != 0 or (status.st_mode & 0o022 and not status.st_mode & stat.S_ISVTX)


def check_folders(folder: Path) -> None:
    """Every folder from / down to ``folder``: a real directory, root's, writable by root alone or sticky."""
    path = Path("/")
    for part in folder.absolute().parts[1:]:
        path = path / part
        try:
            status = os.lstat(path)
        except OSError as error:
            raise UntrustedFragment(f"{path}: {error.strerror}") from None
        if stat.S_ISLNK(status.st_mode):
            raise UntrustedFragment(f"{path} is a symbolic link; name the folder itself")
        if not stat.S_ISDIR(status.st_mode) or _loose(status):
            raise UntrustedFragment(f"{path} is not root's alone (owner uid {status.st_uid}, mode "
                                    f"{status.st_mode & 0o7777:o})")
    root = os.lstat("/")
    if _loose(root):
        raise UntrustedFragment(f"/ is not root's alone (owner uid {root.st_uid}, mode {root.st_mode & 0o7777:o})")


def read_fragment(path: Path) -> str:
    """The text of one fragment, read from the file checked once open."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        reason = "a symbolic link" if os.path.islink(path) else error.strerror
        raise UntrustedFragment(f"{path} cannot be read as a file of root's: {reason}") from None
    with os.fdopen(fd, "rb") as opened:
        status = os.fstat(opened.fileno())
        if not stat.S_ISREG(status.st_mode):
            raise UntrustedFragment(f"{path} is not a regular file")
        if _loose(status):
            raise UntrustedFragment(f"{path} is not root's alone (owner uid {status.st_uid}, mode "
                                    f"{status.st_mode & 0o7777:o})")
        if status.st_size > MAX_FRAGMENT_BYTES:
            raise UntrustedFragment(f"{path} is larger than {MAX_FRAGMENT_BYTES} bytes")
        return opened.read(MAX_FRAGMENT_BYTES + 1).decode()


def trusted_fragments(folder: Path) -> list[tuple[Path, str]]:
    """(path, text) of every ``*.py`` in ``folder``, in name order; [] when the folder does not exist. Raises
    UntrustedFragment at the first one that another account could have written."""
    if not folder.exists() and not folder.is_symlink():
        return []
    check_folders(folder)
    fragments = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            fragments.append((folder / name, read_fragment(folder / name)))
    return fragments
