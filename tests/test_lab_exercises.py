"""The graded exercises of labs 1–5 against wrong solutions: for every exercise the reference solution passes its
test cell, and each plausible wrong solution below fails it with an AssertionError whose message says what is
wrong. A wrong solution marked "hidden" passes the checks the student can see and is caught by the hidden tests
only; one marked "visible" is already caught by the visible checks. Where an exercise has more than one right
answer, the others below must pass too.

Each exercise's solution cell is taken from the source notebook with the code between `### BEGIN SOLUTION` and
`### END SOLUTION` replaced (as a student's notebook holds it), then run with the test cell in a fresh namespace in
a child process, after the imports (and, for lab 1, the data) the test cell needs. Nothing trains: seconds each."""

from __future__ import annotations

import re

import nbformat
import pytest

from labtools import LABS, Wrong, assert_rejected, code_cell_containing, grade_exercise, python_source

NOTEBOOKS = {"lab1": LABS / "source" / "lab1" / "lab1_gradient_descent.ipynb",
             "lab2": LABS / "source" / "lab2" / "lab2_batch_size.ipynb",
             "lab3": LABS / "source" / "lab3" / "lab3_horovod.ipynb",
             "lab4": LABS / "source" / "lab4" / "lab4_communication.ipynb",
             "lab5": LABS / "source" / "lab5" / "lab5_large_batch.ipynb"}
# The cell each lab's test cells rely on (None: only the parameters cell): lab 1's tests need its data, the others
# only the imports of the lab's setup cell.
CONTEXT = {"lab1": ("np.polyfit", False), "lab2": (None, False), "lab3": ("HOROVODRUN = ", True),
           "lab4": ("from scalelab import comm", True), "lab5": ("from scalelab.optimizers import", True)}




RING_SUM_FOR_SHOW = """
chunks = [list(np.array_split(np.array(buffer, copy=True), p)) for buffer in buffers]
for step in range(2 * (p - 1)):
    for rank in range(p):
        send(rank, (rank + 1) % p, chunks[rank][(rank - step) % p])
return [sum(np.array(buffer, copy=True) for buffer in buffers) for _ in range(p)]
"""
RING_ALLGATHER_FROM_THE_OWNER = """
chunks = [list(np.array_split(np.array(buffer, copy=True), p)) for buffer in buffers]
right = lambda rank: (rank + 1) % p
for step in range(p - 1):
    messages = [(rank, (rank - step) % p) for rank in range(p)]
    received = [send(rank, right(rank), chunks[rank][index]) for rank, index in messages]
    for (rank, index), data in zip(messages, received):
        chunks[right(rank)][index] = chunks[right(rank)][index] + data
owner = {(rank + 1) % p: rank for rank in range(p)}
for step in range(p - 1):
    for rank in range(p):
        send(rank, right(rank), chunks[rank][(rank + 1 - step) % p])
return [np.concatenate([chunks[owner[index]][index] for index in range(p)]) for _ in range(p)]
"""

