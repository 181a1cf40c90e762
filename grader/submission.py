"""What can be a submission at all: one non-empty UTF-8 ``.py`` file under the size limit, checked before
anything of it runs. The CLI, class grading and the Assess service refuse the same files with the same words.
"""

from __future__ import annotations

from pathlib import Path

from .pipeline import SUBMISSION_SIZE_LIMIT_BYTES


class NotASubmission(ValueError):
    """The file cannot be a submission; the message names the file and says why."""


def check_submission_file(path: Path) -> None:
    """Refuse what cannot be a submission at all (a syntax error is the submission's problem, not this)."""
    if not path.exists():
        raise NotASubmission(f"{path} does not exist")
    if path.is_dir():
        raise NotASubmission(f"{path} is a directory; give the submission's assessment.py")
    if path.suffix != ".py":
        raise NotASubmission(f"{path} is not a Python file (.py)")
    size = path.stat().st_size
    if size == 0:
        raise NotASubmission(f"{path} is empty")
    if size > SUBMISSION_SIZE_LIMIT_BYTES:
        raise NotASubmission(f"{path} is {size} bytes, over the {SUBMISSION_SIZE_LIMIT_BYTES} byte limit "
                             f"for a submission")
    content = path.read_bytes()
    if b"\0" in content:
        raise NotASubmission(f"{path} is binary, not Python source")
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        raise NotASubmission(f"{path} is not UTF-8 text, so not Python source") from None
    if not text.strip():
        raise NotASubmission(f"{path} holds only white space")
