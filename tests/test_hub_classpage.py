"""The instructors' class page of the Hub service (grader/service/classpage.py), behind a real Hub and its proxy.

Students A, B and C submit through the service; D, a Hub user too, never submits; I is an instructor (the Hub
group ``instructors``). The Hub, the service and the real accounts come from tests/hubtools.py.
"""

from __future__ import annotations

import csv
import io
import re
import textwrap
from html.parser import HTMLParser

import pytest

from hubtools import FAST_SUBMISSION, TEST_TRACK, running_hub

from scalelab.grader.service.classpage import CSV_COLUMNS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# Prints HTML on every rank and ends with HTML in its error: both must reach the instructor escaped.
SCRIPT_PRINTING_SUBMISSION = textwrap.dedent("""
    print('<script>alert("scalelab-rank-log")</script>', flush=True)
    raise RuntimeError('<img src=x onerror=alert("scalelab-reason")>')
    """)


@pytest.fixture(scope="module")
def hub():
    with running_hub(student_roles=("A", "B", "C", "D"), instructor_roles=("I",)) as running:
        yield running


class TableReader(HTMLParser):
    """The text of each cell of each body row of a page's table, and its form fields."""

    def __init__(self):
        super().__init__()
        self.rows: list[list[str]] = []
        self.inputs: list[dict] = []
        self._in_body = self._in_cell = False

    def handle_starttag(self, tag, attrs):
        if tag == "tbody":
            self._in_body = True
        elif tag == "tr" and self._in_body:
            self.rows.append([])
        elif tag == "td" and self._in_body:
            self._in_cell = True
            self.rows[-1].append("")
        elif tag == "input":
            self.inputs.append(dict(attrs))

    def handle_endtag(self, tag):
        if tag == "tbody":
            self._in_body = False
        elif tag == "td":
            self._in_cell = False

    def handle_data(self, data):
        if self._in_cell:
            self.rows[-1][-1] += data


def read_page(text: str) -> TableReader:
    reader = TableReader()
    reader.feed(text)
    return reader


def rows_by_student(text: str) -> dict[str, list[str]]:
    return {row[0]: [cell.strip() for cell in row] for row in read_page(text).rows}


def instructor_token(hub) -> str:
    return hub.tokens[hub.instructors["I"]]


def queue_total(hub) -> int:
    counts = hub.api("GET", "service", instructor_token(hub)).json()["counts"]
    return sum(counts.values())


def history(hub, role: str) -> list[dict]:
    student = hub.students[role]
    return hub.api("GET", "assessments", hub.tokens[student]).json()["assessments"]


def submit_and_wait(hub, role: str, source: str) -> dict:
    student = hub.students[role]
    answer = hub.submit(student, source)
    assert answer.status_code == 201, answer.text
    return hub.wait_for_job(student, answer.json()["job"]["id"])


def test_a_student_or_no_login_gets_no_class_page_and_cannot_regrade(hub):
    student = hub.students["A"]
    token = hub.tokens[student]
    for path in ("class", "class.csv", "class/jobs/1"):
        answer = hub.service("GET", path, token)
        assert answer.status_code == 403, (path, answer.text)
        assert f"{student} is not an instructor" in answer.text
        assert answer.headers["Content-Type"].startswith("text/html")
    regrade = hub.service("POST", "class/regrade", token, data={"student": student})
    assert regrade.status_code == 403 and "is not an instructor" in regrade.text
    assert regrade.headers["Content-Type"].startswith("text/html")
    # Without a login, a browser is sent to the Hub's login; a POST is refused.
    anonymous = hub.service("GET", "class", allow_redirects=False)
    assert anonymous.status_code == 302 and "/hub/api/oauth2/authorize" in anonymous.headers["Location"]
    assert hub.service("POST", "class/regrade", data={"all": "1"}).status_code == 401
    assert queue_total(hub) == 0