EXERCISES = {
    ("lab1", "ex0-days", "ex0-tests"): {
        "the forward pass only (2ND)": Wrong(
            ("return 2 * parameters * tokens / (gpus * peak_flops * utilisation) / 86_400",), "visible", ""),
        "the utilisation left out": Wrong(
            ("return 6 * parameters * tokens / (gpus * peak_flops) / 86_400",), "visible", ""),
        "seconds, not days": Wrong(("return 6 * parameters * tokens / (gpus * peak_flops * utilisation)",),
                                   "visible", ""),
        "nothing refused": Wrong(("return 6 * parameters * tokens / (gpus * peak_flops * utilisation) / 86_400",),
                                 "hidden", "raise ValueError"),
        "a utilisation above 1 accepted": Wrong(("""
            if gpus < 1 or utilisation <= 0 or parameters < 0 or tokens < 0:
                raise ValueError("cannot be")
            return 6 * parameters * tokens / (gpus * peak_flops * utilisation) / 86_400
            """,), "hidden", "'utilisation': 1.5} cannot be: raise ValueError"),
    },
    ("lab1", "ex1-gradient", "ex1-tests"): {
        "the loss sums the squared errors": Wrong(
            ("return float(np.sum((w * x + b - y) ** 2))", None), "hidden", "the gradient must match the slope"),
        "the gradient lacks the factor 2": Wrong(
            (None, "error = w * x + b - y\nreturn float(np.mean(error * x)), float(np.mean(error))"), "visible", ""),
    },
    ("lab1", "ex2-convergence", "ex2-tests"): {
        "a strict comparison": Wrong(("""
            if len(epoch_losses) < 2:
                return False
            return abs(epoch_losses[-2] - epoch_losses[-1]) < tolerance * epoch_losses[-2]
            """,), "hidden", "exactly tolerance"),
        "the signed change": Wrong(("""
            if len(epoch_losses) < 2:
                return False
            return epoch_losses[-2] - epoch_losses[-1] <= tolerance * epoch_losses[-2]
            """,), "hidden", "diverging, not converged"),
    },
    ("lab1", "ex3-minibatches", "ex3-tests"): {
        "shuffled with the global np.random": Wrong(("""
            order = np.random.permutation(num_examples)
            return [order[start:start + batch_size] for start in range(0, num_examples, batch_size)]
            """,), "hidden", "the same seed must give the same batches"),
        "a new generator with a fixed seed": Wrong(("""
            order = np.random.default_rng(0).permutation(num_examples)
            return [order[start:start + batch_size] for start in range(0, num_examples, batch_size)]
            """,), "hidden", "the order must come from the rng you are given"),
    },
    ("lab2", "ex1-throughput", "ex1-tests"): {
        "only a zero duration raises": Wrong(("""
            if seconds == 0:
                raise ValueError("no time measured")
            return steps * batch_size * workers / seconds
            """,), "hidden", "not positive must raise ValueError"),
    },
    ("lab2", "ex2-pick", "ex2-tests"): {
        "0 seconds counts as not reached": Wrong(("""
            reached = [run for run in results if run["seconds_to_target"]]
            return min(reached, key=lambda run: (run["seconds_to_target"], run["batch_size"]))["batch_size"] \\
                if reached else None
            """,), "hidden", "0 seconds is a time"),
        "ties go to the first run listed": Wrong(("""
            reached = [run for run in results if run["seconds_to_target"] is not None]
            return min(reached, key=lambda run: run["seconds_to_target"])["batch_size"] if reached else None
            """,), "hidden", "prefer the smaller batch"),
    },
    ("lab2", "ex3-files", "ex3-tests"): {
        "blocks of the rounded-down share": Wrong(("""
            if not 0 <= rank < size or len(files) < size:
                raise ValueError("no such rank, or too few files")
            share = len(files) // size
            return files[rank * share:(rank + 1) * share]
            """,), "visible", ""),
        "blocks of the rounded-up share": Wrong(("""
            if not 0 <= rank < size or len(files) < size:
                raise ValueError("no such rank, or too few files")
            share = -(-len(files) // size)
            return files[rank * share:(rank + 1) * share]
            """,), "hidden", "balance them to within one file"),
        "by a checksum of the name": Wrong(("""
            import zlib
            if not 0 <= rank < size or len(files) < size:
                raise ValueError("no such rank, or too few files")
            return [name for name in files if zlib.crc32(name.encode()) % size == rank]
            """,), "hidden", "balance them to within one file"),
        "each rank shuffles with its own seed": Wrong(("""
            import random
            if not 0 <= rank < size or len(files) < size:
                raise ValueError("no such rank, or too few files")
            order = list(files)
            random.Random(rank).shuffle(order)
            return order[rank::size]
            """,), "visible", ""),
        "a rank past the last one reads nothing": Wrong(("return list(files[rank::size])",), "hidden",
                                                          "does not exist: raise ValueError"),
        "fewer files than ranks leaves a rank empty": Wrong(("""
            if not 0 <= rank < size:
                raise ValueError(f"rank {rank} is not one of {size} ranks")
            return list(files[rank::size])
            """,), "hidden", "leaves a rank with nothing to read"),
    },
    ("lab3", "ex1-prints-progress", "ex1-tests"): {
        "every even rank prints": Wrong(("return rank % 2 == 0",), "hidden", "only rank 0 prints"),
    },
    ("lab3", "ex2-scaled-lr", "ex2-tests"): {
        "the rate doubles per worker": Wrong(("return base_lr * 2 ** (size - 1)",), "hidden",
                                             "multiplies the base rate by the worker count"),
    },
    ("lab3", "ex3-shard", "ex3-tests"): {
        "the steps ignore the workers": Wrong((None, "return num_images // batch_size"), "hidden",
                                              "N / (batch x size)"),
        "contiguous blocks instead of every size-th": Wrong(("""
            share = len(images) // size
            return images[rank * share:(rank + 1) * share], labels[rank * share:(rank + 1) * share]
            """, None), "visible", ""),
    },
    ("lab3", "ex4-callbacks", "ex4-tests"): {
        "the metric averaging twice, no broadcast": Wrong((
            "return [hvd.callbacks.MetricAverageCallback(), hvd.callbacks.MetricAverageCallback()]",),
            "hidden", "one BroadcastGlobalVariablesCallback"),
        "the learning-rate warmup instead of the metric averaging": Wrong((
            "return [hvd.callbacks.BroadcastGlobalVariablesCallback(0), "
            "hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.02)]",), "hidden", "one MetricAverageCallback"),
        "a broadcast from rank 1": Wrong((
            "return [hvd.callbacks.BroadcastGlobalVariablesCallback(1), hvd.callbacks.MetricAverageCallback()]",),
            "hidden", "broadcast from rank 0"),
    },
    ("lab3", "ex5-efficiency", "ex5-tests"): {
        "the ratio upside down": Wrong(("return n * images_per_s_one / images_per_s_n",), "hidden",
                                       "throughput(n) / (n x throughput(1))"),
    },
    ("lab4", "ex1-ring", "ex1-tests"): {
        "the sum of the buffers, send only for show": Wrong((RING_SUM_FOR_SHOW,), "hidden",
                                                            "computed from the chunks send() returned"),
        "the allgather copies from the owner, send only for show": Wrong((RING_ALLGATHER_FROM_THE_OWNER,), "hidden",
                                                                         "computed from the chunks send() returned"),
        "whole buffers in every message": Wrong(("""
            total = [np.array(buffer, dtype=float) for buffer in buffers]
            for step in range(2 * (p - 1)):
                for rank in range(p):
                    send(rank, (rank + 1) % p, np.asarray(buffers[rank]))
            return [sum(total) for _ in range(p)]
            """,), "hidden", "each message carries one chunk"),
    },
    ("lab4", "ex2-ring-time", "ex2-tests"): {
        "the whole message through each link": Wrong((
            "return 2 * (ranks - 1) * alpha_s + message_bytes * beta_s_per_byte",), "hidden",
            "2(p-1)/p of the message"),
    },
    ("lab5", "ex1-noise-scale", "ex1-tests"): {
        "a negative estimate clipped": Wrong(("""
            true_sq_norm = (b_big * big_sq_norm - b_small * small_sq_norm) / (b_big - b_small)
            trace_sigma = (small_sq_norm - big_sq_norm) / (1 / b_small - 1 / b_big)
            return abs(trace_sigma / true_sq_norm)
            """,), "hidden", "negative estimate"),
        "the big batch's norm taken as the true gradient's": Wrong(("""
            return (small_sq_norm - big_sq_norm) / (1 / b_small - 1 / b_big) / big_sq_norm
            """,), "visible", ""),
    },
    ("lab5", "ex2-warmup", "ex2-tests"): {
        "the ramp goes on after the warmup": Wrong((
            "return initial_lr + (peak_lr - initial_lr) * step / warmup_steps",), "hidden", "stays at its peak"),
    },
    ("lab5", "ex3-lars", "ex3-tests"): {
        "a zero gradient divides by epsilon": Wrong(("""
            weight_norm, gradient_norm = np.linalg.norm(weight), np.linalg.norm(gradient)
            if weight_norm == 0:
                return 1.0
            return float(eta * weight_norm / (gradient_norm + weight_decay * weight_norm + epsilon))
            """,), "hidden", "zero gradient takes the plain rate"),
        "epsilon left out": Wrong(("""
            weight_norm, gradient_norm = np.linalg.norm(weight), np.linalg.norm(gradient)
            if weight_norm == 0 or gradient_norm == 0:
                return 1.0
            return float(eta * weight_norm / (gradient_norm + weight_decay * weight_norm))
            """,), "hidden", "epsilon belongs in the denominator"),
        "weight decay not scaled by the weights' norm": Wrong(("""
            weight_norm, gradient_norm = np.linalg.norm(weight), np.linalg.norm(gradient)
            if weight_norm == 0 or gradient_norm == 0:
                return 1.0
            return float(eta * weight_norm / (gradient_norm + weight_decay + epsilon))
            """,), "hidden", "compare with the formula"),
    },
}

