"""The grader's GPU paths on a machine without a GPU (no GPU machine has been lent to the course's tests): the
PyTorch GPU track, the device nodes the grader finds, and what a graded job on every GPU is given in its sandbox
(its GPUs' device nodes, the grader's CUDA_VISIBLE_DEVICES, one torchrun process per GPU). Each DDP rank's device
and backend are tests/test_torch_models.py's."""

import dataclasses
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from scalelab.grader import launch, spec
from scalelab.grader import sandbox as sandbox_module


def test_the_pytorch_gpu_track_runs_one_ddp_rank_per_gpu_and_says_why_it_is_uncalibrated():
    track = spec.load_track("cifar10-ddp")
    assert (track.ranks, track.launcher, track.framework, track.model_file) == \
        (spec.ALL_GPUS, "torchrun", "pytorch", "model.pt2")
    with pytest.raises(spec.SpecError, match="no GPU"):
        track.resolve_ranks(0)
    assert [track.resolve_ranks(gpus) for gpus in (1, 8)] == [1, 8]
    assert track.calibration["status"] == "uncalibrated"
    assert "no GPU machine" in track.calibration["why"]
    assert "scalelab calibrate --track cifar10-ddp" in track.calibration_problems()[0]


def test_the_grader_finds_the_nvidia_device_nodes_and_nothing_else(tmp_path):
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "sda", "null", "dri"):
        (tmp_path / name).touch()
    (tmp_path / "nvidia-caps").mkdir()
    assert launch.gpu_device_paths(tmp_path) == [tmp_path / name for name in (
        "nvidia-caps", "nvidia-uvm", "nvidia-uvm-tools", "nvidia0", "nvidia1", "nvidiactl")]
    assert launch.gpu_device_paths(tmp_path / "none") == []


def stand_in_devices() -> tuple[Path, Path]:
    """Two character devices of this machine that bubblewrap's own /dev lacks: one stands in for /dev/nvidia0, the
    other for a device the job is not given."""
    found = [path for path in map(Path, ("/dev/kmsg", "/dev/fuse", "/dev/loop-control", "/dev/tty0", "/dev/autofs"))
             if path.exists() and stat.S_ISCHR(path.stat().st_mode)]
    if len(found) < 2:
        pytest.skip(f"this machine has {len(found)} character devices beyond bubblewrap's own /dev, 2 are needed")
    return found[0], found[1]


def test_a_job_on_every_gpu_gets_one_torchrun_process_per_gpu_the_gpus_devices_and_the_graders_gpu_choice(
        tmp_path, monkeypatch):
    problem = sandbox_module.sandbox_works()
    if problem:
        pytest.fail(problem)
    gpu, withheld = stand_in_devices()
    monkeypatch.setattr(launch, "gpu_device_paths", lambda dev=Path("/dev"): [gpu])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "all")
    submission = tmp_path / "assessment.py"
    submission.write_text("print('hello')\n")
    track = spec.load_track("cifar10-ddp")
    np = track.resolve_ranks(2)  # what the pipeline does with nvidia-smi's two GPUs
    job = launch.prepare_job(submission, tmp_path / "job", dataset="fashion-mnist", track_name=track.name, np=np,
                             launcher=track.launcher, launcher_options=(), time_budget_s=60, grace_s=5,
                             logs_dir=tmp_path / "logs", hidden_paths=[], model_file=track.model_file)
    try:
        command = job.command
        assert command[command.index("--nproc_per_node") + 1] == "2" and command[-1] == "assessment.py"
        assert Path(command[0]).name == "torchrun"
        assert job.device_paths == [gpu]
        assert (job.env["CUDA_VISIBLE_DEVICES"], job.env["NVIDIA_VISIBLE_DEVICES"]) == ("1,0", "all")

        probe = ("import os, stat, sys; print(os.environ.get('CUDA_VISIBLE_DEVICES')); "
                 "print(stat.S_ISCHR(os.stat(sys.argv[1]).st_mode)); print(os.path.exists(sys.argv[2])); "
                 "print(os.getuid())")
        inside = dataclasses.replace(job, command=[sys.executable, "-c", probe, str(gpu), str(withheld)])
        private = tmp_path / "private"
        private.mkdir()
        done = subprocess.run(launch.sandbox_argv(inside, private), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        visible, is_device, other_device, uid = done.stdout.split()
        # The GPUs the grader was given, their device node as a device, and no other device of the machine.
        assert (visible, is_device, other_device) == ("1,0", "True", "False")
        if os.geteuid() == 0:
            assert int(uid) == job.sandbox_uid != 0  # dropped to the job's own uid, the device still there
    finally:
        sandbox_module.release_uid(job.sandbox_uid)


def test_the_gpu_checks_tracks_join_the_course_file_and_run_on_one_gpu_per_rank_or_two_ranks_on_one(tmp_path):
    # containers/gpu-check.sh calibrates these on a lent GPU machine, in a copy of the course's file with them added:
    # a mistake here would only show there, in its few minutes.
    joined = tmp_path / "tracks.toml"
    joined.write_text((spec.DEFAULT_TRACKS_FILE.read_text() +
                       (spec.COURSE_ROOT / "containers" / "gpu-check-tracks.toml").read_text()))
    names = spec.load_tracks(joined)  # every track of both, checked; a name in both would not parse
    assert {"cifar10-ddp", "cifar10-ddp-subset-nccl", "cifar10-ddp-subset-shared"} <= set(names)
    nccl, shared = (spec.load_track(name, joined) for name in ("cifar10-ddp-subset-nccl", "cifar10-ddp-subset-shared"))
    course = spec.load_track("cifar10-ddp", joined)
    for track in (nccl, shared):
        assert (track.dataset, track.launcher, track.framework) == (course.dataset, course.launcher, course.framework)
        assert track.target_accuracy == spec.load_track("cifar10-ddp-cpu", joined).target_accuracy  # the subset's
    assert [nccl.resolve_ranks(gpus) for gpus in (1, 4)] == [1, 4]
    assert [shared.resolve_ranks(gpus) for gpus in (1, 4)] == [2, 2]
