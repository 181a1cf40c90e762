"""Quick hints for the graded cells of lab 3's PyTorch edition: has the student's script started each DDP step?

The script is parsed (never run) and searched for the names a step adds; nothing more is concluded from the
spelling. A hint only ever says what it could not find, and that the graded run (:mod:`ddp_questions`) judges what
the script does: a step written in a way the hint does not know still gets its points there.
"""

from __future__ import annotations

import ast
from pathlib import Path

from .conversion_hints import names_used, options_defined

# The serial script's options: a converted script keeps them, so the grader can run it like the serial one.
SERIAL_OPTIONS = ("--batch-size", "--val-batch-size", "--epochs", "--lr", "--momentum", "--train-images",
                  "--val-images", "--output-dir", "--weights-digest-dir")
# step -> (any of these names started it, what the step adds)
STARTED_BY = {
    "init": (("init_process_group",), "dist.init_process_group(\"gloo\"), so that the processes torchrun starts "
                                      "join one group"),
    "sampler": (("DistributedSampler",), "a DistributedSampler for the training images, and set_epoch(epoch) at "
                                         "the start of every epoch"),
    "ddp": (("DistributedDataParallel",), "model = DistributedDataParallel(model)"),
    "scaled_lr": (("get_world_size", "world_size"), "the learning rate multiplied by the world size"),
    "metrics": (("all_reduce",), "dist.all_reduce of the epoch's sums (loss, correct answers, images)"),
    "rank0_writes": (("get_rank", "rank"), "a test of the rank, so that rank 0 alone prints and writes"),
}
STEPS = (*STARTED_BY, "cli")


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
    started_by, adds = STARTED_BY[step]
    if not names_used(tree).intersection(started_by):
        return [f"nothing of this step was found in the script ({' or '.join(started_by)}): it adds {adds}. "
                "If you wrote it another way, the graded run judges what your script does"]
    return []


def check(script: Path | str, step: str) -> None:
    """Raise an AssertionError with the :func:`hints` for ``step``, if there are any."""
    found = hints(script, step)
    assert not found, f"{step.replace('_', ' ')}: " + "; ".join(found)