# Right solutions other than the reference, which the graded tests must accept too (the solution regions' code, as
# in Wrong.bodies).
ALSO_RIGHT = {
    ("lab2", "ex3-files", "ex3-tests"): {
        "balanced contiguous blocks": ("""
            if not 0 <= rank < size or len(files) < size:
                raise ValueError("no such rank, or too few files")
            return files[rank * len(files) // size:(rank + 1) * len(files) // size]
            """,),
        "the same shuffle on every rank, then every size-th": ("""
            import random
            if not 0 <= rank < size or len(files) < size:
                raise ValueError("no such rank, or too few files")
            order = sorted(files)
            random.Random(42).shuffle(order)
            return order[rank::size]
            """,),
    },
    ("lab3", "ex4-callbacks", "ex4-tests"): {
        # The broadcast acts at the end of the first batch, the averaging at each epoch's end: either order works.
        "the metric average first": (
            "return [hvd.callbacks.MetricAverageCallback(), hvd.callbacks.BroadcastGlobalVariablesCallback(0)]",),
    },
}


def context_of(lab: str) -> str:
    """What runs before the solution cell: the lab's parameters cell, then its setup cell (or the imports of it)."""
    notebook = nbformat.read(NOTEBOOKS[lab], as_version=4)
    parameters = next(cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", []))
    fragment, imports_only = CONTEXT[lab]
    if fragment is None:
        return parameters.source
    setup = python_source(code_cell_containing(notebook, fragment))
    if imports_only:
        setup = "\n".join(line for line in setup.splitlines() if re.match(r"(import|from) \w", line))
    return parameters.source + "\n\n" + setup


def test_every_graded_exercise_of_labs_1_to_5_has_wrong_solutions_here():
    for lab, path in NOTEBOOKS.items():
        notebook = nbformat.read(path, as_version=4)
        # Solution cells other than the quiz's answer cells.
        exercises = {cell.metadata.nbgrader["grade_id"] for cell in notebook.cells
                     if cell.metadata.get("nbgrader", {}).get("solution")
                     and not re.fullmatch(r"q\d+-answer", cell.metadata.nbgrader["grade_id"])}
        assert exercises == {solution for exercise_lab, solution, _ in EXERCISES if exercise_lab == lab}, lab


@pytest.mark.parametrize("lab, solution_id, tests_id", list(EXERCISES), ids=[f"{lab}-{solution}"
                                                                            for lab, solution, _ in EXERCISES])
def test_the_graded_tests_pass_the_reference_and_reject_each_wrong_solution(lab, solution_id, tests_id, tmp_path):
    assert_rejected(NOTEBOOKS[lab], solution_id, tests_id, context_of(lab), EXERCISES[lab, solution_id, tests_id],
                    tmp_path)


@pytest.mark.parametrize("lab, solution_id, tests_id", list(ALSO_RIGHT), ids=[f"{lab}-{solution}"
                                                                             for lab, solution, _ in ALSO_RIGHT])
def test_the_graded_tests_accept_other_right_solutions(lab, solution_id, tests_id, tmp_path):
    solutions = ALSO_RIGHT[lab, solution_id, tests_id]
    outcomes = grade_exercise(NOTEBOOKS[lab], solution_id, tests_id, context_of(lab), solutions, tmp_path)
    assert outcomes == {name: {"graded": None, "visible": None} for name in solutions}
