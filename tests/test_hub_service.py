"""The grader as JupyterHub's managed service (grader/service/hub.py) behind a real Hub and its real proxy.

The Hub, its service and the students' real system accounts come from tests/hubtools.py (removed afterwards,
whatever happened). Submissions are the fast ones of tests/submissions on the short test track.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import re
import secrets
import shutil
import socket
import stat
import textwrap
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest
import requests

from hubtools import (FAST_SUBMISSION, SLEEPING_SUBMISSION, SUBMISSIONS, TEST_TRACK, TEST_TRACKS, free_port, run,
                      running_hub)

from conftest import EDITION_HONEST_SUBMISSION
from scalelab.grader import assess_helper, launch, panel, sandbox, spec
from scalelab.grader.pipeline import SUBMISSION_SIZE_LIMIT_BYTES
from scalelab.grader.serve import JOB_FIELDS_FOR_STUDENTS, VERDICT_FIELDS_FOR_STUDENTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
# The service grades the installed edition's test track: the student's script and the saved model are named after
# its framework.
GRADED = spec.load_track(TEST_TRACK, TEST_TRACKS)

# What a student sees of a job: the single-user service's public view, field for field.
JOB_VIEW_FIELDS = {*JOB_FIELDS_FOR_STUDENTS, "time_budget_s", "position", "progress", "progress_history", "verdict"}


@pytest.fixture(scope="module")
def hub():
    """A Hub with the service on free ports, three students A, B and C, until the module's tests are done."""
    with running_hub(student_roles=("A", "B", "C")) as running:
        yield running


# --- who runs it, and who may use it ------------------------------------------------------------------------------

def test_the_service_runs_as_scalelab_with_its_state_private_to_it(hub):
    scalelab = pwd.getpwnam("scalelab")
    [service] = hub.service_processes()
    assert os.stat(f"/proc/{service.pid}").st_uid == scalelab.pw_uid
    assert service.uids().real == service.uids().effective == scalelab.pw_uid
    state = hub.state.stat()
    assert (state.st_uid, stat.S_IMODE(state.st_mode)) == (scalelab.pw_uid, 0o700)
    environment = service.environ()
    assert not any(name.startswith("CONFIGPROXY") for name in environment), "the proxy's token leaked"
    for name in ("assess/queue.db", "logs/service.log", "cookie_secret",
                 "data/fashion-mnist/t10k-labels-idx1-ubyte.gz"):
        assert (hub.state / name).exists(), name
    # A student's account cannot read it.
    student = hub.students["A"]
    peek = run("runuser", "-u", student, "--", "ls", str(hub.state), cwd="/")
    assert peek.returncode != 0 and "Permission denied" in peek.stderr


def test_a_submission_sent_as_content_gets_the_same_verdict_json_as_the_single_user_service(hub):
    student = hub.students["A"]
    info = hub.api("GET", "service", hub.tokens[student]).json()
    assert (info["student"], info["track"]) == (student, TEST_TRACK)
    answer = hub.submit(student, FAST_SUBMISSION.read_text())
    assert answer.status_code == 201, answer.text
    submitted = answer.json()
    assert submitted["created"] is True and set(submitted["job"]) == JOB_VIEW_FIELDS
    job = hub.wait_for_job(student, submitted["job"]["id"])
    assert job["state"] == "done" and set(job) == JOB_VIEW_FIELDS
    assert job["student"] == student
    verdict = job["verdict"]
    assert verdict["verdict"] == "fail"
    assert {"verdict", "reasons", "track", "submission_sha256", "student"} <= set(verdict) <= set(
        VERDICT_FIELDS_FOR_STUDENTS)
    assert "not valid Python" in " ".join(verdict["reasons"])
    history = hub.api("GET", "assessments", hub.tokens[student]).json()
    assert history["student"] == student and [item["id"] for item in history["assessments"]] == [job["id"]]


