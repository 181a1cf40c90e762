"""The benchmarks (source_code/benchmarks): the figures' arithmetic, and a real --quick run of the runner."""

from __future__ import annotations

import json
import subprocess
import sys

import nbformat
import pytest

from conftest import HAS_TENSORFLOW, PROJECT_ROOT, subprocess_env

sys.path.insert(0, str(PROJECT_ROOT / "source_code"))  # the benchmarks are a directory, not an installed package

from benchmarks import bandwidth, processes, report, run, time_to_accuracy, training  # noqa: E402
from benchmarks.summary import not_measured, run_in_turn, spread  # noqa: E402
from scalelab.environment import KERAS_LEFT_OUT  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# The installed edition's Horovod binding, for the two-rank scripts below.
HOROVOD_BINDING = "horovod.tensorflow" if HAS_TENSORFLOW else "horovod.torch"


def test_spread_gives_min_median_max_of_the_samples_and_none_without_samples():
    assert spread([3.0, 1.0, 2.0, 10.0]) == {"min": 1.0, "median": 2.5, "max": 10.0, "n": 4,
                                             "samples": [3.0, 1.0, 2.0, 10.0]}
    assert spread([])["median"] is None


def test_goal_is_judged_on_the_median_in_the_goals_direction():
    assert report.judge("P6", spread([0.4, 0.6, 0.7]))["met"] is True
    assert report.judge("P6", spread([0.1, 0.2, 0.9]))["met"] is False
    assert report.judge("P3", spread([1.0, 2.0, 9.0]))["met"] is True
    assert report.judge("P3", spread([3.5, 4.0, 2.0]))["met"] is False
    assert report.judge("P4", spread([0.7]))["met"] is True  # 60-80 % of the budget
    assert report.judge("P4", spread([0.5]))["met"] is False and report.judge("P4", spread([0.85]))["met"] is False
    assert report.judge("P4", spread([0.7]))["goal"] == "0.6–0.8"
    assert report.judge("P7", spread([1.0]))["met"] is True and report.judge("P7", spread([0.9]))["met"] is False
    assert report.judge("P1", not_measured("skipped"))["met"] is None


def test_epoch_throughputs_reads_the_course_scripts_epoch_lines_and_drops_the_first_epoch():
    from scalelab.progress import format_epoch  # the line the scripts really print

    logs = {"loss": 0.8, "accuracy": 0.7, "val_loss": 0.7, "val_accuracy": 0.75, "lr": 0.02, "elapsed_s": 4.0}
    output = "training on 2560 images, batch 128, 20 steps per epoch\n" + "\n".join(
        format_epoch(epoch, 3, dict(logs, images_per_s=rate)) for epoch, rate in enumerate((1500, 3100, 3300)))
    assert training.epoch_throughputs(output) == [3100.0, 3300.0]
    under_horovodrun = "\n".join(f"[0]<stdout>:{line}" for line in output.splitlines())
    assert training.epoch_throughputs(under_horovodrun) == [3100.0, 3300.0]
    under_mpi = "\n".join(f"[1,0]<stdout>:{line}" for line in output.splitlines())
    assert training.epoch_throughputs(under_mpi) == [3100.0, 3300.0]


def test_p10_is_the_pytorch_references_img_s_over_the_bare_steps_within_each_repeat(tmp_path, monkeypatch):
    bare = iter([[1000.0, 1100.0, 1200.0], [500.0, 600.0, 700.0]])
    reference = iter([[900.0, 1000.0], [480.0, 540.0]])
    monkeypatch.setattr(training, "torch_bare_step", lambda out_dir, tag, steps: {
        "images_per_s": next(bare), "device_name": "NVIDIA H100 80GB HBM3"})
    monkeypatch.setattr(training, "torch_reference", lambda out_dir, tag, epochs: next(reference))
    result = training.measure_torch(tmp_path, repeats=2, epochs=3, steps=40, log=lambda line: None)
    # Each repeat's medians: 950 / 1100, then 510 / 600 (the machine slowed down between repeats: both sides moved).
    assert result["P10"]["samples"] == pytest.approx([950 / 1100, 510 / 600])
    assert result["device"] == "NVIDIA H100 80GB HBM3"
    monkeypatch.setattr(training, "torch_reference", lambda out_dir, tag, epochs: [])
    bare = iter([[1000.0]])
    with pytest.raises(processes.BenchmarkError, match="printed no epoch after the first"):
        training.measure_torch(tmp_path, repeats=1, epochs=1, steps=40, log=lambda line: None)


