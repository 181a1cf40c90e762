"""Run every benchmark and write the report.

    PYTHONPATH=source_code .venv/bin/python -m benchmarks.run --out bench-report          # 20-30 min on 2 cores
    PYTHONPATH=source_code .venv/bin/python -m benchmarks.run --out /tmp/quick --quick    # < 1 min, P1 and P6 only

Writes OUT/report.json (every figure with its samples, and the environment), OUT/report.md (the table) and
OUT/*.png, plus each measured program's log under OUT/logs/. A benchmark that fails leaves its figure
"not measured" with the error, and the others still run. P4 clicks Assess in headless Chromium with the
reference solution and P7 grades the reference and the baseline repeatedly (``benchmarks.assessment``). The
time-to-accuracy plot is drawn from the runs of `scalelab calibrate --track cifar10-cpu` (--calibration), which
trained the reference and the baseline already.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
import traceback
from pathlib import Path

from scalelab import environment
from scalelab.grader import store
from scalelab.runtime import usable_cores

from . import (assessment, bandwidth, class_grading, grader_overhead, processes, report, time_to_accuracy,
               training)
from .summary import not_measured, spread

STAGES = ("bandwidth", "training", "training-torch", "grader", "class", "assessment")
# What each stage fills in, so that a run of some stages (--only) can keep the others' results (--keep).
STAGE_FIGURES = {"bandwidth": ("P6",), "training": ("P1", "P2"), "training-torch": ("P10",), "grader": ("P3",),
                 "class": ("P5",), "assessment": ("P4", "P7", "P8")}
STAGE_DETAILS = {"bandwidth": ("allreduce", "allreduce_bound"), "training": ("training", "batch_sweep"),
                 "training-torch": ("training_torch",), "grader": ("grader_overhead",), "class": ("class_grading",),
                 "assessment": ()}
# Stages that measure the Keras course (its scripts, honest_small.py, the Keras reference): not run where TensorFlow
# is not installed (the PyTorch edition), their figures "not measured" with the reason.
KERAS_STAGES = ("training", "grader", "class", "assessment")
STAGE_PLOTS = {"bandwidth": ("allreduce_bandwidth.png",), "training": ("images_per_s_vs_batch.png",),
               "training-torch": (), "grader": (), "class": ("class_grading.png",), "assessment": ()}


def _plots():
    """benchmarks.plots, imported by the stages that draw: measuring needs no matplotlib (a bare GPU machine)."""
    from . import plots
    return plots


def settings(quick: bool) -> dict:
    if quick:
        return dict(sizes=bandwidth.QUICK_SIZES, allreduce_repeats=3, variants=["gloo"], repeats=1, epochs=2,
                    train_images=2560, steps=10, sweep=[32, 128], sweep_images=256, sweep_repeats=1,
                    with_horovod=False, grader_repeats=0, students=0, clicks=0, repeat_gradings=0, live_pairs=0,
                    torch_repeats=0, torch_epochs=0, torch_steps=0)
    # Sized to stay under 15 minutes on 2 cores. P1/P2: 5 repeats of 80-step epochs (40-step epochs and 3 repeats
    # gave medians from 0.91 to 0.99 for the same code: consecutive runs here differ by up to 10 %).
    return dict(sizes=bandwidth.FULL_SIZES, allreduce_repeats=7, variants=list(bandwidth.VARIANTS), repeats=5,
                epochs=3, train_images=10240, steps=40, sweep=[32, 64, 128, 256, 512], sweep_images=1280,
                sweep_repeats=2, with_horovod=True, grader_repeats=6, students=20, clicks=2, repeat_gradings=5,
                live_pairs=2, torch_repeats=3, torch_epochs=3, torch_steps=40)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="ScaleLab benchmarks: report.json, report.md and plots")
    parser.add_argument("--out", type=Path, required=True, help="report directory (created)")
    parser.add_argument("--quick", action="store_true", help="tiny settings: P6 up to 1 MB and P1 only (< 1 min)")
    parser.add_argument("--only", default=",".join(STAGES), help=f"comma-separated stages of {', '.join(STAGES)}")
    parser.add_argument("--keep", action="store_true",
                        help="keep the results of stages not run now from OUT/report.json (run the stages one "
                             "at a time into the same OUT)")
    parser.add_argument("--keep-from", type=Path, action="append", default=[],
                        help="also keep stages from this earlier report.json (repeatable; its plots are copied)")
    parser.add_argument("--track", default="cifar10-cpu", help="the track P4 and P7 grade on (default cifar10-cpu)")
    parser.add_argument("--calibration", type=Path, default=None,
                        help="a `scalelab calibrate --out` directory for the time-to-accuracy plot "
                             "(default: $SCALELAB_HOME/calibration/cifar10-cpu)")
    args = parser.parse_args(argv)
    stages = [stage.strip() for stage in args.only.split(",") if stage.strip()]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        parser.error(f"unknown stages {unknown}; known: {', '.join(STAGES)}")
    config = settings(args.quick)
    out = args.out.resolve()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    skipped = "skipped in --quick" if args.quick else "stage not selected (--only)"
    figures = {figure_id: not_measured(skipped) for figure_id in report.FIGURES}
    details, notes, plot_files, durations, stages_kept = {}, [], [], {}, []
    started = time.perf_counter()
    earlier = ([out / "report.json"] if args.keep else []) + [path.resolve() for path in args.keep_from]
    for previous_file in (path for path in earlier if path.is_file()):
        previous = json.loads(previous_file.read_text())
        kept_here = []
        for name in STAGES:
            if name in stages or name in stages_kept or name not in previous.get("stages", []):
                continue
            for figure_id in STAGE_FIGURES[name]:
                figures[figure_id] = previous["figures"][figure_id]
            for key in STAGE_DETAILS[name]:
                if key in previous["details"]:
                    details[key] = previous["details"][key]
            for plot in STAGE_PLOTS[name]:
                if plot in previous.get("plots", []):
                    if previous_file.parent != out:
                        shutil.copyfile(previous_file.parent / plot, out / plot)
                    plot_files.append(plot)
            durations[name] = previous["stage_durations_s"].get(name)
            notes.extend(n for n in previous.get("notes", []) if n.startswith((f"{name} ", f"{name}:")))
            kept_here.append(name)
        stages_kept.extend(kept_here)
        if kept_here:
            notes.append(f"kept from the run of {previous['finished_at']} ({previous_file}): {', '.join(kept_here)}")

    keras_stages_left_out = []

    def stage(name, body):
        if name not in stages:
            return
        if name in KERAS_STAGES and environment.tensorflow_version() is None:
            for figure_id in STAGE_FIGURES[name]:
                figures[figure_id] = not_measured(environment.KERAS_LEFT_OUT)
            keras_stages_left_out.append(name)
            return
        print(f"[{name}]", flush=True)
        stage_started = time.perf_counter()
        try:
            body()
        except Exception as error:  # one failed benchmark must not lose the others' figures
            notes.append(f"{name} failed: {type(error).__name__}: {str(error)[:300]}")
            (logs / f"{name}-error.log").write_text(traceback.format_exc())
            print(f"  FAILED: {error}", flush=True)
        durations[name] = time.perf_counter() - stage_started

    def run_bandwidth():
        documents = []
        for variant in config["variants"]:
            if bandwidth.VARIANTS[variant][1].get("TF_CPU_ALLOCATOR_USE_BFC") and not environment.tensorflow_version():
                continue  # TensorFlow's allocator: nothing to compare where TensorFlow is not installed
            document = bandwidth.measure(variant, logs, sizes=config["sizes"], repeats=config["allreduce_repeats"])
            documents.append(document)
            ratio = bandwidth.p6_ratio(document)
            print(f"  {variant}: {ratio['bus_gb_per_s']['median']:.2f} GB/s at {ratio['message_bytes']} bytes, "
                  f"memcpy {ratio['memcpy_gb_per_s']['median']:.2f} GB/s: ratio {ratio['median']:.3f}", flush=True)
        details["allreduce"] = documents
        # P6 is the best transport setting measured (named in the figure); every setting's ratio is kept.
        by_variant = {document["variant"]: bandwidth.p6_ratio(document) for document in documents}
        best = max(by_variant.values(), key=lambda ratio: ratio["median"])
        figures["P6"] = dict(best, by_variant={name: {k: ratio[k] for k in ("min", "median", "max")}
                                               for name, ratio in by_variant.items()})
        notes.append("bandwidth: P6 is the best transport setting measured, " + figures["P6"]["variant"]
                     + "; medians by setting: " + ", ".join(f"{name} {ratio['median']:.3f}"
                                                            for name, ratio in by_variant.items()))
        bound = bandwidth.ideal_bound(logs, figures["P6"]["message_bytes"], config["allreduce_repeats"])
        details["allreduce_bound"] = bound
        figures["P6"]["ideal_shared_memory_ratio"] = bound["ratio"]
        print(f"  ideal shared-memory allreduce (no transport, no Horovod): ratio {bound['ratio']['median']:.3f}",
              flush=True)
        notes.append(f"bandwidth: P6 ceiling on this machine: an ideal 2-rank allreduce done directly in shared "
                     f"memory (allreduce_bound.py) reaches {bound['ratio']['median']:.2f} of memcpy "
                     f"(min {bound['ratio']['min']:.2f}, max {bound['ratio']['max']:.2f}).")
        if figures["P6"]["message_bytes"] != bandwidth.P6_MESSAGE_BYTES:
            notes.append(f"bandwidth: P6 measured at {figures['P6']['message_bytes']} bytes, not 64 MB (--quick)")
        plot_files.append(_plots().allreduce_bandwidth(documents, out / "allreduce_bandwidth.png").name)

    def run_training():
        result = training.measure(logs, repeats=config["repeats"], epochs=config["epochs"],
                                  train_images=config["train_images"], steps=config["steps"],
                                  with_horovod=config["with_horovod"])
        figures["P1"] = result["P1"]
        if result["P2"] is not None:
            figures["P2"] = result["P2"]
        details["training"] = result
        sweep = training.batch_sweep(logs, config["sweep"], config["sweep_images"], config["sweep_repeats"])
        details["batch_sweep"] = sweep
        plot_files.append(_plots().throughput_vs_batch(sweep, out / "images_per_s_vs_batch.png").name)

    def run_training_torch():
        if config["torch_repeats"] < 1:
            return
        result = training.measure_torch(logs / "training-torch", repeats=config["torch_repeats"],
                                        epochs=config["torch_epochs"], steps=config["torch_steps"])
        figures["P10"] = dict(result["P10"], device=result["device"])
        details["training_torch"] = result
        notes.append(f"training-torch: P10 measured on {result['device']}")

    def run_grader():
        if config["grader_repeats"] < 1:
            return
        result = grader_overhead.measure(logs / "grader", repeats=config["grader_repeats"])
        figures["P3"] = result["P3"]
        details["grader_overhead"] = result

    def run_class():
        if config["students"] < 1:
            return
        slots = usable_cores()  # one-rank jobs: one slot per core, as `scalelab grade` would choose
        result = class_grading.measure(logs / "class", students=config["students"], slots=slots)
        figures["P5"] = result["P5"]
        details["class_grading"] = result
        plot_files.append(_plots().class_grading_timeline(result["jobs"], slots, out / "class_grading.png").name)

    def run_assessment():
        if config["clicks"] < 1:
            return
        (logs / "assessment").mkdir(exist_ok=True)
        figures["P4"] = assessment.click_to_verdict(logs / "assessment", args.track, config["clicks"])
        figures["P7"] = assessment.repeatability(logs / "assessment", args.track, config["repeat_gradings"])
        figures["P8"] = assessment.live_evaluation_cost(logs / "assessment", args.track, config["live_pairs"])

    stage("bandwidth", run_bandwidth)
    stage("training", run_training)
    stage("training-torch", run_training_torch)
    stage("grader", run_grader)
    stage("class", run_class)
    stage("assessment", run_assessment)
    if keras_stages_left_out:
        notes.append(f"not run: {', '.join(keras_stages_left_out)}: {environment.KERAS_LEFT_OUT}")
    calibration_dir = args.calibration or store.scalelab_home() / "calibration" / "cifar10-cpu"
    try:
        details["time_to_accuracy"] = time_to_accuracy.read_calibration(calibration_dir)
        plot_files.append(_plots().time_to_accuracy(details["time_to_accuracy"], out / "time_to_accuracy.png").name)
    except FileNotFoundError as missing:
        notes.append(f"time-to-accuracy plot not drawn: {missing}")

    env = environment.describe()
    # The Horovod and Open MPI settings the measured programs ran with (processes.environment adds the course's).
    launch_env = processes.environment()
    env.update(mpi=environment.mpi_implementation(),
               horovod_env={k: v for k, v in launch_env.items() if k.startswith(("HOROVOD_", "OMPI_MCA_"))})
    document = {
        "quick": args.quick, "stages": stages + stages_kept, "stages_kept_from_earlier_run": stages_kept,
        "settings": config, "environment": env,
        "figures": {figure_id: report.judge(figure_id, figures[figure_id]) for figure_id in report.FIGURES},
        "details": details, "notes": notes, "plots": plot_files,
        "stage_durations_s": durations,
        "total_s": sum(d for d in durations.values() if d),
    }
    report.write(out, document)
    print((out / "report.md").read_text(), flush=True)
    print(f"report: {out / 'report.json'}, {out / 'report.md'} (stages took {document['total_s']:.0f} s)", flush=True)
    return 1 if any(" failed: " in note for note in notes) else 0


if __name__ == "__main__":
    raise SystemExit(main())
