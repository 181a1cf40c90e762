"""The questions lab 3's graded cells ask of a probed two-rank run of the student's conversion.

Each conversion step is judged by what the ranks did (:mod:`conversion_run`), not by how the script spells it:
``problems(run, step)`` returns the mistakes the run shows for ``step``, in the student's terms, or [] when the
step is done right; ``check(script, step)`` runs the script once per kernel (the same file is not run twice) and
raises an AssertionError that names them. When the run stopped before a question could be answered, the answer
says where it stopped instead of guessing.
"""

from __future__ import annotations

from pathlib import Path

from .conversion_run import STALL_S, ConversionRun, run_conversion, script_digest

STEPS = ("init", "pin_device", "rank0_output", "scaled_lr", "distributed_optimizer", "broadcast",
         "steps_per_epoch", "metric_average", "rank0_checkpoint", "two_ranks")
# Callbacks that read the epoch's metrics: under Horovod they must see the averaged ones.
METRIC_READERS = ("ReduceLROnPlateau", "EarlyStopping", "ModelCheckpoint", "StopAtAccuracy", "EpochPrinter",
                  "CSVLogger", "CSVTimeLog", "TensorBoard")
# Callbacks that change how training goes on: a rank without them trains differently or waits for ever.
TRAINING_CONTROLLERS = ("EarlyStopping", "StopAtAccuracy", "ReduceLROnPlateau", "LearningRateScheduler",
                        "TerminateOnNaN", "BroadcastGlobalVariablesCallback", "MetricAverageCallback")
RELATIVE_TOLERANCE = 1e-4

_runs: dict[tuple[str, str], ConversionRun] = {}


def stopped_early(run: ConversionRun) -> str:
    """Why a question could not be answered: where the ranks were, and the error if one was raised."""
    said = f"the two-rank run stopped before this could be seen ({run.where()})"
    errors = [record["error"] for record in run.records.values() if record.get("error")]
    if errors:
        said += f": {errors[0]}"
    elif run.stopped:
        said += f": {run.stopped}"
    return said


def fit_of(record: dict) -> dict | None:
    return record["fits"][0] if record.get("fits") else None


def ranks_with(run: ConversionRun, needed: str) -> dict[int, dict] | None:
    """The records of all ranks, when every rank got as far as ``needed`` ("init", "fit", "steps"); else None."""
    if len(run.records) < run.size:
        return None
    for record in run.records.values():
        if needed == "init" and record.get("init") is None:
            return None
        if needed == "fit" and not record.get("fits"):
            return None
        if needed == "steps" and not record.get("steps"):
            return None
    return run.records


def _ask_init(run: ConversionRun) -> list[str]:
    found = []
    for rank, record in sorted(run.records.items()):
        if record.get("init") is None:
            if "not been initialized" in (record.get("error") or ""):
                found.append(f"rank {rank} used Horovod before hvd.init() had run: call hvd.init() first, so that "
                             "every rank learns its rank and the number of ranks")
            elif record.get("fits"):
                found.append(f"rank {rank} trained without calling hvd.init(): the ranks never learned of each "
                             "other, so each trained alone")
            continue
        if record["init"]["tensorflow_started"]:
            found.append(f"on rank {rank} hvd.init() ran after TensorFlow had started (a model or a tensor was "
                         "already made): call it before anything builds the model, so the GPU can still be pinned")
    if not found and ranks_with(run, "init") is None:
        found.append(stopped_early(run))
    return found


def _ask_pin_device(run: ConversionRun) -> list[str]:
    found = []
    for rank, record in sorted(run.records.items()):
        if not record["pins"]:
            if record.get("fits"):
                found.append(f"rank {rank} pinned no GPU: call pin_gpu(hvd.local_rank()) right after hvd.init(), or "
                             "on a machine with GPUs every rank takes all of them")
            continue
        chosen = record["pins"][-1]["gpus"]
        if chosen != [0]:
            found.append(f"rank {rank} pinned GPU {chosen[0] if len(chosen) == 1 else chosen}, but it is the first "
                         "process on its machine (local rank 0): choose the GPU by hvd.local_rank(); hvd.rank() "
                         "counts the processes of all machines")
        if any(pin["tensorflow_started"] for pin in record["pins"]):
            found.append(f"rank {rank} pinned its GPU after TensorFlow had started, when the choice no longer "
                         "takes effect: pin right after hvd.init(), before the model is built")
    if not found and ranks_with(run, "fit") is None:
        found.append(stopped_early(run))
    return found


