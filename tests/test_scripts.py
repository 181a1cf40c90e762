"""The course's training scripts: the serial baseline's output and errors, and the readable Horovod steps."""

from __future__ import annotations

import ast
import difflib
import json
import re
import subprocess
import sys

import pytest

from conftest import PROJECT_ROOT, subprocess_env

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