def test_the_instructor_sees_one_row_per_student_after_each_has_a_verdict(hub):
    for role in ("A", "B"):
        assert submit_and_wait(hub, role, FAST_SUBMISSION.read_text())["verdict"]["verdict"] == "fail"
    page = hub.service("GET", "class", instructor_token(hub))
    assert page.status_code == 200, page.text
    assert page.headers["Content-Security-Policy"].startswith("default-src 'none'")  # no script runs
    rows = rows_by_student(page.text)
    a, b, d = (hub.students[role] for role in ("A", "B", "D"))
    for name in (a, b):
        [job] = history(hub, "A" if name == a else "B")
        # student, attempts, latest verdict, best verdict, board rank, time to accuracy, accuracy, wall time,
        # when, (regrade)
        assert rows[name][1] == "1"
        assert rows[name][2] == f"fail #{job['id']}" and rows[name][3] == f"fail #{job['id']}"
        assert rows[name][4:6] == ["", ""]  # a fail is not on the board
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", rows[name][8]), rows[name]
        assert f'href="/services/scalelab/class/jobs/{job["id"]}"' in page.text
    # A student who has logged in but never submitted has a row too; the instructor has none.
    assert rows[d][1:4] == ["0", "none", "none"]
    assert hub.instructors["I"] not in rows
    assert "are not listed" not in page.text  # the Hub told the service its users
    # Sortable: by name both ways; an unknown column is refused.
    ascending = list(rows_by_student(hub.service("GET", "class?sort=student&order=asc", instructor_token(hub)).text))
    descending = list(rows_by_student(hub.service("GET", "class?sort=student&order=desc",
                                                  instructor_token(hub)).text))
    assert ascending == sorted(ascending) and descending == ascending[::-1] and len(ascending) == 4
    by_attempts = list(rows_by_student(hub.service("GET", "class?sort=attempts&order=desc",
                                                   instructor_token(hub)).text))
    assert by_attempts[-2:] == sorted([hub.students["C"], d])  # 0 attempts last, by name
    assert hub.service("GET", "class?sort=password", instructor_token(hub)).status_code == 400


def test_the_instructors_browser_gets_the_page_through_the_hubs_login(hub):
    browser = hub.login(hub.instructors["I"])
    page = browser.get(f"{hub.service_url}class", timeout=60)  # → the Hub's OAuth → the service's callback
    assert page.status_code == 200, page.text
    assert any(step.url.startswith(f"{hub.url}/hub/api/oauth2/authorize") for step in page.history)
    assert set(rows_by_student(page.text)) == set(hub.students.values())
    student = hub.login(hub.students["B"]).get(f"{hub.service_url}class", timeout=60)
    assert student.status_code == 403 and "is not an instructor" in student.text


def test_the_csv_download_has_one_row_per_student_with_the_right_columns(hub):
    answer = hub.service("GET", "class.csv", instructor_token(hub))
    assert answer.status_code == 200, answer.text
    assert answer.headers["Content-Type"].startswith("text/csv")
    assert re.fullmatch(rf'attachment; filename="scalelab-class-{re.escape(TEST_TRACK)}\.csv"',
                        answer.headers["Content-Disposition"])
    reader = csv.DictReader(io.StringIO(answer.content.decode("utf-8"), newline=""))
    assert tuple(reader.fieldnames) == CSV_COLUMNS
    rows = {row["student"]: row for row in reader}
    assert set(rows) == set(hub.students.values())
    for role in ("A", "B"):
        [job] = history(hub, role)
        row = rows[hub.students[role]]
        assert (row["attempts"], row["regrades"], row["latest_job"], row["latest_state"], row["latest_verdict"],
                row["best_job"], row["best_verdict"]) == ("1", "0", str(job["id"]), "done", "fail", str(job["id"]),
                                                          "fail")
        assert row["latest_submitted_at"].endswith("+00:00") and row["best_finished_at"]
    assert rows[hub.students["D"]]["attempts"] == "0" and rows[hub.students["D"]]["latest_job"] == ""


