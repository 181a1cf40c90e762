"""What ``make lab`` prepares before JupyterLab starts (``scalelab lab-setup``).

- The course's kernel, ``scalelab``, in this Python's prefix (``share/jupyter/kernels/scalelab``): ipykernel on
  this interpreter, with its scripts directory first on ``PATH`` (so that ``!horovodrun`` in a notebook is the
  venv's) and the course's Open MPI settings. Everything else, the data locations included, a kernel inherits from
  the Jupyter server that starts it (``make lab`` exports ``SCALELAB_CIFAR10_DIR``). The notebooks name this kernel.
- JupyterLab settings for the course (``overrides.d/scalelab.json`` in JupyterLab's settings directory): Markdown
  opens rendered, and JupyterLab neither asks about nor fetches news and update checks.
- The student's view of the course: the released labs (nbgrader's ``labs/release/``, generated first when missing
  or older than ``labs/source/``), the assessment notebook and serial script, and the start page. Never
  ``labs/source/`` (solutions, hidden tests) nor ``assessment/solution/``. A file already in the view is the
  student's work and is never overwritten. The track file is a link to the course's own; ``source_code/`` is a
  folder of links to the course library and the scripts the labs run, never to a lab's worked solution until
  ``release_solutions`` adds it, on purpose, after the lab (``scalelab lab-setup --release-solutions LAB``).
  On the PyTorch edition (no TensorFlow: ``make setup`` on Python 3.12 or 3.13) the Keras labs are left out.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from .environment import COURSE_SCRIPTS, edition, openmpi_settings

KERNEL_NAME = "scalelab"
KERNEL_DISPLAY_NAME = "Python 3 (ScaleLab)"
COURSE_ROOT = Path(__file__).resolve().parents[2]
JUPYTERLAB_SETTINGS = {
    # The pop-up "Would you like to get notified about official Jupyter news?" and update checks: not the course.
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False},
    # START.md and the READMEs are for reading; "Open With > Editor" still edits them.
    "@jupyterlab/docmanager-extension:plugin": {"defaultViewers": {"markdown": "Markdown Preview"}},
}
# Copied into the view once; from then on they are the student's (the serial script of each edition: Keras, PyTorch).
ASSESSMENT_FILES = ("assessment.ipynb", "assessment.py", "assessment_pytorch.py")
# The course's source_code/ also holds the worked solutions and the benchmarks, so the view's is a folder of its own
# that links only these: the course library and the scripts the labs run.
STUDENT_SOURCE = ("scalelab", *COURSE_SCRIPTS)
# Each lab's worked solution, out of the view until released after the lab.
SOLUTIONS = {"lab3": ("source_code/fashion_mnist_horovod.py", "source_code/horovod_steps"),
             "lab3_ddp": ("source_code/fashion_mnist_ddp.py",)}
# The labs that train with TensorFlow (Keras, Horovod for Keras, MultiWorkerMirroredStrategy): not in the view of the
# PyTorch edition, where they cannot run.
KERAS_LABS = ("lab1", "lab2", "lab3", "lab4", "lab5", "lab6")
# Linked: the course's own, always current (the grader reads its own track file, never the view's).
LINKS = ("assessment/tracks.toml", *(f"source_code/{name}" for name in STUDENT_SOURCE))
IGNORED = {"__pycache__"}


def labs_left_out() -> tuple[str, ...]:
    """The released labs a student's copy of the course leaves out on this install: the Keras labs on the PyTorch
    edition (``make lab``'s view and the Hub's copy alike)."""
    return KERAS_LABS if edition() == "pytorch" else ()


def scripts_dir() -> Path:
    """Where this interpreter's console scripts are: the venv's bin/ (horovodrun, nbgrader, scalelab)."""
    return Path(sysconfig.get_path("scripts"))


def kernel_spec(environ: dict[str, str] | None = None) -> dict:
    """kernel.json of the course's kernel. ``${PATH}`` is filled in by jupyter_client from the server's own PATH."""
    from ipykernel.kernelspec import get_kernel_dict

    spec = get_kernel_dict()
    spec["display_name"] = KERNEL_DISPLAY_NAME
    spec["env"] = {"PATH": f"{scripts_dir()}{os.pathsep}${{PATH}}", **openmpi_settings(environ)}
    return spec


def write_if_changed(path: Path, text: str) -> bool:
    """Write ``text`` to ``path`` atomically unless it already holds it (a starting kernel never sees half a file)."""
    if path.is_file() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)
    return True


def install_kernel(prefix: Path | None = None, environ: dict[str, str] | None = None) -> Path:
    """Install (or update) the ``scalelab`` kernel in ``prefix`` (default: this Python's); returns its directory."""
    from ipykernel.kernelspec import RESOURCES

    directory = Path(prefix or sys.prefix) / "share" / "jupyter" / "kernels" / KERNEL_NAME
    directory.mkdir(parents=True, exist_ok=True)
    for logo in Path(RESOURCES).iterdir():
        if not (directory / logo.name).exists():
            shutil.copy(logo, directory / logo.name)
    write_if_changed(directory / "kernel.json", json.dumps(kernel_spec(environ), indent=1) + "\n")
    return directory


def install_jupyterlab_settings(app_dir: Path | None = None) -> Path:
    """The course's JupyterLab defaults, as a settings override of its own (a user's overrides.json stays theirs)."""
    if app_dir is None:
        from jupyterlab.commands import get_app_dir

        app_dir = Path(get_app_dir())
    path = Path(app_dir) / "settings" / "overrides.d" / "scalelab.json"
    write_if_changed(path, json.dumps(JUPYTERLAB_SETTINGS, indent=1) + "\n")
    return path


@contextlib.contextmanager
def locked(directory: Path):
    """One process at a time generates the release and copies from it (two `make lab` may start together)."""
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)


