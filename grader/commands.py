"""The grader's commands in the ``scalelab`` CLI: ``assess``, ``grade`` and ``calibrate``.

Exit codes (all three commands): 0 pass; 1 fail, timeout or a submission that errors; 2 bad input to the
command, with a one-line message on stderr; 3 an internal error of the grader (an ``error`` verdict, still
written when --out is given).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import pipeline, spec

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3
VERDICT_EXIT = {"pass": EXIT_PASS, "fail": EXIT_FAIL, "timeout": EXIT_FAIL, "error": EXIT_INTERNAL}


class UsageError(Exception):
    """Bad input to a command: printed as one line, exit code 2."""


def check_submission_file(path: Path) -> None:
    """Refuse what cannot be a submission at all (a syntax error is the submission's problem, not this)."""
    if not path.exists():
        raise UsageError(f"{path} does not exist")
    if path.is_dir():
        raise UsageError(f"{path} is a directory; give the submission's assessment.py")
    if path.suffix != ".py":
        raise UsageError(f"{path} is not a Python file (.py)")
    size = path.stat().st_size
    if size == 0:
        raise UsageError(f"{path} is empty")
    if size > pipeline.SUBMISSION_SIZE_LIMIT_BYTES:
        raise UsageError(f"{path} is {size} bytes, over the {pipeline.SUBMISSION_SIZE_LIMIT_BYTES} byte limit "
                         f"for a submission")
    content = path.read_bytes()
    if b"\0" in content:
        raise UsageError(f"{path} is binary, not Python source")
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not UTF-8 text, so not Python source") from None
    if not text.strip():
        raise UsageError(f"{path} holds only white space")


def load_track_or_usage(name: str | None, track_file) -> spec.Track:
    try:
        return spec.load_track(name, track_file)
    except spec.SpecError as error:
        raise UsageError(str(error)) from None


def summary(verdict: dict) -> str:
    """The human-readable verdict."""
    def number(value, form):
        return "—" if value is None else format(value, form)

    lines = [
        f"verdict      {verdict['verdict'].upper()}",
        f"track        {verdict.get('track')}  ({verdict.get('np')} ranks)",
        f"accuracy     {number(verdict.get('heldout_accuracy'), '.4f')} held-out "
        f"(target {number(verdict.get('target_accuracy'), '.4f')})",
        f"time         {number(verdict.get('wall_time_s'), '.1f')} s (budget {number(verdict.get('time_budget_s'), '.0f')} s)",
        f"ranks seen   {verdict.get('ranks_seen')}, {verdict.get('allreduce_count')} allreduces",
    ]
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
    except UsageError as error:
        print(f"scalelab assess: error: {error}", file=sys.stderr)
        return EXIT_USAGE

    def show_progress(state: dict) -> None:
        if not args.json and state.get("state") == "running" and state.get("elapsed_s"):
            print(f"  {state['elapsed_s']:6.0f} s of {state['time_budget_s']:.0f} s, "
                  f"epochs seen {state['epochs_seen']}", file=sys.stderr, end="\r", flush=True)

    verdict = pipeline.assess(submission, args.track, np=args.np, out_dir=args.out, backend=args.backend,
                              allow_unsandboxed=args.allow_unsandboxed, progress=show_progress,
                              track_file=args.track_file)
    if args.json:
        print(json.dumps(verdict, sort_keys=True, default=str))
    else:
        print(file=sys.stderr)
        print(summary(verdict))
    return VERDICT_EXIT[verdict["verdict"]]


def _add_track_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--track", default=None,
                        help=f"track name from the track file (default: $SCALELAB_TRACK or {spec.DEFAULT_TRACK})")
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
    from . import grading
    grading.register(subparsers, _add_track_arguments)
