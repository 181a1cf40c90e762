"""The questions the graded cells of lab 3's PyTorch edition ask of a probed two-rank run of the student's DDP
conversion.

Each step is judged by what the ranks did (:mod:`ddp_run`), not by how the script spells it: ``problems(run, step)``
returns the mistakes the run shows for ``step``, in the student's terms, or [] when the step is done right;
``check(script, step)`` runs the script once per kernel (the same file is not run twice) and raises an
AssertionError that names them. When the run stopped before a question could be answered, the answer says where it
stopped instead of guessing.
"""

from __future__ import annotations

import re
from pathlib import Path

from .conversion_questions import stopped_early
from .conversion_run import script_digest
from .ddp_run import STALL_S, DDPRun, run_ddp

STEPS = ("init", "sampler", "ddp", "scaled_lr", "metrics", "rank0_writes", "two_ranks")
RELATIVE_TOLERANCE = 1e-4
PRINTED_FRACTION = re.compile(r"\b(accuracy|val_accuracy) (\d+\.\d+)")

_runs: dict[str, DDPRun] = {}


def training_passes(record: dict) -> list[tuple[int, dict]]:
    """(index among all the loader passes, pass) of each pass over a DataLoader in which the optimizer stepped."""
    return [(index, entry) for index, entry in enumerate(record["passes"]) if entry.get("steps")]


def ranks_with(run: DDPRun, needed: str) -> dict[int, dict] | None:
    """The records of all ranks, when every rank got as far as ``needed`` ("init": a process group; "training": a
    training epoch; "epochs": every epoch's training); else None."""
    if len(run.records) < run.size:
        return None
    for record in run.records.values():
        if needed == "init" and "world_size" not in (record.get("init") or {}):
            return None
        if needed == "training" and not training_passes(record):
            return None
        if needed == "epochs" and len(training_passes(record)) < run.epochs:
            return None
    return run.records


def _ask_init(run: DDPRun) -> list[str]:
    found = []
    for rank, record in sorted(run.records.items()):
        init = record.get("init")
        if init is None:
            if "not been initialized" in (record.get("error") or ""):
                found.append(f"rank {rank} used torch.distributed (a DistributedSampler, DDP or an all-reduce) before "
                             "init_process_group had run: call dist.init_process_group(\"gloo\") first")
            elif record.get("steps"):
                found.append(f"rank {rank} trained without calling dist.init_process_group: the ranks never joined "
                             "one group, so each trained alone")
            continue
        if init.get("failed"):
            asked = init.get("backend_asked") or "default"
            if "nccl" in asked.lower():
                found.append(f"rank {rank} asked init_process_group for the {asked!r} backend, which needs a GPU for "
                             "every rank: these ranks run on CPUs, whose backend is Gloo: "
                             "dist.init_process_group(\"gloo\")")
            else:
                found.append(f"init_process_group failed on rank {rank}: {init['failed']}")
            continue
        if "world_size" not in init:
            continue  # still joining when the run ended: said below
        if "gloo" not in init["backend"]:
            found.append(f"rank {rank}'s process group uses the {init['backend']!r} backend: these ranks run on CPUs, "
                         "whose backend is Gloo: dist.init_process_group(\"gloo\")")
        if init["world_size"] != run.size:
            found.append(f"rank {rank}'s process group has {init['world_size']} process(es), but torchrun started "
                         f"{run.size}: call init_process_group without world_size= and rank= (torchrun's environment "
                         "gives them)")
        elif init["rank"] != rank:
            found.append(f"the process torchrun started as rank {rank} joined the group as rank {init['rank']}: let "
                         "init_process_group take the rank from torchrun's environment")
        if found:
            break  # the same mistake on every rank is said once
    if not found and ranks_with(run, "init") is None:
        found.append(stopped_early(run))
    return found


