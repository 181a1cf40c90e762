"""P4 and P7: the assessment as a student meets it, on a real track.

P4 clicks **Assess** in JupyterLab in headless Chromium with the reference solution and reads the time to accuracy
the panel shows ÷ the track's budget (``tests/test_serve_browser.py --reference`` drives the browser; each click
is a fresh server); click-to-verdict is reported beside it. A calibrated budget puts it at 0.6-0.8: the budget
measures speed, yet leaves the reference room.

P7 grades the reference solution, an honest fixed-epoch conversion as students write it
(``submissions/fixed_epochs_cifar10.py``: 12 epochs, tf.data's default autotuning) and the unmodified serial
script ``runs`` times each, in turn, through the same pipeline as ``scalelab assess``: a trustworthy grader gives
the same verdict every time (pass for the reference, fail or timeout for the baseline). The figure is the share
of those gradings with the expected verdict; the fixed-epoch conversion's verdicts and times to accuracy are
reported beside it (it is not calibrated to the track).

P8 prices live evaluation: the reference graded with the grader measuring each snapshot as it arrives (at idle
priority) and without (the snapshots measured after the run, no early stop), in interleaved pairs. The figure is
the ratio of the times the same snapshots appeared (the grader's clock), epoch for epoch: how much later an epoch
ends because the measuring process shares the cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from scalelab.grader import pipeline, spec

from .summary import run_in_turn, spread

BROWSER_TOOL = spec.COURSE_ROOT / "tests" / "test_serve_browser.py"
REFERENCE = spec.COURSE_ROOT / "assessment" / "solution" / "assessment.py"
BASELINE = spec.COURSE_ROOT / "assessment" / "assessment.py"
FIXED_EPOCHS = Path(__file__).parent / "submissions" / "fixed_epochs_cifar10.py"


def click_to_verdict(logs: Path, track: str, clicks: int) -> dict:
    """P4: the reference's time to accuracy ÷ budget as the panel shows it, ``clicks`` times in a real browser
    (click-to-verdict beside it)."""
    samples = []
    for click in range(clicks):
        done = subprocess.run([sys.executable, str(BROWSER_TOOL), "--reference", "--track", track],
                              capture_output=True, text=True, timeout=3600)
        (logs / f"click-{click + 1}.log").write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            raise RuntimeError(f"the browser click failed (exit {done.returncode}); see {logs}/click-{click + 1}.log")
        samples.append(json.loads(done.stdout[done.stdout.index("{"):]))
        print(f"  click {click + 1}: verdict after {samples[-1]['click_to_verdict_s']} s of "
              f"{samples[-1]['time_budget_s']} s, time to accuracy {samples[-1]['time_to_accuracy_s']} s: "
              f"{samples[-1]['verdict_text'].splitlines()[0]}", flush=True)
    figure = spread(sample["time_to_accuracy_to_budget"] for sample in samples)
    figure.update(track=track, click_to_verdict_s=spread(s["click_to_verdict_s"] for s in samples),
                  click_to_verdict_to_budget=spread(s["ratio_to_budget"] for s in samples),
                  time_to_accuracy_s=spread(s["time_to_accuracy_s"] for s in samples),
                  time_budget_s=samples[0]["time_budget_s"], source="headless Chromium, tests/test_serve_browser.py")
    return figure


def repeatability(logs: Path, track: str, runs: int) -> dict:
    """P7: the share of ``runs`` gradings each of the reference and the baseline that got the expected verdict; the
    fixed-epoch conversion is graded in the same turns and reported beside it."""
    programs = {"reference": REFERENCE, "fixed-epochs": FIXED_EPOCHS, "baseline": BASELINE}
    verdicts = {name: [] for name in programs}
    for run in range(runs):
        results = run_in_turn({name: (lambda path=path, name=name: pipeline.assess(
            path, track, out_dir=logs / f"{name}-{run + 1}")) for name, path in programs.items()}, run)
        for name, verdict in results.items():
            verdicts[name].append({key: verdict[key] for key in ("verdict", "wall_time_s", "heldout_accuracy",
                                                                 "time_to_accuracy_s")})
            print(f"  {name} {run + 1}: {verdict['verdict']} in {verdict['wall_time_s']} s (time to accuracy "
                  f"{verdict['time_to_accuracy_s']} s), held-out {verdict['heldout_accuracy']}", flush=True)
    # The fixed-epoch conversion is not calibrated to the track (nothing promises it passes every time): its
    # verdicts and times are reported beside the figure, not counted in it.
    expected = ([v["verdict"] == "pass" for v in verdicts["reference"]]
                + [v["verdict"] in ("fail", "timeout") for v in verdicts["baseline"]])
    figure = spread([sum(expected) / len(expected)])
    figure.update(track=track, verdicts=verdicts,
                  reference_wall_time_s=spread(v["wall_time_s"] for v in verdicts["reference"]),
                  reference_heldout_accuracy=spread(v["heldout_accuracy"] for v in verdicts["reference"]),
                  time_to_accuracy_s={name: spread(v["time_to_accuracy_s"] for v in verdicts[name]
                                                   if v["time_to_accuracy_s"] is not None)
                                      for name in ("reference", "fixed-epochs")})
    return figure


def live_evaluation_cost(logs: Path, track: str, pairs: int) -> dict:
    """P8: snapshot times with live evaluation ÷ without, the reference graded ``pairs`` times each way."""
    ratios, times = [], {"live": [], "after": []}
    for pair in range(pairs):
        results = run_in_turn({
            "live": lambda: pipeline.assess(REFERENCE, track, out_dir=logs / f"live-{pair + 1}"),
            "after": lambda: pipeline.assess(REFERENCE, track, out_dir=logs / f"after-{pair + 1}",
                                             live_evaluation=False),
        }, pair)
        at = {name: {s["index"]: s["at_s"] for s in verdict["snapshots"]} for name, verdict in results.items()}
        common = sorted(set(at["live"]) & set(at["after"]))
        if not common:
            raise RuntimeError(f"pair {pair + 1}: no snapshot index common to both gradings")
        ratios.append(sum(at["live"][i] for i in common) / sum(at["after"][i] for i in common))
        for name, verdict in results.items():
            times[name].append(verdict["time_to_accuracy_s"])
        print(f"  pair {pair + 1}: snapshots 1-{common[-1]} at {ratios[-1]:.3f}× with live evaluation; time to "
              f"accuracy {times['live'][-1]} s live, {times['after'][-1]} s measured after", flush=True)
    figure = spread(ratios)
    figure.update(track=track, time_to_accuracy_live_s=times["live"], time_to_accuracy_after_s=times["after"])
    return figure
