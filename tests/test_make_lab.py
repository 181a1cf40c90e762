"""`make lab` serves the course in JupyterLab."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import pytest
import requests

from conftest import PROJECT_ROOT, subprocess_env


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture()
def lab_server(tmp_path):
    port = _free_port()
    env = subprocess_env(JUPYTER_TOKEN="course-test-token", JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
                         JUPYTER_CONFIG_DIR=str(tmp_path / "config"), BROWSER="true")
    log = (tmp_path / "lab.log").open("w")
    server = subprocess.Popen(["make", "lab", f"LAB_PORT={port}"], cwd=PROJECT_ROOT, env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if server.poll() is not None:
                pytest.fail(f"make lab exited with {server.returncode}:\n{(tmp_path / 'lab.log').read_text()}")
            try:
                requests.get(f"{base}/api", timeout=2)
                break
            except requests.ConnectionError:
                time.sleep(1)
        else:
            pytest.fail(f"JupyterLab did not answer within 120 s:\n{(tmp_path / 'lab.log').read_text()}")
        yield base
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


def test_make_lab_serves_jupyterlab_on_the_course(lab_server):
    headers = {"Authorization": "token course-test-token"}
    page = requests.get(f"{lab_server}/lab", headers=headers, timeout=30)
    assert page.status_code == 200
    assert "JupyterLab" in page.text
    listing = requests.get(f"{lab_server}/api/contents/", headers=headers, timeout=30).json()
    names = {entry["name"] for entry in listing["content"]}
    assert {"labs", "source_code", "README.md"} <= names, "the server must be rooted at the course"
    assert requests.get(f"{lab_server}/api/contents/", timeout=30).status_code == 403, \
        "the course must not be served without Jupyter's authentication"
