"""The grader's commands in the ``scalelab`` CLI: ``assess``, ``grade`` and ``calibrate``.

Exit codes (all three commands): 0 pass; 1 fail, timeout or a submission that errors; 2 bad input to the
command, with a one-line message on stderr; 3 an internal error of the grader (an ``error`` verdict, still
written when --out is given). ``assess`` exits 4 when the run ran out of time while other work on the machine
used too much of its CPU: the submission was not graded (an ``error`` verdict with ``contended``: true); assess it
again once the machine is quieter. ``assess`` stopped by SIGTERM stops its run and removes its job directory
first, then exits 143.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import signal
import statistics
import sys
import threading
try:
    import tomllib
except ImportError:  # Python 3.10 (Ubuntu 22.04): the same parser as the tomli package
    import tomli as tomllib
from pathlib import Path

import psutil

from scalelab import environment
from scalelab.runtime import usable_cores

from . import grading, pipeline, report, spec, store
from .submission import NotASubmission, check_submission_file

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_INTERNAL, EXIT_CONTENDED = 0, 1, 2, 3, 4
EXIT_STOPPED = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM
VERDICT_EXIT = {"pass": EXIT_PASS, "fail": EXIT_FAIL, "timeout": EXIT_FAIL, "error": EXIT_INTERNAL}


class UsageError(Exception):
    """Bad input to a command: printed as one line, exit code 2."""


class Stopped(BaseException):
    """SIGTERM arrived. Not an ``Exception``: it unwinds the grader through its finally blocks (which stop the
    run and remove its job directory) without being taken for a failure of the grader."""


def load_track_or_usage(name: str | None, track_file) -> spec.Track:
    try:
        return spec.load_track(name, track_file)
    except spec.SpecError as error:
        raise UsageError(str(error)) from None


def _raise_stopped(_signum, _frame) -> None:
    # Once: a second SIGTERM must not cut the clean-up short.
    signal.signal(signal.SIGTERM, lambda _signum, _frame: None)
    raise Stopped()


@contextlib.contextmanager
def _sigterm_raises_stopped():
    """Without it SIGTERM would end the process at once, leaving the run going and its job directory behind."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _kill_leftover_children(wait_s: float = 5.0) -> None:
    """SIGKILL what this process started and its own clean-up did not stop (e.g. a measurement cut short)."""
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(children, timeout=wait_s)


def summary(verdict: dict) -> str:
    """The human-readable verdict."""
    def number(value, form):
        return "—" if value is None else format(value, form)

    headline = verdict["verdict"].upper()
    if verdict.get("contended"):
        headline += " (not graded: other work on the machine used too much of its CPU; assess it again)"
    lines = [
        f"verdict      {headline}",
        f"track        {verdict.get('track')}  ({verdict.get('np')} ranks)",
        f"accuracy     {number(verdict.get('heldout_accuracy'), '.4f')} held-out "
        f"(target {number(verdict.get('target_accuracy'), '.4f')})",
        f"time         {number(verdict.get('wall_time_s'), '.1f')} s (budget {number(verdict.get('time_budget_s'), '.0f')} s)",
        f"ranks seen   {verdict.get('ranks_seen')}, {verdict.get('allreduce_count')} allreduces",
    ]
    busy = verdict.get("cpu_contention")
    if busy:
        lines.append(f"machine      other work used {busy['share'] * 100:.0f} % of the CPU during the run "
                     f"({busy['others_cpu_s']:.0f} of {busy['capacity_cpu_s']:.0f} CPU-seconds)")
    for reason in verdict.get("reasons") or []:
        lines.append("reason       " + reason.replace("\n", "\n             "))
    for note in verdict.get("notes") or []:
        lines.append("note         " + note)
    lines.append(f"logs         {verdict.get('logs_dir')}")
    return "\n".join(lines)


def assess_command(args: argparse.Namespace) -> int:
    try:
        submission = Path(args.file)
        check_submission_file(submission)
        load_track_or_usage(args.track, args.track_file)
        if args.np is not None and args.np < 1:
            raise UsageError("--np must be at least 1")
        if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
            raise UsageError(f"--out {args.out} exists and is not a directory")
    except (UsageError, NotASubmission) as error:
        print(f"scalelab assess: error: {error}", file=sys.stderr)
        return EXIT_USAGE

    def show_progress(state: dict) -> None:
        if not args.json and state.get("state") == "running" and state.get("elapsed_s"):
            print(f"  {state['elapsed_s']:6.0f} s of {state['time_budget_s']:.0f} s, "
                  f"epochs seen {state['epochs_seen']}", file=sys.stderr, end="\r", flush=True)

    try:
        with _sigterm_raises_stopped():
            verdict = pipeline.assess(submission, args.track, np=args.np, out_dir=args.out, backend=args.backend,
                                      allow_unsandboxed=args.allow_unsandboxed, progress=show_progress,
                                      track_file=args.track_file)
    except Stopped:
        _kill_leftover_children()
        print("scalelab assess: stopped by SIGTERM: the run was stopped and its job directory removed",
              file=sys.stderr)
        return EXIT_STOPPED
    if args.json:
        print(json.dumps(verdict, sort_keys=True, default=str))
    else:
        print(file=sys.stderr)
        print(summary(verdict))
    return EXIT_CONTENDED if verdict.get("contended") else VERDICT_EXIT[verdict["verdict"]]


