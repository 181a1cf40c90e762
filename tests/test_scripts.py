"""The course's training scripts: the serial baseline's output and errors, and the readable Horovod steps."""

from __future__ import annotations

import ast
import csv
import difflib
import json
import re
import subprocess
import sys

import pytest

from conftest import PROJECT_ROOT, keras_only, subprocess_env

# The Keras edition's: skipped, with the reason, where `make setup` installed the PyTorch edition alone.
pytestmark = keras_only

SOURCE = PROJECT_ROOT / "source_code"
SERIAL_SCRIPT = SOURCE / "fashion_mnist.py"
# The conversion a student follows in lab 3: each file is the previous one plus one Horovod change.
CONVERSION = [
    SERIAL_SCRIPT,
    SOURCE / "horovod_steps" / "step1_init.py",
    SOURCE / "horovod_steps" / "step2_pin_device.py",
    SOURCE / "horovod_steps" / "step3_rank0_output.py",
    SOURCE / "horovod_steps" / "step4_distributed_optimizer.py",
    SOURCE / "horovod_steps" / "step5_broadcast.py",
    SOURCE / "horovod_steps" / "step6_partition_data.py",
    SOURCE / "horovod_steps" / "step7_metric_average.py",
    SOURCE / "fashion_mnist_horovod.py",
]
EPOCH_LINE = re.compile(r"^epoch (\d+)/(\d+)  loss \d+\.\d{4}  accuracy \d\.\d{4}  val_loss \d+\.\d{4}  "
                        r"val_accuracy \d\.\d{4}  lr [0-9.e-]+  img/s \d+  elapsed \d+\.\d s$")


def run_serial(*flags: str, timeout_s: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SERIAL_SCRIPT), *flags], capture_output=True, text=True,
                          timeout=timeout_s, env=subprocess_env(), cwd=PROJECT_ROOT)


def code_lines(path) -> list[str]:
    """The file without its module docstring (each step's docstring says what the step is about)."""
    text = path.read_text()
    docstring_end = ast.parse(text).body[0].end_lineno
    return text.splitlines()[docstring_end:]


def test_serial_script_prints_one_line_per_epoch_and_writes_a_checkpoint(tmp_path):
    result = run_serial("--epochs", "2", "--train-images", "1024", "--val-images", "512", "--seed", "0",
                        "--output-dir", str(tmp_path / "output"), "--weights-digest-dir", str(tmp_path / "weights"))
    assert result.returncode == 0, result.stderr[-3000:]
    epoch_lines = [line for line in result.stdout.splitlines() if line.startswith("epoch ")]
    assert [EPOCH_LINE.match(line).groups() for line in epoch_lines] == [("1", "2"), ("2", "2")], result.stdout
    assert "training on 1024 images, batch 128, 8 steps per epoch" in result.stdout
    assert re.search(r"^final val_accuracy \d\.\d{4}$", result.stdout, re.MULTILINE)
    assert (tmp_path / "output" / "checkpoint.keras").is_file()
    record = json.loads((tmp_path / "weights" / "weights_rank0.json").read_text())
    assert (record["rank"], record["size"], len(record["sha256"])) == (0, 1, 64)


@pytest.mark.parametrize("bad_flags", [
    ["--batch-size", "0"],
    ["--epochs", "two"],
    ["--no-such-flag"],
    ["--momentum", "1.5"],
    ["--train-images", "100", "--batch-size", "128"],
], ids=["zero-batch", "non-integer-epochs", "unknown-flag", "momentum-above-one", "batch-larger-than-data"])
def test_serial_script_rejects_bad_flags_with_exit_status_2(bad_flags):
    result = run_serial(*bad_flags, timeout_s=120)
    assert result.returncode == 2, (result.stdout, result.stderr[-2000:])
    assert "error:" in result.stderr
    assert "epoch 1/" not in result.stdout


def test_every_conversion_step_is_valid_python():
    for path in CONVERSION:
        compile(path.read_text(), str(path), "exec")


@pytest.mark.parametrize("step", range(1, len(CONVERSION)), ids=[p.stem for p in CONVERSION[1:]])
def test_each_conversion_step_adds_a_small_commented_horovod_change(step):
    previous, current = code_lines(CONVERSION[step - 1]), code_lines(CONVERSION[step])
    diff = list(difflib.unified_diff(previous, current, lineterm="", n=0))
    added = [line[1:] for line in diff if line.startswith("+") and not line.startswith("+++")]
    removed = [line[1:] for line in diff if line.startswith("-") and not line.startswith("---")]
    assert added, f"{CONVERSION[step].name} does not change the code of {CONVERSION[step - 1].name}"
    # Readable diffs: mostly additions, a few lines changed.
    assert len(removed) <= 8 and len(added) <= 20, "\n".join(diff)
    new_comments = [line for line in added if line.strip().startswith("# Horovod:")]
    assert new_comments, f"{CONVERSION[step].name} adds no '# Horovod: why' comment:\n" + "\n".join(diff)


