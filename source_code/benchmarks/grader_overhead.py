"""P3: what ``scalelab assess`` adds to a run: its wall time minus a bare ``horovodrun`` of the same submission.

The submission is tests/submissions/honest_small.py on the fashion-mnist-test track of
tests/submissions/tracks.toml (2 ranks, Gloo). The bare run is what a student runs to self-test, in a fresh
directory with the same environment variables the grader sets. Both are timed from outside, as whole commands,
once per repeat, in turn (which one goes first alternates). The overhead is split with the grader's own
launch-to-exit time (``wall_time_s``): ``inside_run_s`` (sandbox, timeline) and ``outside_run_s`` (start-up,
staging, the held-out measurement).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from scalelab.environment import horovodrun_path

from . import processes
from .summary import run_in_turn, spread

SUBMISSION = processes.COURSE_ROOT / "tests" / "submissions" / "honest_small.py"
TRACK_FILE = processes.COURSE_ROOT / "tests" / "submissions" / "tracks.toml"
TRACK = "fashion-mnist-test"


def scalelab_command() -> str:
    beside_python = Path(sys.executable).with_name("scalelab")
    return str(beside_python) if beside_python.exists() else "scalelab"


def bare_run(work_dir: Path, np: int = 2, controller: str = "gloo") -> float:
    """``horovodrun -np 2 --gloo python assessment.py`` in a fresh directory: its wall time."""
    if work_dir.exists():
        shutil.rmtree(work_dir)
    (work_dir / "output").mkdir(parents=True)
    shutil.copyfile(SUBMISSION, work_dir / "assessment.py")
    env = processes.environment(SCALELAB_OUTPUT_DIR=str(work_dir / "output"), SCALELAB_TRACK=TRACK,
                                SCALELAB_DATASET="fashion-mnist")
    argv = [horovodrun_path(), "-np", str(np), f"--{controller}", sys.executable, "assessment.py"]
    finished = processes.run(argv, work_dir / "horovodrun.log", env=env, cwd=work_dir, timeout_s=400)
    if not (work_dir / "output" / "model.keras").is_file():
        raise processes.BenchmarkError(f"the bare run saved no model; log {work_dir / 'horovodrun.log'}")
    return finished.wall_s


def assess_run(work_dir: Path, home: Path) -> tuple[float, dict]:
    """``scalelab assess --json`` of the same submission: its wall time and verdict."""
    if work_dir.exists():
        shutil.rmtree(work_dir)
    argv = [scalelab_command(), "assess", str(SUBMISSION), "--track", TRACK, "--track-file", str(TRACK_FILE),
            "--json", "--out", str(work_dir)]
    log = work_dir.parent / f"{work_dir.name}.log"
    # Exit 1 is a fail verdict: still a measured run (the verdict is reported next to the figure).
    finished = processes.run(argv, log, env=processes.environment(SCALELAB_HOME=str(home)), timeout_s=500,
                             ok_exit_codes=(0, 1))
    verdict = json.loads(finished.output.strip().splitlines()[-1])
    return finished.wall_s, verdict


def measure(out_dir: Path, *, repeats: int, log=print) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    bare, assessed, overhead, inside, outside, verdicts = [], [], [], [], [], []
    for repeat in range(repeats):
        runs = run_in_turn({"bare": lambda: bare_run(out_dir / f"bare_{repeat}"),
                            "assess": lambda: assess_run(out_dir / f"assess_{repeat}", out_dir / "home")}, repeat)
        bare_s, (assess_s, verdict) = runs["bare"], runs["assess"]
        bare.append(bare_s)
        assessed.append(assess_s)
        overhead.append(assess_s - bare_s)
        inside.append(verdict["wall_time_s"] - bare_s)
        outside.append(assess_s - verdict["wall_time_s"])
        verdicts.append(verdict["verdict"])
        log(f"  repeat {repeat + 1}: bare horovodrun {bare_s:.1f} s, scalelab assess {assess_s:.1f} s "
            f"(its run {verdict['wall_time_s']:.1f} s, verdict {verdict['verdict']})")
    return {"P3": spread(overhead), "bare_horovodrun_s": spread(bare), "scalelab_assess_s": spread(assessed),
            "inside_run_s": spread(inside), "outside_run_s": spread(outside), "verdicts": verdicts,
            "submission": str(SUBMISSION.relative_to(processes.COURSE_ROOT)), "track": TRACK}
