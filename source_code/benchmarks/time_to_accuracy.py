"""Time-to-accuracy of the reference solution vs the serial baseline on a track, read from `scalelab calibrate`.

Calibration already runs both under the grader (the reference several times, the baseline once, on a quiet
machine), so the benchmark reads those runs instead of training again for eight more minutes:
``CALIBRATION/reference-K/`` and ``CALIBRATION/baseline/``, each with the grader's ``verdict.json`` and the
rank-0 log, whose epoch lines (scalelab.callbacks.format_epoch) give validation accuracy against training time.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .summary import spread

EPOCH_LINE = re.compile(r"^(?:\[[\d,]+\]<stdout>:)?epoch (\d+)/\d+.*\bval_accuracy ([\d.]+).*\belapsed ([\d.]+) s",
                        re.MULTILINE)


def epoch_curve(log_text: str) -> list[tuple[float, float]]:
    """``(elapsed_s, val_accuracy)`` of every epoch line, in order."""
    return [(float(elapsed), float(accuracy)) for _, accuracy, elapsed in EPOCH_LINE.findall(log_text)]


def read_run(run_dir: Path) -> dict | None:
    """One graded run: its verdict's figures and its epoch curve; None if the run is not there."""
    verdict_file, log_file = run_dir / "verdict.json", run_dir / "logs" / "rank-0.log"
    if not verdict_file.is_file() or not log_file.is_file():
        return None
    verdict = json.loads(verdict_file.read_text())
    return {"run": run_dir.name, "verdict": verdict["verdict"], "wall_time_s": verdict["wall_time_s"],
            "heldout_accuracy": verdict["heldout_accuracy"], "time_budget_s": verdict.get("time_budget_s"),
            "target_accuracy": verdict.get("target_accuracy"), "curve": epoch_curve(log_file.read_text(errors="replace"))}


def read_calibration(calibration_dir: Path) -> dict:
    """The reference runs and the baseline run of one ``scalelab calibrate --out CALIBRATION_DIR``.

    Raises ``FileNotFoundError`` naming what is missing, so the report can say why the plot is not there.
    """
    references = [run for run in (read_run(path) for path in sorted(calibration_dir.glob("reference-*"))) if run]
    baseline = read_run(calibration_dir / "baseline")
    if not references or baseline is None:
        raise FileNotFoundError(f"no finished calibration runs in {calibration_dir} (reference-K/ and baseline/ "
                                f"with verdict.json and logs/rank-0.log): run `scalelab calibrate --track "
                                f"cifar10-cpu --out {calibration_dir}` first")
    return {"source": str(calibration_dir), "references": references, "baseline": baseline,
            "reference_wall_time_s": spread([run["wall_time_s"] for run in references]),
            "reference_heldout_accuracy": spread([run["heldout_accuracy"] or 0.0 for run in references])}
