"""`make lab` enables the Assess service: its REST API answers on the served JupyterLab, behind Jupyter's auth."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import requests

from conftest import PROJECT_ROOT, keras_only, subprocess_env

# The Keras edition's: skipped, with the reason, where `make setup` installed the PyTorch edition alone.
pytestmark = keras_only

TOKEN = "assess-make-lab-token"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_make_lab_serves_the_assess_api(tmp_path):
    port = _free_port()
    env = subprocess_env(JUPYTER_TOKEN=TOKEN, JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
                         JUPYTER_CONFIG_DIR=str(tmp_path / "config"), SCALELAB_HOME=str(tmp_path / "home"),
                         BROWSER="true")
    log_path = tmp_path / "lab.log"
    with log_path.open("w") as log:
        server = subprocess.Popen(["make", "lab", f"LAB_PORT={port}", f"STUDENT_DIR={tmp_path / 'student'}"],
                                  cwd=PROJECT_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    api = f"http://127.0.0.1:{port}/scalelab/api/service"
    try:
        deadline, answer = time.monotonic() + 120, None
        while time.monotonic() < deadline and server.poll() is None:
            try:
                # Extensions load before the server listens: its first answer is the definitive one.
                answer = requests.get(api, headers={"Authorization": f"token {TOKEN}"}, timeout=5)
                break
            except requests.ConnectionError:
                pass
            time.sleep(1)
        assert answer is not None, f"make lab never answered:\n{log_path.read_text()[-3000:]}"
        assert answer.status_code == 200, f"{answer.status_code} {answer.text[:200]}\n{log_path.read_text()[-3000:]}"
        info = answer.json()
        assert info["track"] == "cifar10-cpu" and info["slots"] >= 1 and info["submission_path"] == \
            "assessment/assessment.py"
        assert requests.get(api, timeout=5).status_code in (401, 403)  # Jupyter's auth guards it
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