def test_requests_without_a_token_or_with_one_the_hub_does_not_accept_are_refused(hub):
    for method in ("GET", "POST"):
        anonymous = hub.api(method, "assessments")
        assert anonymous.status_code == 401 and "Log in to JupyterHub" in anonymous.json()["message"]
    assert hub.api("GET", "service", token=secrets.token_hex(16)).status_code == 403
    # A real token of the student's, but without access to this service.
    student = hub.students["A"]
    narrow = hub.admin("POST", f"users/{student}/tokens", json={"scopes": ["read:users:name!user"]}).json()["token"]
    assert hub.api("GET", "assessments", token=narrow).status_code == 403
    # The name in a request counts for nothing: the token's owner is the student.
    other = hub.students["B"]
    answer = hub.api("GET", f"assessments?student={other}", hub.tokens[student], headers={"X-Student": other})
    assert answer.json()["student"] == student


def test_a_browser_logged_in_to_the_hub_is_the_student_through_the_services_oauth_cookie(hub):
    student = hub.students["A"]
    browser = requests.Session()
    assert browser.get(f"{hub.url}/hub/login", timeout=30).status_code == 200
    login = browser.post(f"{hub.url}/hub/login", allow_redirects=False, timeout=60, data={
        "username": student, "password": hub.passwords[student], "_xsrf": browser.cookies.get("_xsrf", path="/hub/")})
    assert login.status_code == 302, login.text
    page = browser.get(hub.service_url, timeout=60)  # the service → the Hub's OAuth → the service's callback
    assert page.status_code == 200 and f"signed in as <b>{student}</b>" in page.text
    assert any(step.url.startswith(f"{hub.url}/hub/api/oauth2/authorize") for step in page.history)
    info = browser.get(f"{hub.service_url}api/service", timeout=60)
    assert info.status_code == 200 and info.json()["student"] == student
    # The cookie alone does not submit: a cross-site form could send it, so a POST needs the xsrf token too.
    before = hub.api("GET", "assessments", hub.tokens[student]).json()["assessments"]
    forged = browser.post(f"{hub.service_url}api/assessments", data=b"print(1)\n", timeout=60)
    assert forged.status_code == 403
    assert hub.api("GET", "assessments", hub.tokens[student]).json()["assessments"] == before


def test_another_students_job_does_not_exist_for_a_student(hub):
    owner, other = hub.students["A"], hub.students["B"]
    [job] = hub.api("GET", "assessments", hub.tokens[owner]).json()["assessments"]
    answer = hub.api("GET", f"assessments/{job['id']}", hub.tokens[other])
    assert answer.status_code == 404 and "There is no assessment" in answer.json()["message"]
    assert hub.api("GET", "assessments/99999999999999999999", hub.tokens[other]).status_code == 404
    assert hub.api("GET", "assessments", hub.tokens[other]).json()["assessments"] == []


def test_an_oversized_or_non_utf8_script_is_refused_with_a_sentence_and_queues_nothing(hub):
    student = hub.students["B"]
    token = hub.tokens[student]
    too_big = b"#" * (SUBMISSION_SIZE_LIMIT_BYTES + 1)
    raw = hub.api("POST", "assessments", token, data=too_big, headers={"Content-Type": "text/x-python"})
    assert raw.status_code == 413 and f"over the {SUBMISSION_SIZE_LIMIT_BYTES} byte limit" in raw.json()["message"]
    as_json = hub.api("POST", "assessments", token,
                      json={"source": too_big.decode(), "filename": GRADED.submission_file})
    assert as_json.status_code == 413 and "byte limit" in as_json.json()["message"]
    latin1 = "print('caf\u00e9')\n".encode("latin-1")
    raw = hub.api("POST", "assessments", token, data=latin1, headers={"Content-Type": "text/x-python"})
    assert raw.status_code == 400 and "not UTF-8" in raw.json()["message"]
    in_json = b'{"source": "print(\'caf\xe9\')", "filename": "assessment.py"}'
    answer = hub.api("POST", "assessments", token, data=in_json, headers={"Content-Type": "application/json"})
    assert answer.status_code == 400 and "not UTF-8" in answer.json()["message"]
    surrogate = hub.api("POST", "assessments", token, data=b'{"source": "x = 1  # \\ud800"}',
                        headers={"Content-Type": "application/json"})
    assert surrogate.status_code == 400 and "not UTF-8" in surrogate.json()["message"]
    bad_name = hub.api("POST", "assessments", token, json={"source": "x = 1\n", "filename": "../../etc/passwd"})
    assert bad_name.status_code == 400 and "file name" in bad_name.json()["message"]
    assert hub.api("GET", "assessments", token).json()["assessments"] == []


