"""Tracks: the course's track file loads, and bad track files or names get clear errors."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import keras_only, subprocess_env
from scalelab.grader import grading, spec

TEST_TRACKS = Path(__file__).parent / "submissions" / "tracks.toml"


def test_course_track_file_has_the_gpu_cpu_and_fashion_mnist_tracks():
    tracks = spec.load_tracks()
    assert {"cifar10", "cifar10-cpu", "fashion-mnist-cpu"} <= set(tracks)
    assert tracks["cifar10"].ranks == spec.ALL_GPUS and tracks["cifar10"].dataset == "cifar10"
    assert tracks["cifar10-cpu"].ranks == 2 and tracks["fashion-mnist-cpu"].dataset == "fashion-mnist"
    for track in tracks.values():
        assert 0 < track.target_accuracy <= 1 and track.time_budget_s > 0


def test_cpu_tracks_are_calibrated_by_their_recorded_figures():
    # "Calibrated": the reference reached the target in every recorded run with at least 20% of the budget to
    # spare (its time to accuracy on the grader's clock); the unmodified serial assessment did not pass.
    tracks = spec.load_tracks()
    for name in ("cifar10-cpu", "fashion-mnist-cpu"):
        track, calibration = tracks[name], tracks[name].calibration
        assert calibration["reference_runs"] >= 5, name
        assert calibration["reference_verdicts"] == ["pass"] * calibration["reference_runs"], name
        assert len(calibration["reference_time_to_accuracy_s"]) == calibration["reference_runs"], name
        assert max(calibration["reference_time_to_accuracy_s"]) <= 0.8 * track.time_budget_s, name
        assert min(calibration["reference_heldout_accuracy"]) >= track.target_accuracy, name
        assert calibration["baseline_verdict"] in ("fail", "timeout"), name


@keras_only
def test_default_track_is_cifar10_cpu_unless_scalelab_track_says_otherwise(monkeypatch):
    monkeypatch.delenv("SCALELAB_TRACK", raising=False)
    assert spec.load_track().name == "cifar10-cpu"
    monkeypatch.setenv("SCALELAB_TRACK", "fashion-mnist-cpu")
    assert spec.load_track().name == "fashion-mnist-cpu"


def test_the_pytorch_edition_grades_the_ddp_track_by_default_and_refuses_a_keras_track_with_the_reason(monkeypatch):
    from scalelab import environment

    monkeypatch.delenv("SCALELAB_TRACK", raising=False)
    monkeypatch.setattr(environment, "tensorflow_version", lambda: None)  # `make setup` on Python 3.13
    assert spec.load_track().name == "cifar10-ddp-cpu"
    assert spec.load_track("cifar10-horovod-torch-cpu").framework == "pytorch"
    with pytest.raises(spec.SpecError) as refused:
        spec.load_track("cifar10-cpu")
    assert str(refused.value).startswith(f"track 'cifar10-cpu' grades a Keras model: {environment.KERAS_LEFT_OUT}; "
                                         "the PyTorch tracks: cifar10-ddp, cifar10-ddp-cpu, cifar10-horovod-torch-cpu")


def test_unknown_track_error_lists_the_known_ones():
    with pytest.raises(spec.SpecError, match=r"unknown track 'nope'; known tracks: .*cifar10-cpu"):
        spec.load_track("nope")


@keras_only
def test_all_gpus_track_on_a_machine_without_gpus_says_so():
    with pytest.raises(spec.SpecError, match="no GPU"):
        spec.load_track("cifar10").resolve_ranks(0)
    assert spec.load_track("cifar10").resolve_ranks(4) == 4


@pytest.mark.parametrize("body, message", [
    ("[tracks.x]\ndataset = 'mnist'\nranks = 2\ntarget_accuracy = 0.5\ntime_budget_s = 10\n", "dataset 'mnist'"),
    ("[tracks.x]\ndataset = 'cifar10'\nranks = 0\ntarget_accuracy = 0.5\ntime_budget_s = 10\n", "ranks must be"),
    ("[tracks.x]\ndataset = 'cifar10'\nranks = 2\ntime_budget_s = 10\n", "lacks target_accuracy"),
    ("[tracks.x]\ndataset = 'cifar10'\nranks = 2\ntarget_accuracy = 0.5\ntime_budget_s = 10\nbudget = 3\n",
     "unknown keys"),
    ("[tracks.x\n", "not readable TOML"),
    ("[tracks.x]\ndataset = 'cifar10'\nranks = 2\ntarget_accuracy = 0.5\ntime_budget_s = 10\nmemory_limit_gib = 0\n",
     "memory_limit_gib must be positive"),
])
def test_bad_track_files_are_refused_with_the_problem_named(tmp_path, body, message):
    track_file = tmp_path / "tracks.toml"
    track_file.write_text(body)
    with pytest.raises(spec.SpecError, match=message):
        spec.load_tracks(track_file)


def test_test_tracks_load_with_their_launchers_and_a_short_hang_budget():
    tracks = spec.load_tracks(TEST_TRACKS)
    assert tracks["fashion-mnist-test"].launcher == "gloo"
    assert tracks["fashion-mnist-test-mpi"].launcher == "mpi"
    # The hang test waits for the whole budget: its track must be the short one.
    assert tracks["fashion-mnist-hang"].time_budget_s < tracks["fashion-mnist-test"].time_budget_s / 4
    assert tracks["fashion-mnist-small-memory"].memory_limit_gib == 1.0
    assert tracks["fashion-mnist-test"].memory_limit_gib == 8.0  # the default


# ---------------------------------------------------------------------------------------------------------------
# Calibration: the recorded figures against the rule, and the tools that produce them
# ---------------------------------------------------------------------------------------------------------------

def test_every_calibrated_track_meets_the_rule_and_an_uncalibrated_one_says_so():
    tracks = spec.load_tracks(spec.DEFAULT_TRACKS_FILE)
    for track in tracks.values():
        problems = track.calibration_problems()
        if track.calibration.get("status") == "uncalibrated":
            assert problems and "is not calibrated" in problems[0] and "scalelab calibrate" in problems[0]
        else:
            assert problems == [], (track.name, problems)
            assert track.calibration["reference_runs"] == len(track.calibration["reference_wall_time_s"]) >= 5
    assert tracks["cifar10-cpu"].calibration.get("status") != "uncalibrated"
    assert tracks["fashion-mnist-cpu"].calibration.get("status") != "uncalibrated"


def calibrated(**figures) -> spec.Track:
    base = dict(reference_runs=5, reference_verdicts=["pass"] * 5,
                reference_time_to_accuracy_s=[42.0, 44.0, 45.0, 46.0, 47.0],
                reference_heldout_accuracy=[0.51, 0.52, 0.5, 0.53, 0.51], baseline_verdict="timeout",
                cpu_model="Some CPU", cpus=2, gpus=[])
    return spec.Track(name="t", dataset="cifar10", ranks=2, target_accuracy=0.5, time_budget_s=60,
                      calibration={**base, **figures})


def test_the_calibration_rule_names_each_way_a_track_misses_it():
    assert calibrated().calibration_problems() == []
    assert "reached the target after 30.0 s, outside 36-48 s" in \
        calibrated(reference_time_to_accuracy_s=[30.0, 44, 45, 46, 47]).calibration_problems()[0]
    assert "outside" in calibrated(reference_time_to_accuracy_s=[42.0, 44, 45, 46, 49]).calibration_problems()[0]
    assert "reference run 2 ended timeout, without reaching the target" in calibrated(
        reference_verdicts=["pass", "timeout", "pass", "pass", "pass"]).calibration_problems()[0]
    assert "not a fail or timeout" in calibrated(baseline_verdict="pass").calibration_problems()[0]
    assert "5 needed" in calibrated(reference_time_to_accuracy_s=[44.0, 45.0], reference_heldout_accuracy=[0.6, 0.6]) \
        .calibration_problems()[0]


def test_a_table_recorded_before_the_referee_is_judged_by_its_wall_times_and_margin():
    old = calibrated(reference_wall_time_s=[42.0, 44.0, 45.0, 46.0, 47.0])
    del old.calibration["reference_time_to_accuracy_s"], old.calibration["reference_verdicts"]
    assert "less than 0.03 over the target" in old.calibration_problems()[0]
    old.calibration["reference_heldout_accuracy"] = [0.55, 0.57, 0.58, 0.6, 0.61]
    assert old.calibration_problems() == []


@pytest.mark.parametrize("times", [[40.0, 41.5, 42.3, 43.0, 44.9], [30.0, 33.0, 38.0], [100.0, 101.0]])
def test_suggested_budget_puts_every_reference_run_at_60_to_80_percent(times):
    budget = grading.suggest(times)
    assert budget % 5 == 0
    assert all(0.6 * budget <= t <= 0.8 * budget for t in times), (budget, times)


def test_too_wide_a_spread_keeps_the_slowest_run_inside_the_budget():
    budget = grading.suggest([20.0, 60.0])
    assert budget == 75 and 60.0 <= 0.8 * budget


def test_recording_sets_the_budget_and_target_and_the_figures_and_keeps_the_rest(tmp_path):
    track_file = tmp_path / "tracks.toml"
    shutil.copyfile(spec.DEFAULT_TRACKS_FILE, track_file)
    before = spec.load_tracks(track_file)
    machine = {"cpu_model": "Test CPU", "cpus": 2, "gpus": []}
    references = [{"verdict": "pass", "time_to_accuracy_s": seconds, "wall_time_s": seconds + 2,
                   "heldout_accuracy": 0.53} for seconds in (44.0, 45.0, 46.0, 47.0, 48.0)]
    table = grading.calibration_table(before["cifar10-cpu"], machine, references, {
        "verdict": "timeout", "wall_time_s": 70.2, "heldout_accuracy": 0.42}, "2026-11-25")
    grading.record_settings(track_file, "cifar10-cpu", 65, 0.52)
    grading.record_calibration(track_file, "cifar10-cpu", table)
    after = spec.load_tracks(track_file)
    assert (after["cifar10-cpu"].time_budget_s, after["cifar10-cpu"].target_accuracy) == (65, 0.52)
    assert after["cifar10-cpu"].calibration["cpu_model"] == "Test CPU"
    assert after["cifar10-cpu"].calibration_problems() == []
    assert after["fashion-mnist-cpu"] == before["fashion-mnist-cpu"] and after["cifar10"] == before["cifar10"]


@keras_only
def test_doctor_warns_when_a_track_was_calibrated_on_another_kind_of_machine(tmp_path):
    track_file = tmp_path / "tracks.toml"
    shutil.copyfile(spec.DEFAULT_TRACKS_FILE, track_file)
    here = grading.machine_facts()
    assert grading.machine_differences(calibrated(cpu_model=here["cpu_model"], cpus=here["cpus"],
                                                  gpus=here["gpus"]), here) == []
    grading.record_calibration(track_file, "fashion-mnist-cpu", grading.calibration_table(
        spec.load_track("fashion-mnist-cpu", track_file), {"cpu_model": "A Faster CPU", "cpus": 64, "gpus": []},
        [{"verdict": "pass", "time_to_accuracy_s": 44.0, "heldout_accuracy": 0.88}] * 5, {"verdict": "timeout"},
        "2026-11-25"))
    done = subprocess.run([sys.executable, "-m", "scalelab.cli", "doctor"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "SCALELAB_TRACKS": str(track_file)})
    warnings = [line for line in done.stdout.splitlines() if line.startswith("warning:")]
    assert any("track fashion-mnist-cpu was calibrated on another machine" in w and "A Faster CPU" in w
               and f"{here['cpus']} cores, calibrated with 64" in w and "scalelab calibrate" in w for w in warnings)
    assert not any("track cifar10 " in w for w in warnings)  # uncalibrated: nothing to compare


@keras_only
def test_the_track_file_is_read_without_tomllib_as_on_python_3_10():
    # Python 3.10 (Ubuntu 22.04's) has no tomllib: the grader falls back to the tomli package (pinned for < 3.11).
    # Here tomllib is made unimportable and tomli stands in for it, as it would there.
    program = """