def _ask_rank0_output(run: ConversionRun) -> list[str]:
    found = []
    for rank in range(1, run.size):
        lines = [line for line in run.printed.get(rank, []) if line.strip()]
        if lines:
            found.append(f"rank {rank} printed {len(lines)} line(s), for example {lines[0].strip()[:80]!r}: only "
                         "rank 0 prints (print under `if hvd.rank() == 0`, callbacks told is_chief, verbose=0 "
                         "elsewhere), or every message comes once per rank")
    if not found and not run.finished:  # the ranks might have printed later
        found.append(stopped_early(run))
    return found


def _effective_rate(fit: dict, size: int) -> float | None:
    peak = fit.get("peak_learning_rate")
    if peak is None:
        return None
    distributed = fit.get("distributed") or {}
    for op in (distributed.get("op"), distributed.get("inner_op")):
        if op == "Sum":
            peak *= size
    return peak


def _close(value: float, expected: float) -> bool:
    return abs(value - expected) <= RELATIVE_TOLERANCE * abs(expected)


def _ask_scaled_lr(run: ConversionRun) -> list[str]:
    records = ranks_with(run, "fit")
    if records is None:
        return [stopped_early(run)]
    fit, base, size = fit_of(records[0]), run.base_lr, run.size
    effective = _effective_rate(fit, size)
    if effective is None:
        return ["the learning rate of the optimizer given to compile could not be read: give it a number or a "
                "Keras LearningRateSchedule"]
    expected = base * size
    if _close(effective, expected):
        return []
    summed = "Sum" in ((fit.get("distributed") or {}).get("op"), (fit.get("distributed") or {}).get("inner_op"))
    if summed:
        return [f"the optimizer sums the gradients of the {size} ranks (op=hvd.Sum) and the peak rate is "
                f"{fit['peak_learning_rate']:g}, so each update moves {effective / base:g}x as far as --base-lr "
                f"{base:g} on one rank: with {size} ranks it must be {size}x (average the gradients and multiply "
                "the rate by hvd.size())"]
    if _close(effective, base):
        return [f"the peak learning rate is {effective:g}, the same as --base-lr on one rank, although each update "
                f"now averages a batch {size}x larger: multiply it by hvd.size() ({expected:g} on {size} ranks)"]
    if _close(effective, base * size * size):
        return [f"the peak learning rate is {effective:g}: --base-lr {base:g} was multiplied by hvd.size() twice; "
                f"once is right ({expected:g} on {size} ranks)"]
    return [f"the peak learning rate is {effective:g} with --base-lr {base:g} on {size} ranks: scale the learning "
            f"rate linearly with the number of ranks, to --base-lr x hvd.size() = {expected:g}"]


def _ask_distributed_optimizer(run: ConversionRun) -> list[str]:
    for rank, record in sorted(run.records.items()):
        wrappings = [call for call in record.get("optimizer_wrappings", []) if call["wraps_a_distributed_optimizer"]]
        if wrappings:
            return [f"on rank {rank} an optimizer that hvd.DistributedOptimizer already wrapped is wrapped again: "
                    "wrap the plain optimizer once (twice allreduces every gradient twice, and Horovod cannot "
                    "build it)"]
    records = ranks_with(run, "fit")
    if records is None:
        return [stopped_early(run)]
    found = []
    for rank, record in sorted(records.items()):
        fit = fit_of(record)
        distributed = fit.get("distributed")
        if distributed is None:
            found.append(f"on rank {rank} the optimizer given to compile is a plain {fit['optimizer']}, not the one "
                         "hvd.DistributedOptimizer returned: each rank would step with its own gradients only")
        elif "Sum" in (distributed["op"], distributed.get("inner_op")):
            found.append(f"on rank {rank} the DistributedOptimizer sums the gradients (op=hvd.Sum): average them "
                         "(the default op) and scale the learning rate instead")
        if found:
            break  # the same mistake on every rank is said once
    return found


