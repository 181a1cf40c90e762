"""Issue 19, a class on one server, end to end in real browsers: `make hub` with its grader service, real accounts,
Playwright driving Debian's Chromium.

Students A and B log in through the Hub's form in browsers of their own, the Hub spawns their JupyterLab, each saves
a failing script (the quick syntax error, as the test track's assessment.py or assessment_pytorch.py) through their
server's contents API, runs the Assess panel of ~/scalelab/assessment/assessment.ipynb and clicks Assess, both at
once; each sees FAIL. Code typed into A's notebook then tries the service's state, the held-out split and B's home,
and asks the service for B's history. The instructor logs in, opens the class page through the Hub's OAuth and
downloads its CSV.

Screenshots and the figures (spawn and click-to-verdict seconds, resident memory of the Hub, its proxy, the service
and each student's server) are kept in tests/artifacts/; `-s` prints the figures.
"""

from __future__ import annotations

import csv
import io
import json
import re
import time

import psutil
import pytest

from hubtools import FAST_SUBMISSION, HUB_VENV, TEST_TRACK, processes_of, running_hub
from test_serve_browser import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, SUBMITTED, run_panel_cell

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2700)]

FIGURES = ARTIFACTS / "hub-figures.json"
VIEWPORT = {"width": 1300, "height": 1400}
SPAWN_TIMEOUT_MS = 300_000
VERDICT_TIMEOUT_S = 240
MIB = 1 << 20


def log_in(page, hub, name: str, next_path: str | None = None) -> float:
    """The Hub's login form, filled and sent; the seconds from Sign in until the page it leads to has loaded."""
    page.goto(f"{hub.url}/hub/login" + (f"?next={next_path}" if next_path else ""))
    page.locator("#username_input").fill(name)
    page.locator("#password_input").fill(hub.passwords[name])
    started = time.monotonic()
    page.locator("#login_submit").click()
    if next_path is None:  # a student: the Hub spawns their server, then opens the course in their JupyterLab
        page.wait_for_url(re.compile(rf"/user/{name}/lab"), timeout=SPAWN_TIMEOUT_MS)
        page.locator(".jp-DirListing-content").wait_for(timeout=SPAWN_TIMEOUT_MS)
    return time.monotonic() - started


def save_as_the_student(context, hub, name: str, path: str, content: str) -> None:
    """A file of the student's, written through their server's contents API with their browser's login (its
    cookies, and the _xsrf cookie sent back as a header, as JupyterLab does)."""
    server = f"{hub.url}/user/{name}/"
    [xsrf] = [cookie["value"] for cookie in context.cookies(server)
              if cookie["name"] == "_xsrf" and cookie["path"].startswith(f"/user/{name}")]
    answer = context.request.put(f"{server}api/contents/{path}", headers={"X-XSRFToken": xsrf},
                                 data={"type": "file", "format": "text", "content": content})
    assert answer.status == 200, f"{name} could not save {path}: {answer.status} {answer.text()}"
    written = hub.homes[name] / path
    assert written.read_text() == content
    assert written.stat().st_uid == _uid(hub, name), f"{written} is not {name}'s"


def _uid(hub, name: str) -> int:
    return hub.homes[name].stat().st_uid


def rss_mib(processes) -> float:
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.Error:
            pass
    return round(total / MIB, 1)


def with_children(process: psutil.Process) -> list[psutil.Process]:
    return [process, *process.children(recursive=True)]


def memory_figures(hub) -> dict:
    """RSS (MiB) of the Hub alone (its children are counted below), its proxy, the grader service with the
    processes it started, and each student's server (alone, and with its kernels)."""
    hub_state = hub.state.parent / "hub-state"  # hub.sh serves from HUB_STATE (hubtools: scratch/hub-state)
    hubs = []
    for process in psutil.process_iter(["cmdline"]):
        command = process.info["cmdline"] or []
        try:
            if str(HUB_VENV / "bin" / "jupyterhub") in command and process.cwd() == str(hub_state):
                hubs.append(process)
        except psutil.Error:
            pass
    assert len(hubs) == 1, f"not one JupyterHub process served from {hub_state}: {hubs}"
    [jupyterhub] = hubs
    proxies = [child for child in jupyterhub.children()
               if any("configurable-http-proxy" in part for part in child.cmdline())]
    assert len(proxies) == 1, f"not one proxy under the Hub: {jupyterhub.children()}"
    services = hub.service_processes()
    assert len(services) == 1, services
    figures = {"hub": rss_mib([jupyterhub]), "proxy": rss_mib(with_children(proxies[0])),
               "service": rss_mib(with_children(services[0]))}
    for role, name in hub.students.items():
        servers = [process for process in processes_of(_uid(hub, name))
                   if any("jupyterhub-singleuser" in part for part in process.info["cmdline"] or [])]
        assert len(servers) == 1, f"not one server of {name}: {servers}"
        figures[f"server_{role}"] = rss_mib(servers)
        figures[f"server_{role}_with_kernels"] = rss_mib(with_children(servers[0]))
    return figures