def test_fully_converted_script_keeps_the_serial_flags_and_uses_every_horovod_piece():
    serial_flags = set(re.findall(r'add_argument\("(--[a-z-]+)"', SERIAL_SCRIPT.read_text()))
    converted = CONVERSION[-1].read_text()
    assert serial_flags <= set(re.findall(r'add_argument\("(--[a-z-]+)"', converted))
    for piece in ("hvd.init()", "hvd.local_rank()", "hvd.DistributedOptimizer(", "BroadcastGlobalVariablesCallback(0)",
                  "MetricAverageCallback()", "shard_arrays(", "scaled_learning_rate(", "if is_chief:"):
        assert piece in converted, piece


LADDER_SCRIPT = SOURCE / "cifar10_ladder.py"


def ladder_variants() -> dict[str, dict]:
    """The ladder's VARIANTS table, read from the script's source (running it would train)."""
    tree = ast.parse(LADDER_SCRIPT.read_text())
    table = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                 and getattr(node.targets[0], "id", None) == "VARIANTS")
    return {ast.literal_eval(key): {keyword.arg: ast.literal_eval(keyword.value) for keyword in value.keywords}
            for key, value in zip(table.keys, table.values)}


def run_ladder(*flags: str, timeout_s: int = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(LADDER_SCRIPT), *flags], capture_output=True, text=True,
                          timeout=timeout_s, env=subprocess_env(**env), cwd=PROJECT_ROOT)


def test_each_ladder_rung_changes_the_model_the_learning_rate_the_schedule_or_the_optimizer():
    variants = ladder_variants()
    assert list(variants)[:5] == ["base", "batch_norm", "scaled_lr", "warmup", "lamb"]
    names = list(variants)
    for before, after in zip(names, names[1:]):
        changed = {key for key in variants[after] if variants[after][key] != variants[before][key]}
        assert changed, f"{after} is the same run as {before}"
    assert variants["base"] == dict(batch_norm=False, scaling="none", warmup=False, optimizer="sgd")
    assert variants["lamb"]["optimizer"] == "lamb" and variants["warmup"]["warmup"]


