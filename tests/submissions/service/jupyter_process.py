"""A real Jupyter server process with the Assess service, for the tests: start, call, kill -9, stop.

Everything the server writes (SCALELAB_HOME, Jupyter's config, runtime and data directories) lives under the
test's ``home``; its config file enables ``scalelab.grader.serve`` exactly as ``make lab`` does on the command line.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import requests

HERE = Path(__file__).resolve().parent
PROJECT_ROOT = HERE.parents[2]
VENV_BIN = Path(sys.executable).parent
TEST_TRACKS = PROJECT_ROOT / "tests" / "submissions" / "tracks.toml"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class JupyterServer:
    def __init__(self, root_dir: Path, home: Path, *, app: str = "server", token: str = "admin-token",
                 user_tokens: dict[str, str] | None = None, service: dict | None = None):
        self.root_dir, self.home, self.app, self.token = Path(root_dir), Path(home), app, token
        self.user_tokens = user_tokens
        self.service = service or {}
        self.process: subprocess.Popen | None = None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.log_path = self.home / f"jupyter-{self.app}.log"
        self.database = self.home / "assess" / "queue.db"

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(SCALELAB_HOME=str(self.home), JUPYTER_CONFIG_DIR=str(self.home / "jupyter-config"),
                   JUPYTER_RUNTIME_DIR=str(self.home / "jupyter-runtime"),
                   JUPYTER_DATA_DIR=str(self.home / "jupyter-data"), IPYTHONDIR=str(self.home / "ipython"),
                   OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", TF_CPP_MIN_LOG_LEVEL="2",
                   PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
        env.pop("JUPYTER_TOKEN", None)
        return env

    def write_config(self) -> None:
        config = {
            "ServerApp": {"jpserver_extensions": {"scalelab.grader.serve": True}, "open_browser": False},
            "IdentityProvider": {"token": self.token},
            "AssessService": self.service,
        }
        if self.user_tokens is not None:
            config["ServerApp"]["identity_provider_class"] = "scalelab_test_identity.TokenTableIdentityProvider"
            # The admin token (readiness checks, queue counts) is one more user of the table.
            config["TokenTableIdentityProvider"] = {"user_tokens": {**self.user_tokens, self.token: "admin"}}
        directory = self.home / "jupyter-config"
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "jupyter_server_config.json").write_text(json.dumps(config, indent=1))

    def start(self, timeout_s: float = 90, ready_path: str = "scalelab/api/service") -> "JupyterServer":
        """Start the server; ready when ``ready_path`` answers (``api/status``: Jupyter alone, Assess or not)."""
        self.write_config()
        argv = [str(VENV_BIN / "jupyter"), self.app, "--no-browser", f"--ServerApp.port={self.port}",
                "--ServerApp.ip=127.0.0.1", f"--ServerApp.root_dir={self.root_dir}", "--ServerApp.port_retries=0"]
        if os.geteuid() == 0:
            argv.append("--allow-root")
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(argv, env=self.environment(), stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, cwd=self.root_dir, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the Jupyter server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}{ready_path}", headers=self.headers(self.token), timeout=5).ok:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.3)
        self.stop(timeout_s=10)  # never leave a half-started server behind
        raise RuntimeError(f"the Jupyter server did not answer within {timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    @staticmethod
    def headers(token: str | None) -> dict[str, str]:
        return {"Authorization": f"token {token}"} if token else {}

    def api(self, method: str, path: str, token: str | None = None, timeout: float = 60,
            **kwargs) -> requests.Response:
        token = self.token if token is None else token
        return requests.request(method, f"{self.url}scalelab/api/{path}", headers=self.headers(token),
                                timeout=timeout, **kwargs)

    def wait_for_job(self, job_id: int, token: str | None = None, states=("done", "interrupted"),
                     timeout_s: float = 120, poll_s: float = 0.5) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            job = self.api("GET", f"assessments/{job_id}", token).json()
            if job["state"] in states or time.monotonic() > deadline:
                return job
            time.sleep(poll_s)

    def kill_hard(self) -> None:
        """kill -9 the server process alone (its graders run in their own sessions and survive it)."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self, timeout_s: float = 60) -> int | None:
        """A clean stop (SIGTERM, as a service manager does); kills the whole session if it does not end."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            return self.process.wait(timeout=30)


def processes_with_environment(key: str, value: str) -> list[psutil.Process]:
    """Live processes whose environment has key=value (how tests find what a server under a home started)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(key) == value:
                found.append(process)
        except psutil.Error:
            continue
    return found
