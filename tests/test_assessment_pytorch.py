"""The PyTorch edition's serial assessment script: the run contract of the Keras one (no arguments needed, the data
the grader names, one line per epoch, the model saved each epoch where the grader looks), with a model the grader can
measure without the student's code."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import PROJECT_ROOT, subprocess_env
from scalelab.data import load

SCRIPT = PROJECT_ROOT / "assessment" / "assessment_pytorch.py"
SOLUTION = PROJECT_ROOT / "assessment" / "solution" / "assessment_pytorch.py"
EPOCH_LINE = re.compile(r"^epoch (\d+)/(\d+)  loss [\d.]+  accuracy ([\d.]+)  val_loss [\d.]+  val_accuracy ([\d.]+)  "
                        r"lr 0\.02  img/s \d+  elapsed [\d.]+ s$")
# The grader's way to score a saved model: torch.export.load in an interpreter that has never seen the course.
HELD_OUT_SCORE = """
import json, sys
import numpy as np, torch
model = torch.export.load(sys.argv[1]).module()
held_out = np.load(sys.argv[2])
with torch.no_grad():
    predicted = model(torch.from_numpy(held_out["images"])).argmax(dim=1).numpy()
print(json.dumps({"accuracy": float(np.mean(predicted == held_out["labels"])), "images": len(predicted),
                  "scalelab_imported": "scalelab" in sys.modules}))
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run(*flags: str, env: dict, timeout_s: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=timeout_s,
                          env=subprocess_env(**env), cwd=PROJECT_ROOT)


@pytest.mark.slow
def test_the_serial_script_trains_prints_each_epoch_and_saves_a_model_scored_without_the_course(cifar10_dir, tmp_path,
                                                                                               monkeypatch):
    output_dir = tmp_path / "output"
    result = run("--epochs", "2", "--lr", "0.02", "--momentum", "0.9", env={"SCALELAB_CIFAR10_DIR": str(cifar10_dir),
                                                        "SCALELAB_OUTPUT_DIR": str(output_dir)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^training on \d+ images, validating on \d+, batch 32$", result.stdout, re.MULTILINE)
    epochs = [EPOCH_LINE.match(line) for line in result.stdout.splitlines() if line.startswith("epoch ")]
    assert [(match.group(1), match.group(2)) for match in epochs] == [("1", "2"), ("2", "2")], result.stdout
    assert sorted(path.name for path in output_dir.iterdir()) == ["model.pt2"]
    monkeypatch.setenv("SCALELAB_CIFAR10_DIR", str(cifar10_dir))
    images, labels = load("cifar10", "test", download=False)
    np.savez(tmp_path / "held_out.npz", images=images, labels=labels)
    score = tmp_path / "score.py"
    score.write_text(HELD_OUT_SCORE)
    scored = subprocess.run([sys.executable, "-I", str(score), str(output_dir / "model.pt2"),
                             str(tmp_path / "held_out.npz")], capture_output=True, text=True, timeout=120,
                            env=subprocess_env(), cwd=tmp_path)
    assert scored.returncode == 0, scored.stderr[-3000:]
    held_out = json.loads(scored.stdout.strip().splitlines()[-1])
    assert held_out["scalelab_imported"] is False
    # Two epochs with momentum on the subset learn something (chance is 0.10) and agree with validation roughly.
    assert held_out["images"] > 500 and held_out["accuracy"] > 0.15
    assert abs(held_out["accuracy"] - float(epochs[-1].group(4))) < 0.15


@pytest.mark.parametrize("flags", [["--batch-size", "0"], ["--epochs", "two"], ["--val-fraction", "1"],
                                   ["--no-such-flag"]])
def test_bad_flags_exit_with_status_2(flags, tmp_path):
    result = run(*flags, env={"SCALELAB_OUTPUT_DIR": str(tmp_path)}, timeout_s=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "error:" in result.stderr and not any(tmp_path.iterdir())


def test_missing_data_exits_with_status_3_and_says_where_it_looked(tmp_path):
    result = run(env={"SCALELAB_CIFAR10_DIR": str(tmp_path / "nowhere"), "SCALELAB_OUTPUT_DIR": str(tmp_path / "out"),
                      "SCALELAB_DATASET": "cifar10"}, timeout_s=120)
    assert result.returncode == 3, result.stderr[-2000:]
    assert "error:" in result.stderr and str(tmp_path / "nowhere") in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_ddp_solution_trains_on_two_ranks_under_torchrun_and_only_rank_0_speaks_and_saves(cifar10_dir, tmp_path):
    output_dir = tmp_path / "output"
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    result = subprocess.run([torchrun, "--nproc_per_node", "2", "--master_port", str(free_port()), str(SOLUTION),
                             "--epochs", "2"], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                            env=subprocess_env(SCALELAB_CIFAR10_DIR=str(cifar10_dir),
                                               SCALELAB_OUTPUT_DIR=str(output_dir)))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"^training on \d+ images, validating on \d+, batch 64 per rank on 2 ranks$", result.stdout,
                     re.MULTILINE), result.stdout
    epoch_lines = [line for line in result.stdout.splitlines() if line.startswith("epoch ")]
    assert [line.split()[1] for line in epoch_lines] == ["1/2", "2/2"], result.stdout  # rank 0 alone prints
    # The warmup reaches the rate scaled for 2 ranks (2 x 0.025) and holds it until the decay epoch (6).
    assert all("  lr 0.05  " in line for line in epoch_lines), epoch_lines
    assert sorted(path.name for path in output_dir.iterdir()) == ["model.pt2"]
    assert float(epoch_lines[-1].split("val_accuracy ")[1].split()[0]) > 0.2