def test_regrading_one_student_queues_exactly_one_job_for_them_and_it_reaches_a_verdict(hub):
    token = instructor_token(hub)
    before_total = queue_total(hub)
    [earlier] = history(hub, "A")
    others = {role: history(hub, role) for role in ("B", "C", "D")}
    answer = hub.service("POST", "class/regrade", token, data={"student": hub.students["A"]},
                         headers={"Accept": "application/json"})
    assert answer.status_code == 202, answer.text
    [outcome] = answer.json()["regrades"]
    assert (outcome["student"], outcome["outcome"], outcome["regrade_of"]) == (hub.students["A"], "queued",
                                                                               earlier["id"])
    assert queue_total(hub) == before_total + 1
    assert {role: history(hub, role) for role in others} == others
    job = hub.wait_for_job(hub.students["A"], outcome["job"])
    assert job["state"] == "done" and job["verdict"]["verdict"] == "fail"
    assert job["submission_sha256"] == earlier["submission_sha256"]  # the same script, graded again
    assert [item["id"] for item in history(hub, "A")] == [job["id"], earlier["id"]]
    row = {row["student"]: row for row in csv.DictReader(io.StringIO(
        hub.service("GET", "class.csv", token).text, newline=""))}[hub.students["A"]]
    assert (row["attempts"], row["regrades"], row["latest_job"]) == ("1", "1", str(job["id"]))
    # Nobody to regrade: said, and nothing queued.
    nothing = hub.service("POST", "class/regrade", token, data={"student": hub.students["D"]},
                          headers={"Accept": "application/json"})
    assert nothing.status_code == 200 and nothing.json()["regrades"][0]["outcome"] == "nothing"
    assert hub.service("POST", "class/regrade", token).status_code == 400
    assert queue_total(hub) == before_total + 1


def test_regrade_all_from_the_browser_needs_the_pages_xsrf_token(hub):
    browser = hub.login(hub.instructors["I"])
    page = browser.get(f"{hub.service_url}class", timeout=60)
    assert page.status_code == 200, page.text
    xsrf = {field["value"] for field in read_page(page.text).inputs if field.get("name") == "_xsrf"}
    assert len(xsrf) == 1
    before_total = queue_total(hub)
    # A cross-site form would carry the cookie but not the token.
    forged = browser.post(f"{hub.service_url}class/regrade", data={"all": "1"}, timeout=60)
    assert forged.status_code == 403 and queue_total(hub) == before_total
    answer = browser.post(f"{hub.service_url}class/regrade", data={"all": "1", "_xsrf": xsrf.pop()}, timeout=60)
    assert answer.status_code == 202, answer.text
    submitted = ("A", "B")  # C and D have submitted nothing yet
    for role in submitted:
        assert f"queued for {hub.students[role]}:" in answer.text
    assert queue_total(hub) == before_total + len(submitted)
    for role in submitted:
        [latest, *_] = history(hub, role)
        assert hub.wait_for_job(hub.students[role], latest["id"])["verdict"]["verdict"] == "fail"


def test_the_job_page_shows_the_reasons_and_rank_logs_with_what_the_run_printed_escaped(hub):
    job = submit_and_wait(hub, "C", SCRIPT_PRINTING_SUBMISSION)
    assert job["verdict"]["verdict"] == "fail"
    page = hub.service("GET", f"class/jobs/{job['id']}", instructor_token(hub))
    assert page.status_code == 200, page.text
    assert page.headers["Content-Type"].startswith("text/html")
    assert "<script" not in page.text and "<img" not in page.text
    assert "&lt;script&gt;alert(&quot;scalelab-rank-log&quot;)&lt;/script&gt;" in page.text
    assert "RuntimeError: &lt;img src=x onerror=alert(&quot;scalelab-reason&quot;)&gt;" in page.text
    for heading in ("Reasons", "rank-0.log", "rank-1.log", "Submitted script"):
        assert f"<h2>{heading}</h2>" in page.text
    # The rank that fails first printed first; horovodrun may stop the other one before it prints.
    rank_logs = [page.text.split(f"<h2>rank-{rank}.log</h2>", 1)[1].split("<h2>", 1)[0] for rank in (0, 1)]
    assert any("scalelab-rank-log" in rank_log for rank_log in rank_logs), rank_logs
    assert hub.service("GET", "class/jobs/99999999", instructor_token(hub)).status_code == 404
    own = hub.service("GET", f"class/jobs/{job['id']}", hub.tokens[hub.students["C"]])
    assert own.status_code == 403
