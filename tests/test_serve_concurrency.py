"""Ten students click Assess at the same moment on one real Jupyter server with 2 grading slots.

Each student has their own token (token table identity provider) and their own folder with a slightly different
fast submission, so every stored verdict can be traced back to exactly one student's file.
"""

from __future__ import annotations

import hashlib
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "submissions" / "service"))
from conftest import EDITION_TEST_TRACK  # noqa: E402
from jupyter_process import TEST_TRACKS, JupyterServer  # noqa: E402

from scalelab.grader.queue import AssessQueue, sqlite_url  # noqa: E402

FAST_SUBMISSION = Path(__file__).parent / "submissions" / "service" / "syntax_error_fast.py"
STUDENTS = [f"student{number:02d}" for number in range(10)]
SLOTS = 2


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals],
                    key=lambda event: (event[0], event[1]))  # an end before a start at the same instant
    open_now = most = 0
    for _, change in events:
        open_now += change
        most = max(most, open_now)
    return most


def test_ten_students_at_once_on_two_slots_get_ten_verdicts_in_fifo_order(tmp_path):
    root, home = tmp_path / "course", tmp_path / "home"
    expected_sha256 = {}
    for student in STUDENTS:
        folder = root / student / "assessment"
        folder.mkdir(parents=True)
        source = FAST_SUBMISSION.read_text() + f"\n# {student}'s copy\n"
        (folder / "assessment.py").write_text(source)
        expected_sha256[student] = hashlib.sha256(source.encode()).hexdigest()
    tokens = {f"{student}-token": student for student in STUDENTS}
    server = JupyterServer(root, home, user_tokens=tokens, service={
        "slots": SLOTS, "track": EDITION_TEST_TRACK, "tracks_file": str(TEST_TRACKS),
        "submission_path": "{student}/assessment/assessment.py", "poll_interval_s": 0.5}).start()
    try:
        # Everyone clicks at once: the requests are released together from a barrier.
        barrier = threading.Barrier(len(STUDENTS))

        def click(student):
            barrier.wait()
            return student, server.api("POST", "assessments", token=f"{student}-token")

        clicked_at = time.monotonic()
        with ThreadPoolExecutor(len(STUDENTS)) as pool:
            responses = dict(pool.map(click, STUDENTS))
        assert all(response.status_code == 201 for response in responses.values()), \
            {student: response.text for student, response in responses.items() if response.status_code != 201}
        job_of = {student: response.json()["job"]["id"] for student, response in responses.items()}
        assert len(set(job_of.values())) == len(STUDENTS)

        # Watch the service's own counts while the queue drains.
        observed_max_running, deadline = 0, time.monotonic() + 150
        while time.monotonic() < deadline:
            counts = server.api("GET", "service").json()["counts"]
            observed_max_running = max(observed_max_running, counts["running"])
            if counts["done"] + counts["interrupted"] == len(STUDENTS):
                break
            time.sleep(0.2)
        makespan_s = time.monotonic() - clicked_at
        jobs = {student: server.api("GET", f"assessments/{job_of[student]}", token=f"{student}-token").json()
                for student in STUDENTS}
    finally:
        server.stop()

    # Nothing lost or duplicated: exactly one stored job per student, each with the verdict of their own file.
    stored = AssessQueue(sqlite_url(server.database)).all_jobs()
    assert sorted(job["student"] for job in stored) == STUDENTS
    for student, job in jobs.items():
        assert job["state"] == "done", job
        assert job["verdict"]["verdict"] == "fail"
        assert any("not valid Python" in reason for reason in job["verdict"]["reasons"])
        assert job["verdict"]["submission_sha256"] == expected_sha256[student]

    # FIFO: jobs started in the order they arrived (ids are given in arrival order).
    by_start = sorted(stored, key=lambda job: job["started_at"])
    assert [job["id"] for job in by_start] == sorted(job["id"] for job in stored)

    # Never more than the slots at once, measured from the stored start/end times and from the live counts.
    stored_max_running = max_overlap([(job["started_at"], job["finished_at"]) for job in stored])
    print(f"\nconcurrency: {len(STUDENTS)} students, {SLOTS} slots: makespan {makespan_s:.1f} s, "
          f"max running observed live {observed_max_running}, from stored times {stored_max_running}")
    assert observed_max_running <= SLOTS and stored_max_running <= SLOTS
    assert stored_max_running == SLOTS, "both slots should have been used"