def peek_source(hub, other: str) -> str:
    """What student A types into a new cell: read what is not theirs, and ask the service for B's history."""
    paths = {"service state": str(hub.state), "results database": str(hub.state / "results.db"),
             "queue database": str(hub.state / "assess" / "queue.db"), "B's home": str(hub.homes[other]),
             "held-out labels": str(hub.state / "data" / "fashion-mnist" / "t10k-labels-idx1-ubyte.gz")}
    return f"""import json, os, requests
found = {{}}
for label, path in {paths!r}.items():
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            open(path, "rb").close()
        found[label] = "READ"
    except Exception as error:
        found[label] = type(error).__name__
history = os.environ["SCALELAB_ASSESS_SERVICE_URL"] + "api/assessments"
asked = {{"student": {other!r}}}
mine = requests.get(history, params=asked, timeout=30, headers={{
    "Authorization": "token " + os.environ["JUPYTERHUB_API_TOKEN"], "X-Student": {other!r}}})
anonymous = requests.get(history, params=asked, timeout=30, headers={{"X-Student": {other!r}}})
print("PEEK " + json.dumps({{"found": found, "with_token": [mine.status_code, mine.json()],
                            "without_token": anonymous.status_code}}))
"""


def run_new_cell(page, source: str) -> str:
    """A new cell below the Assess panel, ``source`` typed into it and run; the cell's output."""
    from playwright.sync_api import expect

    page.keyboard.press("Escape")
    page.locator(".jp-CodeCell", has_text="AssessPanel()").locator(".jp-InputArea-prompt").click()
    page.keyboard.press("b")  # a new cell below, in command mode
    page.keyboard.press("Enter")  # edit it
    # Inserted whole, not key by key: the editor's auto-indent and bracket closing would change it.
    page.keyboard.insert_text(source)
    cell = page.locator(".jp-CodeCell", has_text="PEEK")
    expect(cell).to_have_count(1, timeout=10_000)
    page.keyboard.press("Shift+Enter")
    output = cell.locator(".jp-OutputArea-output")
    expect(output.first).to_be_visible(timeout=60_000)
    expect(cell.locator(".jp-InputArea-prompt")).to_have_text(re.compile(r"^\[\d+\]:$"), timeout=60_000)
    return "\n".join(output.all_inner_texts())


