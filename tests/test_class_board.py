"""The class board (grader/board.py): passes ranked by best time to accuracy, on the instructors' page and CSV,
and as one student sees it (their own time and rank; the others' names only where the course shows them)."""

import csv
import io

from scalelab.grader import board, panel
from scalelab.grader.service import classpage
from scalelab.grader.spec import Track


def job(job_id: int, student: str, verdict: str, time_to_accuracy_s=None, wall_time_s=80.0, state="done",
        snapshots=()) -> dict:
    return {"id": job_id, "student": student, "state": state, "submitted_at": 1_700_000_000 + job_id,
            "finished_at": 1_700_000_100 + job_id, "submission_path": "assessment.py",
            "verdict": {"verdict": verdict, "time_to_accuracy_s": time_to_accuracy_s, "wall_time_s": wall_time_s,
                        "heldout_accuracy": 0.55 if verdict == "pass" else 0.3, "snapshots": list(snapshots)}}


CURVE = [{"index": 1, "at_s": 20.0, "heldout_accuracy": 0.31}, {"index": 2, "at_s": 41.5, "heldout_accuracy": 0.52}]
JOBS = [
    job(1, "ada", "pass", 70.0),
    job(2, "ada", "pass", 41.5, snapshots=CURVE),   # ada's best pass counts
    job(3, "bob", "pass", 55.0),
    job(4, "cy", "pass", 55.0),                    # the same time as bob: the same rank
    job(5, "dee", "timeout", None),                # not on the board
    job(6, "eve", "pass", None, wall_time_s=90.0),  # a verdict from before the referee: its run's time
    job(7, "fay", "pass", 12.0, state="running"),  # not finished: not on the board
    job(8, "bob", "fail", None),                   # a later fail does not take bob off
]


def test_passes_are_ranked_by_best_time_to_accuracy_and_equal_times_share_a_rank():
    places = board.standings(JOBS)
    assert [(p.rank, p.student, p.time_to_accuracy_s, p.job) for p in places] == [
        (1, "ada", 41.5, 2), (2, "bob", 55.0, 3), (2, "cy", 55.0, 4), (4, "eve", 90.0, 6)]
    assert places[0].curve == [(20.0, 0.31), (41.5, 0.52)]


def test_a_student_sees_their_own_time_and_rank_and_no_other_name_unless_the_course_says_so():
    seen = board.student_view(JOBS, "bob", names_shown=False)
    assert (seen["best_time_to_accuracy_s"], seen["rank"], seen["on_board"]) == (55.0, 2, 4)
    assert [place["student"] for place in seen["board"]] == [None, "bob", None, None]
    assert [place["time_to_accuracy_s"] for place in seen["board"]] == [41.5, 55.0, 55.0, 90.0]
    assert "ada" not in panel.board_html(seen) and "rank <b>2</b> of 4" in panel.board_html(seen)
    named = board.student_view(JOBS, "bob", names_shown=True)
    assert [place["student"] for place in named["board"]] == ["ada", "bob", "cy", "eve"]
    off = board.student_view(JOBS, "dee", names_shown=False)
    assert off["rank"] is None and "not on the board yet" in panel.board_html(off)


def test_the_instructors_page_and_csv_carry_the_board():
    rows = classpage.class_rows(JOBS, ["gus"])
    by_name = {row.student: row for row in rows}
    assert by_name["ada"].best["id"] == 2  # the fastest pass is the best run
    assert by_name["bob"].place.rank == 2 and by_name["dee"].place is None and by_name["gus"].place is None
    table = list(csv.DictReader(io.StringIO(classpage.csv_text(rows))))
    assert {row["student"]: (row["best_time_to_accuracy_s"], row["board_rank"]) for row in table} == {
        "ada": ("41.5", "1"), "bob": ("55.0", "2"), "cy": ("55.0", "2"), "dee": ("", ""), "eve": ("90.0", "4"),
        "fay": ("", ""), "gus": ("", "")}
    ranked = [row.student for row in classpage.sorted_rows(rows, "time_to_accuracy", descending=False)]
    assert ranked[:4] == ["ada", "bob", "cy", "eve"]
    track = Track(name="t", dataset="cifar10", ranks=2, target_accuracy=0.5, time_budget_s=110)
    svg = classpage.curve_svg(by_name["ada"].place.curve, track)
    assert svg.startswith("<svg") and 'points="21.8,19.3 45.3,13.4"' in svg
    assert classpage.curve_svg([], track) == ""
