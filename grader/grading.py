"""Instructors' work on a whole class or track: grading a class (K at a time, resumable, to nbgrader's gradebook)
and calibrating a track (a budget suggested from the reference's times to accuracy, recorded in the track file).
``scalelab grade`` and ``scalelab calibrate`` (commands.py) call these.

Gradebook choice: nbgrader 0.9.6 records scores only as ``Grade`` rows of grade cells of notebooks of an
assignment, so the assignment ``assessment`` gets a notebook ``assessment`` with one autograded grade cell
``verdict`` (max score 1); a student's grade is that cell's ``auto_score`` (1 pass, 0 otherwise). The formgrader
and ``nbgrader export`` then show it like any autograded score.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import math
import os
import re
import sys
import threading
from pathlib import Path

from scalelab import environment

from . import pipeline, report, spec, store
from .verdict import new_verdict
from .submission import NotASubmission, check_submission_file

ASSIGNMENT = "assessment"
NOTEBOOK = "assessment"
GRADE_CELL = "verdict"
COURSE_ID = "scalelab"
DEFAULT_GRADEBOOK = spec.COURSE_ROOT / "labs" / "gradebook.db"


# ---------------------------------------------------------------------------------------------------------------
# grade
# ---------------------------------------------------------------------------------------------------------------

def find_submissions(root: Path, script: str = "assessment.py") -> dict[str, Path | None]:
    """student → their script (None: nothing submitted), from ``<student>/<script>`` or nbgrader's
    ``submitted/<student>/assessment/<script>`` (given the course directory or its submitted/); ``script`` is the
    track's (``Track.submission_file``: assessment.py, or assessment_pytorch.py for PyTorch)."""
    if (root / "submitted").is_dir():
        root = root / "submitted"
    found = {}
    for student_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        candidates = [student_dir / script, student_dir / ASSIGNMENT / script]
        found[student_dir.name] = next((c for c in candidates if c.is_file()), None)
    return found


def _not_gradable(student: str, path: Path | None, track: spec.Track, out_dir: Path) -> dict | None:
    """A fail verdict for a student whose file cannot be a submission (nothing, empty, binary, too large)."""
    if path is None:
        script = track.submission_file
        problem = f"no {script} was submitted (looked for {student}/{script} and {student}/{ASSIGNMENT}/{script})"
    else:
        try:
            check_submission_file(path)
            return None
        except NotASubmission as error:
            problem = f"the submission cannot be run: {error}"
    return new_verdict(verdict="fail", reasons=[problem], student=student, track=track.name,
                       target_accuracy=track.target_accuracy, time_budget_s=track.time_budget_s,
                       submission_sha256=hashlib.sha256(path.read_bytes()).hexdigest() if path else None,
                       out_dir=str(out_dir))


class NbgraderGradebook:
    """Scores of the ``assessment`` assignment in nbgrader's gradebook (see the module docstring)."""

    def __init__(self, path: Path):
        from nbgrader.api import Gradebook

        path.parent.mkdir(parents=True, exist_ok=True)
        # nbgrader runs `alembic` from PATH: make this interpreter's copy findable when the venv is not activated.
        venv_bin = str(Path(sys.executable).parent)
        if venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
        self.gradebook = Gradebook(f"sqlite:///{path}", course_id=COURSE_ID)
        self.gradebook.update_or_create_assignment(ASSIGNMENT)
        self.gradebook.update_or_create_notebook(NOTEBOOK, ASSIGNMENT)
        self.gradebook.update_or_create_grade_cell(GRADE_CELL, NOTEBOOK, ASSIGNMENT, max_score=1.0,
                                                   cell_type="code")

    def record(self, student: str, score: float) -> None:
        self.gradebook.update_or_create_student(student)
        self.gradebook.update_or_create_submission(ASSIGNMENT, student)
        grade = self.gradebook.find_grade(GRADE_CELL, NOTEBOOK, ASSIGNMENT, student)
        grade.auto_score = score
        self.gradebook.db.commit()

    def score(self, student: str) -> float | None:
        return self.gradebook.find_grade(GRADE_CELL, NOTEBOOK, ASSIGNMENT, student).score

    def close(self) -> None:
        self.gradebook.close()


