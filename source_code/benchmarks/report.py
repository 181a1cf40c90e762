"""report.json and report.md: every figure with what it is, its min/median/max, its goal and whether it is met.

A goal is judged on the median over repeats; the min and max show how much the machine's noise moved it.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

# id → (what, goal comparison, goal value, unit); comparison None means "report only".
FIGURES = {
    "P1": ("img/s of the course's training script (fashion_mnist.py) ÷ bare TF train step, same model, "
           "in-memory data", ">=", 0.95, "ratio"),
    "P2": ("horovodrun -np 2 --mpi, 1 intra-op thread per rank ÷ 1 process with 2 threads, same model and "
           "global batch (img/s)", ">=", 0.95, "ratio"),
    "P3": ("`scalelab assess` wall time − bare `horovodrun` wall time, same submission", "<=", 3.0, "s"),
    "P4": ("the reference solution's time to accuracy, as the Assess panel shows it in headless Chromium, ÷ the "
           "track's budget (click-to-verdict beside it)", "between", (0.6, 0.8), "ratio"),
    "P5": ("class grading: makespan ÷ (sum of job times ÷ slots)", "<=", 1.10, "ratio"),
    "P6": ("hvd.allreduce bus bandwidth at 64 MB, np 2, loopback ÷ single-core memcpy bandwidth", ">=", 0.5,
           "ratio"),
    "P7": ("repeatability: share of 5 gradings each of the reference and the baseline with the expected verdict "
           "(pass; fail or timeout); an honest fixed-epoch conversion graded beside them, reported", ">=", 1.0,
           "ratio"),
    "P8": ("live evaluation's cost: the reference's snapshot times (grader's clock) with the grader measuring each "
           "snapshot as it arrives ÷ without (measured after the run), same epochs, interleaved pairs", "<=", 1.03,
           "ratio"),
    "P10": ("img/s of the PyTorch reference (assessment_pytorch.py, one DDP rank under torchrun, on the GPU where "
            "there is one) ÷ bare PyTorch train step, same model and batch, data already on the device; report only "
            "until measured on a GPU", None, None, "ratio"),
}


def judge(figure_id: str, figure: dict) -> dict:
    """The figure with ``what``, ``goal`` and ``met`` (None when not measured or report-only)."""
    what, comparison, goal, unit = FIGURES[figure_id]
    median = figure.get("median")
    if comparison is None or median is None:
        met = None
    elif comparison == "between":
        met = goal[0] <= median <= goal[1]
    else:
        met = median >= goal if comparison == ">=" else median <= goal
    if comparison is None:
        shown = None
    elif comparison == "between":
        shown = f"{goal[0]:g}–{goal[1]:g}"
    else:
        shown = f"{comparison.replace('>=', '≥').replace('<=', '≤')} {goal:g}"
    return dict(figure, id=figure_id, what=what, unit=unit, goal=shown, met=met)


def _number(value, unit: str) -> str:
    if value is None:
        return "—"
    return f"{value:.2f} s" if unit == "s" else f"{value:.3f}"


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        f"# ScaleLab benchmark report",
        "",
        f"{report['finished_at']} on {env.get('cpu_count')} × {env.get('cpu_model')} ({env.get('host')}); "
        f"TensorFlow {env.get('tensorflow')}, Horovod {env.get('horovod')}, Python {env.get('python')}"
        + (" — **quick run** (small settings, not for comparison)" if report["quick"] else "") + ".",
        "",
        "| id | what | min | median | max | goal | met? |",
        "|---|---|---|---|---|---|---|",
    ]
    for figure_id in FIGURES:
        figure = report["figures"][figure_id]
        unit = figure["unit"]
        if figure.get("not_measured"):
            cells = ["—", "—", "—"]
            met = f"not measured: {figure['not_measured']}"
        else:
            cells = [_number(figure.get(key), unit) for key in ("min", "median", "max")]
            met = {True: "yes", False: "**no**", None: "report"}[figure["met"]]
        lines.append(f"| {figure_id} | {figure['what']} | {' | '.join(cells)} | {figure['goal'] or '—'} | {met} |")
    lines += ["", "Each figure is min/median/max over repeats (n per figure in report.json); goals are judged on "
              "the median.", ""]
    for note in report.get("notes", []):
        lines.append(f"- {note}")
    if report.get("plots"):
        lines += ["", "## Plots", ""] + [f"![{name}]({name})" for name in report["plots"]]
    return "\n".join(lines) + "\n"


def write(out_dir: Path, report: dict) -> None:
    report["finished_at"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, default=str))
    (out_dir / "report.md").write_text(markdown(report))