def _ask_broadcast(run: ConversionRun) -> list[str]:
    records = ranks_with(run, "fit")
    if records is None:
        return [stopped_early(run)]
    roots = {rank: fit_of(record)["broadcast_roots"] for rank, record in records.items()}
    by_hand = {rank: [call["root_rank"] for call in record["broadcast_calls"]] for rank, record in records.items()}
    joined = [rank for rank in records if roots[rank] or by_hand[rank]]
    if joined and len(joined) < run.size:
        missing = sorted(set(records) - set(joined))
        return [f"only rank(s) {', '.join(map(str, sorted(joined)))} take part in the broadcast, rank(s) "
                f"{', '.join(map(str, missing))} never do, so the broadcast waits for ever: give every rank "
                "BroadcastGlobalVariablesCallback(0)"]
    wrong_roots = sorted({root for rank in records for root in roots[rank] + by_hand[rank] if root != 0})
    if wrong_roots:
        return [f"the weights are broadcast from rank {wrong_roots[0]}: broadcast from rank 0, the rank that writes "
                "the checkpoints and would restore them"]
    after_first = {record["weights"].get("after_first_step") for record in records.values()}
    if None in after_first:
        return [stopped_early(run)]
    if len(after_first) > 1:
        return ["after the first step the ranks hold different weights: broadcast rank 0's initial weights to "
                "every rank (BroadcastGlobalVariablesCallback(0) in the callbacks of every rank)"]
    at_start = {record["weights"].get("train_begin") for record in records.values()}
    if not joined and len(at_start) == 1:
        return ["the ranks started from the same weights only because they drew the same random numbers (the same "
                "seed on every rank); no rank broadcast, so with other seeds they start apart: broadcast rank 0's "
                "weights (BroadcastGlobalVariablesCallback(0))"]
    return []


def _examples_per_rank(run: ConversionRun, records: dict[int, dict]) -> dict[int, list[list[str]]]:
    """The examples of each step of the first epoch, per rank (from the batches the probe saw)."""
    drawn = {}
    for rank, record in records.items():
        steps = record["steps"][0]
        if record.get("batches"):
            drawn[rank] = record["batches"][:steps]
        elif record.get("array_examples"):
            drawn[rank] = [record["array_examples"]]
    return drawn


def _ask_steps_per_epoch(run: ConversionRun) -> list[str]:
    records = ranks_with(run, "steps")
    if records is None:
        return [stopped_early(run)]
    found = []
    batch, size, images = run.batch_size, run.size, run.train_images
    expected_steps = images // (batch * size)
    for rank, record in sorted(records.items()):
        sizes = {len(examples) for examples in record.get("batches", [])[:record["steps"][0]]}
        batch_size = fit_of(record).get("batch_size") if not record.get("batches") else None
        if sizes and sizes != {batch} or batch_size not in (None, batch):
            shown = batch_size or sorted(sizes)[-1]
            found.append(f"rank {rank}'s batches hold {shown} images: --batch-size ({batch}) is the batch of one "
                         f"rank; the batch of one update is {batch} x hvd.size()")
            break
    for rank, record in sorted(records.items()):
        steps = record["steps"][0]
        if steps != expected_steps and run.finished:
            found.append(f"rank {rank} ran {steps} steps in the first epoch: with {images} images, batches of {batch} "
                         f"and {size} ranks, one pass over the data is {expected_steps} steps per rank (divide the "
                         "steps per epoch by hvd.size())")
            break
    drawn = _examples_per_rank(run, records)
    if not run.finished and (len(drawn) < size or any(not examples for examples in drawn.values())):
        if not found:
            found.append(stopped_early(run))
    elif len(drawn) == size:
        seen_by_zero = {example for batch_examples in drawn[0] for example in batch_examples}
        for rank in range(1, size):
            for step, batch_examples in enumerate(drawn[rank], start=1):
                shared = seen_by_zero.intersection(batch_examples)
                if shared:
                    total = len(seen_by_zero.intersection(e for b in drawn[rank] for e in b))
                    found.append(f"rank {rank} trained on {total} of the same images as rank 0 in the first epoch "
                                 f"({len(shared)} of them in its step {step}): give each rank its own share of the "
                                 "images, chosen by hvd.rank() and hvd.size() (shard_arrays or Dataset.shard)")
                    break
    else:
        found.append("the images each rank trained on could not be seen: pass fit a tf.data.Dataset or arrays")
    return found


def _ask_metric_average(run: ConversionRun) -> list[str]:
    records = ranks_with(run, "fit")
    if records is None:
        return [stopped_early(run)]
    found = []
    callbacks = {rank: fit_of(record)["callbacks"] for rank, record in records.items()}
    for rank, names in sorted(callbacks.items()):
        if "MetricAverageCallback" not in names:
            found.append(f"rank {rank} does not average the metrics: add hvd.callbacks.MetricAverageCallback() to "
                         "the callbacks of every rank, so the callbacks that read val_accuracy see all ranks' value")
            break
        first_reader = next((name for name in names if name in METRIC_READERS), None)
        if first_reader and names.index(first_reader) < names.index("MetricAverageCallback"):
            found.append(f"on rank {rank} {first_reader} comes before MetricAverageCallback in the callbacks, so it "
                         f"reads rank {rank}'s own metrics: put MetricAverageCallback before every callback that "
                         "reads them")
            break
    for name in TRAINING_CONTROLLERS:
        having = sorted(rank for rank, names in callbacks.items() if name in names)
        if having and len(having) < run.size:
            found.append(f"{name} runs on rank(s) {', '.join(map(str, having))} only: when it changes or stops "
                         "training there, the other ranks go on and wait for them for ever; give it to every rank")
    validating = sorted(rank for rank, record in records.items() if fit_of(record)["validation"])
    if validating and len(validating) < run.size:
        found.append(f"only rank(s) {', '.join(map(str, validating))} validate: every rank validates its share of "
                     "the held-out images, and MetricAverageCallback averages val_accuracy over the ranks")
    if not found:
        seen = [record["epoch_logs"][0].get("val_accuracy") if record["epoch_logs"] else None
                for record in records.values()]
        if None not in seen and len(set(seen)) > 1:
            found.append(f"the ranks' callbacks saw different val_accuracy at the end of epoch 1 ({seen}): the "
                         "metrics must be averaged over the ranks before the callbacks read them")
    return found