def _ask_sampler(run: DDPRun) -> list[str]:
    records = ranks_with(run, "training")
    if records is None:
        return [stopped_early(run)]
    first_epoch = {rank: training_passes(record)[0][1] for rank, record in records.items()}
    for rank, entry in sorted(first_epoch.items()):
        if not entry["distributed"]:
            return [f"rank {rank}'s training DataLoader draws its batches with a {entry['sampler']}, not a "
                    f"DistributedSampler: every rank goes through all {entry['dataset_size']} images each epoch, the "
                    "same images as the others. Give the DataLoader sampler=DistributedSampler(train_set, "
                    "shuffle=True) (and no shuffle=True of its own)"]
    for rank, entry in sorted(first_epoch.items()):
        if entry["num_replicas"] != run.size:
            return [f"rank {rank}'s DistributedSampler splits the images into {entry['num_replicas']} share(s), but "
                    f"{run.size} ranks train: num_replicas is the world size (dist.get_world_size())"]
        if entry["sampler_rank"] != rank:
            return [f"rank {rank}'s DistributedSampler hands it share {entry['sampler_rank']}, another rank's: give it "
                    "rank=dist.get_rank(), so that each rank takes its own share"]
    found = []
    seen_by_zero = set(first_epoch[0]["indices"] or [])
    for rank in range(1, run.size):
        shared = seen_by_zero.intersection(first_epoch[rank]["indices"] or [])
        if shared:
            found.append(f"rank {rank} trained on {len(shared)} of the same images as rank 0 in epoch 1: give the "
                         "DistributedSampler of every rank the same seed, so that their shares do not overlap")
            break
    records = ranks_with(run, "epochs")
    if records is None:
        return found or [stopped_early(run)]
    for rank, record in sorted(records.items()):
        epochs = [entry for _, entry in training_passes(record)[:run.epochs]]
        orders = {tuple(entry["indices"] or ()) for entry in epochs}
        if len(orders) < len(epochs):
            if not epochs[0].get("shuffle", True):
                found.append(f"rank {rank}'s DistributedSampler was made with shuffle=False: it hands out its images "
                             "in the same order every epoch; make it with shuffle=True (and call set_epoch each epoch)")
            else:
                found.append(f"rank {rank}'s DistributedSampler was at epoch "
                             f"{[entry['sampler_epoch'] for entry in epochs]} in the {len(epochs)} epochs, so it "
                             "shuffled the images the same way each time: call train_sampler.set_epoch(epoch) at the "
                             "start of every epoch, before the loop over the DataLoader")
            break
    return found


def _ask_ddp(run: DDPRun) -> list[str]:
    records = ranks_with(run, "training")
    if records is None:
        return [stopped_early(run)]
    for rank, record in sorted(records.items()):
        if not record["ddp"]:
            return [f"rank {rank} trained the model without DistributedDataParallel: each rank stepped with its own "
                    "gradients only, so the ranks drift apart. Wrap it: model = DistributedDataParallel(model)"]
        if not record["ddp_training_forwards"]:
            return [f"rank {rank} wrapped the model in DistributedDataParallel but trained the plain model (no "
                    "training step went through the wrapper), so no gradient was averaged: train the wrapper that "
                    "DistributedDataParallel(model) returns"]
    return []


def _close(value: float, expected: float) -> bool:
    return abs(value - expected) <= RELATIVE_TOLERANCE * abs(expected)


def _ask_scaled_lr(run: DDPRun) -> list[str]:
    records = ranks_with(run, "training")
    if records is None:
        return [stopped_early(run)]
    peak, base, size = records[0]["peak_lr"], run.lr, run.size
    expected = base * size
    if _close(peak, expected):
        return []
    if _close(peak, base):
        return [f"the learning rate is {peak:g}, the same as --lr on one rank, although each update now averages a "
                f"batch {size}x larger: multiply it by the world size ({expected:g} on {size} ranks)"]
    if _close(peak, base * size * size):
        return [f"the learning rate is {peak:g}: --lr {base:g} was multiplied by the world size twice; once is right "
                f"({expected:g} on {size} ranks)"]
    return [f"the largest learning rate of the optimizer is {peak:g} with --lr {base:g} on {size} ranks: scale it "
            f"linearly with the number of ranks, to --lr x world size = {expected:g}"]


