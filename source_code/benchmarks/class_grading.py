"""P5: class grading's makespan ÷ (sum of job times ÷ slots), i.e. how close ``scalelab grade`` comes to keeping
every slot busy. 1.00 is perfect packing with no dispatch cost.

The runner writes N tiny submissions (init Horovod, one allreduce, save a small model) and a one-rank track,
then starts ``python -m benchmarks.class_grading`` which calls the grader's own ``grade_class`` (what
``scalelab grade`` runs) with ``parallel = slots``. Each job's time is taken around the grader's
``pipeline.assess`` call (its whole life: staging, launch, verify, store); the makespan around ``grade_class``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

from . import processes
from .summary import spread

TRACK = "bench-tiny"
TRACK_TABLE = f"""[tracks.{TRACK}]
description = "Benchmark only: one rank, a tiny job; the verdict does not matter, its duration does."
dataset = "fashion-mnist"
ranks = 1
target_accuracy = 0.05
time_budget_s = 120
grace_s = 5
launcher = "gloo"
min_spread_deciles = 0
"""
TINY_SUBMISSION = '''"""A tiny submission for the class-grading benchmark ({student})."""
import os
from pathlib import Path

import horovod.tensorflow.keras as hvd
import tensorflow as tf

hvd.init()
total = hvd.allreduce(tf.constant([1.0]), op=hvd.Sum)
model = tf.keras.Sequential([tf.keras.Input((28, 28, 1)), tf.keras.layers.Rescaling(1 / 255),
                             tf.keras.layers.Flatten(), tf.keras.layers.Dense(10, activation="softmax")])
model.compile(loss="sparse_categorical_crossentropy")
if hvd.rank() == 0:
    model.save(Path(os.environ["SCALELAB_OUTPUT_DIR"]) / "model.keras")
'''


def write_class(root: Path, students: int) -> Path:
    """``root/submissions/studentNN/assessment.py`` (each a distinct file) and the track file; returns the latter."""
    for number in range(1, students + 1):
        student = f"student{number:02d}"
        (root / "submissions" / student).mkdir(parents=True, exist_ok=True)
        (root / "submissions" / student / "assessment.py").write_text(TINY_SUBMISSION.format(student=student))
    track_file = root / "tracks.toml"
    track_file.write_text(TRACK_TABLE)
    return track_file


def measure(out_dir: Path, *, students: int, slots: int, log=print) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    track_file = write_class(out_dir, students)
    result_file = out_dir / "class_grading.json"
    argv = [sys.executable, "-m", "benchmarks.class_grading", "--submissions",
            str(out_dir / "submissions"), "--track-file", str(track_file), "--slots", str(slots),
            "--out", str(out_dir / "grades"), "--json", str(result_file)]
    env = processes.environment(PYTHONPATH=str(processes.SOURCE_CODE), SCALELAB_HOME=str(out_dir / "home"))
    processes.run(argv, out_dir / "class_grading.log", env=env, timeout_s=students * 120)
    timing = json.loads(result_file.read_text())
    job_s = [end - start for start, end in timing["jobs"]]
    ideal_s = sum(job_s) / slots
    log(f"  {students} jobs, {slots} slots: makespan {timing['makespan_s']:.1f} s, jobs sum {sum(job_s):.1f} s "
        f"(ideal makespan {ideal_s:.1f} s); verdicts {timing['verdicts']}")
    return {"P5": spread([timing["makespan_s"] / ideal_s]), "makespan_s": timing["makespan_s"],
            "job_s": spread(job_s), "ideal_makespan_s": ideal_s, "students": students, "slots": slots,
            "jobs": timing["jobs"], "verdicts": timing["verdicts"]}


def main() -> None:
    """Grade the class with the grader's own ``grade_class``, timing every job (run by ``measure``)."""
    from scalelab.grader import grading, pipeline, spec

    parser = argparse.ArgumentParser(description="time scalelab grade's class grading")
    parser.add_argument("--submissions", type=Path, required=True)
    parser.add_argument("--track-file", type=Path, required=True)
    parser.add_argument("--slots", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()

    jobs, lock, assess = [], threading.Lock(), pipeline.assess

    def timed_assess(*positional, **keywords):
        started = time.perf_counter()
        try:
            return assess(*positional, **keywords)
        finally:
            with lock:
                jobs.append((started, time.perf_counter()))

    # Instrumentation only: grade_class looks pipeline.assess up at each call, so every job is timed.
    pipeline.assess = timed_assess
    track = spec.load_track(TRACK, args.track_file)
    started = time.perf_counter()
    verdicts = grading.grade_class(args.submissions, track, out_root=args.out, parallel=args.slots, regrade=True,
                                   database=args.out / "results.db", gradebook_path=args.out / "gradebook.db",
                                   log=lambda line: print(line, flush=True))
    makespan_s = time.perf_counter() - started
    counts = {}
    for verdict in verdicts:
        counts[verdict["verdict"]] = counts.get(verdict["verdict"], 0) + 1
    args.json.write_text(json.dumps({"makespan_s": makespan_s, "verdicts": counts,
                                     "jobs": [(s - started, e - started) for s, e in sorted(jobs)]}))


if __name__ == "__main__":
    main()