def test_the_bare_pytorch_step_times_the_assessments_model_on_real_cifar10(tmp_path):
    result_file = tmp_path / "step.json"
    done = subprocess.run([sys.executable, str(PROJECT_ROOT / "source_code" / "benchmarks" /
                                                "train_step_throughput_torch.py"),
                           "--steps", "3", "--warmup", "1", "--repeats", "2", "--images", "256", "--device", "cpu",
                           "--json", str(result_file)], capture_output=True, text=True, timeout=300,
                          env=subprocess_env())
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(result_file.read_text())
    assert result["device"] == "cpu" and result["batch_size"] == training.TORCH_BATCH
    assert len(result["images_per_s"]) == 2 and all(rate > 0 for rate in result["images_per_s"])


def test_p6_is_bus_bandwidth_over_the_median_memcpy_at_64_mb_or_the_largest_size_measured():
    document = {"controller": "gloo", "memcpy_gb_per_s_spread": spread([4.0, 5.0, 6.0]), "sizes": []}
    for size, rates in ((1 << 20, [1.0, 1.0]), (64 << 20, [2.0, 3.0, 2.5])):
        document["sizes"].append({"message_bytes": size, "bus_gb_per_s_spread": spread(rates),
                                  "ratio_to_memcpy": spread(r / 5.0 for r in rates)})
    figure = bandwidth.p6_ratio(document)
    assert figure["message_bytes"] == 64 << 20 and figure["median"] == pytest.approx(0.5)
    document["sizes"].pop()
    assert bandwidth.p6_ratio(document)["message_bytes"] == 1 << 20


def test_programs_run_in_turn_and_in_reverse_every_other_repeat():
    for repeat, expected in ((0, ["a", "b", "c"]), (1, ["c", "b", "a"]), (2, ["a", "b", "c"])):
        called = []
        results = run_in_turn({name: (lambda name=name: called.append(name) or name.upper()) for name in "abc"},
                              repeat)
        assert called == expected and results == {"a": "A", "b": "B", "c": "C"}


def test_repeatability_counts_the_gradings_with_the_expected_verdict(tmp_path, monkeypatch):
    from benchmarks import assessment

    outcomes = {"reference": iter(["pass", "fail", "pass"]), "baseline": iter(["timeout", "fail", "pass"]),
                "fixed-epochs": iter(["pass", "timeout", "pass"])}

    def graded(path, track, out_dir):
        verdict = next(outcomes[out_dir.name.rsplit("-", 1)[0]])
        return {"verdict": verdict, "wall_time_s": 40.0, "heldout_accuracy": 0.55,
                "time_to_accuracy_s": 38.0 if verdict == "pass" else None}
    monkeypatch.setattr(assessment.pipeline, "assess", graded)
    figure = assessment.repeatability(tmp_path, "cifar10-cpu", runs=3)
    assert [v["verdict"] for v in figure["verdicts"]["reference"]] == ["pass", "fail", "pass"]
    assert [v["verdict"] for v in figure["verdicts"]["baseline"]] == ["timeout", "fail", "pass"]
    assert figure["median"] == 4 / 6  # one reference failed, one baseline passed: neither repeats its verdict
    # The fixed-epoch conversion is reported beside the figure, not counted in it.
    assert [v["verdict"] for v in figure["verdicts"]["fixed-epochs"]] == ["pass", "timeout", "pass"]
    assert figure["time_to_accuracy_s"]["fixed-epochs"]["n"] == 2


def test_measured_programs_run_with_open_mpis_idle_threads_yielding_unless_the_caller_chose(monkeypatch):
    monkeypatch.delenv("OMPI_MCA_mpi_yield_when_idle", raising=False)
    assert processes.environment()["OMPI_MCA_mpi_yield_when_idle"] == "1"
    monkeypatch.setenv("OMPI_MCA_mpi_yield_when_idle", "0")
    assert processes.environment()["OMPI_MCA_mpi_yield_when_idle"] == "0"