def _ask_metrics(run: DDPRun) -> list[str]:
    records = ranks_with(run, "training")
    if records is None:
        return [stopped_early(run)]
    for rank, record in sorted(records.items()):
        epochs = training_passes(record)
        for epoch, (index, _) in enumerate(epochs):
            later = epochs[epoch + 1][0] if epoch + 1 < len(epochs) else None
            if later is None and not run.finished:
                break  # the epoch's figures may still have been coming
            reduced = [call for call in record["all_reduces"]
                       if call["passes_started"] > index and (later is None or call["passes_started"] <= later)]
            if not reduced:
                return [f"rank {rank} all-reduced nothing in epoch {epoch + 1}: the loss and accuracy of each rank "
                        "are then its own share's only. Add up the loss, the correct answers and the image counts "
                        "over the ranks with dist.all_reduce(tensor, op=dist.ReduceOp.SUM) every epoch (validation "
                        "too), then divide"]
    printed = [(name, float(value)) for line in records[0]["printed"] if line.startswith("epoch ")
               for name, value in PRINTED_FRACTION.findall(line)]
    beyond_one = [(name, value) for name, value in printed if value > 1.0]
    if beyond_one:
        name, value = beyond_one[0]
        return [f"rank 0 printed {name} {value:g}, more than 1: the ranks' accuracies were added up. Add up the "
                "correct answers and the image counts over the ranks, then divide"]
    if ranks_with(run, "epochs") is None:
        return [stopped_early(run)]
    return []


def _ask_rank0_writes(run: DDPRun) -> list[str]:
    found = []
    for rank, record in sorted(run.records.items()):
        if rank == 0:
            continue
        if record["writes"]:
            names = sorted({Path(write["path"]).name for write in record["writes"]})
            found.append(f"rank {rank} wrote {', '.join(names)} too ({record['writes'][0]['how']}): only rank 0 "
                         "writes files (under `if rank == 0`): the ranks hold the same weights, and two writers of "
                         "one file can leave it broken")
        lines = [line for line in record["printed"] if line.strip()]
        if lines:
            found.append(f"rank {rank} printed {len(lines)} line(s), for example {lines[0].strip()[:80]!r}: only "
                         "rank 0 prints, or every line comes once per rank")
        if found:
            break
    if found:
        return found
    if not run.finished:
        return [stopped_early(run)]
    chief = run.records[0]
    if not chief["writes"]:
        found.append("rank 0 wrote no checkpoint: keep the torch.save of each epoch, on rank 0")
    if not any(line.startswith("epoch ") for line in chief["printed"]):
        found.append("rank 0 printed no epoch line: rank 0 reports every epoch")
    return found


def _ask_two_ranks(run: DDPRun) -> list[str]:
    if run.stopped:
        return [f"the two-rank run was stopped: {run.stopped} ({run.where()})"]
    if run.returncode != 0:
        return [f"the two-rank run failed (exit status {run.returncode}): {stopped_early(run)}; its last lines:\n"
                f"{run.tail}"]
    finals = {record["weights"].get("end") for record in run.records.values()}
    if len(run.records) < run.size or None in finals:
        return [stopped_early(run)]
    if len(finals) > 1:
        return ["the two ranks ended with different weights: train the model wrapped in DistributedDataParallel (it "
                "starts every rank from rank 0's weights and averages every gradient)"]
    return []


QUESTIONS = {"init": _ask_init, "sampler": _ask_sampler, "ddp": _ask_ddp, "scaled_lr": _ask_scaled_lr,
             "metrics": _ask_metrics, "rank0_writes": _ask_rank0_writes, "two_ranks": _ask_two_ranks}


def problems(run: DDPRun, step: str) -> list[str]:
    if step not in QUESTIONS:
        raise ValueError(f"unknown step {step!r}; choose one of {STEPS}")
    return QUESTIONS[step](run)


def graded_run(script: Path | str, stall_s: float = STALL_S) -> DDPRun:
    """The probed run of ``script`` as it is now; run once per content of the file."""
    key = script_digest(script)
    if key not in _runs:
        _runs[key] = run_ddp(script, stall_s=stall_s)
    return _runs[key]


def check(script: Path | str, step: str) -> None:
    """Raise an AssertionError naming what the run of ``script`` shows wrong for ``step``."""
    path = Path(script)
    if not path.is_file():
        raise AssertionError(f"{path.name} is missing: it must be next to this notebook")
    found = problems(graded_run(path), step)
    assert not found, f"{step.replace('_', ' ')}: " + "; ".join(found)


def report(script: Path | str) -> str:
    """Every step's answer for ``script``, one line each: what the graded cells will say."""
    path = Path(script)
    if not path.is_file():
        return f"{path.name} is missing: it must be next to this notebook"
    run = graded_run(path)
    lines = [f"graded two-rank run of {path.name} ({run.elapsed_s:.0f} s):"]
    for step in STEPS:
        found = problems(run, step)
        lines.append(f"  {'ok' if not found else 'NO'}  {step.replace('_', ' ')}"
                     + (f": {'; '.join(found)}" if found else ""))
    return "\n".join(lines)