def grade_command(args: argparse.Namespace) -> int:
    try:
        root = Path(args.submissions)
        if not root.is_dir():
            raise UsageError(f"{root} is not a directory of submissions")
        track = load_track_or_usage(args.track, args.track_file)
        if args.parallel is not None and args.parallel < 1:
            raise UsageError("--parallel must be at least 1")
        if not grading.find_submissions(root, track.submission_file):
            raise UsageError(f"{root} holds no student directories")
        ranks = track.resolve_ranks(len(environment.gpus()))
    except (UsageError, spec.SpecError) as error:
        print(f"scalelab grade: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    parallel = args.parallel or max(1, usable_cores() // ranks)
    out_root = Path(args.out) if args.out else store.scalelab_home() / "grades" / track.name
    gradebook = None if args.no_gradebook else Path(args.gradebook or grading.DEFAULT_GRADEBOOK)
    print(f"grading {root} on track {track.name}, {parallel} at a time; results in {out_root}")
    verdicts = grading.grade_class(root, track, out_root=out_root, parallel=parallel, regrade=args.regrade,
                                   database=Path(args.database) if args.database else None, gradebook_path=gradebook)
    csv_path = Path(args.csv) if args.csv else out_root / "grades.csv"
    report.write_csv(csv_path, verdicts)
    counts = {kind: sum(v["verdict"] == kind for v in verdicts) for kind in ("pass", "fail", "timeout", "error")}
    print(f"{len(verdicts)} students: " + ", ".join(f"{n} {kind}" for kind, n in counts.items())
          + f"; CSV {csv_path}" + (f"; gradebook {gradebook}" if gradebook else ""))
    return EXIT_INTERNAL if counts["error"] else EXIT_PASS


def calibrate_command(args: argparse.Namespace) -> int:
    try:
        track = load_track_or_usage(args.track, args.track_file)
        if args.runs < 1:
            raise UsageError("--runs must be at least 1")
        # The course's scripts for the track's framework (and, on PyTorch, its launcher), unless others are named.
        script = "assessment_pytorch.py" if track.framework == "pytorch" else "assessment.py"
        solution = "assessment_pytorch_horovod.py" if track.framework == "pytorch" and track.horovod else script
        args.reference = args.reference or str(spec.COURSE_ROOT / "assessment" / "solution" / solution)
        args.baseline = args.baseline or str(spec.COURSE_ROOT / "assessment" / script)
        for path in (args.reference, args.baseline):
            check_submission_file(Path(path))
    except (UsageError, NotASubmission) as error:
        print(f"scalelab calibrate: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    out_root = Path(args.out) if args.out else store.scalelab_home() / "calibration" / track.name
    # The reference runs with a stretched budget, so that its natural time to accuracy is measured, not the budget's
    # cut; the target is the course's choice and stays.
    stretched = dataclasses.replace(track, time_budget_s=max(track.time_budget_s * 3, 600))
    references = []
    for run in range(1, args.runs + 1):
        verdict = pipeline.assess(args.reference, stretched, out_dir=out_root / f"reference-{run}")
        if verdict["verdict"] == "error":
            print(f"reference run {run}: grader error: {verdict['reasons']}", file=sys.stderr)
            return EXIT_INTERNAL
        references.append(verdict)
        print(f"reference run {run}: {verdict['verdict']} under the stretched budget, time to accuracy "
              f"{verdict['time_to_accuracy_s']} s (run {verdict['wall_time_s']:.1f} s), held-out accuracy "
              f"{verdict['heldout_accuracy']}" + ("" if verdict["verdict"] == "pass" else f"; {verdict['reasons'][0]}"),
              flush=True)
    # The curves (the grader's held-out accuracy of each snapshot), beside the runs' own verdicts.
    store.write_json_atomic(out_root / "curves.json", {"track": track.name, "target_accuracy": track.target_accuracy,
                                                        "curves": [reference["snapshots"] for reference in references]})
    times = [reference["time_to_accuracy_s"] or reference["wall_time_s"] for reference in references]
    budget, target = grading.suggest(times), track.target_accuracy
    print(f"times to accuracy: median {statistics.median(times):.1f} s, max {max(times):.1f} s")
    print(f"suggested time_budget_s = {budget} (target_accuracy {target:.2f} stays)", flush=True)
    # The baseline is graded as the suggested track would grade it: it must fail there.
    suggested = dataclasses.replace(track, time_budget_s=budget)
    baseline = pipeline.assess(args.baseline, suggested, out_dir=out_root / "baseline")
    print(f"baseline (unmodified assessment.py): {baseline['verdict']} in {baseline['wall_time_s']} s, "
          f"held-out accuracy {baseline['heldout_accuracy']}; {baseline['reasons'][0] if baseline['reasons'] else ''}")
    table = grading.calibration_table(track, grading.machine_facts(), references, baseline,
                                      dt.datetime.now(dt.timezone.utc).date().isoformat())
    recorded = dataclasses.replace(suggested, calibration=tomllib.loads(table.split("\n", 1)[1]))
    problems = recorded.calibration_problems()
    for problem in problems:
        print(f"not calibrated: {problem}")
    print(table)
    print("CALIBRATED with the suggested settings" if not problems else "NOT calibrated")
    if args.record:
        track_file = spec.tracks_file(args.track_file)
        grading.record_settings(track_file, track.name, budget, target)
        grading.record_calibration(track_file, track.name, table)
        print(f"recorded in {track_file}: time_budget_s = {budget} and the figures")
    return EXIT_FAIL if problems else EXIT_PASS


def _add_track_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--track", default=None,
                        help=f"track name from the track file (default: $SCALELAB_TRACK or {spec.DEFAULT_TRACK}; "
                             f"{spec.DEFAULT_PYTORCH_TRACK} on the PyTorch edition)")
    parser.add_argument("--track-file", default=None,
                        help="track file (default: $SCALELAB_TRACKS or assessment/tracks.toml)")


def register(subparsers) -> None:
    """Add ``assess``, ``grade`` and ``calibrate`` to the ``scalelab`` command."""
    assess = subparsers.add_parser("assess", help="grade one assessment.py: run it under horovodrun, verify it",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    assess.add_argument("file", help="the submission (assessment.py)")
    _add_track_arguments(assess)
    assess.add_argument("--np", type=int, default=None, help="number of ranks (default: the track's)")
    assess.add_argument("--json", action="store_true", help="print exactly one JSON object (the verdict)")
    assess.add_argument("--out", default=None,
                        help="directory for verdict.json, progress.json and logs/ (default: a new one under "
                             "$SCALELAB_HOME/runs)")
    assess.add_argument("--backend", choices=("local", "slurm"), default="local", help="where the job runs")
    assess.add_argument("--allow-unsandboxed", action="store_true",
                        help="run even where bubblewrap cannot sandbox the submission (instructors only)")
    assess.set_defaults(func=assess_command)

    grade = subparsers.add_parser("grade", help="grade a class of submissions (resumable, K at a time)")
    grade.add_argument("submissions", help="directory of <student>/assessment.py, or an nbgrader course "
                                           "(submitted/<student>/assessment/assessment.py); "
                                           "assessment_pytorch.py for a PyTorch track")
    _add_track_arguments(grade)
    grade.add_argument("--parallel", type=int, default=None, help="jobs at a time (default: cores ÷ ranks)")
    grade.add_argument("--csv", default=None, help="the class CSV (default: OUT/grades.csv)")
    grade.add_argument("--out", default=None, help="per-student verdicts, logs and feedback.md "
                                                   "(default: $SCALELAB_HOME/grades/TRACK)")
    grade.add_argument("--regrade", action="store_true", help="grade again submissions already graded")
    grade.add_argument("--database", default=None, help="results database (default: $SCALELAB_HOME/results.db)")
    grade.add_argument("--gradebook", default=None, help=f"nbgrader gradebook (default: {grading.DEFAULT_GRADEBOOK})")
    grade.add_argument("--no-gradebook", action="store_true", help="do not write scores to nbgrader's gradebook")
    grade.set_defaults(func=grade_command)

    calibrate = subparsers.add_parser("calibrate", help="measure the reference and the baseline on a track")
    _add_track_arguments(calibrate)
    calibrate.add_argument("--runs", type=int, default=5, help="reference runs (default 5)")
    calibrate.add_argument("--reference", default=None,
                           help="the reference solution (default: the course's, for the track's framework)")
    calibrate.add_argument("--baseline", default=None,
                           help="the serial script (default: the course's, for the track's framework)")
    calibrate.add_argument("--out", default=None, help="where the runs' verdicts and logs go")
    calibrate.add_argument("--record", action="store_true",
                           help="write the figures into the track file's [tracks.T.calibration] table")
    calibrate.set_defaults(func=calibrate_command)