@pytest.mark.slow
def test_mpi_ranks_started_by_the_benchmarks_see_the_yield_setting(tmp_path, monkeypatch):
    # P2 depends on it: a spinning MPI thread takes a core from the rank's TensorFlow.
    monkeypatch.delenv("OMPI_MCA_mpi_yield_when_idle", raising=False)
    script = tmp_path / "show_setting.py"
    script.write_text(f"import os\nimport {HOROVOD_BINDING} as hvd\nhvd.init()\n"
                      "print(f'rank {hvd.rank()} yield={os.environ.get(\"OMPI_MCA_mpi_yield_when_idle\")}')\n")
    finished = processes.run(processes.horovodrun(2, "mpi") + [str(script)], tmp_path / "log.txt", timeout_s=120)
    assert "rank 0 yield=1" in finished.output and "rank 1 yield=1" in finished.output, finished.output


@pytest.mark.slow
def test_a_failed_runs_message_shows_the_ranks_error_not_only_horovodruns_traceback(tmp_path):
    script = tmp_path / "failing_rank.py"
    script.write_text(f"import {HOROVOD_BINDING} as hvd\nhvd.init()\nif hvd.rank() == 1:\n"
                      "    raise ModuleNotFoundError('no module named scalelab.missing')\n")
    with pytest.raises(processes.BenchmarkError) as failure:
        processes.run(processes.horovodrun(2, "gloo") + [str(script)], tmp_path / "log.txt", timeout_s=120)
    message = str(failure.value)
    first_error = message.split("\n...\n")[0]
    assert first_error.endswith("ModuleNotFoundError: no module named scalelab.missing"), message
    assert "exited with" in message and (tmp_path / "log.txt").is_file()


def write_calibration_run(run_dir, verdict: str, wall_time_s: float, heldout: float, epochs: int) -> None:
    """A graded run as `scalelab calibrate` leaves it: verdict.json and rank 0's epoch lines."""
    from scalelab.progress import format_epoch

    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "verdict.json").write_text(json.dumps({
        "verdict": verdict, "wall_time_s": wall_time_s, "heldout_accuracy": heldout, "time_budget_s": 240,
        "target_accuracy": 0.5}))
    lines = ["training on 4153 images, validating on 0"] + [
        format_epoch(epoch, epochs, {"loss": 1.0, "accuracy": 0.4, "val_loss": 1.2, "val_accuracy": 0.1 * (epoch + 1),
                                     "elapsed_s": 20.0 * (epoch + 1)}) for epoch in range(epochs)]
    (run_dir / "logs" / "rank-0.log").write_text("\n".join(lines) + "\n")


def test_time_to_accuracy_reads_the_calibration_runs_epoch_lines_and_verdicts(tmp_path):
    for run_index in (1, 2):
        write_calibration_run(tmp_path / f"reference-{run_index}", "pass", 150.0 + run_index, 0.55, epochs=5)
    write_calibration_run(tmp_path / "baseline", "timeout", 250.0, 0.31, epochs=3)
    (tmp_path / "reference-3").mkdir()  # a run cut short leaves no verdict: left out
    calibration = time_to_accuracy.read_calibration(tmp_path)
    assert [run["run"] for run in calibration["references"]] == ["reference-1", "reference-2"]
    assert calibration["references"][0]["curve"] == [(20.0, 0.1), (40.0, 0.2), (60.0, 0.3), (80.0, 0.4), (100.0, 0.5)]
    assert calibration["baseline"]["verdict"] == "timeout" and len(calibration["baseline"]["curve"]) == 3
    assert calibration["reference_wall_time_s"]["median"] == 151.5


def test_time_to_accuracy_without_a_baseline_run_names_what_is_missing(tmp_path):
    write_calibration_run(tmp_path / "reference-1", "pass", 150.0, 0.55, epochs=2)
    with pytest.raises(FileNotFoundError, match="scalelab calibrate"):
        time_to_accuracy.read_calibration(tmp_path)