def test_two_students_assess_at_once_in_their_browsers_and_the_instructor_sees_both_on_the_class_page():
    from playwright.sync_api import expect, sync_playwright

    submission = FAST_SUBMISSION.read_text()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with running_hub(student_roles=("A", "B"), instructor_roles=("I",)) as hub, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            roles = ("A", "B")
            pages, panels, spawn_s = {}, {}, {}
            for role in roles:
                name = hub.students[role]
                context = browser.new_context(viewport=VIEWPORT)
                page = pages[role] = context.new_page()
                spawn_s[role] = log_in(page, hub, name)
                assert f"/user/{name}/lab/tree/scalelab" in page.url, page.url  # the Hub's default_url: the course
                save_as_the_student(context, hub, name, f"scalelab/assessment/{SUBMITTED}", submission)
                page.goto(f"{hub.url}/user/{name}/lab/tree/scalelab/assessment/assessment.ipynb")
                panel = panels[role] = run_panel_cell(page)
                expect(panel.locator(".scalelab-status")).to_contain_text("Not assessed yet", timeout=60_000)

            # Assess, A and B at once; each verdict timed from its own click.
            clicked, verdict_at = {}, {}
            for role in roles:
                clicked[role] = time.monotonic()
                panels[role].locator("button", has_text="Assess").click()
            deadline = time.monotonic() + VERDICT_TIMEOUT_S
            while len(verdict_at) < len(roles):
                for role in roles:
                    if role not in verdict_at and any(
                            "Verdict:" in text for text in panels[role].locator(".scalelab-verdict").all_inner_texts()):
                        verdict_at[role] = time.monotonic()
                assert time.monotonic() < deadline, f"no verdict within {VERDICT_TIMEOUT_S} s:\n{hub.log_text()}"
                time.sleep(0.1)
            click_to_verdict_s = {role: verdict_at[role] - clicked[role] for role in roles}
            assert max(clicked.values()) < min(verdict_at.values()), "the two were not assessing at the same time"

            jobs = {}
            for role in roles:
                name, panel, page = hub.students[role], panels[role], pages[role]
                verdict = panel.locator(".scalelab-verdict").inner_text()
                assert "Verdict: FAIL" in verdict and "not valid Python" in verdict, verdict
                expect(panel.locator(".scalelab-status")).to_contain_text("done", timeout=30_000)
                expect(panel.locator(".scalelab-history tr")).to_have_count(2, timeout=30_000)  # header + this one
                assert "Traceback" not in panel.inner_text()
                [job] = hub.api("GET", "assessments", hub.tokens[name]).json()["assessments"]
                assert (job["student"], job["state"], job["verdict"]["verdict"]) == (name, "done", "fail"), job
                jobs[role] = job["id"]
                panel.scroll_into_view_if_needed()
                page.screenshot(path=str(ARTIFACTS / f"hub-student-{role.lower()}.png"), full_page=True)
            assert jobs["A"] != jobs["B"]

            # Both logged in, their servers and kernels running: what the class costs in memory.
            memory = memory_figures(hub)

            # From A's kernel: the service's state, the held-out split and B's home are out of reach, and the
            # service answers A's token with A's history whatever student the request names.
            student, other = hub.students["A"], hub.students["B"]
            for path in (hub.state, hub.state / "results.db", hub.state / "assess" / "queue.db", hub.homes[other],
                         hub.state / "data" / "fashion-mnist" / "t10k-labels-idx1-ubyte.gz"):
                assert path.exists(), f"{path} does not exist: a refusal to read it would prove nothing"
            output = run_new_cell(pages["A"], peek_source(hub, other))
            pages["A"].screenshot(path=str(ARTIFACTS / "hub-student-a-trust.png"), full_page=True)
            peeked = re.search(r"^PEEK (\{.*\})$", output, re.MULTILINE)
            assert peeked, f"the cell did not print its findings:\n{output}"
            seen = json.loads(peeked.group(1))
            assert seen["found"] == {label: "PermissionError" for label in seen["found"]} and len(seen["found"]) == 5, \
                seen["found"]
            status, history = seen["with_token"]
            assert status == 200 and history["student"] == student, seen["with_token"]
            assert [item["id"] for item in history["assessments"]] == [jobs["A"]], history
            assert {item["student"] for item in history["assessments"]} == {student}
            assert seen["without_token"] == 401

            # The instructor, in a browser of their own: the class page through the Hub's OAuth, and its CSV.
            instructor = hub.instructors["I"]
            page = browser.new_context(viewport=VIEWPORT).new_page()
            visited = []
            page.on("request", lambda request: visited.append(request.url))
            log_in(page, hub, instructor, next_path="/services/scalelab/class")
            page.goto(f"{hub.service_url}class")
            expect(page.locator("h1")).to_contain_text(f"Class: {TEST_TRACK}", timeout=60_000)
            assert page.url == f"{hub.service_url}class", page.url
            assert any(url.startswith(f"{hub.url}/hub/api/oauth2/authorize") for url in visited), visited
            rows = {}
            for row in page.locator("tbody tr").all():
                cells = [cell.strip() for cell in row.locator("td").all_inner_texts()]
                rows[cells[0]] = cells
            assert set(rows) == {student, other}, rows  # the students; no row for the instructor
            for role in roles:
                row = rows[hub.students[role]]
                # student, attempts, latest verdict, best verdict, ...
                assert row[1:4] == ["1", f"fail #{jobs[role]}", f"fail #{jobs[role]}"], row
            page.screenshot(path=str(ARTIFACTS / "hub-class-page.png"), full_page=True)
            with page.expect_download() as downloading:
                page.get_by_role("link", name="Download CSV").click()
            download = downloading.value
            assert download.suggested_filename == f"scalelab-class-{TEST_TRACK}.csv"
            with open(download.path(), encoding="utf-8", newline="") as stream:
                table = {row["student"]: row for row in csv.DictReader(io.StringIO(stream.read()))}
            assert set(table) == {student, other}, table
            for role in roles:
                row = table[hub.students[role]]
                assert (row["latest_job"], row["latest_state"], row["latest_verdict"]) == (
                    str(jobs[role]), "done", "fail"), row
        finally:
            browser.close()

    figures = {"spawn_s": {role: round(seconds, 1) for role, seconds in spawn_s.items()},
               "click_to_verdict_s_two_at_once": {role: round(seconds, 1)
                                                 for role, seconds in click_to_verdict_s.items()},
               "rss_mib": memory, "track": TEST_TRACK}
    FIGURES.write_text(json.dumps(figures, indent=1) + "\n")
    print(f"\nspawn: A {figures['spawn_s']['A']} s, B {figures['spawn_s']['B']} s; click-to-verdict, both at once: "
          f"A {figures['click_to_verdict_s_two_at_once']['A']} s, B {figures['click_to_verdict_s_two_at_once']['B']} s")
    print("RSS (MiB): " + ", ".join(f"{what} {mib}" for what, mib in memory.items()))
    print(f"figures in {FIGURES}")