def _first_reason(verdict: dict) -> str:
    return (verdict.get("reasons") or [""])[0].split("\n")[0][:160]


def grade_class(submissions_root: Path, track: spec.Track, *, out_root: Path, parallel: int, regrade: bool,
                database: Path | None, gradebook_path: Path | None, log=print) -> list[dict]:
    """Grade every student's submission; returns their verdicts (stored ones reused unless ``regrade``)."""
    results = store.ResultsDatabase(database)
    submissions = find_submissions(submissions_root, track.submission_file)
    verdicts: dict[str, dict] = {}
    lock = threading.Lock()
    # The submission must not see the other students' files, the class's results or the gradebook.
    hidden = [submissions_root.resolve(), out_root.resolve()]
    if gradebook_path is not None:
        hidden += [Path(f"{gradebook_path}{suffix}") for suffix in ("", "-journal", "-wal", "-shm")]

    def grade_one(student: str, path: Path | None) -> None:
        student_out = out_root / student
        verdict = _not_gradable(student, path, track, student_out)
        if verdict is None:
            sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
            stored = None if regrade else results.latest(student, track.name, sha256)
            if stored is not None and stored.get("verdict") != "error":
                verdict = dict(stored, student=student)
                with lock:
                    log(f"{student:<20} {verdict['verdict']:<8} (already graded; --regrade to run again)")
            else:
                if student_out.exists():
                    import shutil
                    shutil.rmtree(student_out)
                verdict = pipeline.assess(path, track, out_dir=student_out, database=results.path,
                                          student=student, extra_hidden=hidden)
                with lock:
                    log(f"{student:<20} {verdict['verdict']:<8} {_first_reason(verdict)}")
        else:
            results.record(verdict, student=student)
            with lock:
                log(f"{student:<20} {verdict['verdict']:<8} {_first_reason(verdict)}")
        student_out.mkdir(parents=True, exist_ok=True)
        (student_out / "feedback.md").write_text(report.feedback_markdown(verdict))
        with lock:
            verdicts[student] = verdict

    with concurrent.futures.ThreadPoolExecutor(max_workers=parallel) as pool:
        futures = [pool.submit(grade_one, student, path) for student, path in submissions.items()]
        for future in concurrent.futures.as_completed(futures):
            future.result()
    ordered = [verdicts[student] for student in sorted(verdicts)]
    if gradebook_path is not None:
        gradebook = NbgraderGradebook(gradebook_path)
        try:
            for verdict in ordered:
                gradebook.record(verdict["student"], report.score(verdict))
        finally:
            gradebook.close()
    return ordered


# ---------------------------------------------------------------------------------------------------------------
# calibrate
# ---------------------------------------------------------------------------------------------------------------

def suggest(reference_times: list[float]) -> int:
    """A budget (a multiple of 5 s) that the reference's times to accuracy fill to 60-80 % (the middle of what
    every run allows, or, where their spread is too wide for that, the least that keeps the slowest at 80 %)."""
    low_share, high_share = spec.BUDGET_SHARE
    least = 5 * math.ceil(max(reference_times) / high_share / 5)   # the slowest run at 80 %
    most = 5 * math.floor(min(reference_times) / low_share / 5)    # the fastest run at 60 %
    middle = 5 * round((least + most) / 2 / 5)
    return int(min(max(middle, least), most) if least <= most else least)


def machine_facts() -> dict:
    """What a calibration depends on: the CPU model, its usable cores and the GPUs."""
    facts = environment.describe()
    return {"cpu_model": facts["cpu_model"], "cpus": facts["cpu_count"], "gpus": environment.gpus()}


