"""The Assess service and its panel on a PyTorch track: the student's file is assessment/assessment_pytorch.py (the
serial script of the PyTorch edition, beside the Keras one), graded under torchrun like any submission.

A real Jupyter server with the Assess service on the DDP test track, the course's folder as a student's view has
it (both serial scripts), the panel driven in this process as the notebook's kernel drives it; and class grading
finding each student's PyTorch script.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "submissions" / "service"))
from jupyter_process import TEST_TRACKS, JupyterServer  # noqa: E402

from scalelab.grader import grading, panel, spec  # noqa: E402

SUBMISSIONS = Path(__file__).parent / "submissions"
TRACK = "fashion-mnist-ddp-test"


@pytest.mark.slow
def test_the_panel_grades_the_pytorch_script_on_a_torchrun_track(tmp_path):
    root, home = tmp_path / "course", tmp_path / "home"
    (root / "assessment").mkdir(parents=True)
    home.mkdir()
    # The Keras script beside it would fail at once (not Python): the service must take the PyTorch one.
    (root / "assessment" / "assessment.py").write_text("this is not Python\n")
    script = root / "assessment" / "assessment_pytorch.py"
    shutil.copy(SUBMISSIONS / "ddp_small.py", script)
    server = JupyterServer(root, home, service={"slots": 1, "track": TRACK, "tracks_file": str(TEST_TRACKS),
                                                "poll_interval_s": 0.5}).start()
    try:
        client = panel.AssessClient(server.url, server.token)
        info = client.service()
        assert (info["submission_file"], info["submission_path"], info["framework"]) == \
            ("assessment_pytorch.py", "assessment/assessment_pytorch.py", "pytorch"), info

        assessment = panel.AssessPanel(client=client, poll_interval_s=0.5)
        deadline = time.monotonic() + 60
        while "assessment_pytorch.py" not in assessment.track_line.value and time.monotonic() < deadline:
            time.sleep(0.2)
        assert f"on track <b>{TRACK}</b>" in assessment.track_line.value, assessment.error.value
        assert "click Assess to grade your current assessment_pytorch.py" in assessment.status.value
        assessment.button.click()
        deadline = time.monotonic() + 400
        while "Verdict:" not in assessment.status.value and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "Verdict: PASS" in assessment.status.value, (assessment.status.value, assessment.verdict.value,
                                                            assessment.error.value, server.log_tail())
        [job] = client.history()
        assert job["track"] == TRACK
        assert job["submission_sha256"] == hashlib.sha256(script.read_bytes()).hexdigest()
        assert job["verdict"]["witnesses"]["ranks"]["rank_cpu_s"], job["verdict"]  # DDP's witnesses, not Horovod's
    finally:
        server.stop()


def test_class_grading_looks_for_the_tracks_script(tmp_path):
    track = spec.load_track(TRACK, TEST_TRACKS)
    assert track.submission_file == "assessment_pytorch.py"
    (tmp_path / "ann" / "assessment").mkdir(parents=True)
    (tmp_path / "ann" / "assessment" / "assessment_pytorch.py").write_text("print('ann')\n")
    (tmp_path / "ben").mkdir()
    (tmp_path / "ben" / "assessment.py").write_text("print('the Keras script')\n")

    found = grading.find_submissions(tmp_path, track.submission_file)
    assert found == {"ann": tmp_path / "ann" / "assessment" / "assessment_pytorch.py", "ben": None}
    assert grading.find_submissions(tmp_path)["ben"] == tmp_path / "ben" / "assessment.py"  # a Keras track's

    verdict = grading._not_gradable("ben", None, track, tmp_path / "out")
    assert verdict["verdict"] == "fail"
    assert "no assessment_pytorch.py was submitted (looked for ben/assessment_pytorch.py and " \
           "ben/assessment/assessment_pytorch.py)" in verdict["reasons"][0]
