"""What instructors and students read after grading: per-student feedback markdown and the class CSV."""

from __future__ import annotations

import csv
import re
from pathlib import Path

CSV_COLUMNS = ("student", "verdict", "score", "heldout_accuracy", "target_accuracy", "wall_time_s",
               "time_budget_s", "np", "ranks_seen", "allreduce_count", "submission_sha256", "reasons", "out_dir")
EPOCH_LINE = re.compile(r"\bepoch (\d+)/(\d+)\s+(.*)")
METRIC = re.compile(r"([a-z_/]+) ([-+0-9.eE]+)")


def score(verdict: dict) -> float:
    return 1.0 if verdict.get("verdict") == "pass" else 0.0


def epoch_curve(rank0_log: Path) -> list[dict]:
    """The per-epoch lines rank 0 printed (``epoch 3/16  loss ...  val_accuracy ...``), as rows.

    What the student printed is shown as their own curve only; nothing in it counts toward the verdict.
    """
    rows = []
    try:
        lines = rank0_log.read_text(errors="replace").splitlines()
    except OSError:
        return rows
    for line in lines:
        match = EPOCH_LINE.search(line)
        if match:
            row = {"epoch": int(match.group(1))}
            row.update((name, value) for name, value in METRIC.findall(match.group(3)))
            rows.append(row)
    return rows[-200:]


def _figure(value, form: str) -> str:
    return "—" if value is None else format(value, form)


def heldout_curve_table(verdict: dict) -> list[str]:
    """The models the run saved, as the grader measured them on the held-out split: what the verdict rests on."""
    measured = [snapshot for snapshot in verdict.get("snapshots") or [] if snapshot.get("heldout_accuracy") is not None]
    if not measured:
        return []
    lines = ["", "## Held-out accuracy the grader measured", "",
             "| snapshot | saved at (s) | held-out accuracy |", "|---|---|---|"]
    for snapshot in measured[-200:]:
        deciding = " (decided the verdict)" if snapshot["index"] == verdict.get("deciding_snapshot") else ""
        lines.append(f"| {snapshot['index']}{deciding} | {snapshot['at_s']:.1f} | {snapshot['heldout_accuracy']:.4f} |")
    return lines


def feedback_markdown(verdict: dict) -> str:
    """One student's feedback: verdict, reasons, accuracy vs target, time vs budget and their epoch curve."""
    lines = [f"# Assessment feedback: {verdict.get('student') or 'submission'}", "",
             f"**Verdict: {verdict['verdict'].upper()}** (track `{verdict.get('track')}`, {verdict.get('np')} ranks)",
             "", "| | yours | required |", "|---|---|---|",
             f"| held-out accuracy (measured by the grader) | {_figure(verdict.get('heldout_accuracy'), '.4f')} "
             f"| ≥ {_figure(verdict.get('target_accuracy'), '.4f')} |",
             f"| wall time, launch to exit | {_figure(verdict.get('wall_time_s'), '.1f')} s | — |",
             f"| time to accuracy (the grader's clock) | {_figure(verdict.get('time_to_accuracy_s'), '.1f')} s "
             f"| ≤ {_figure(verdict.get('time_budget_s'), '.0f')} s |",
             f"| ranks seen allreducing | {len(verdict.get('ranks_seen') or [])} | {verdict.get('np')} |",
             "", "## Why", ""]
    for reason in verdict.get("reasons") or []:
        first, *rest = reason.split("\n")
        lines.append(f"- {first}")
        if rest:
            lines += ["", "  ```", *("  " + line for line in rest), "  ```"]
    for note in verdict.get("notes") or []:
        lines.append(f"- Note: {note}")
    lines += heldout_curve_table(verdict)
    logs_dir = verdict.get("logs_dir")
    curve = epoch_curve(Path(logs_dir) / "rank-0.log") if logs_dir else []
    if curve:
        columns = ["epoch"] + sorted({key for row in curve for key in row} - {"epoch"})
        lines += ["", "## Your training curve (as rank 0 printed it)", "",
                  "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(str(row.get(column, "")) for column in columns) + " |" for row in curve]
    lines += ["", f"Logs: `{logs_dir}`", ""]
    return "\n".join(lines)


def write_csv(path: Path, verdicts: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for verdict in verdicts:
            row = {column: verdict.get(column) for column in CSV_COLUMNS}
            row["score"] = score(verdict)
            row["ranks_seen"] = " ".join(str(rank) for rank in verdict.get("ranks_seen") or [])
            row["reasons"] = " | ".join(reason.split("\n")[0] for reason in verdict.get("reasons") or [])
            writer.writerow(row)
