"""`make lab` serves the student's view of the course in JupyterLab: the released labs and the assessment (never a
solution nor a hidden test), kernels with the course's environment, a rendered start page and no news pop-up.

One `make lab` for the module, started from a student's plain shell: nothing of the venv on PATH, the view in a
temporary STUDENT_DIR, Jupyter's and the Assess service's state in temporary directories.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from conftest import HAS_TENSORFLOW, PROJECT_ROOT, VENV_BIN, keras_only
from scalelab.lab_setup import KERAS_LABS

TOKEN = "course-test-token"
HEADERS = {"Authorization": f"token {TOKEN}"}
ASSIGNMENTS = sorted(path.name for path in (PROJECT_ROOT / "labs" / "source").iterdir() if path.is_dir())
# What the student's view holds: on the PyTorch edition (no TensorFlow) the Keras labs are left out.
SERVED = ASSIGNMENTS if HAS_TENSORFLOW else sorted(set(ASSIGNMENTS) - set(KERAS_LABS))
SELF_TEST = "!horovodrun -np 2 python assessment.py"
# Stands in for the student's assessment.py under the notebook's own self-test cell: Horovod on 2 ranks, quickly.
TINY_ASSESSMENT = """import sys
import horovod.tensorflow as hvd

hvd.init()
print(f"self-test rank {hvd.rank()} of {hvd.size()} on {sys.prefix}", flush=True)
"""
ARTIFACTS = PROJECT_ROOT / "tests" / "artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--headless=new", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def students_shell(**extra: str) -> dict[str, str]:
    """A student's shell: the tests' environment without the venv (no bin/ on PATH, no VIRTUAL_ENV)."""
    env = {name: value for name, value in os.environ.items() if name not in ("VIRTUAL_ENV", "JUPYTER_TOKEN")}
    env["PATH"] = os.pathsep.join(entry for entry in env.get("PATH", "").split(os.pathsep)
                                  if entry and Path(entry).resolve() != VENV_BIN.resolve())
    env.update(extra)
    return env


@dataclass
class Lab:
    url: str
    student_dir: Path
    cifar10_dir: str
    log: Path

    def get(self, path: str, **kwargs) -> requests.Response:
        return requests.get(f"{self.url}/{path}", headers=HEADERS, timeout=30, **kwargs)


@pytest.fixture(scope="module")
def lab(tmp_path_factory, cifar10_dir):
    tmp = tmp_path_factory.mktemp("make-lab")
    port = _free_port()
    env = students_shell(JUPYTER_TOKEN=TOKEN, JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
                         JUPYTER_CONFIG_DIR=str(tmp / "config"), JUPYTER_DATA_DIR=str(tmp / "data"),
                         IPYTHONDIR=str(tmp / "ipython"), SCALELAB_HOME=str(tmp / "home"),
                         SCALELAB_CIFAR10_DIR=str(cifar10_dir), BROWSER="true")
    assert shutil.which("horovodrun", path=env["PATH"]) is None, "the student's shell must not find horovodrun"
    log_path = tmp / "lab.log"
    with log_path.open("w") as log:
        server = subprocess.Popen(["make", "lab", f"LAB_PORT={port}", f"STUDENT_DIR={tmp / 'student'}"],
                                  cwd=PROJECT_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if server.poll() is not None:
                pytest.fail(f"make lab exited with {server.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                requests.get(f"{base}/api", timeout=2)
                break
            except requests.ConnectionError:
                time.sleep(1)
        else:
            pytest.fail(f"JupyterLab did not answer within 180 s:\n{log_path.read_text()[-3000:]}")
        yield Lab(base, tmp / "student", str(cifar10_dir), log_path)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


def names(listing: dict) -> set[str]:
    return {entry["name"] for entry in listing["content"]}


def test_make_lab_serves_the_students_view_and_none_of_the_instructors_material(lab):
    assert "JupyterLab" in lab.get("lab").text
    assert requests.get(f"{lab.url}/api/contents/", timeout=30).status_code == 403, \
        "the course must not be served without Jupyter's authentication"
    assert names(lab.get("api/contents/").json()) == {"START.md", "labs", "assessment", "source_code"}
    assert names(lab.get("api/contents/labs").json()) == set(SERVED), "the released labs, no source/"
    assert names(lab.get("api/contents/assessment").json()) == {"assessment.ipynb", "assessment.py",
                                                                "assessment_pytorch.py", "tracks.toml"}
    for hidden in ("labs/source", "labs/release", "assessment/solution", "assessment/solution/assessment.py"):
        assert lab.get(f"api/contents/{hidden}").status_code in (400, 404), hidden
    quiz_source = (PROJECT_ROOT / "labs" / "source" / "quiz" / "quiz.ipynb").read_text()
    assert "### BEGIN SOLUTION" in quiz_source and "### BEGIN HIDDEN TESTS" in quiz_source
    for assignment in SERVED:
        for entry in lab.get(f"api/contents/labs/{assignment}").json()["content"]:
            text = json.dumps(lab.get(f"api/contents/{entry['path']}").json()["content"])
            assert "BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text, entry["path"]
    for script in ("assessment.py", "assessment_pytorch.py"):  # the Keras and the PyTorch edition
        served_script = lab.get(f"api/contents/assessment/{script}").json()["content"]
        assert served_script == (PROJECT_ROOT / "assessment" / script).read_text(), \
            f"the {script} to convert is the serial script, not the reference solution"
    assert lab.get("api/kernelspecs").json()["default"] == "scalelab", "new notebooks get the course's kernel"


class KernelChannel:
    """A kernel of the server, spoken to as JupyterLab does: Jupyter's messages over the server's websocket."""

    def __init__(self, lab: Lab, kernel_id: str):
        import websocket

        self.session = uuid.uuid4().hex
        self.socket = websocket.create_connection(
            f"{lab.url.replace('http', 'ws', 1)}/api/kernels/{kernel_id}/channels?session_id={self.session}",
            header=[f"Authorization: token {TOKEN}"], timeout=60)

    def execute(self, code: str, timeout_s: float = 240) -> tuple[str, list[str]]:
        """Run ``code``; returns what it printed and the errors it raised (as "Name: value")."""
        msg_id = uuid.uuid4().hex
        self.socket.send(json.dumps({
            "header": {"msg_id": msg_id, "session": self.session, "username": "student", "version": "5.3",
                       "msg_type": "execute_request", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True}}))
        printed, errors, replied, idle = [], [], False, False
        deadline = time.monotonic() + timeout_s
        while not (replied and idle):
            assert time.monotonic() < deadline, f"no reply within {timeout_s} s; printed so far:\n{''.join(printed)}"
            message = json.loads(self.socket.recv())
            if message.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = message["msg_type"], message["content"]
            if kind == "stream":
                printed.append(content["text"])
            elif kind == "error":
                errors.append(f"{content['ename']}: {content['evalue']}")
            elif kind == "execute_reply":
                replied = True
            elif kind == "status" and content["execution_state"] == "idle":
                idle = True
        return "".join(printed), errors

    def close(self) -> None:
        self.socket.close()


@keras_only
def test_make_lab_kernels_run_the_assessment_self_test_with_the_courses_environment(lab):
    notebook = lab.get("api/contents/assessment/assessment.ipynb").json()["content"]
    kernel_name = notebook["metadata"]["kernelspec"]["name"]
    assert kernel_name == "scalelab", "the assessment notebook must run on the course's kernel"
    self_test = [cell["source"] for cell in notebook["cells"]
                 if cell["cell_type"] == "code" and SELF_TEST in cell["source"]]
    assert len(self_test) == 1, "the notebook's self-test cell"
    (lab.student_dir / "assessment" / "assessment.py").write_text(TINY_ASSESSMENT)
    # As JupyterLab opens the notebook: a session for its path, with the kernel its metadata names.
    session = requests.post(f"{lab.url}/api/sessions", headers=HEADERS, timeout=120, json={
        "path": "assessment/assessment.ipynb", "name": "assessment.ipynb", "type": "notebook",
        "kernel": {"name": kernel_name}})
    assert session.status_code == 201, session.text
    kernel = session.json()["kernel"]
    channel = KernelChannel(lab, kernel["id"])
    try:
        which, errors = channel.execute("!which horovodrun")
        assert not errors and which.strip() == str(VENV_BIN / "horovodrun"), which
        printed, errors = channel.execute(self_test[0])
        assert not errors, errors
        assert "not found" not in printed, printed
        for rank in (0, 1):
            assert re.search(rf"self-test rank {rank} of 2 on {re.escape(str(VENV_BIN.parent))}\b", printed), printed
        seen, errors = channel.execute(
            "import json, os\nprint(json.dumps({name: os.environ.get(name) for name in ("
            "'PATH', 'SCALELAB_CIFAR10_DIR', 'OMPI_MCA_mpi_yield_when_idle', 'OMPI_MCA_coll_tuned_use_dynamic_rules',"
            "'OMPI_MCA_coll_tuned_dynamic_rules_filename')}))")
        assert not errors, errors
    finally:
        channel.close()
        requests.delete(f"{lab.url}/api/sessions/{session.json()['id']}", headers=HEADERS, timeout=60)
    environment = json.loads(seen)
    assert environment["PATH"].split(os.pathsep)[0] == str(VENV_BIN)
    assert environment["SCALELAB_CIFAR10_DIR"] == lab.cifar10_dir, "the data location make lab was given"
    assert environment["OMPI_MCA_mpi_yield_when_idle"] == "1"
    assert environment["OMPI_MCA_coll_tuned_use_dynamic_rules"] == "1"
    assert environment["OMPI_MCA_coll_tuned_dynamic_rules_filename"] == str(
        PROJECT_ROOT / "source_code" / "scalelab" / "openmpi-collective-rules.conf")


def test_make_lab_opens_a_rendered_start_page_and_no_news_pop_up(lab):
    from playwright.sync_api import expect, sync_playwright

    screenshot = ARTIFACTS / "make_lab_start_page.png"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1300, "height": 900})
            page.goto(f"{lab.url}/?token={TOKEN}")  # the address make lab opens: the server's default URL
            heading = page.locator(".jp-RenderedMarkdown h1", has_text="Welcome to ScaleLab")
            expect(heading).to_be_visible(timeout=120_000)
            expect(page.locator(".jp-RenderedMarkdown a", has_text="Lab 1")).to_be_visible()
            assert page.locator(".jp-FileEditor").count() == 0, "START.md must open rendered, not as source"
            # JupyterLab asks about news right after it has restored its layout; leave it the time to ask.
            page.wait_for_timeout(5000)
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(screenshot))
            expect(page.get_by_text("official Jupyter news")).to_have_count(0)
            expect(page.locator(".Toastify__toast")).to_have_count(0)
        finally:
            browser.close()
