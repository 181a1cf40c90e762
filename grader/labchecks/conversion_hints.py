"""Quick hints for lab 3's graded cells: has the student's script started each conversion step?

The script is parsed (never run) and searched for the names a step adds; nothing more is concluded from the
spelling. A hint only ever says what it could not find, and that the graded run (:mod:`conversion_questions`)
judges what the script does: a step written in a way the hint does not know still gets its points there.
"""

from __future__ import annotations

import ast
from pathlib import Path

# The serial script's options: a converted script keeps them, so the grader can run it like the serial one.
SERIAL_OPTIONS = ("--batch-size", "--val-batch-size", "--epochs", "--base-lr", "--momentum", "--warmup-epochs",
                  "--target-accuracy", "--patience", "--wd", "--train-images", "--val-images", "--output-dir",
                  "--seed", "--weights-digest-dir")
# step -> (any of these names started it, what the step adds)
STARTED_BY = {
    "init": (("init",), "hvd.init(), so that the processes horovodrun starts learn of each other"),
    "pin_device": (("local_rank",), "pin_gpu(hvd.local_rank()): each process on its own GPU"),
    "rank0_output": (("rank",), "a test of hvd.rank() == 0, so that rank 0 alone prints"),
    "scaled_lr": (("size",), "the learning rate multiplied by hvd.size()"),
    "distributed_optimizer": (("DistributedOptimizer",), "hvd.DistributedOptimizer around the optimizer"),
    "broadcast": (("BroadcastGlobalVariablesCallback", "broadcast_variables", "broadcast_global_variables"),
                  "hvd.callbacks.BroadcastGlobalVariablesCallback(0) in the callbacks"),
    "steps_per_epoch": (("shard", "shard_arrays"), "a share of the images for each rank (shard_arrays or "
                                                   "Dataset.shard) and the steps per epoch divided by hvd.size()"),
    "metric_average": (("MetricAverageCallback",), "hvd.callbacks.MetricAverageCallback() in the callbacks"),
    "rank0_checkpoint": (("ModelCheckpoint", "save", "save_weights"), "a ModelCheckpoint written by rank 0"),
}
STEPS = (*STARTED_BY, "cli")


def names_used(tree: ast.AST) -> set[str]:
    """Every name the script refers to: variables, attributes, imported names."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.update(node.name.split("."))
    return found


def imports_horovod(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(alias.name.split(".")[0] == "horovod" for alias in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "horovod":
            return True
    return False


def options_defined(tree: ast.AST) -> set[str]:
    return {arg.value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
            for arg in node.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str)}


def hints(script: Path | str, step: str) -> list[str]:
    """What the script lacks to have started ``step``; [] when it has started it (or for ``cli``, kept the options)."""
    if step not in STEPS:
        raise ValueError(f"unknown step {step!r}; choose one of {STEPS}")
    path = Path(script)
    if not path.is_file():
        return [f"{path.name} is missing: it must be next to this notebook"]
    try:
        tree = ast.parse(path.read_text(), filename=path.name)
    except SyntaxError as error:
        return [f"{path.name} does not parse (line {error.lineno}): {error.msg}"]
    if step == "cli":
        missing = [option for option in SERIAL_OPTIONS if option not in options_defined(tree)]
        return [f"keep the serial script's options (the grader runs your script with them); missing: "
                f"{', '.join(missing)}"] if missing else []
    if not imports_horovod(tree):
        return ["no import of Horovod was found in the script: step 1 imports its Keras API "
                "(`import horovod.tensorflow.keras as hvd`)"]
    names, (started_by, adds) = names_used(tree), STARTED_BY[step]
    if not names.intersection(started_by):
        return [f"nothing of this step was found in the script ({' or '.join(started_by)}): it adds {adds}. "
                "If you wrote it another way, the graded run judges what your script does"]
    return []


def check(script: Path | str, step: str) -> None:
    """Raise an AssertionError with the :func:`hints` for ``step``, if there are any."""
    found = hints(script, step)
    assert not found, f"{step.replace('_', ' ')}: " + "; ".join(found)