def course_files(directory: Path) -> list[Path]:
    """Files under ``directory``, relative to it, without hidden ones (Jupyter's checkpoints, other tools' marks)
    and Python's caches."""
    found = []
    for path in directory.rglob("*"):
        parts = path.relative_to(directory).parts
        if path.is_file() and not any(part.startswith(".") or part in IGNORED for part in parts):
            found.append(path.relative_to(directory))
    return sorted(found)


def release_is_stale(labs: Path) -> bool:
    source, release = labs / "source", labs / "release"
    for relative in course_files(source):
        released = release / relative
        if not released.is_file() or released.stat().st_mtime < (source / relative).stat().st_mtime:
            return True
    return False


def release_labs(labs: Path) -> None:
    """nbgrader's student versions of every assignment into ``labs/release/`` (the gradebook is left alone)."""
    nbgrader = scripts_dir() / "nbgrader"
    # nbgrader runs `alembic` from PATH: the venv's tools first, as the Makefile's `release` does.
    env = {**os.environ, "PATH": f"{scripts_dir()}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run([str(nbgrader), "generate_assignment", "*", "--no-db", "--force"], cwd=labs, env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"nbgrader generate_assignment failed in {labs}:\n{done.stdout[-2000:]}"
                           f"{done.stderr[-2000:]}")


def link_into_view(view: Path, course: Path, relative: str) -> bool:
    """Link ``view/relative`` to the course's own unless something is there already; whether it was linked."""
    link = view / relative
    if os.path.lexists(link):
        return False
    link.parent.mkdir(parents=True, exist_ok=True)
    # Relative inside the checkout (student/ moves with it), absolute elsewhere.
    inside = view.is_relative_to(course)
    link.symlink_to(os.path.relpath(course / relative, link.parent) if inside else course / relative)
    return True


def build_student_view(view: Path, course: Path = COURSE_ROOT) -> dict[str, list[str]]:
    """Fill ``view`` with the student's view of ``course``; returns the files copied, kept and linked, and
    ``replaced``: ``source_code`` when a link to the course's whole folder gave way to the view's own, and
    ``left_out``: the Keras labs on the PyTorch edition."""
    view, course = Path(view).resolve(), Path(course).resolve()
    labs = course / "labs"
    copies = {}
    left_out = labs_left_out()
    with locked(labs):
        if release_is_stale(labs):
            release_labs(labs)
        release = labs / "release"
        released = course_files(release)
        for relative in released:
            if relative.parts[0] not in left_out:
                copies[Path("labs") / relative] = release / relative
        for name in ASSESSMENT_FILES:
            copies[Path("assessment") / name] = course / "assessment" / name
        copies[Path("START.md")] = course / "student" / "START.md"
        report = {"copied": [], "kept": [], "linked": [], "replaced": [],
                  "left_out": sorted({relative.parts[0] for relative in released} & set(left_out))}
        for relative, source in copies.items():
            target = view / relative
            if target == source:
                continue  # the course's own student/ folder already holds its start page
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                with open(target, "xb") as copy:
                    copy.write(source.read_bytes())
            except FileExistsError:
                report["kept"].append(str(relative))
                continue
            shutil.copymode(source, target)
            report["copied"].append(str(relative))
        # A link standing for the whole of source_code/ shows the worked solutions: the view's own folder replaces
        # it (removing a link removes nothing it points to).
        if (view / "source_code").is_symlink():
            (view / "source_code").unlink()
            report["replaced"].append("source_code")
        for relative in LINKS:
            if link_into_view(view, course, relative):
                report["linked"].append(relative)
    return report


def release_solutions(view: Path, lab: str, course: Path = COURSE_ROOT) -> dict[str, list[str]]:
    """Add ``lab``'s worked solution to the student's view, on purpose, after the lab: links to the course's own.
    Returns what was ``added`` and what was already there and ``kept`` (released before, or the student's own)."""
    if lab not in SOLUTIONS:
        raise ValueError(f"no worked solution to release for {lab!r} (there is one for {', '.join(SOLUTIONS)})")
    view, course = Path(view).resolve(), Path(course).resolve()
    released = {"added": [], "kept": []}
    with locked(course / "labs"):
        for relative in SOLUTIONS[lab]:
            released["added" if link_into_view(view, course, relative) else "kept"].append(relative)
    return released
