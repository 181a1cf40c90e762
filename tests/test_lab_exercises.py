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

from conftest import keras_only
from labtools import LABS, Wrong, assert_rejected, code_cell_containing, grade_exercise, python_source

# The Keras edition's: skipped, with the reason, where `make setup` installed the PyTorch edition alone.
pytestmark = keras_only

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
    ("lab1", "ex4-direction", "ex4-tests"): {
        "each whole layer scaled to the layer's norm": Wrong(("""
            return [np.zeros_like(w) if w.ndim == 1 else
                    (lambda d: d * np.linalg.norm(w) / np.linalg.norm(d))(rng.standard_normal(w.shape))
                    for w in weights]
            """,), "visible", ""),
        "filters taken along the input channels": Wrong(("""
            direction = []
            for w in weights:
                if w.ndim == 1:
                    direction.append(np.zeros_like(w))
                    continue
                d = rng.standard_normal(w.shape)
                axes = tuple(axis for axis in range(w.ndim) if axis != w.ndim - 2)
                d *= np.sqrt(np.sum(w**2, axis=axes, keepdims=True)) / np.sqrt(np.sum(d**2, axis=axes, keepdims=True))
                direction.append(d)
            return direction
            """,), "visible", ""),
        "filters along the first axis, as in PyTorch": Wrong(("""
            direction = []
            for w in weights:
                d = rng.standard_normal(w.shape)
                if w.ndim == 1:
                    d[:] = 0
                else:
                    for d_filter, w_filter in zip(d, w):
                        d_filter *= np.linalg.norm(w_filter) / np.linalg.norm(d_filter)
                direction.append(d)
            return direction
            """,), "visible", ""),
        "each filter scaled to unit norm": Wrong(("""
            direction = []
            for w in weights:
                d = rng.standard_normal(w.shape)
                if w.ndim == 1:
                    direction.append(np.zeros_like(w))
                else:
                    direction.append(d / np.sqrt(np.sum(d**2, axis=tuple(range(w.ndim - 1)))))
            return direction
            """,), "visible", ""),
        "biases and batch norm left random": Wrong(("""
            direction = []
            for w in weights:
                d = rng.standard_normal(w.shape)
                if w.ndim > 1:
                    axes = tuple(range(w.ndim - 1))
                    d *= np.sqrt(np.sum(w**2, axis=axes)) / np.sqrt(np.sum(d**2, axis=axes))
                direction.append(d)
            return direction
            """,), "hidden", "get a zero direction"),
        "drawn with the global np.random": Wrong(("""
            direction = []
            for w in weights:
                if w.ndim == 1:
                    direction.append(np.zeros_like(w))
                    continue
                d = np.random.standard_normal(w.shape)
                axes = tuple(range(w.ndim - 1))
                direction.append(d * np.sqrt(np.sum(w**2, axis=axes)) / np.sqrt(np.sum(d**2, axis=axes)))
            return direction
            """,), "hidden", "the same seed must give the same direction"),
        "a new generator with a fixed seed": Wrong(("""
            fixed_rng = np.random.default_rng(0)
            direction = []
            for w in weights:
                if w.ndim == 1:
                    direction.append(np.zeros_like(w))
                    continue
                d = fixed_rng.standard_normal(w.shape)
                axes = tuple(range(w.ndim - 1))
                direction.append(d * np.sqrt(np.sum(w**2, axis=axes)) / np.sqrt(np.sum(d**2, axis=axes)))
            return direction
            """,), "hidden", "two calls on the same generator must give two different directions"),
        "the biases zeroed in place": Wrong(("""
            direction = []
            for w in weights:
                if w.ndim == 1:
                    w *= 0
                    direction.append(w)
                    continue
                d = rng.standard_normal(w.shape)
                axes = tuple(range(w.ndim - 1))
                direction.append(d * np.sqrt(np.sum(w**2, axis=axes)) / np.sqrt(np.sum(d**2, axis=axes)))
            return direction
            """,), "hidden", "the weights must stay as they were"),
        "only conv kernels normalised, dense kernels left out": Wrong(("""
            direction = []
            for w in weights:
                if w.ndim != 4:
                    direction.append(np.zeros_like(w))
                    continue
                d = rng.standard_normal(w.shape)
                norms = lambda a: np.sqrt(np.sum(a**2, axis=(0, 1, 2)))
                direction.append(d * norms(w) / norms(d))
            return direction
            """,), "hidden", "a dense kernel (inputs x units) is normalised too"),
        "the weights themselves, not a random direction": Wrong(("""
            rng.standard_normal(1)
            return [np.zeros_like(w) if w.ndim == 1 else w.copy() for w in weights]
            """,), "hidden", "the direction must be random"),
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
    # A "visible" mistake's message is checked by tests/test_lab3_practice.py.
    ("lab3", "ex6-resume-plan", "ex6-tests"): {
        "each rank reads its own newest file": Wrong(("""
            newest, epoch = None, 0
            for name in files:
                match = re.fullmatch(r"checkpoint-epoch(\\d+)\\.keras", name)
                if match and int(match.group(1)) > epoch:
                    newest, epoch = name, int(match.group(1))
            return {"load": newest, "initial_epoch": epoch, "initial_step": epoch * steps_per_epoch}
            """,), "visible", "every rank must start at rank 0's epoch"),
        "rank 0 restores and broadcasts, the others do not receive": Wrong(("""
            newest, epoch = None, 0
            if rank == 0:
                for name in files:
                    match = re.fullmatch(r"checkpoint-epoch(\\d+)\\.keras", name)
                    if match and int(match.group(1)) > epoch:
                        newest, epoch = name, int(match.group(1))
                epoch = broadcast(epoch, 0)
            return {"load": newest, "initial_epoch": epoch, "initial_step": epoch * steps_per_epoch}
            """,), "visible", "A broadcast is a collective"),
        "every rank restores the file rank 0 named": Wrong(("""
            newest, epoch = None, 0
            for name in files:
                match = re.fullmatch(r"checkpoint-epoch(\\d+)\\.keras", name)
                if match and int(match.group(1)) > epoch:
                    newest, epoch = name, int(match.group(1))
            newest, epoch = broadcast((newest, epoch), 0)
            return {"load": newest, "initial_epoch": epoch, "initial_step": epoch * steps_per_epoch}
            """,), "visible", "only rank 0 restores a checkpoint"),
        "the weights restored, training from epoch 0": Wrong(("""
            newest, epoch = None, 0
            if rank == 0:
                for name in files:
                    match = re.fullmatch(r"checkpoint-epoch(\\d+)\\.keras", name)
                    if match and int(match.group(1)) > epoch:
                        newest, epoch = name, int(match.group(1))
            broadcast(epoch, 0)
            return {"load": newest, "initial_epoch": 0, "initial_step": 0}
            """,), "visible", "resuming at epoch 0 would train every epoch again"),
        "the learning-rate schedule restarted at its warmup": Wrong(("""
            newest, epoch = None, 0
            if rank == 0:
                for name in files:
                    match = re.fullmatch(r"checkpoint-epoch(\\d+)\\.keras", name)
                    if match and int(match.group(1)) > epoch:
                        newest, epoch = name, int(match.group(1))
            epoch = broadcast(epoch, 0)
            return {"load": newest, "initial_epoch": epoch, "initial_step": 0}
            """,), "visible", "at 0 it would start its warmup again"),
        "the epoch after the checkpoint's (off by one)": Wrong(("""
            newest, epoch = None, 0
            if rank == 0:
                for name in files:
                    match = re.fullmatch(r"checkpoint-epoch(\\d+)\\.keras", name)
                    if match and int(match.group(1)) > epoch:
                        newest, epoch = name, int(match.group(1))
            epoch = broadcast(epoch, 0)
            start = epoch + 1 if newest or epoch else 0
            return {"load": newest, "initial_epoch": start, "initial_step": start * steps_per_epoch}
            """,), "visible", "Keras counts the epochs from 0"),
        "the newest checkpoint by modification time": Wrong(("""
            newest, epoch = None, 0
            if rank == 0:
                checkpoints = [name for name in files if re.fullmatch(r"checkpoint-epoch\\d+\\.keras", name)]
                if checkpoints:
                    newest = max(checkpoints, key=files.get)
                    epoch = int(re.fullmatch(r"checkpoint-epoch(\\d+)\\.keras", newest).group(1))
            epoch = broadcast(epoch, 0)
            return {"load": newest, "initial_epoch": epoch, "initial_step": epoch * steps_per_epoch}
            """,), "hidden", "not the modification time"),
        "the newest checkpoint by its name, as text": Wrong(("""
            newest, epoch = None, 0
            if rank == 0:
                checkpoints = [name for name in files if re.fullmatch(r"checkpoint-epoch\\d+\\.keras", name)]
                if checkpoints:
                    newest = max(checkpoints)
                    epoch = int(newest[len("checkpoint-epoch"):-len(".keras")])
            epoch = broadcast(epoch, 0)
            return {"load": newest, "initial_epoch": epoch, "initial_step": epoch * steps_per_epoch}
            """,), "hidden", "not the names"),
        "a partial file taken for a checkpoint": Wrong(("""
            newest, epoch = None, 0
            if rank == 0:
                for name in files:
                    match = re.search(r"checkpoint-epoch(\\d+)", name)
                    if match and int(match.group(1)) > epoch:
                        newest, epoch = name, int(match.group(1))
            epoch = broadcast(epoch, 0)
            return {"load": newest, "initial_epoch": epoch, "initial_step": epoch * steps_per_epoch}
            """,), "hidden", "A partial file (rank 0 was killed while writing it) is not a checkpoint"),
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
    ("lab4", "ex3-spans", "ex3-tests"): {
        "one stack for all tensors: an E ends the last phase begun on any pid": Wrong(("""
            names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and "name" in e["args"]}
            open_phases, spans = [], []
            for event in events:
                if event["ph"] == "B":
                    open_phases.append(event)
                elif event["ph"] == "E" and open_phases:
                    begin = open_phases.pop()
                    spans.append((names[begin["pid"]], begin["name"], begin["ts"] / 1000, event["ts"] / 1000))
            return spans
            """,), "hidden", "an 'E' ends a phase of its own pid"),
        "a queue per tensor: an E ends the phase begun first": Wrong(("""
            names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and "name" in e["args"]}
            open_phases, spans = {}, []
            for event in events:
                if event["ph"] == "B":
                    open_phases.setdefault(event["pid"], []).append(event)
                elif event["ph"] == "E" and open_phases.get(event["pid"]):
                    begin = open_phases[event["pid"]].pop(0)
                    spans.append((names[event["pid"]], begin["name"], begin["ts"] / 1000, event["ts"] / 1000))
            return spans
            """,), "hidden", "phases nest"),
        "phases still open at the end of the trace end at its last event": Wrong(("""
            names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and "name" in e["args"]}
            open_phases, spans = {}, []
            for event in events:
                if event["ph"] == "B":
                    open_phases.setdefault(event["pid"], []).append(event)
                elif event["ph"] == "E" and open_phases.get(event["pid"]):
                    begin = open_phases[event["pid"]].pop()
                    spans.append((names[event["pid"]], begin["name"], begin["ts"] / 1000, event["ts"] / 1000))
            last_ms = max(event.get("ts", 0) for event in events) / 1000
            spans += [(names[pid], begin["name"], begin["ts"] / 1000, last_ms)
                      for pid, begins in open_phases.items() for begin in begins]
            return spans
            """,), "hidden", "is not a span: leave it out"),
        "X ticks kept as spans": Wrong(("""
            names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and "name" in e["args"]}
            open_phases, spans = {}, []
            for event in events:
                if event["ph"] == "X":
                    spans.append((names[event["pid"]], event["name"], event["ts"] / 1000,
                                  (event["ts"] + event["dur"]) / 1000))
                elif event["ph"] == "B":
                    open_phases.setdefault(event["pid"], []).append(event)
                elif event["ph"] == "E" and open_phases.get(event["pid"]):
                    begin = open_phases[event["pid"]].pop()
                    spans.append((names[event["pid"]], begin["name"], begin["ts"] / 1000, event["ts"] / 1000))
            return spans
            """,), "visible", ""),
        "microseconds left as they are": Wrong(("""
            names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and "name" in e["args"]}
            open_phases, spans = {}, []
            for event in events:
                if event["ph"] == "B":
                    open_phases.setdefault(event["pid"], []).append(event)
                elif event["ph"] == "E" and open_phases.get(event["pid"]):
                    begin = open_phases[event["pid"]].pop()
                    spans.append((names[event["pid"]], begin["name"], begin["ts"], event["ts"]))
            return spans
            """,), "visible", ""),
        "the pid taken for the tensor's name": Wrong(("""
            open_phases, spans = {}, []
            for event in events:
                if event["ph"] == "B":
                    open_phases.setdefault(event["pid"], []).append(event)
                elif event["ph"] == "E" and open_phases.get(event["pid"]):
                    begin = open_phases[event["pid"]].pop()
                    spans.append((str(event["pid"]), begin["name"], begin["ts"] / 1000, event["ts"] / 1000))
            return spans
            """,), "visible", ""),
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
    ("lab5", "ex4-local-sgd", "ex4-tests"): {
        "the workers never restart from the average (one average at the end)": Wrong(("""
            models = [np.array(initial_weights, dtype=float) for _ in shards]
            rounds = 0
            for round_start in range(first_step, first_step + total_steps, local_steps):
                for index, shard in enumerate(shards):
                    for step in range(round_start, round_start + local_steps):
                        models[index] = models[index] - learning_rate * gradient(
                            models[index], *minibatch(shard, step, batch_size))
                rounds += 1
            return np.mean(models, axis=0), rounds
            """,), "visible", ""),
        "the gradients averaged at every step whatever H": Wrong(("""
            average = np.array(initial_weights, dtype=float)
            for step in range(first_step, first_step + total_steps):
                average = average - learning_rate * np.mean(
                    [gradient(average, *minibatch(shard, step, batch_size)) for shard in shards], axis=0)
            return average, total_steps // local_steps
            """,), "hidden", "no averaging in between"),
        "the rounds counted in steps": Wrong(("""
            average = np.array(initial_weights, dtype=float)
            rounds = 0
            for round_start in range(first_step, first_step + total_steps, local_steps):
                models = []
                for shard in shards:
                    weights = average.copy()
                    for step in range(round_start, round_start + local_steps):
                        weights = weights - learning_rate * gradient(weights, *minibatch(shard, step, batch_size))
                    models.append(weights)
                average = np.mean(models, axis=0)
                rounds += local_steps
            return average, rounds
            """,), "hidden", "3 rounds, not 12"),
        "the same shard on every worker": Wrong(("""
            average = np.array(initial_weights, dtype=float)
            rounds = 0
            for round_start in range(first_step, first_step + total_steps, local_steps):
                models = []
                for _ in shards:
                    weights = average.copy()
                    for step in range(round_start, round_start + local_steps):
                        weights = weights - learning_rate * gradient(weights, *minibatch(shards[0], step, batch_size))
                    models.append(weights)
                average = np.mean(models, axis=0)
                rounds += 1
            return average, rounds
            """,), "visible", ""),
        "the models weighted by their shard's size": Wrong(("""
            average = np.array(initial_weights, dtype=float)
            rounds = 0
            for round_start in range(first_step, first_step + total_steps, local_steps):
                models = []
                for shard in shards:
                    weights = average.copy()
                    for step in range(round_start, round_start + local_steps):
                        weights = weights - learning_rate * gradient(weights, *minibatch(shard, step, batch_size))
                    models.append(weights)
                sizes = [len(targets) for _, targets in shards]
                average = sum(size * model for size, model in zip(sizes, models)) / sum(sizes)
                rounds += 1
            return average, rounds
            """,), "visible", ""),
        "the caller's initial weights overwritten": Wrong(("""
            average = np.asarray(initial_weights, dtype=float)
            rounds = 0
            for round_start in range(first_step, first_step + total_steps, local_steps):
                models = []
                for shard in shards:
                    weights = average.copy()
                    for step in range(round_start, round_start + local_steps):
                        weights = weights - learning_rate * gradient(weights, *minibatch(shard, step, batch_size))
                    models.append(weights)
                average[...] = np.mean(models, axis=0)
                rounds += 1
            return average, rounds
            """,), "hidden", "leave initial_weights unchanged"),
        "every phase starts the shards again (first_step ignored)": Wrong(("""
            average = np.array(initial_weights, dtype=float)
            rounds = 0
            for round_start in range(0, total_steps, local_steps):
                models = []
                for shard in shards:
                    weights = average.copy()
                    for step in range(round_start, round_start + local_steps):
                        weights = weights - learning_rate * gradient(weights, *minibatch(shard, step, batch_size))
                    models.append(weights)
                average = np.mean(models, axis=0)
                rounds += 1
            return average, rounds
            """,), "hidden", "steps are counted from first_step"),
    },
}

# Right solutions other than the reference, which the graded tests must accept too (the solution regions' code, as
# in Wrong.bodies).
ALSO_RIGHT = {
    ("lab1", "ex4-direction", "ex4-tests"): {
        "one filter at a time, drawn with rng.normal": ("""
            direction = []
            for w in weights:
                d = np.zeros(w.shape)
                if w.ndim > 1:
                    for j in range(w.shape[-1]):
                        d_filter = rng.normal(size=w[..., j].shape)
                        d[..., j] = d_filter / np.linalg.norm(d_filter) * np.linalg.norm(w[..., j])
                direction.append(d)
            return direction
            """,),
        "filters as the columns of a (-1, out) reshape": ("""
            direction = []
            for w in weights:
                if w.ndim <= 1:
                    direction.append(np.zeros_like(w))
                    continue
                d = rng.standard_normal(w.shape)
                columns, w_columns = d.reshape(-1, w.shape[-1]), w.reshape(-1, w.shape[-1])
                scale = np.linalg.norm(w_columns, axis=0) / np.linalg.norm(columns, axis=0)
                direction.append((columns * scale).reshape(w.shape))
            return direction
            """,),
    },
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
    ("lab3", "ex6-resume-plan", "ex6-tests"): {
        "the epochs in a dict, the newest by max, broadcast by keyword": ("""
            found = {}
            if rank == 0:
                found = {int(match.group(1)): name for name in files
                         if (match := re.fullmatch(r"checkpoint-epoch(\\d+)\\.keras", name))}
            epoch = broadcast(max(found, default=0), root_rank=0)
            return {"load": found.get(epoch), "initial_epoch": epoch, "initial_step": epoch * steps_per_epoch}
            """,),
        "rank 0 broadcasts its whole plan, the others restore nothing": ("""
            plan = None
            if rank == 0:
                epochs = [int(name[len("checkpoint-epoch"):-len(".keras")]) for name in files
                          if re.fullmatch(r"checkpoint-epoch\\d+\\.keras", name)]
                epoch = max(epochs, default=0)
                plan = {"load": CHECKPOINT_NAME.format(epoch=epoch) if epoch else None, "initial_epoch": epoch,
                        "initial_step": epoch * steps_per_epoch}
            plan = dict(broadcast(plan, 0))
            if rank != 0:
                plan["load"] = None
            return plan
            """,),
    },
    ("lab4", "ex3-spans", "ex3-tests"): {
        # Sorting by time is stable, so a B and the E that share a timestamp keep their order.
        "events sorted by time first, a defaultdict of stacks": ("""
            from collections import defaultdict
            names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and "name" in e.get("args", {})}
            stacks, spans = defaultdict(list), []
            for event in sorted(events, key=lambda e: e.get("ts", -1)):
                if event["ph"] == "B":
                    stacks[event["pid"]].append((event["name"], event["ts"]))
                elif event["ph"] == "E" and stacks[event["pid"]]:
                    phase, start = stacks[event["pid"]].pop()
                    spans.append((names[event["pid"]], phase, start * 1e-3, event["ts"] * 1e-3))
            return spans
            """,),
        "recursion over each tensor's events": ("""
            def close(pid_events, position, spans, name):
                # Returns the position after the span that begins at `position`.
                begin = pid_events[position]
                position += 1
                while position < len(pid_events):
                    if pid_events[position]["ph"] == "B":
                        position = close(pid_events, position, spans, name)
                    else:
                        spans.append((name, begin["name"], begin["ts"] / 1000, pid_events[position]["ts"] / 1000))
                        return position + 1
                return position

            names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and "name" in e.get("args", {})}
            spans = []
            for pid, name in names.items():
                pid_events = [e for e in events if e.get("pid") == pid and e["ph"] in ("B", "E")]
                position = 0
                while position < len(pid_events):
                    if pid_events[position]["ph"] == "B":
                        position = close(pid_events, position, spans, name)
                    else:
                        position += 1
            return spans
            """,),
    },
    ("lab5", "ex4-local-sgd", "ex4-tests"): {
        # With plain SGD steps, averaging the workers' updates and averaging their models are the same.
        "the workers' updates averaged, in place, rounds counted up front": ("""
            average = np.array(initial_weights, dtype=float)
            for round_index in range(total_steps // local_steps):
                round_start = first_step + round_index * local_steps
                updates = []
                for shard in shards:
                    weights = average.copy()
                    for step in range(round_start, round_start + local_steps):
                        weights -= learning_rate * gradient(weights, *minibatch(shard, step, batch_size))
                    updates.append(weights - average)
                average = average + sum(updates) / len(shards)
            return average, total_steps // local_steps
            """,),
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
