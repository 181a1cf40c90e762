"""What the hub tests share: `make hub` on free ports as root (a module-scoped fixture), accounts made with
`scalelab class` under random names and removed afterwards (accounts, homes, processes) even when a test fails, and
logging in and spawning as a browser does. nbgrader's exchange and course directory are the fixture's own
(HUB_NBGRADER in a temporary directory), so the tests never touch a class's.

`running_hub()` is the same `make hub` with the grader service on the short test track, its state in a directory of
the test's, the accounts already logged in once (so the Hub knows them and their groups) and an API token for each;
the tests reach the Hub's REST API through a service of their own, added with HUB_CONFIG_D."""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import requests

from conftest import EDITION_TEST_TRACK, PROJECT_ROOT

from scalelab.grader.classroom import server_limits

HUB_VENV = Path("/opt/scalelab/venv")  # the Makefile's default
SCALELAB = str(HUB_VENV / "bin" / "scalelab")
SUBMISSIONS = PROJECT_ROOT / "tests" / "submissions"
TEST_TRACKS = SUBMISSIONS / "tracks.toml"
# The Keras test track, or the DDP one on the PyTorch edition (no TensorFlow), which refuses a Keras track.
TEST_TRACK = EDITION_TEST_TRACK
# A syntax error fails in seconds without a launch; the other keeps a job running for a minute, then fails.
FAST_SUBMISSION = SUBMISSIONS / "service" / "syntax_error_fast.py"
SLEEPING_SUBMISSION = SUBMISSIONS / "service" / "sleeps_then_fails.py"
SERVICE_URL_PATH = "/services/scalelab/"
FINAL_JOB_STATES = ("done", "interrupted")


