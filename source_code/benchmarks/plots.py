"""The report's PNG plots (matplotlib, no display needed). Each takes the figures' dicts and a path."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)


def _errorbars(spreads):
    medians = [s["median"] for s in spreads]
    return medians, [[m - s["min"] for m, s in zip(medians, spreads)], [s["max"] - m for m, s in zip(medians, spreads)]]


def allreduce_bandwidth(documents: list[dict], path: Path) -> Path:
    """Bus bandwidth vs message size, one line per transport, with single-core memcpy as a reference line."""
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for document in documents:
        sizes = [row["message_bytes"] for row in document["sizes"]]
        medians, errors = _errorbars([row["bus_gb_per_s_spread"] for row in document["sizes"]])
        axes.errorbar(sizes, medians, yerr=errors, marker="o", capsize=3,
                      label=f"hvd.allreduce, np {document['ranks']}, {document.get('variant', document['controller'])}")
    if documents:
        # The reference every P6 ratio divides by (the median over the jobs' own memcpy measurements).
        memcpy = sorted(d["memcpy_gb_per_s_spread"]["median"] for d in documents)[len(documents) // 2]
        axes.axhline(memcpy, linestyle="--", color="grey", label=f"memcpy, one core: {memcpy:.1f} GB/s")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("message size (bytes)")
    axes.set_ylabel("bus bandwidth (GB/s)")
    axes.set_title("Allreduce bandwidth vs message size (median, min–max)")
    axes.legend(loc="center left")
    axes.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def throughput_vs_batch(sweep: list[dict], path: Path) -> Path:
    figure, axes = plt.subplots(figsize=(6, 4))
    labels = [str(row["batch_size"]) for row in sweep]
    medians, errors = _errorbars([row["images_per_s"] for row in sweep])
    axes.bar(labels, medians, yerr=errors, capsize=4, color="tab:blue")
    axes.set_xlabel("batch size")
    axes.set_ylabel("images/s")
    axes.set_title("Bare training step of the course's small CNN (median, min–max)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def class_grading_timeline(jobs: list[list[float]], slots: int, path: Path) -> Path:
    """Each job as a bar on the slot it ran in (slots assigned greedily by start time), to see idle gaps."""
    figure, axes = plt.subplots(figsize=(8, 1.2 + 0.6 * slots))
    slot_free_at = [0.0] * slots
    for start, end in sorted(jobs):
        slot = min(range(slots), key=lambda index: (slot_free_at[index] > start + 1e-6, slot_free_at[index]))
        axes.barh(slot, end - start, left=start, color="tab:green", edgecolor="black")
        slot_free_at[slot] = end
    axes.set_yticks(range(slots), [f"slot {index + 1}" for index in range(slots)])
    axes.set_xlabel("seconds since grading began")
    axes.set_title(f"Class grading: {len(jobs)} jobs on {slots} slots")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def time_to_accuracy(calibration: dict, path: Path) -> Path:
    """Validation accuracy vs training time of every reference run and of the baseline, with the track's
    budget and target, and each run's held-out accuracy (the grader's) at its wall time."""
    figure, axes = plt.subplots(figsize=(7, 4.5))
    baseline = calibration["baseline"]
    for index, run in enumerate(calibration["references"]):
        times, accuracies = zip(*run["curve"]) if run["curve"] else ((), ())
        axes.plot(times, accuracies, marker=".", color="tab:blue", alpha=0.6,
                  label="reference solution, 2 ranks (validation)" if index == 0 else None)
        axes.plot([run["wall_time_s"]], [run["heldout_accuracy"] or 0], marker="*", markersize=11, color="tab:blue",
                  linestyle="none", label="reference: held-out accuracy at exit" if index == 0 else None)
    if baseline["curve"]:
        times, accuracies = zip(*baseline["curve"])
        axes.plot(times, accuracies, marker=".", color="tab:red", label="serial baseline (validation)")
    axes.plot([baseline["wall_time_s"]], [baseline["heldout_accuracy"] or 0], marker="*", markersize=11,
              color="tab:red", linestyle="none", label=f"baseline at exit ({baseline['verdict']})")
    if baseline.get("time_budget_s"):
        axes.axvline(baseline["time_budget_s"], linestyle="--", color="grey", label="time budget")
    if baseline.get("target_accuracy"):
        axes.axhline(baseline["target_accuracy"], linestyle=":", color="black", label="target accuracy")
    axes.set_xlabel("seconds (epoch lines: since training began; stars: the grader's launch-to-exit time)")
    axes.set_ylabel("accuracy")
    axes.set_title("Time to accuracy: reference solution vs serial baseline")
    axes.legend(loc="lower right", fontsize=8)
    axes.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