def head_of_a_post(url: str, headers: dict[str, str], timeout_s: float = 20) -> str:
    """What the service answers to a POST's head and the first KiB of the body it declares; the rest is never
    sent (the Hub's proxy passes a request on with its first bytes of body)."""
    parts = urlsplit(url)
    lines = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s) as connection:
        connection.sendall(f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n{lines}\r\n".encode()
                           + b"x" * 1024)
        try:
            return connection.recv(65536).decode("latin-1")
        except TimeoutError:
            return f"no answer within {timeout_s} s: the service waits for the body"


def test_a_body_is_read_only_once_its_sender_is_known_and_never_beyond_a_submission(hub):
    """The Hub's answer about the sender comes first, and a body longer than a submission can be is refused with a
    sentence before a byte of it is read."""
    huge = {"Content-Type": "application/json", "Content-Length": str(50 << 20)}
    student = hub.tokens[hub.students["B"]]
    for token, status in ((None, 401), ("not-a-token", 403), (student, 413)):
        authorization = {"Authorization": f"token {token}"} if token else {}
        answer = head_of_a_post(f"{hub.service_url}api/assessments", {**huge, **authorization})
        assert answer.startswith(f"HTTP/1.1 {status} "), answer[:400]
    assert "nothing of it was read" in answer
    form = {"Content-Type": "application/x-www-form-urlencoded", "Content-Length": "100000"}
    answer = head_of_a_post(f"{hub.service_url}class/regrade", {**form, "Authorization": f"token {student}"})
    assert answer.startswith("HTTP/1.1 403 "), answer[:400]


def test_a_token_the_hub_revoked_is_refused_at_once(hub):
    """The Hub is asked about every request: a token it revoked works for no further request."""
    student = hub.students["C"]
    issued = hub.admin("POST", f"users/{student}/tokens", json={"note": "revoked by the test"})
    assert issued.status_code == 201, issued.text
    token = issued.json()["token"]
    assert hub.api("GET", "assessments", token).status_code == 200
    assert hub.admin("DELETE", f"users/{student}/tokens/{issued.json()['id']}").status_code == 204
    answer = hub.api("GET", "assessments", token)
    assert answer.status_code == 403 and "did not accept" in answer.json()["message"]
    assert hub.api("POST", "assessments", token, json={"source": "x = 1\n"}).status_code == 403


