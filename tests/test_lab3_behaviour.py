"""Lab 3's conversion judged by what it does: a probed two-rank run of each conversion, and each step's question.

Every conversion below is the instructor's (`source_code/fashion_mnist_horovod.py`) with edits. The right ones,
spelled unusually, must pass every step. Each wrong one carries mistakes that different steps must catch: the
steps that reject it must be exactly the expected ones, each with a message that names the mistake, and every
other step must pass (a question that blames the wrong step fails here too)."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest

from conftest import PROJECT_ROOT, keras_only
from labtools import runs_leftovers
from scalelab.grader.labchecks import conversion_questions, conversion_run

# The Keras edition's: skipped, with the reason, where `make setup` installed the PyTorch edition alone.
pytestmark = keras_only

SOLUTION = PROJECT_ROOT / "source_code" / "fashion_mnist_horovod.py"
# A hang is stopped sooner here than in the notebook (45 s): the ranks report something new every few seconds.
STALL_S = 15

INIT = "hvd.init()\n"
BUILD_MODEL = "model = small_cnn(input_shape=(28, 28, 1), num_classes=10, weight_decay=args.wd)\n"
PIN = "pin_gpu(hvd.local_rank())\n"
SEED = "if args.seed is not None:\n"
BROADCAST = "    hvd.callbacks.BroadcastGlobalVariablesCallback(0),\n"
METRIC_AVERAGE = "    hvd.callbacks.MetricAverageCallback(),\n"
WRAP = "optimizer = hvd.DistributedOptimizer(optimizer, groups=1)\n"
SCALE_LR = "peak_lr = scaled_learning_rate(args.base_lr, hvd.size())\n"
STEPS = "steps_per_epoch = len(train_images) // (args.batch_size * hvd.size())\n"
SHARD = "    train_images, train_labels = shard_arrays(train_images, train_labels, hvd.rank(), hvd.size())\n"
BATCH = ".shuffle(len(train_images)).repeat().batch(args.batch_size)"
EPOCH_PRINTER = "EpochPrinter(args.epochs, is_chief=is_chief)"
CHECKPOINT_GUARD = "if is_chief:\n    # Horovod: only rank 0 writes checkpoints"
TRAINING_PRINT = "if is_chief:\n    print(f\"training on"
FINAL_PRINT = "if is_chief:\n    print(f\"final val_accuracy"
FIT = "history = model.fit(train_data, steps_per_epoch=steps_per_epoch, epochs=args.epochs, validation_data=val_data,"
CALLBACKS_START = "callbacks = [\n"
CALLBACKS_END = "    EpochPrinter(args.epochs, is_chief=is_chief),\n]\n"


# The steps whose question needs every rank to have reached fit (a run that ends earlier cannot answer them).
STEPS_NEEDING_FIT = ("rank0_output", "scaled_lr", "distributed_optimizer", "broadcast", "steps_per_epoch",
                     "metric_average", "rank0_checkpoint", "pin_device")


class Conversion(NamedTuple):
    edits: tuple                   # (old, new) replacements in the instructor's conversion, each old text once
    rejected_by: dict              # step -> a fragment of its message; every other step must pass


RIGHT = {
    "constants, the optimizer and callbacks built by helper functions, a broadcast by hand": Conversion((
        ("import hashlib\n", "import hashlib\nROOT_RANK = 0\n"),
        (CALLBACKS_START, "def make_callbacks(chief):\n    return [\n"),
        (CALLBACKS_END, "    EpochPrinter(args.epochs, is_chief=chief),\n]\ncallbacks = make_callbacks(is_chief)\n"),
        (WRAP, "def distributed(plain):\n    return hvd.DistributedOptimizer(plain, groups=1)\n"
               "optimizer = distributed(optimizer)\n"),
        # Every rank copies rank 0's initial weights before training instead of at the end of the first batch.
        (BROADCAST, ""),
        ("model.compile(", "import horovod.tensorflow as hvd_tf\nhvd_tf.broadcast_variables(model.variables, "
                           "root_rank=ROOT_RANK)\nmodel.compile("),
    ), {}),
}

WRONG = {
    "gradients summed with the rate scaled, a printer on every rank, checkpoints on every local rank 0": Conversion((
        (WRAP, "optimizer = hvd.DistributedOptimizer(optimizer, groups=1, op=hvd.Sum)\n"),
        (EPOCH_PRINTER, "EpochPrinter(args.epochs)"),
        (CHECKPOINT_GUARD, "if hvd.local_rank() == 0:\n    # Horovod: only rank 0 writes checkpoints"),
    ), {"distributed_optimizer": "sums the gradients (op=hvd.Sum)", "scaled_lr": "(op=hvd.Sum)",
        "rank0_output": "rank 1 printed", "rank0_checkpoint": "rank 1 writes checkpoints too"}),
    "the rate scaled twice, the GPU by the global rank, metrics averaged after EarlyStopping": Conversion((
        (SCALE_LR, "peak_lr = scaled_learning_rate(args.base_lr, hvd.size()) * hvd.size()\n"),
        (PIN, "pin_gpu(hvd.rank())\n"),
        (METRIC_AVERAGE, "    tf.keras.callbacks.EarlyStopping(monitor=\"val_accuracy\", patience=args.patience),\n"
                         + METRIC_AVERAGE),
    ), {"scaled_lr": "multiplied by hvd.size() twice", "pin_device": "rank 1 pinned GPU 1",
        "metric_average": "EarlyStopping comes before MetricAverageCallback"}),
    "batches of batch // size with steps from the global batch, no metric averaging, no broadcast": Conversion((
        (BATCH, ".shuffle(len(train_images)).repeat().batch(args.batch_size // hvd.size())"),
        (STEPS, "steps_per_epoch = len(train_images) // args.batch_size\n"),
        (METRIC_AVERAGE, ""),
        (BROADCAST, ""),
    ), {"steps_per_epoch": "batches hold 16 images", "metric_average": "does not average the metrics",
        "broadcast": "after the first step the ranks hold different weights", "two_ranks": "different weights"}),
    "the rate not scaled, a broadcast from rank 1, checkpoints on every rank, metrics averaged last": Conversion((
        (SCALE_LR, "peak_lr = args.base_lr\n"),
        (BROADCAST, BROADCAST.replace("(0)", "(1)")),
        (CHECKPOINT_GUARD, "if True:\n    # Horovod: only rank 0 writes checkpoints"),
        (METRIC_AVERAGE, ""),
        (TRAINING_PRINT, "callbacks.append(hvd.callbacks.MetricAverageCallback())\n" + TRAINING_PRINT),
    ), {"scaled_lr": "the same as --base-lr on one rank", "broadcast": "broadcast from rank 1",
        "rank0_checkpoint": "rank 1 writes checkpoints too",
        "metric_average": "StopAtAccuracy comes before MetricAverageCallback"}),
    # TensorFlow refuses configure_threads once it has started, so the run ends there.
    "the model built before hvd.init()": Conversion(((BUILD_MODEL, ""), (INIT, BUILD_MODEL + INIT)), {
        step: "stopped before" for step in STEPS_NEEDING_FIT} | {
        "init": "after TensorFlow had started", "pin_device": "after TensorFlow had started",
        "two_ranks": "Intra op parallelism cannot be modified"}),
    "shards by the local rank, a dataset batched by the global batch, compile given the plain optimizer": Conversion((
        (SHARD, SHARD.replace("hvd.rank()", "hvd.local_rank()")),
        (BATCH, ".shuffle(len(train_images)).repeat().batch(args.batch_size * hvd.size())"),
        (WRAP, "distributed_optimizer = hvd.DistributedOptimizer(optimizer, groups=1)\n"),
    ), {"steps_per_epoch": "of the same images as rank 0", "distributed_optimizer": "a plain SGD",
        "two_ranks": "different weights"}),
    # Horovod cannot build a DistributedOptimizer of one (it recurses), so the run ends there.
    "the optimizer wrapped twice": Conversion(((WRAP, WRAP + "optimizer = hvd.DistributedOptimizer(optimizer)\n"),), {
        step: "stopped before" for step in STEPS_NEEDING_FIT} | {
        "distributed_optimizer": "is wrapped again", "two_ranks": "RecursionError"}),
    "one seed on every rank and no shard, no broadcast": Conversion((
        (SEED, "tf.keras.utils.set_random_seed(1234)\nif False:\n"),
        ("if args.data_partition == \"shard\":\n", "if False:\n"),
        (BROADCAST, ""),
    ), {"steps_per_epoch": "of the same images as rank 0", "broadcast": "the same seed on every rank"}),
    "early stopping on the chief only, a print on every rank, the device pinned after the model": Conversion((
        (CHECKPOINT_GUARD, "if is_chief:\n    callbacks.append(tf.keras.callbacks.EarlyStopping("
                           "monitor=\"val_accuracy\", patience=args.patience))\n" + CHECKPOINT_GUARD),
        (FINAL_PRINT, "if True:\n    print(f\"final val_accuracy"),
        (PIN, ""), (BUILD_MODEL, BUILD_MODEL + PIN),
    ), {"metric_average": "EarlyStopping runs on rank(s) 0 only", "rank0_output": "rank 1 printed",
        "pin_device": "after TensorFlow had started"}),
    "square-root scaling, a progress bar on every rank, steps not divided": Conversion((
        (SCALE_LR, "peak_lr = scaled_learning_rate(args.base_lr, hvd.size(), rule=\"sqrt\")\n"),
        ("callbacks=callbacks, verbose=0)", "callbacks=callbacks, verbose=2)"),
        (STEPS, "steps_per_epoch = len(train_images) // args.batch_size\n"),
    ), {"scaled_lr": "scale the learning rate linearly",
        "rank0_output": "rank 1 printed", "steps_per_epoch": "ran 12 steps"}),
    "callbacks and validation on the chief only (the broadcast waits for ever)": Conversion((
        (CALLBACKS_START, "def make_callbacks():\n    if not is_chief:\n        return []\n    return [\n"),
        (CALLBACKS_END, CALLBACKS_END + "callbacks = make_callbacks()\n"),
        ("validation_data=val_data,", "validation_data=val_data if is_chief else None,"),
    ), {"broadcast": "never do, so the broadcast waits for ever", "metric_average": "only rank(s) 0 validate",
        "two_ranks": "was stopped", "rank0_output": "stopped before", "steps_per_epoch": "stopped before"}),
    "no hvd.init()": Conversion(((INIT, ""),), {
        step: "stopped before" for step in conversion_questions.STEPS if step != "init"} | {
        "init": "before hvd.init() had run", "two_ranks": "failed"}),
}


def converted(edits: tuple, folder: Path) -> Path:
    text = SOLUTION.read_text()
    for old, new in edits:
        assert text.count(old) == 1, f"the instructor's conversion no longer holds {old!r} once"
        text = text.replace(old, new)
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "fashion_mnist_student.py"
    script.write_text(text)
    return script


def answers(script: Path) -> tuple[conversion_run.ConversionRun, dict[str, list[str]]]:
    # The graded cells' own cache: test_lab3_conversion.py grades the same files again without running them again.
    before = runs_leftovers()
    run = conversion_questions.graded_run(script, stall_s=STALL_S)
    assert runs_leftovers() <= before, "the probed run, stopped or not, leaves nothing in the temporary folder"
    return run, {step: conversion_questions.problems(run, step) for step in conversion_questions.STEPS}


@pytest.mark.slow
def test_the_instructors_conversion_passes_every_step_and_its_ranks_are_recorded():
    run, found = answers(SOLUTION)
    assert found == {step: [] for step in conversion_questions.STEPS}, run.tail
    assert run.finished and set(run.records) == {0, 1}
    for rank, record in run.records.items():
        assert record["rank"] == rank and record["size"] == 2 and record["pins"] == [
            {"gpus": [0], "tensorflow_started": False}]
        [fit] = record["fits"]
        assert fit["distributed"] == {"op": "Average", "wrappings": 1, "inner_op": None}
        assert abs(fit["peak_learning_rate"] - 2 * conversion_run.BASE_LR) < 1e-6
        assert record["steps"] == [6] and all(len(batch) == 32 for batch in record["batches"][:6])
    first = run.records[0]["weights"]
    second = run.records[1]["weights"]
    assert first["train_begin"] != second["train_begin"], "no seed: the ranks start apart until the broadcast"
    assert first["after_first_step"] == second["after_first_step"] and first["train_end"] == second["train_end"]
    drawn = [{example for batch in record["batches"][:6] for example in batch} for record in run.records.values()]
    assert len(drawn[0]) == len(drawn[1]) == 192 and not drawn[0] & drawn[1]
    assert set(run.printed) == {0}


@pytest.mark.slow
@pytest.mark.parametrize("name", RIGHT)
def test_right_conversions_in_unusual_spellings_pass_every_step(name, tmp_path):
    run, found = answers(converted(RIGHT[name].edits, tmp_path / "script"))
    assert found == {step: [] for step in conversion_questions.STEPS}, run.tail


@pytest.mark.slow
@pytest.mark.parametrize("name", WRONG)
def test_each_mistake_is_rejected_by_its_own_step_with_a_message_that_names_it(name, tmp_path):
    mistake = WRONG[name]
    run, found = answers(converted(mistake.edits, tmp_path / "script"))
    rejected = {step for step, said in found.items() if said}
    assert rejected == set(mistake.rejected_by), (found, run.tail)
    for step, fragment in mistake.rejected_by.items():
        assert fragment in "; ".join(found[step]), (step, found[step])


def test_a_missing_script_and_an_unknown_step_are_refused_clearly(tmp_path):
    with pytest.raises(AssertionError, match="nothing.py is missing"):
        conversion_questions.check(tmp_path / "nothing.py", "init")
    with pytest.raises(ValueError, match="unknown step"):
        conversion_questions.problems(conversion_run.ConversionRun(0, None), "no such step")