def calibration_table(track: spec.Track, machine: dict, references: list[dict], baseline: dict, date: str) -> str:
    """The track's calibration table (TOML) from the reference's verdicts and the baseline's."""
    def numbers(key: str, digits: int) -> str:
        return ", ".join(f"{(reference.get(key) or 0):.{digits}f}" for reference in references)
    times = [reference.get("time_to_accuracy_s") or reference.get("wall_time_s") or 0 for reference in references]
    return "\n".join([
        f"[tracks.{track.name}.calibration]",
        f'date = "{date}"',
        f'cpu_model = "{machine["cpu_model"]}"',
        f"cpus = {machine['cpus']}",
        f"gpus = [{', '.join(repr(str(gpu)).replace(chr(39), chr(34)) for gpu in machine['gpus'])}]",
        f"reference_runs = {len(references)}",
        f"reference_verdicts = [{', '.join(chr(34) + reference['verdict'] + chr(34) for reference in references)}]",
        f"reference_time_to_accuracy_s = [{', '.join(f'{t:.1f}' for t in times)}]",
        f"reference_wall_time_s = [{numbers('wall_time_s', 1)}]",
        f"reference_heldout_accuracy = [{numbers('heldout_accuracy', 4)}]",
        f'baseline_verdict = "{baseline["verdict"]}"',
        f"baseline_wall_time_s = {baseline.get('wall_time_s') or 0:.1f}",
        f"baseline_heldout_accuracy = {baseline.get('heldout_accuracy') or 0:.4f}",
    ])


def machine_differences(track: spec.Track, machine: dict) -> list[str]:
    """How this machine differs from the one ``track`` was calibrated on (empty: the same kind, or uncalibrated)."""
    figures = track.calibration
    if not figures or figures.get("status") == "uncalibrated":
        return []
    differences = []
    if figures.get("cpu_model") is not None and figures["cpu_model"] != machine["cpu_model"]:
        differences.append(f"CPU {machine['cpu_model']!r}, calibrated on {figures['cpu_model']!r}")
    if figures.get("cpus") is not None and figures["cpus"] != machine["cpus"]:
        differences.append(f"{machine['cpus']} cores, calibrated with {figures['cpus']}")
    if figures.get("gpus") is not None and list(figures["gpus"]) != list(machine["gpus"]):
        differences.append(f"GPUs {machine['gpus'] or 'none'}, calibrated with {figures['gpus'] or 'none'}")
    return differences


def record_settings(track_file: Path, track_name: str, budget: int, target: float) -> None:
    """Set the track's time_budget_s and target_accuracy in the track file, leaving everything else as it is."""
    text = track_file.read_text()
    section = re.compile(rf"^\[tracks\.{re.escape(track_name)}\]\n(?:(?!\[).*\n?)*", re.MULTILINE)
    found = section.search(text)
    if found is None:
        raise spec.SpecError(f"{track_file} has no [tracks.{track_name}] table")
    body = re.sub(r"^time_budget_s = .*$", f"time_budget_s = {budget}", found.group(0), flags=re.MULTILINE)
    body = re.sub(r"^target_accuracy = .*$", f"target_accuracy = {target:.2f}", body, flags=re.MULTILINE)
    track_file.write_text(text[:found.start()] + body + text[found.end():])
    spec.load_tracks(track_file)


def record_calibration(track_file: Path, track_name: str, table: str) -> None:
    """Replace (or add) the track's calibration table in the track file, leaving everything else as it is."""
    text = track_file.read_text()
    pattern = re.compile(rf"^\[tracks\.{re.escape(track_name)}\.calibration\]\n(?:(?!\[).*\n?)*", re.MULTILINE)
    if pattern.search(text):
        text = pattern.sub(table + "\n\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + table + "\n"
    track_file.write_text(text)
    spec.load_tracks(track_file)  # the file must still be a valid track file
