"""Instructors' commands: ``scalelab grade`` (a class, K at a time, resumable, to nbgrader's gradebook) and
``scalelab calibrate`` (measure the reference and the baseline on a track, suggest a budget and a target).

Gradebook choice: nbgrader 0.9.6 records scores only as ``Grade`` rows of grade cells of notebooks of an
assignment, so the assignment ``assessment`` gets a notebook ``assessment`` with one autograded grade cell
``verdict`` (max score 1); a student's grade is that cell's ``auto_score`` (1 pass, 0 otherwise). The formgrader
and ``nbgrader export`` then show it like any autograded score.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hashlib
import math
import os
import re
import statistics
import sys
import threading
from pathlib import Path

from scalelab import environment
from scalelab.runtime import usable_cores

from . import commands, pipeline, report, spec, store

ASSIGNMENT = "assessment"
NOTEBOOK = "assessment"
GRADE_CELL = "verdict"
COURSE_ID = "scalelab"
DEFAULT_GRADEBOOK = spec.COURSE_ROOT / "labs" / "gradebook.db"


# ---------------------------------------------------------------------------------------------------------------
# grade
# ---------------------------------------------------------------------------------------------------------------

def find_submissions(root: Path) -> dict[str, Path | None]:
    """student → their assessment.py (None: nothing submitted), from ``<student>/assessment.py`` or nbgrader's
    ``submitted/<student>/assessment/assessment.py`` (given the course directory or its submitted/)."""
    if (root / "submitted").is_dir():
        root = root / "submitted"
    found = {}
    for student_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        candidates = [student_dir / "assessment.py", student_dir / ASSIGNMENT / "assessment.py"]
        found[student_dir.name] = next((c for c in candidates if c.is_file()), None)
    return found


def _not_gradable(student: str, path: Path | None, track: spec.Track, out_dir: Path) -> dict | None:
    """A fail verdict for a student whose file cannot be a submission (nothing, empty, binary, too large)."""
    if path is None:
        problem = f"no assessment.py was submitted (looked for {student}/assessment.py and " \
                  f"{student}/{ASSIGNMENT}/assessment.py)"
    else:
        try:
            commands.check_submission_file(path)
            return None
        except commands.UsageError as error:
            problem = f"the submission cannot be run: {error}"
    return {"verdict": "fail", "reasons": [problem], "notes": [], "student": student, "track": track.name,
            "np": None, "heldout_accuracy": None, "target_accuracy": track.target_accuracy, "wall_time_s": None,
            "time_budget_s": track.time_budget_s, "ranks_seen": [], "allreduce_count": 0,
            "submission_sha256": hashlib.sha256(path.read_bytes()).hexdigest() if path else None,
            "logs_dir": None, "out_dir": str(out_dir)}


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
    submissions = find_submissions(submissions_root)
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


def grade_command(args: argparse.Namespace) -> int:
    try:
        root = Path(args.submissions)
        if not root.is_dir():
            raise commands.UsageError(f"{root} is not a directory of submissions")
        track = commands.load_track_or_usage(args.track, args.track_file)
        if args.parallel is not None and args.parallel < 1:
            raise commands.UsageError("--parallel must be at least 1")
        if not find_submissions(root):
            raise commands.UsageError(f"{root} holds no student directories")
        ranks = track.resolve_ranks(len(environment.gpus()))
    except (commands.UsageError, spec.SpecError) as error:
        print(f"scalelab grade: error: {error}", file=sys.stderr)
        return commands.EXIT_USAGE
    parallel = args.parallel or max(1, usable_cores() // ranks)
    out_root = Path(args.out) if args.out else store.scalelab_home() / "grades" / track.name
    gradebook = None if args.no_gradebook else Path(args.gradebook or DEFAULT_GRADEBOOK)
    print(f"grading {root} on track {track.name}, {parallel} at a time; results in {out_root}")
    verdicts = grade_class(root, track, out_root=out_root, parallel=parallel, regrade=args.regrade,
                           database=Path(args.database) if args.database else None, gradebook_path=gradebook)
    csv_path = Path(args.csv) if args.csv else out_root / "grades.csv"
    report.write_csv(csv_path, verdicts)
    counts = {kind: sum(v["verdict"] == kind for v in verdicts) for kind in ("pass", "fail", "timeout", "error")}
    print(f"{len(verdicts)} students: " + ", ".join(f"{n} {kind}" for kind, n in counts.items())
          + f"; CSV {csv_path}" + (f"; gradebook {gradebook}" if gradebook else ""))
    return commands.EXIT_INTERNAL if counts["error"] else commands.EXIT_PASS


# ---------------------------------------------------------------------------------------------------------------
# calibrate
# ---------------------------------------------------------------------------------------------------------------

def suggest(reference_times: list[float], reference_accuracies: list[float]) -> tuple[int, float]:
    """A budget that leaves 20% to spare over the slowest reference run (rounded up to 10 s), and a target
    two points under the worst reference accuracy (rounded down to a hundredth)."""
    budget = int(math.ceil(max(reference_times) / 0.8 / 10.0) * 10)
    target = math.floor((min(reference_accuracies) - 0.02) * 100) / 100
    return budget, target


def calibration_table(track: spec.Track, machine: str, times, accuracies, baseline: dict, date: str) -> str:
    return "\n".join([
        f"[tracks.{track.name}.calibration]",
        f'date = "{date}"',
        f'machine = "{machine}"',
        f"reference_runs = {len(times)}",
        f"reference_wall_time_s = [{', '.join(f'{t:.1f}' for t in times)}]",
        f"reference_heldout_accuracy = [{', '.join(f'{a:.4f}' for a in accuracies)}]",
        f'baseline_verdict = "{baseline["verdict"]}"',
        f"baseline_wall_time_s = {baseline.get('wall_time_s') or 0:.1f}",
        f"baseline_heldout_accuracy = {baseline.get('heldout_accuracy') or 0:.4f}",
    ])


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


def calibrate_command(args: argparse.Namespace) -> int:
    import datetime as dt

    try:
        track = commands.load_track_or_usage(args.track, args.track_file)
        if args.runs < 1:
            raise commands.UsageError("--runs must be at least 1")
        for path in (args.reference, args.baseline):
            commands.check_submission_file(Path(path))
    except commands.UsageError as error:
        print(f"scalelab calibrate: error: {error}", file=sys.stderr)
        return commands.EXIT_USAGE
    out_root = Path(args.out) if args.out else store.scalelab_home() / "calibration" / track.name
    # The reference runs with a stretched budget, so that its natural time is measured, not the budget's cut.
    stretched = dataclasses.replace(track, time_budget_s=max(track.time_budget_s * 3, 600))
    times, accuracies, spare_ok = [], [], 0
    for run in range(1, args.runs + 1):
        verdict = pipeline.assess(args.reference, stretched, out_dir=out_root / f"reference-{run}")
        if verdict["verdict"] == "error":
            print(f"reference run {run}: grader error: {verdict['reasons']}", file=sys.stderr)
            return commands.EXIT_INTERNAL
        wall, accuracy = verdict["wall_time_s"], verdict["heldout_accuracy"] or 0.0
        passes = verdict["verdict"] == "pass" and wall <= track.time_budget_s
        comfortable = passes and wall <= 0.8 * track.time_budget_s
        spare_ok += comfortable
        times.append(wall)
        accuracies.append(accuracy)
        print(f"reference run {run}: {verdict['verdict']} under the stretched budget, {wall:.1f} s "
              f"({100 * (1 - wall / track.time_budget_s):.0f}% of the {track.time_budget_s:.0f} s budget to spare), "
              f"held-out accuracy {accuracy:.4f} (target {track.target_accuracy:.4f})"
              + ("" if verdict["verdict"] == "pass" else f"; {verdict['reasons'][0]}"), flush=True)
    baseline = pipeline.assess(args.baseline, track, out_dir=out_root / "baseline")
    print(f"baseline (unmodified assessment.py): {baseline['verdict']} in {baseline['wall_time_s']} s, "
          f"held-out accuracy {baseline['heldout_accuracy']}; {baseline['reasons'][0] if baseline['reasons'] else ''}")
    budget, target = suggest(times, accuracies)
    calibrated = spare_ok == args.runs and baseline["verdict"] in ("fail", "timeout")
    print(f"reference times: median {statistics.median(times):.1f} s, max {max(times):.1f} s; "
          f"accuracies: min {min(accuracies):.4f}, median {statistics.median(accuracies):.4f}")
    print(f"suggested time_budget_s = {budget}, target_accuracy = {target:.2f}")
    print(f"with the track's current settings: the reference passed with ≥ 20% to spare in {spare_ok} of "
          f"{args.runs} runs, the baseline {'failed' if baseline['verdict'] != 'pass' else 'PASSED'}: "
          f"{'CALIBRATED' if calibrated else 'NOT calibrated'}")
    facts = environment.describe()
    machine = f"{facts['cpu_count']} × {facts['cpu_model']}" + (f", GPUs {facts['gpus']}" if facts.get("gpus") else "")
    table = calibration_table(track, machine, times, accuracies, baseline,
                              dt.datetime.now(dt.timezone.utc).date().isoformat())
    print(table)
    if args.record:
        record_calibration(spec.tracks_file(args.track_file), track.name, table)
        print(f"recorded in {spec.tracks_file(args.track_file)}")
    return commands.EXIT_PASS if calibrated else commands.EXIT_FAIL


def register(subparsers, add_track_arguments) -> None:
    grade = subparsers.add_parser("grade", help="grade a class of submissions (resumable, K at a time)")
    grade.add_argument("submissions", help="directory of <student>/assessment.py, or an nbgrader course "
                                           "(submitted/<student>/assessment/assessment.py)")
    add_track_arguments(grade)
    grade.add_argument("--parallel", type=int, default=None, help="jobs at a time (default: cores ÷ ranks)")
    grade.add_argument("--csv", default=None, help="the class CSV (default: OUT/grades.csv)")
    grade.add_argument("--out", default=None, help="per-student verdicts, logs and feedback.md "
                                                   "(default: $SCALELAB_HOME/grades/TRACK)")
    grade.add_argument("--regrade", action="store_true", help="grade again submissions already graded")
    grade.add_argument("--database", default=None, help="results database (default: $SCALELAB_HOME/results.db)")
    grade.add_argument("--gradebook", default=None, help=f"nbgrader gradebook (default: {DEFAULT_GRADEBOOK})")
    grade.add_argument("--no-gradebook", action="store_true", help="do not write scores to nbgrader's gradebook")
    grade.set_defaults(func=grade_command)

    calibrate = subparsers.add_parser("calibrate", help="measure the reference and the baseline on a track")
    add_track_arguments(calibrate)
    calibrate.add_argument("--runs", type=int, default=5, help="reference runs (default 5)")
    calibrate.add_argument("--reference", default=str(spec.COURSE_ROOT / "assessment" / "solution" / "assessment.py"))
    calibrate.add_argument("--baseline", default=str(spec.COURSE_ROOT / "assessment" / "assessment.py"))
    calibrate.add_argument("--out", default=None, help="where the runs' verdicts and logs go")
    calibrate.add_argument("--record", action="store_true",
                           help="write the figures into the track file's [tracks.T.calibration] table")
    calibrate.set_defaults(func=calibrate_command)