import sys, tomllib, types
stand_in = types.ModuleType("tomli")
stand_in.load, stand_in.loads, stand_in.TOMLDecodeError = tomllib.load, tomllib.loads, tomllib.TOMLDecodeError
sys.modules["tomli"], sys.modules["tomllib"] = stand_in, None
from scalelab.grader import commands, spec
track = spec.load_track("cifar10-cpu")
print(spec.tomllib.__name__, commands.tomllib.__name__, track.ranks, track.time_budget_s)
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                          env=subprocess_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:3] == ["tomli", "tomli", "2"], done.stdout


def test_a_torchrun_track_is_a_pytorch_track_and_names_its_model_file(tmp_path):
    tracks = spec.load_tracks(spec.DEFAULT_TRACKS_FILE)
    ddp = tracks["cifar10-ddp-cpu"]
    assert (ddp.launcher, ddp.framework, ddp.model_file, ddp.horovod) == ("torchrun", "pytorch", "model.pt2", False)
    horovod_torch = tracks["cifar10-horovod-torch-cpu"]
    assert (horovod_torch.launcher, horovod_torch.model_file, horovod_torch.horovod) == ("gloo", "model.pt2", True)
    keras = tracks["cifar10-cpu"]
    assert (keras.framework, keras.model_file, keras.horovod) == ("keras", "model.keras", True)
    base = "[tracks.x]\ndataset = 'cifar10'\nranks = 2\ntarget_accuracy = 0.5\ntime_budget_s = 10\n"
    for body, message in ((base + "launcher = 'torchrun'\n", "torchrun launches PyTorch runs only"),
                          (base + "framework = 'jax'\n", "has framework 'jax'; known: keras, pytorch")):
        (tmp_path / "tracks.toml").write_text(body)
        with pytest.raises(spec.SpecError, match=message):
            spec.load_tracks(tmp_path / "tracks.toml")
    # Horovod for PyTorch: horovodrun with a PyTorch model file.
    (tmp_path / "tracks.toml").write_text(base + "launcher = 'gloo'\nframework = 'pytorch'\n")
    horovod_torch = spec.load_tracks(tmp_path / "tracks.toml")["x"]
    assert (horovod_torch.model_file, horovod_torch.horovod) == ("model.pt2", True)