def run(*command: str, cwd: str | Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(list(command), cwd=cwd, capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def random_name(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(4)}"


def scalelab_class(*arguments: str, password: str | None = None, as_user: str | None = None):
    command = [SCALELAB, "class", *arguments]
    if as_user:
        command = ["runuser", "-u", as_user, "--", *command]
    return subprocess.run(command, input=password + "\n" if password is not None else None,
                          capture_output=True, text=True, timeout=120)


def processes_of(uid: int) -> list[psutil.Process]:
    """The processes of ``uid``, each with ``info["cmdline"]`` read as it was found (None for one that had ended
    meanwhile: a zombie has no command line to read later)."""
    found = []
    for process in psutil.process_iter(["uids", "cmdline"]):
        uids = process.info["uids"]
        if uids and uid in (uids.real, uids.effective):
            found.append(process)
    return found


def is_zombie(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def remove_account(name: str) -> None:
    """The account, its home and its processes (ended by pid), whatever state a failed test left them in."""
    try:
        uid = pwd.getpwnam(name).pw_uid
    except KeyError:
        return
    for attempt in range(20):
        # A killed server stays a zombie until the Hub, its parent, polls it (every 30 s): it is dead already.
        left = [process for process in processes_of(uid) if not is_zombie(process)]
        if not left:
            break
        for process in left:
            try:
                process.send_signal(signal.SIGKILL if attempt else signal.SIGTERM)
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=3)
    server_limits.release(name)  # a Hub stopped by the test leaves its students' cgroups behind
    subprocess.run(["userdel", "--remove", name], capture_output=True)
    assert name not in {entry.pw_name for entry in pwd.getpwall()}, f"the test account {name} could not be removed"


class Hub:
    def __init__(self, url: str, state: Path, log: Path, nbgrader_home: Path):
        self.url, self.state, self.log, self.nbgrader_home = url, state, log, nbgrader_home
        self.passwords: dict[str, str] = {}
        self.start_seconds = 0.0

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def login(self, name: str, password: str) -> tuple[requests.Session, requests.Response]:
        """The login form as a browser sends it: the _xsrf cookie from the form's page, posted back."""
        session = requests.Session()
        assert session.get(f"{self.url}/hub/login", timeout=30).status_code == 200
        answer = session.post(f"{self.url}/hub/login", allow_redirects=False, timeout=60, data={
            "username": name, "password": password, "_xsrf": session.cookies.get("_xsrf", path="/hub/")})
        return session, answer


def start_make_hub(log_path: Path, settings: list[str], environment: dict | None = None) -> subprocess.Popen:
    """`make hub SETTING=...` in its own process group, its output in ``log_path``."""
    with log_path.open("w") as log:
        return subprocess.Popen(["make", "hub", *settings], cwd=PROJECT_ROOT, env=environment, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def wait_until_answers(url: str, server: subprocess.Popen, log: Path, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while True:
        if server.poll() is not None:
            pytest.fail(f"make hub exited with {server.returncode}:\n{log.read_text(errors='replace')[-6000:]}")
        try:
            if requests.get(url, timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"{url} did not answer within {within_s} s:\n{log.read_text(errors='replace')[-6000:]}")
        time.sleep(1)


def stop_make_hub(server: subprocess.Popen) -> None:
    """SIGTERM: JupyterHub stops its service, the students' servers and its proxy, then exits."""
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """`make hub` on free ports with its state in a directory of the test's, until the module's tests are done.
    nbgrader's exchange and course directory too, in a directory every account can reach (pytest's are root's)."""
    if os.geteuid() != 0:
        pytest.fail("the hub tests create system accounts and run JupyterHub as root: run them as root (CI does)")
    port, proxy_api_port, internal_port = free_port(), free_port(), free_port()
    state = tmp_path_factory.mktemp("hub") / "state"
    log_path = tmp_path_factory.getbasetemp() / "make-hub.log"
    nbgrader_home = Path(tempfile.mkdtemp(prefix="scalelab-test-nbgrader-", dir="/tmp"))
    nbgrader_home.chmod(0o755)
    started = time.monotonic()
    server = start_make_hub(log_path, [f"HUB_PORT={port}", f"HUB_PROXY_API_PORT={proxy_api_port}",
                                       f"HUB_INTERNAL_PORT={internal_port}", f"HUB_STATE={state}",
                                       f"HUB_NBGRADER={nbgrader_home}"])
    running = Hub(f"http://127.0.0.1:{port}", state, log_path, nbgrader_home)
    try:
        wait_until_answers(f"{running.url}/hub/api/", server, log_path, 1500)
        running.start_seconds = time.monotonic() - started
        yield running
    finally:
        stop_make_hub(server)
        subprocess.run(["rm", "-rf", str(state)], check=False)
        shutil.rmtree(nbgrader_home, ignore_errors=True)


@pytest.fixture(scope="module")
def accounts(hub):
    """Two students (passwords given on standard input) and an instructor (a generated password), random names."""
    names = {"student_a": random_name("sla"), "student_b": random_name("slb"), "instructor": random_name("sli")}
    try:
        for key in ("student_a", "student_b"):
            password = secrets.token_urlsafe(12)
            added = scalelab_class("add-student", names[key], "--password-stdin", password=password)
            assert added.returncode == 0, added.stderr
            hub.passwords[names[key]] = password
        added = scalelab_class("add-instructor", names["instructor"])
        assert added.returncode == 0, added.stderr
        shown = re.search(rf"one-time password for {names['instructor']}: (\S+)", added.stdout)
        assert shown, f"no generated password in: {added.stdout}"
        hub.passwords[names["instructor"]] = shown.group(1)
        yield names
    finally:
        for name in names.values():
            remove_account(name)


def spawn(hub: Hub, session: requests.Session, name: str) -> float:
    """Start the logged-in user's server as the browser does; the seconds until its JupyterLab page answers."""
    started = time.monotonic()
    session.get(f"{hub.url}/hub/spawn", timeout=60)
    server = f"{hub.url}/user/{name}"
    while time.monotonic() - started < 240:
        page = session.get(f"{server}/lab", timeout=30)
        if page.status_code == 200 and page.url.startswith(f"{server}/lab"):
            return time.monotonic() - started
        time.sleep(0.25)
    pytest.fail(f"{name}'s server did not answer within 240 s:\n{hub.log_text()}")


def logged_in_server(hub: Hub, name: str) -> tuple[requests.Session, str, dict[str, str]]:
    """``name`` logged in through the form and their server spawned: (session, the server's URL, the headers its
    API wants from a browser: the _xsrf token)."""
    session, answer = hub.login(name, hub.passwords[name])
    assert answer.status_code == 302, f"{name} could not log in: {answer.status_code}\n{hub.log_text()}"
    spawn(hub, session, name)
    return session, f"{hub.url}/user/{name}", {"X-XSRFToken": session.cookies.get("_xsrf", path=f"/user/{name}/")}


# --- the Hub with its grader service, for the service's tests ------------------------------------------------------

# Run by containers/hub/jupyterhub_config.py as a site's addition: the tests' own service with a token to the Hub's
# REST API, and no pause between a student's submissions (the tests submit one after another).
ADMIN_SERVICE_CONFIG = """
assess_service["command"].append("--AssessService.min_seconds_between_submissions=0")  # noqa: F821
c.JupyterHub.services.append({{"name": "scalelab-tests", "api_token": {token!r}}})
c.JupyterHub.load_roles.append({{"name": "scalelab-tests", "services": ["scalelab-tests"],
                                 "scopes": ["admin:users", "admin:servers", "tokens", "read:groups"]}})
"""


class RunningHub:
    """A Hub of `make hub` with the grader service on the test track; names by role (``students["A"]``)."""

    def __init__(self, url: str, state: Path, log: Path, admin_token: str, nbgrader_home: Path,
                 service_url: str | None = None):
        self.url, self.state, self.log, self.nbgrader_home = url, state, log, nbgrader_home
        self.service_url = service_url or f"{url}{SERVICE_URL_PATH}"
        self.proxy_api_url = self.hub_state = None
        self.admin_token = admin_token
        self.students: dict[str, str] = {}
        self.instructors: dict[str, str] = {}
        self.passwords: dict[str, str] = {}
        self.tokens: dict[str, str] = {}
        self.homes: dict[str, Path] = {}

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def login(self, name: str) -> requests.Session:
        """A browser logged in to the Hub through its form, as ``name``."""
        session = requests.Session()
        assert session.get(f"{self.url}/hub/login", timeout=30).status_code == 200
        answer = session.post(f"{self.url}/hub/login", allow_redirects=False, timeout=60, data={
            "username": name, "password": self.passwords[name], "_xsrf": session.cookies.get("_xsrf", path="/hub/")})
        assert answer.status_code == 302, f"{name} could not log in: {answer.status_code}\n{self.log_text()}"
        return session

    def admin(self, method: str, path: str, **arguments) -> requests.Response:
        """The Hub's REST API, as the tests' own service."""
        return requests.request(method, f"{self.url}/hub/api/{path}", timeout=60,
                                headers={"Authorization": f"token {self.admin_token}"}, **arguments)

    def service(self, method: str, path: str, token: str | None = None, headers: dict | None = None,
                **arguments) -> requests.Response:
        """A page or form of the grader service, with ``token`` (a Hub API token) or as nobody."""
        headers = dict(headers or {})
        if token is not None:
            headers["Authorization"] = f"token {token}"
        arguments.setdefault("timeout", 60)
        return requests.request(method, f"{self.service_url}{path}", headers=headers, **arguments)

    def api(self, method: str, path: str, token: str | None = None, **arguments) -> requests.Response:
        """The Assess REST API the panel uses, under the service's URL."""
        return self.service(method, f"api/{path}", token, **arguments)

    def submit(self, student: str, source: str) -> requests.Response:
        """What the panel sends on Assess: the content of the student's assessment.py."""
        return self.api("POST", "assessments", self.tokens[student],
                        json={"source": source, "filename": "assessment.py"})

    def wait_for_job(self, student: str, job_id: int, states=FINAL_JOB_STATES, timeout_s: float = 300) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            answer = self.api("GET", f"assessments/{job_id}", self.tokens[student])
            if answer.status_code == 200 and answer.json()["state"] in states:
                return answer.json()
            if time.monotonic() > deadline:
                pytest.fail(f"job {job_id} of {student} not {'/'.join(states)} within {timeout_s} s: "
                            f"{answer.status_code} {answer.text[:2000]}\n{self.log_text()}")
            time.sleep(0.5)

    def service_processes(self) -> list[psutil.Process]:
        """The grader service of this Hub (there may be other Hubs' on the machine)."""
        found = []
        for process in psutil.process_iter(["cmdline"]):
            command = process.info["cmdline"] or []
            if "scalelab.grader.service.hub" in command and f"--state-dir={self.state}" in command:
                found.append(process)
        return found


@contextlib.contextmanager
def running_hub(student_roles=("A", "B"), instructor_roles=(), settings: dict | None = None):
    """`make hub` on free ports with the grader service graded on the test track, students and instructors with
    random names logged in once and given an API token each; everything removed afterwards, whatever happened.
    ``settings``: more of make hub's variables, e.g. HUB_DOMAIN, HUB_TLS_CERT and HUB_TLS_KEY for one origin per user
    over HTTPS, or HUB_GRADING_CPUS."""
    if os.geteuid() != 0:
        pytest.fail("the hub tests create system accounts and run JupyterHub as root: run them as root (CI does)")
    # Every account must reach the service's state directory's parent and the track file: not pytest's (root's).
    scratch = Path(tempfile.mkdtemp(prefix="scalelab-test-hub-", dir="/tmp"))
    scratch.chmod(0o755)
    tracks = scratch / "tracks.toml"
    shutil.copyfile(TEST_TRACKS, tracks)
    tracks.chmod(0o644)
    config_d = scratch / "hub.d"
    config_d.mkdir(mode=0o700)
    admin_token = secrets.token_hex(32)
    (config_d / "50-scalelab-tests.py").write_text(ADMIN_SERVICE_CONFIG.format(token=admin_token))
    nbgrader_home = scratch / "nbgrader"
    nbgrader_home.mkdir(mode=0o755)
    port, proxy_api_port = free_port(), free_port()
    state, log_path = scratch / "service-state", scratch / "make-hub.log"
    environment = {**os.environ, "SCALELAB_SERVICE_STATE": str(state), "SCALELAB_TRACK": TEST_TRACK,
                   "SCALELAB_TRACKS": str(tracks), "SCALELAB_SERVICE_PORT": str(free_port())}
    names: list[str] = []
    server = start_make_hub(log_path, [
        f"HUB_PORT={port}", f"HUB_PROXY_API_PORT={proxy_api_port}", f"HUB_INTERNAL_PORT={free_port()}",
        f"HUB_STATE={scratch / 'hub-state'}", f"HUB_NBGRADER={nbgrader_home}", f"HUB_CONFIG_D={config_d}",
        *(f"{name}={value}" for name, value in (settings or {}).items())], environment)
    if (settings or {}).get("HUB_DOMAIN"):  # the Hub at https://DOMAIN, the grader service at a name of its own
        domain = settings["HUB_DOMAIN"]
        hub = RunningHub(f"https://{domain}:{port}", state, log_path, admin_token, nbgrader_home,
                         service_url=f"https://scalelab--service.{domain}:{port}{SERVICE_URL_PATH}")
    else:
        hub = RunningHub(f"http://127.0.0.1:{port}", state, log_path, admin_token, nbgrader_home)
    hub.proxy_api_url, hub.hub_state = f"http://127.0.0.1:{proxy_api_port}", scratch / "hub-state"
    try:
        wait_until_answers(f"{hub.url}/hub/api/", server, log_path, 1500)
        for roles, role_name, found in ((student_roles, "student", hub.students),
                                        (instructor_roles, "instructor", hub.instructors)):
            for role in roles:
                name = random_name(f"s{role_name[0]}{role.lower()}")
                names.append(name)
                password = secrets.token_urlsafe(12)
                added = scalelab_class(f"add-{role_name}", name, "--password-stdin", password=password)
                assert added.returncode == 0, added.stderr
                found[role], hub.passwords[name] = name, password
                hub.homes[name] = Path(pwd.getpwnam(name).pw_dir)
                hub.login(name)  # the Hub now knows them, and an instructor's group
                token = hub.admin("POST", f"users/{name}/tokens", json={"note": "scalelab tests"})
                assert token.status_code == 201, token.text
                hub.tokens[name] = token.json()["token"]
        # The service answers once the Hub has started it and it has staged the data.
        any_student = next(iter(hub.tokens.values()))
        deadline = time.monotonic() + 300
        while hub.api("GET", "service", any_student).status_code != 200:
            if time.monotonic() > deadline:
                pytest.fail(f"the grader service did not answer within 300 s:\n{hub.log_text()}")
            time.sleep(1)
        yield hub
    finally:
        stop_make_hub(server)
        for name in names:
            remove_account(name)
        for process in hub.service_processes():
            process.kill()
        shutil.rmtree(scratch, ignore_errors=True)