def test_two_submissions_at_once_make_one_active_job(hub):
    student = hub.students["B"]
    answers = []
    barrier = threading.Barrier(2)

    def submit():
        barrier.wait()
        answers.append(hub.submit(student, FAST_SUBMISSION.read_text()))

    threads = [threading.Thread(target=submit) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(answer.status_code for answer in answers) == [200, 201], [a.text for a in answers]
    assert len({answer.json()["job"]["id"] for answer in answers}) == 1
    job = hub.wait_for_job(student, answers[0].json()["job"]["id"])
    assert job["verdict"]["verdict"] == "fail"
    assert len(hub.api("GET", "assessments", hub.tokens[student]).json()["assessments"]) == 1


# --- graded runs cannot reach the service's state -----------------------------------------------------------------

def test_a_graded_run_cannot_read_the_service_state_and_its_verdict_still_arrives(hub):
    student, other = hub.students["C"], hub.students["A"]
    state = hub.state
    absent = [state / "results.db", state / "assess" / "queue.db", state / "assess" / "jobs",
              state / "data" / "fashion-mnist" / "t10k-labels-idx1-ubyte.gz", state / "cookie_secret",
              state / "logs" / "service.log", state / "runs", hub.homes[other], pwd.getpwnam("scalelab").pw_dir]
    source = textwrap.dedent(f"""
        import os
        found = []
        for path in {[str(p) for p in [state, state / "jobs", *absent]]!r}:
            try:
                if os.path.isdir(path):
                    listing = sorted(os.listdir(path))
                    found.append("OWN JOB" if listing == [os.path.basename(os.getcwd())] else f"DIR {{listing}}")
                else:
                    open(path, "rb").close()
                    found.append("SEEN")
            except FileNotFoundError:
                found.append("ABSENT")
            except OSError as error:
                found.append(type(error).__name__)
        raise RuntimeError("peek: " + "; ".join(found))
        """)
    answer = hub.submit(student, source)
    assert answer.status_code == 201, answer.text
    job = hub.wait_for_job(student, answer.json()["job"]["id"])
    verdict = job["verdict"]
    assert verdict["verdict"] == "fail" and verdict["sandboxed"] is True
    reasons = "\n".join(verdict["reasons"])
    peeked = re.search(r"RuntimeError: peek: (.*)", reasons)
    assert peeked, reasons
    # Graded as root by the helper, the run's job directory is a copy in root's private folder: not even the path
    # to the state is shown.
    assert peeked.group(1).split("; ") == ["ABSENT"] * (2 + len(absent))
    # The paths are real: the service's account keeps its queue, results and data there.
    for path in absent[:6]:
        assert path.exists(), path
    assert (state / "results.db").stat().st_mtime >= time.time() - 600  # this very verdict was stored there


def test_an_honest_submission_passes_with_the_held_out_accuracy_measured_and_its_model_kept(hub):
    student, scalelab = hub.students["B"], pwd.getpwnam("scalelab")
    source = (SUBMISSIONS / EDITION_HONEST_SUBMISSION).read_text()
    answer = hub.submit(student, source)
    assert answer.status_code == 201, answer.text
    verdict = hub.wait_for_job(student, answer.json()["job"]["id"])["verdict"]
    assert verdict["verdict"] == "pass", verdict["reasons"]
    assert verdict["heldout_accuracy"] >= verdict["target_accuracy"]
    [job_dir] = [path.parent for path in (hub.state / "assess" / "jobs").glob("*/assessment.py")
                 if path.read_text() == source]
    model = job_dir / "grader" / GRADED.model_file
    assert model.stat().st_uid == scalelab.pw_uid and model.stat().st_size > 0
    # The held-out split stays out of every other account's reach: the state is the service's alone.
    assert stat.S_IMODE(hub.state.stat().st_mode) == 0o700


def test_a_run_that_takes_processes_and_memory_has_a_uid_and_limits_of_its_own_and_the_service_stays(hub):
    student, scalelab = hub.students["A"], pwd.getpwnam("scalelab")
    [service] = hub.service_processes()
    source = (SUBMISSIONS / "service" / "crowds_the_machine.py").read_text()
    answer = hub.submit(student, source)
    assert answer.status_code == 201, answer.text
    # Who the run's processes are, seen from outside while they live (the submission holds them 5 s).
    owners, done = set(), threading.Event()

    def watch():
        while not done.is_set():
            for process in psutil.process_iter(["cmdline", "uids"]):
                if process.info["cmdline"] == ["sleep", "3142"] and process.info["uids"]:
                    owners.add(process.info["uids"].real)
            time.sleep(0.2)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        job = hub.wait_for_job(student, answer.json()["job"]["id"])
    finally:
        done.set()
        watcher.join()
    assert job["state"] == "done" and job["verdict"]["verdict"] == "fail", job
    assert owners and all(uid in sandbox.SANDBOX_UID_RANGE for uid in owners), owners
    assert scalelab.pw_uid not in owners
    [job_dir] = [path.parent for path in (hub.state / "assess" / "jobs").glob("*/assessment.py")
                 if path.read_text() == source]
    # What root's helper copied back is the service's: the verdict, and the rank logs its class page reads.
    stored = json.loads((job_dir / "grader" / "verdict.json").read_text())
    assert stored["sandbox_uid"] in owners
    assert stored["memory"]["limit_bytes"] == 8 * 1024**3 and stored["memory"]["peak_bytes"] > 0, stored["memory"]
    assert stored["logs_dir"] == str(job_dir / "grader" / "logs")
    logs = [Path(stored["logs_dir"]) / f"rank-{rank}.log" for rank in (0, 1)]
    assert all(log.stat().st_uid == scalelab.pw_uid for log in logs)
    lines = [line for log in logs for line in log.read_text().splitlines()]
    spawned = [line for line in lines if line.startswith("spawned ")]
    assert spawned and all("then refused" in line and int(line.split()[1]) < launch.NPROC_LIMIT
                           for line in spawned), spawned
    wrote = [line for line in lines if line.startswith("wrote ")]
    assert wrote and all("refused with ENOSPC" in line for line in wrote), wrote
    assert sum(int(line.split()[1]) for line in wrote) <= sandbox.TMPFS_SIZES["/dev/shm"] // 1024**2, wrote
    assert not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "3142"]]
    # The service was never in reach: the same process answers.
    assert [process.pid for process in hub.service_processes()] == [service.pid]
    assert hub.api("GET", "service", hub.tokens[student]).status_code == 200
    # Only the service's account may run the helper as root.
    tried = run("runuser", "-u", student, "--", "sudo", "-n", "/usr/local/sbin/scalelab-assess", "--help", cwd="/")
    assert tried.returncode != 0 and "password is required" in tried.stderr, tried