def test_quick_run_writes_report_json_markdown_and_plots_with_every_figure(tmp_path):
    out = tmp_path / "report"
    calibration = tmp_path / "calibration"
    write_calibration_run(calibration / "reference-1", "pass", 151.0, 0.55, epochs=5)
    write_calibration_run(calibration / "baseline", "timeout", 250.0, 0.31, epochs=3)
    finished = subprocess.run([sys.executable, "-m", "benchmarks.run", "--out", str(out), "--quick",
                               "--calibration", str(calibration)],
                              capture_output=True, text=True, timeout=240, cwd=PROJECT_ROOT,
                              env=subprocess_env(PYTHONPATH=str(PROJECT_ROOT / "source_code")))
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    document = json.loads((out / "report.json").read_text())
    assert set(document["figures"]) == {"P1", "P2", "P3", "P4", "P5", "P6", "P7", "P8", "P10"}
    for figure in document["figures"].values():
        assert {"min", "median", "max", "goal", "met", "what"} <= set(figure)
    # What --quick measures is real: positive ratios from real runs, min ≤ median ≤ max. The PyTorch edition
    # measures P6 through Horovod's PyTorch binding; the figures of the Keras course say why they are missing.
    keras_figures = ("P1", "P2", "P3", "P4", "P5", "P7", "P8")
    for measured in ("P1", "P6") if HAS_TENSORFLOW else ("P6",):
        figure = document["figures"][measured]
        assert figure["n"] >= 1 and 0 < figure["min"] <= figure["median"] <= figure["max"], figure
    assert document["figures"]["P6"]["memcpy_gb_per_s"]["median"] > 0
    for skipped in ("P2", "P3", "P4", "P5", "P7", "P8", "P10") if HAS_TENSORFLOW else ("P10",):
        assert document["figures"][skipped]["not_measured"] == "skipped in --quick"
    if not HAS_TENSORFLOW:
        for left_out in keras_figures:
            assert document["figures"][left_out]["not_measured"] == KERAS_LEFT_OUT
    for key in ("cpu_model", "cpu_count", "tensorflow" if HAS_TENSORFLOW else "torch", "horovod", "python"):
        assert document["environment"][key], key
    markdown = (out / "report.md").read_text()
    assert "| id | what | min | median | max | goal | met? |" in markdown
    for figure_id in document["figures"]:
        assert f"\n| {figure_id} |" in markdown
    assert set(document["plots"]) == ({"allreduce_bandwidth.png", "time_to_accuracy.png"}
                                      | ({"images_per_s_vs_batch.png"} if HAS_TENSORFLOW else set()))
    assert document["details"]["time_to_accuracy"]["baseline"]["verdict"] == "timeout"
    for plot in document["plots"]:
        assert (out / plot).read_bytes()[:8] == PNG_MAGIC
        assert f"]({plot})" in markdown


def test_a_stage_that_draws_nothing_runs_without_matplotlib(tmp_path):
    # A GPU machine lent with PyTorch and nothing else of the course measures P10 (containers/gpu-check.sh).
    out = tmp_path / "report"
    program = ("import sys; sys.modules['matplotlib'] = None; from benchmarks import run; "
               f"sys.exit(run.main(['--quick', '--only', 'training-torch', '--out', {str(out)!r}]))")
    finished = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                              cwd=PROJECT_ROOT, env=subprocess_env(PYTHONPATH=str(PROJECT_ROOT / "source_code"),
                                                                   SCALELAB_HOME=str(tmp_path / "home")))
    assert finished.returncode == 0, finished.stderr[-3000:]
    document = json.loads((out / "report.json").read_text())
    assert document["plots"] == [] and document["figures"]["P10"]["not_measured"] == "skipped in --quick"
    assert "time-to-accuracy plot not drawn" in " ".join(document["notes"])


def test_the_class_notebooks_benchmark_hands_in_the_sources_answers_without_the_solution_markers(tmp_path):
    from benchmarks import class_notebooks

    source = nbformat.read(PROJECT_ROOT / "labs" / "source" / "quiz" / "quiz.ipynb", as_version=4)
    release = nbformat.reads(nbformat.writes(source), as_version=4)
    answer_cells = [cell for cell in release.cells if cell.metadata.get("nbgrader", {}).get("solution")]
    assert len(answer_cells) == 8
    for cell in answer_cells:
        cell.source = "# YOUR CODE HERE\nraise NotImplementedError()"
    for folder, notebook in (("source", source), ("release", release)):
        (tmp_path / folder / "quiz").mkdir(parents=True)
        nbformat.write(notebook, tmp_path / folder / "quiz" / "quiz.ipynb")
    handed_in = class_notebooks.answered(tmp_path)
    answers = [cell.source for cell in handed_in.cells if cell.metadata.get("nbgrader", {}).get("solution")]
    assert [answer.split(" = ")[0] for answer in answers] == [f"ANSWER_Q{number}" for number in range(1, 9)], answers
    assert not any("SOLUTION" in answer or "NotImplementedError" in answer for answer in answers)
    others = [cell.source for cell in handed_in.cells if not cell.metadata.get("nbgrader", {}).get("solution")]
    assert others == [cell.source for cell in release.cells if not cell.metadata.get("nbgrader", {}).get("solution")]