def _ask_rank0_checkpoint(run: ConversionRun) -> list[str]:
    records = ranks_with(run, "fit")
    if records is None:
        return [stopped_early(run)]
    found = []
    for rank, record in sorted(records.items()):
        wrote = [Path(save["path"]).name for save in record["saves"]]
        checkpointing = "ModelCheckpoint" in fit_of(record)["callbacks"]
        if rank != 0 and (wrote or checkpointing):
            found.append(f"rank {rank} writes checkpoints too ({', '.join(wrote) or 'ModelCheckpoint'}): only rank 0 "
                         "writes them (the ranks hold the same weights, and several writers of one file can leave "
                         "it broken); local rank 0 is one rank per machine, not one in all")
            break
    if run.finished and not records[0]["saves"]:
        found.append("rank 0 wrote no checkpoint: keep ModelCheckpoint in rank 0's callbacks")
    return found


def _ask_two_ranks(run: ConversionRun) -> list[str]:
    if run.stopped:
        return [f"the two-rank run was stopped: {run.stopped} ({run.where()})"]
    if run.returncode != 0:
        return [f"the two-rank run failed (exit status {run.returncode}): {stopped_early(run)}; its last lines:\n"
                f"{run.tail}"]
    finals = {record["weights"].get("train_end") for record in run.records.values()}
    if len(run.records) < run.size or None in finals:
        return [stopped_early(run)]
    if len(finals) > 1:
        return ["the two ranks ended with different weights: broadcast rank 0's initial weights "
                "(BroadcastGlobalVariablesCallback(0)) and average the gradients (hvd.DistributedOptimizer)"]
    return []


QUESTIONS = {"init": _ask_init, "pin_device": _ask_pin_device, "rank0_output": _ask_rank0_output,
             "scaled_lr": _ask_scaled_lr, "distributed_optimizer": _ask_distributed_optimizer,
             "broadcast": _ask_broadcast, "steps_per_epoch": _ask_steps_per_epoch,
             "metric_average": _ask_metric_average, "rank0_checkpoint": _ask_rank0_checkpoint,
             "two_ranks": _ask_two_ranks}


def problems(run: ConversionRun, step: str) -> list[str]:
    if step not in QUESTIONS:
        raise ValueError(f"unknown step {step!r}; choose one of {STEPS}")
    return QUESTIONS[step](run)


def graded_run(script: Path | str, controller: str = "--gloo", stall_s: float = STALL_S) -> ConversionRun:
    """The probed run of ``script`` as it is now; run once per content of the file."""
    key = (script_digest(script), controller)
    if key not in _runs:
        _runs[key] = run_conversion(script, controller=controller, stall_s=stall_s)
    return _runs[key]


def check(script: Path | str, step: str, controller: str = "--gloo") -> None:
    """Raise an AssertionError naming what the run of ``script`` shows wrong for ``step``."""
    path = Path(script)
    if not path.is_file():
        raise AssertionError(f"{path.name} is missing: it must be next to this notebook")
    found = problems(graded_run(path, controller), step)
    assert not found, f"{step.replace('_', ' ')}: " + "; ".join(found)


def report(script: Path | str, controller: str = "--gloo") -> str:
    """Every step's answer for ``script``, one line each: what the graded cells will say."""
    path = Path(script)
    if not path.is_file():
        return f"{path.name} is missing: it must be next to this notebook"
    run = graded_run(path, controller)
    lines = [f"graded two-rank run of {path.name} ({run.elapsed_s:.0f} s):"]
    for step in STEPS:
        found = problems(run, step)
        lines.append(f"  {'ok' if not found else 'NO'}  {step.replace('_', ' ')}" + (f": {'; '.join(found)}"
                                                                                   if found else ""))
    return "\n".join(lines)