# --- the Assess panel in a Hub user's kernel ------------------------------------------------------------------------

@pytest.fixture
def kernel_of(monkeypatch, tmp_path):
    """This process as a kernel of ``student``'s server: the Hub's variables, the notebook's folder as cwd."""
    def become(hub, student: str, script: Path | None = FAST_SUBMISSION) -> Path:
        monkeypatch.setenv("JUPYTERHUB_API_TOKEN", hub.tokens[student])
        monkeypatch.setenv("JUPYTERHUB_SERVICE_PREFIX", f"/user/{student}/")
        monkeypatch.setenv("SCALELAB_ASSESS_SERVICE_URL", hub.service_url)
        monkeypatch.delenv("SCALELAB_ASSESS_URL", raising=False)
        monkeypatch.chdir(tmp_path)
        if script is not None:
            shutil.copy(script, tmp_path / GRADED.submission_file)
        return tmp_path
    return become


def test_the_panel_under_jupyterhub_sends_the_script_and_shows_the_verdict(hub, kernel_of):
    student = hub.students["C"]
    folder = kernel_of(hub, student)
    client = panel.AssessClient.for_this_notebook()
    assert client.hub and client.base_url == hub.service_url
    assessment = panel.AssessPanel(poll_interval_s=0.5)
    deadline = time.monotonic() + 60
    while not assessment.service_info and time.monotonic() < deadline:
        time.sleep(0.2)
    assert assessment.service_info["student"] == student, assessment.error.value
    earlier = {job["id"] for job in hub.api("GET", "assessments", hub.tokens[student]).json()["assessments"]}
    assessment.button.click()
    deadline = time.monotonic() + 240

    def shown_verdict_of_a_new_job() -> bool:
        shown = re.search(r"Assessment (\d+): done\. Verdict: FAIL", assessment.status.value)
        return bool(shown) and int(shown.group(1)) not in earlier

    while not shown_verdict_of_a_new_job() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert shown_verdict_of_a_new_job(), (assessment.status.value, assessment.error.value)
    assert "not valid Python" in assessment.verdict.value
    [latest, *_] = hub.api("GET", "assessments", hub.tokens[student]).json()["assessments"]
    script = folder / GRADED.submission_file
    assert latest["submission_sha256"] == hashlib.sha256(script.read_bytes()).hexdigest()
    script.unlink()
    with pytest.raises(panel.ServiceError, match=f"There is no {GRADED.submission_file} to assess"):
        client.submit()


def test_the_panel_says_in_a_sentence_when_the_hub_has_no_such_service_or_it_does_not_answer(hub, kernel_of):
    kernel_of(hub, hub.students["C"])
    with pytest.raises(panel.ServiceError, match="not running right now"):
        panel.AssessClient(f"http://127.0.0.1:{free_port()}/services/scalelab/", hub.tokens[hub.students["C"]],
                           api_prefix=panel.HUB_API_PREFIX, submission_dir=Path(".")).service()
    with pytest.raises(panel.ServiceError, match="runs no Assess service"):
        panel.AssessClient(f"{hub.url}/services/nothing-here/", hub.tokens[hub.students["C"]],
                           api_prefix=panel.HUB_API_PREFIX, submission_dir=Path(".")).service()
    with pytest.raises(panel.ServiceError, match="did not accept this kernel's JupyterHub token"):
        panel.AssessClient(hub.service_url, "not-a-token", api_prefix=panel.HUB_API_PREFIX,
                           submission_dir=Path(".")).service()


