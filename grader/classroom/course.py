"""The course in a student's home: what the Hub's pre-spawn hook copies before each start of their server, as the
student (``python -I -m scalelab.grader.classroom.course COURSE DESTINATION``)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def copy_course(course: str | os.PathLike, destination: str | os.PathLike) -> list[str]:
    """Copy every file of ``course`` that ``destination`` does not have yet; never touches an existing file, so a
    student's work stays and labs released later still arrive. Run as the student (the Hub's pre-spawn hook):
    their home is theirs, links in it included. Returns the files copied, relative to ``destination``."""
    course, destination = Path(course), Path(destination)
    copied = []
    for source in sorted(course.rglob("*")):
        relative = source.relative_to(course)
        target = destination / relative
        if source.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif not target.exists() and not target.is_symlink():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
            copied.append(str(relative))
    return copied


if __name__ == "__main__":
    copy_course(sys.argv[1], sys.argv[2])
