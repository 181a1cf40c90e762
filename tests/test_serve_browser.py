"""Assess in a real browser: JupyterLab (with the Assess service) + Playwright driving Debian's Chromium.

Opens the course's own assessment/assessment.ipynb, runs its Assess-panel cell, clicks Assess and waits for the
verdict of a fast submission (a syntax error: FAIL in seconds). The screenshot is kept in tests/artifacts/.

Also a measuring tool (not a test): click-to-verdict time of the reference solution on the real track::

    flock /tmp/scalelab-heavy.lock .venv/bin/python tests/test_serve_browser.py --reference [--track cifar10-cpu]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "submissions" / "service"))
from conftest import EDITION_TEST_TRACK  # noqa: E402
from jupyter_process import PROJECT_ROOT, TEST_TRACKS, JupyterServer  # noqa: E402

from scalelab.grader import spec  # noqa: E402

ARTIFACTS = PROJECT_ROOT / "tests" / "artifacts"
FAST_SUBMISSION = Path(__file__).parent / "submissions" / "service" / "syntax_error_fast.py"
# The installed edition's test track, and the file its students submit.
TRACK = EDITION_TEST_TRACK
SUBMITTED = spec.load_track(TRACK, TEST_TRACKS).submission_file
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--headless=new", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def course_copy(root: Path, submission: Path, submitted: str = "assessment.py") -> None:
    """The student's view: the real assessment notebook, and their script (``submitted``) next to it."""
    (root / "assessment").mkdir(parents=True)
    shutil.copy(PROJECT_ROOT / "assessment" / "assessment.ipynb", root / "assessment" / "assessment.ipynb")
    shutil.copy(submission, root / "assessment" / submitted)


def run_panel_cell(page):
    """In the open assessment notebook: wait for its kernel, run the Assess-panel cell; the panel, its button shown."""
    from playwright.sync_api import expect

    cell = page.locator(".jp-CodeCell", has_text="AssessPanel()")
    cell.wait_for(timeout=90_000)
    expect(page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']")).to_have_count(
        1, timeout=90_000)  # the kernel is up
    # Run the panel cell. A key press can land before the editor has focus (seen once in CI: the panel never
    # came); until the cell's prompt shows that it ran ("[*]:" or "[1]:"), press again.
    prompt = cell.locator(".jp-InputArea-prompt")
    for _ in range(3):
        cell.locator(".jp-InputArea-editor").click()
        page.keyboard.press("Shift+Enter")
        try:
            expect(prompt).not_to_have_text(re.compile(r"^\[ \]:$"), timeout=10_000)
            break
        except AssertionError:
            pass  # not run yet: press again
    panel = page.locator(".scalelab-assess-panel")
    panel.locator("button", has_text="Assess").wait_for(timeout=60_000)
    return panel


def assess_in_browser(server: JupyterServer, screenshot: Path, verdict_timeout_s: float) -> dict:
    """Open the notebook, run the panel cell, click Assess, wait for the verdict. Returns timings and texts."""
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 1400})
            page.goto(f"{server.url}lab/tree/assessment/assessment.ipynb?token={server.token}")
            panel = run_panel_cell(page)
            button = panel.locator("button", has_text="Assess")
            expect(panel.locator(".scalelab-status")).to_contain_text("Not assessed yet", timeout=30_000)
            clicked = time.monotonic()
            button.click()
            verdict = panel.locator(".scalelab-verdict")
            expect(verdict).to_contain_text("Verdict:", timeout=verdict_timeout_s * 1000)
            click_to_verdict_s = time.monotonic() - clicked
            expect(panel.locator(".scalelab-history tr")).to_have_count(2, timeout=10_000)  # header + this one
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            panel.scroll_into_view_if_needed()
            page.screenshot(path=str(screenshot), full_page=True)
            return {"click_to_verdict_s": click_to_verdict_s, "verdict_text": verdict.inner_text(),
                    "status_text": panel.locator(".scalelab-status").inner_text(),
                    "history_text": panel.locator(".scalelab-history").inner_text(),
                    "error_text": panel.locator(".scalelab-error").all_inner_texts()}
        finally:
            browser.close()


@pytest.mark.slow
def test_click_assess_in_jupyterlab_shows_the_verdict(tmp_path):
    root, home = tmp_path / "course", tmp_path / "home"
    course_copy(root, FAST_SUBMISSION, SUBMITTED)
    server = JupyterServer(root, home, app="lab", service={
        "slots": 1, "track": TRACK, "tracks_file": str(TEST_TRACKS)}).start()
    screenshot = ARTIFACTS / "assess_panel_verdict.png"
    try:
        seen = assess_in_browser(server, screenshot, verdict_timeout_s=90)
    finally:
        server.stop()
    print(f"\nbrowser: click-to-verdict {seen['click_to_verdict_s']:.1f} s; screenshot {screenshot}")
    assert "Verdict: FAIL" in seen["verdict_text"]
    assert f"{SUBMITTED} is not valid Python" in seen["verdict_text"]
    assert "done" in seen["status_text"]
    assert "fail" in seen["history_text"] and TRACK in seen["history_text"]
    assert "Traceback" not in json.dumps(seen)
    assert screenshot.stat().st_size > 10_000


def measure_reference(track: str) -> dict:
    """Click-to-verdict of assessment/solution/assessment.py on a real track (assessment/tracks.toml)."""

    budget = spec.load_track(track).time_budget_s
    with tempfile.TemporaryDirectory(prefix="scalelab-click-to-verdict-") as scratch:
        root, home = Path(scratch) / "course", Path(scratch) / "home"
        course_copy(root, PROJECT_ROOT / "assessment" / "solution" / "assessment.py")
        server = JupyterServer(root, home, app="lab", service={"slots": 1, "track": track}).start()
        screenshot = ARTIFACTS / f"assess_panel_reference_{track}.png"
        try:
            seen = assess_in_browser(server, screenshot, verdict_timeout_s=budget + 180)
        finally:
            server.stop()
    # The time to accuracy as the panel shows it to the student (the grader's referee clock).
    shown = re.search(r"time to accuracy ([0-9.]+) s", seen["verdict_text"])
    time_to_accuracy_s = float(shown.group(1)) if shown else None
    return {"track": track, "time_budget_s": budget, "click_to_verdict_s": round(seen["click_to_verdict_s"], 1),
            "ratio_to_budget": round(seen["click_to_verdict_s"] / budget, 3),
            "time_to_accuracy_s": time_to_accuracy_s,
            "time_to_accuracy_to_budget": round(time_to_accuracy_s / budget, 3) if shown else None,
            "verdict_text": seen["verdict_text"], "screenshot": str(screenshot)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", action="store_true", required=True)
    parser.add_argument("--track", default="cifar10-cpu")
    print(json.dumps(measure_reference(parser.parse_args().track), indent=1))