@pytest.mark.parametrize("variant, expected", [
    ("base", "batch norm off, SGD peak lr 0.02 (none scaling, k = 2)"),
    ("lamb", "batch norm on, LAMB peak lr 0.002828 (sqrt scaling, k = 2), warmup 2 epochs"),
])
def test_ladder_rung_trains_on_cifar10_and_logs_one_csv_row_per_epoch(variant, expected, cifar10_dir, tmp_path):
    log = tmp_path / f"{variant}.csv"
    result = run_ladder("--variant", variant, "--epochs", "2", "--batch-size", "128", "--train-images", "512",
                        "--val-images", "256", "--seed", "0", "--csv", str(log), SCALELAB_CIFAR10_DIR=str(cifar10_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"variant {variant}: {expected}" in result.stdout
    assert len([line for line in result.stdout.splitlines() if EPOCH_LINE.match(line)]) == 2, result.stdout
    rows = log.read_text().splitlines()
    assert rows[0].startswith("run,epoch,elapsed_s,") and len(rows) == 3
    assert all(row.startswith(f"{variant},") for row in rows[1:])


def test_ladder_rejects_an_unknown_variant_with_exit_status_2():
    result = run_ladder("--variant", "fastest", timeout_s=120)
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_ladder_without_cifar10_exits_3_saying_how_to_stage_it(tmp_path):
    # An empty data folder and cache; the proxy (a closed local port) makes the download fail at once, offline.
    unreachable = "http://127.0.0.1:9"
    result = run_ladder("--variant", "base", timeout_s=120, SCALELAB_CIFAR10_DIR=str(tmp_path),
                        KERAS_HOME=str(tmp_path / "keras"), HTTPS_PROXY=unreachable, HTTP_PROXY=unreachable)
    assert result.returncode == 3, (result.stdout, result.stderr[-2000:])
    assert "SCALELAB_CIFAR10_DIR" in result.stderr and "cifar-10-python.tar.gz" in result.stderr


def test_ladder_measures_held_out_accuracy_every_n_steps_and_at_epoch_ends(cifar10_dir, tmp_path):
    log = tmp_path / "warmup_b64.csv"
    # 256 images at batch 64: 4 steps per epoch, so every 3 steps plus each epoch's end is steps 3, 4, 6, 8.
    result = run_ladder("--variant", "warmup", "--epochs", "2", "--batch-size", "64", "--train-images", "256",
                        "--val-images", "101", "--seed", "0", "--eval-every-steps", "3", "--csv", str(log),
                        SCALELAB_CIFAR10_DIR=str(cifar10_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "held-out accuracy every 3 steps" in result.stdout
    assert len([line for line in result.stdout.splitlines() if EPOCH_LINE.match(line)]) == 2, result.stdout
    with log.open() as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0])[:4] == ["run", "steps", "images", "epoch"]
    assert [int(row["steps"]) for row in rows] == [3, 4, 6, 8]
    assert [int(row["images"]) for row in rows] == [192, 256, 384, 512]
    assert [float(row["epoch"]) for row in rows] == [0.75, 1.0, 1.5, 2.0]
    elapsed = [float(row["elapsed_s"]) for row in rows]
    assert elapsed == sorted(elapsed) and all(0 < float(row["eval_s"]) < float(row["elapsed_s"]) for row in rows)
    # 101 held-out images: every accuracy is a whole number of them.
    assert all(abs(float(row["val_accuracy"]) * 101 - round(float(row["val_accuracy"]) * 101)) < 1e-6 for row in rows)
    final = re.search(r"^final val_accuracy (\d\.\d{4})$", result.stdout, re.MULTILINE)
    assert final and float(final.group(1)) == round(float(rows[-1]["val_accuracy"]), 4)


def test_ladder_stops_at_the_first_held_out_measurement_at_the_target(cifar10_dir, tmp_path):
    log = tmp_path / "warmup_b64.csv"
    # Any model gets one of 101 images right: the first measurement (step 3 of 8) is at the target already.
    result = run_ladder("--variant", "warmup", "--epochs", "2", "--batch-size", "64", "--train-images", "256",
                        "--val-images", "101", "--seed", "0", "--eval-every-steps", "3", "--stop-at-accuracy", "0.009",
                        "--csv", str(log), SCALELAB_CIFAR10_DIR=str(cifar10_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^val_accuracy \d\.\d{4} ≥ 0\.009 after 3 steps: stopping$", result.stdout, re.MULTILINE)
    with log.open() as handle:
        assert [row["steps"] for row in csv.DictReader(handle)] == ["3"]
    assert "epoch 2/2" not in result.stdout


@pytest.mark.parametrize("schedule, final_lr", [("step", 0.0004), ("constant", 0.04)])
def test_ladder_schedule_drops_the_rate_at_fixed_epochs_or_holds_it(schedule, final_lr, cifar10_dir, tmp_path):
    log = tmp_path / f"{schedule}.csv"
    # scaled_lr at batch 128 (k = 2, peak 0.04, no warmup), 4 epochs: the step schedule drops at epochs 2 and 3.
    result = run_ladder("--variant", "scaled_lr", "--epochs", "4", "--batch-size", "128", "--train-images", "256",
                        "--val-images", "128", "--seed", "0", "--schedule", schedule, "--csv", str(log),
                        SCALELAB_CIFAR10_DIR=str(cifar10_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    expected = "×0.1 at epochs 2 and 3" if schedule == "step" else "then constant"
    assert f"warmup 0 epochs, {expected}, global batch 128" in result.stdout, result.stdout
    with log.open() as handle:
        rates = [float(row["lr"]) for row in csv.DictReader(handle)]
    # The rate of each epoch's last step: the step schedule's drops show in epochs 3 and 4.
    expected_rates = [0.04, 0.04, 0.004, 0.0004] if schedule == "step" else [0.04] * 4
    assert rates == pytest.approx(expected_rates, rel=1e-5) and rates[-1] == pytest.approx(final_lr, rel=1e-5)


@pytest.mark.parametrize("bad_flags, message", [
    (["--eval-every-steps", "0", "--csv", "LOG"], "--eval-every-steps must be at least 1"),
    (["--eval-every-steps", "5"], "--eval-every-steps writes its measurements to the --csv file"),
    (["--schedule", "cosine"], "invalid choice: 'cosine'"),
    (["--stop-at-accuracy", "0.5", "--csv", "LOG"], "--stop-at-accuracy needs --eval-every-steps"),
    (["--stop-at-accuracy", "1.5", "--eval-every-steps", "5", "--csv", "LOG"], "and a value in (0, 1]"),
    (["--eval-every-steps", "9", "--csv", "LOG", "--epochs", "2", "--batch-size", "64", "--train-images", "256"],
     "--eval-every-steps 9 is more than the run's 8 steps (2 epochs of 4)"),
], ids=["zero-steps", "no-csv", "unknown-schedule", "stop-without-measurements", "stop-above-one", "beyond-the-run"])
def test_ladder_rejects_bad_measurement_and_schedule_flags_with_exit_status_2(bad_flags, message, cifar10_dir,
                                                                               tmp_path):
    log = tmp_path / "run.csv"
    flags = [str(log) if flag == "LOG" else flag for flag in bad_flags]
    result = run_ladder("--variant", "warmup", *flags, timeout_s=120, SCALELAB_CIFAR10_DIR=str(cifar10_dir))
    assert result.returncode == 2, (result.stdout, result.stderr[-2000:])
    assert message in result.stderr, result.stderr[-2000:]
    assert "epoch 1/" not in result.stdout and not log.exists()