# --- the Hub restarts it, and nothing is lost ----------------------------------------------------------------------

def test_killing_the_service_the_hub_restarts_it_and_the_running_job_is_graded_again_first(hub, kernel_of):
    running_student, queued_student = hub.students["A"], hub.students["B"]
    running = hub.submit(running_student, SLEEPING_SUBMISSION.read_text())
    assert running.status_code == 201, running.text
    running_id = running.json()["job"]["id"]
    hub.wait_for_job(running_student, running_id, states=("running",), timeout_s=120)
    queued = hub.submit(queued_student, FAST_SUBMISSION.read_text())
    assert queued.status_code == 201 and queued.json()["job"]["state"] == "queued", queued.text
    [service] = hub.service_processes()
    deadline = time.monotonic() + 60
    # Root's helper, which the service runs through sudo for the job, and the grader it started.
    while not (helpers := [process for process in psutil.process_iter(["cmdline"])
                           if "scalelab.grader.assess_helper" in (process.info["cmdline"] or [])
                           and str(hub.state) in " ".join(process.info["cmdline"])]) \
            or not (graders := [child for child in helpers[0].children(recursive=True)
                                if "assess" in child.cmdline()]):
        assert time.monotonic() < deadline, "the running job's grader was not found"
        time.sleep(0.5)
    for process in (helpers[0], graders[0]):
        assert process.uids().real == 0
        assert not any(name.startswith("JUPYTERHUB_") for name in process.environ()), "the Hub's token leaked"
    # The Hub starts the service again as soon as it sees it gone, within seconds: held still meanwhile, so that the
    # panel's answer to a service that is down is seen for sure. The proxy, a process of its own, goes on routing.
    hub_process = service.parent()
    assert "jupyterhub" in " ".join(hub_process.cmdline()), hub_process.cmdline()
    hub_process.suspend()
    try:
        service.kill()
        deadline = time.monotonic() + 30
        # Dead but not reaped (its parent, the Hub, is held still): a zombie, which psutil's wait would wait on.
        while service.is_running() and service.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the killed service still runs"
            time.sleep(0.2)
        # The service gone, its end of the helper's input closed: the helper stops the grading.
        _gone, alive = psutil.wait_procs(helpers + graders, timeout=assess_helper.STOP_GRACE_S + 15)
        assert not alive, alive

        # Until the Hub has started it again, the panel says so in a sentence.
        kernel_of(hub, hub.students["C"])
        with pytest.raises(panel.ServiceError, match="not running right now"):
            panel.AssessClient.for_this_notebook().service()
    finally:
        hub_process.resume()

    deadline = time.monotonic() + 180
    while True:
        restarted = [process for process in hub.service_processes() if process.pid != service.pid]
        if restarted:
            try:
                if hub.api("GET", "service", hub.tokens[queued_student]).status_code == 200:
                    break
            except requests.RequestException:
                pass
        if time.monotonic() > deadline:
            pytest.fail(f"the Hub did not restart the service within 180 s:\n{hub.log_text()}")
        time.sleep(1)
    assert restarted[0].uids().real == pwd.getpwnam("scalelab").pw_uid
    rerun = hub.wait_for_job(running_student, running_id)
    assert rerun["state"] == "done" and rerun["verdict"]["verdict"] == "fail", rerun  # it slept, then exited 1
    [again_because] = rerun["reruns"]
    assert "the course's grader service stopped while this assessment was running" in again_because["reason"]
    assert any(note.startswith("Re-run on ") for note in rerun["verdict"]["notes"])
    done = hub.wait_for_job(queued_student, queued.json()["job"]["id"])
    assert done["state"] == "done" and done["verdict"]["verdict"] == "fail"
    assert done["started_at"] > rerun["started_at"], "the re-run job goes first: it had been waiting longest"
    still = [grader for grader in graders if grader.is_running() and grader.status() != psutil.STATUS_ZOMBIE]
    assert not still, "the stopped run's grader still runs"
