"""The Assess panel of ``assessment/assessment.ipynb``: an ipywidgets front end to the Assess service's REST API.

The kernel never grades anything: it finds the Jupyter server it runs under (its URL and token, from Jupyter's
runtime files, matched on the notebook's directory), submits with ``POST /scalelab/api/assessments`` and follows
the job with ``GET /scalelab/api/assessments/<id>`` from a background thread, so the notebook stays usable.
Every failure is shown as a sentence, never a traceback.

Under JupyterHub (``$JUPYTERHUB_API_TOKEN`` and ``$JUPYTERHUB_SERVICE_PREFIX`` in the kernel) the panel talks to
the class's Assess service instead (``grader/service/hub.py``, at ``$SCALELAB_ASSESS_SERVICE_URL``) with the
user's own token, and sends the content of the student's script (next to the notebook: ``assessment.py``, or
``assessment_pytorch.py`` where the service grades a PyTorch track, as its ``api/service`` says) with the request:
the service reads no student's files.

    from scalelab.grader.panel import AssessPanel
    AssessPanel()
"""

from __future__ import annotations

import html
import io
import os
import re
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import ipywidgets as widgets
import requests

API_PREFIX = "scalelab/api"
HUB_API_PREFIX = "api"  # under the Hub service's own URL, /services/scalelab/
HUB_SERVICE_NAME = "scalelab"
FINAL_STATES = ("done", "interrupted")
REQUEST_TIMEOUT_S = 30
SCRIPT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.py")
DEFAULT_SCRIPT = "assessment.py"  # what a service that does not say grades
# Far beyond the service's limit: a file this big is refused here rather than sent.
LARGEST_FILE_SENT_BYTES = 4 << 20
HUB_SERVICE_DOWN = ("The course's grader service is not running right now (JupyterHub starts it again by itself): "
                    "your work is saved, so click Assess again in a minute, and tell your instructor if this "
                    "message stays.")


class ServiceError(Exception):
    """The Assess service could not do what was asked; the message is a sentence for the student."""


# --- finding the server -----------------------------------------------------------------------------------------

def find_server(notebook_dir: Path | None = None) -> tuple[str, str]:
    """(base URL, token) of the Jupyter server whose root directory holds ``notebook_dir`` (the kernel's cwd).

    ``SCALELAB_ASSESS_URL`` and ``SCALELAB_ASSESS_TOKEN`` override the search (e.g. behind a proxy)."""
    if os.environ.get("SCALELAB_ASSESS_URL"):
        return os.environ["SCALELAB_ASSESS_URL"], os.environ.get("SCALELAB_ASSESS_TOKEN", "")
    from jupyter_server.serverapp import list_running_servers

    here = Path(notebook_dir or os.getcwd()).resolve()
    candidates = []
    for server in list_running_servers():
        root = Path(server.get("root_dir") or server.get("notebook_dir") or "/").resolve()
        if here.is_relative_to(root):
            candidates.append((len(root.parts), server))
    if not candidates:
        raise ServiceError("No running Jupyter server serves this notebook, so the Assess service cannot be "
                           "reached: open the notebook in JupyterLab started with `make lab`.")
    server = max(candidates, key=lambda candidate: candidate[0])[1]  # the innermost root wins
    return server["url"], server.get("token", "")


def under_jupyterhub() -> bool:
    """Whether this kernel belongs to a JupyterHub user's server (the Hub puts these in its environment)."""
    return bool(os.environ.get("JUPYTERHUB_API_TOKEN") and os.environ.get("JUPYTERHUB_SERVICE_PREFIX"))


def hub_service_url() -> str:
    """The class's Assess service: ``$SCALELAB_ASSESS_SERVICE_URL`` (the Hub config sets it), else found from the
    Hub's public URL."""
    if os.environ.get("SCALELAB_ASSESS_SERVICE_URL"):
        return os.environ["SCALELAB_ASSESS_SERVICE_URL"]
    public = urlparse(os.environ.get("JUPYTERHUB_PUBLIC_HUB_URL") or os.environ.get("JUPYTERHUB_PUBLIC_URL") or "")
    if not public.netloc:
        raise ServiceError("This server runs under JupyterHub, but the kernel is not told where the class's Assess "
                           "service is: ask your instructor to register it (SCALELAB_ASSESS_SERVICE_URL).")
    base = os.environ.get("JUPYTERHUB_BASE_URL") or "/"
    return f"{public.scheme}://{public.netloc}{base.rstrip('/')}/services/{HUB_SERVICE_NAME}/"


class AssessClient:
    """The REST API, with every failure turned into a ServiceError sentence.

    With ``submission_dir`` (the JupyterHub service) a submission sends the content of the script the service
    names (its ``submission_file``) in that folder; without it (the single-user server) the server reads the
    student's file itself."""

    def __init__(self, base_url: str, token: str = "", api_prefix: str = API_PREFIX,
                 submission_dir: Path | None = None):
        self.base_url = base_url.rstrip("/") + "/"
        self.api_prefix = api_prefix
        self.submission_dir = Path(submission_dir) if submission_dir is not None else None
        self.submission_name: str | None = None  # the script's name, from the service's description
        self.session = requests.Session()
        if token:
            self.session.headers["Authorization"] = f"token {token}"

    @property
    def hub(self) -> bool:
        return self.submission_dir is not None

    @classmethod
    def for_this_notebook(cls) -> "AssessClient":
        if under_jupyterhub():
            return cls(hub_service_url(), os.environ["JUPYTERHUB_API_TOKEN"], api_prefix=HUB_API_PREFIX,
                       submission_dir=Path(os.getcwd()))
        return cls(*find_server())

    def _call(self, method: str, path: str, content: bytes | None = None) -> dict:
        url = f"{self.base_url}{self.api_prefix}/{path}"
        headers = {"Content-Type": "text/x-python; charset=utf-8"} if content is not None else None
        try:
            response = self.session.request(method, url, data=content, headers=headers, timeout=REQUEST_TIMEOUT_S)
        except requests.RequestException:
            if self.hub:
                raise ServiceError(HUB_SERVICE_DOWN) from None
            raise ServiceError(f"The Assess service is not reachable ({self.base_url}): the Jupyter server may "
                               f"have stopped. Save your work and start JupyterLab again with `make lab`.") from None
        try:
            body = response.json()
        except ValueError:
            body = {}
        if not isinstance(body, dict):
            body = {}
        if self.hub:
            self._refuse_hub_errors(response.status_code, path, body)
        if response.status_code in (401, 403):
            raise ServiceError("The Jupyter server refused the request because this kernel is not logged in to "
                               "it; reload the page and run the panel cell again.")
        if response.status_code == 404 and path == "service":
            raise ServiceError("This Jupyter server does not run the Assess service: start JupyterLab with "
                               "`make lab`, which enables it.")
        if response.status_code >= 400:
            message = body.get("message") or response.reason or f"HTTP {response.status_code}"
            raise ServiceError(message)
        return body

    def _refuse_hub_errors(self, status: int, path: str, body: dict) -> None:
        """What the Hub's proxy says when the service is down or absent, and the service's own refusals."""
        if status in (401, 403):
            raise ServiceError("The class's Assess service did not accept this kernel's JupyterHub token: stop and "
                               "start your server from the Hub's control panel, then run the panel cell again.")
        if body.get("message") and status >= 400:
            raise ServiceError(body["message"])
        if status in (502, 503, 504):  # the proxy's answer: nothing listens behind the service's route
            raise ServiceError(HUB_SERVICE_DOWN)
        if status == 404 and path == "service":
            raise ServiceError(f"This JupyterHub runs no Assess service at {self.base_url}: ask your instructor "
                               f"to register it (containers/hub/jupyterhub_config.py).")

    def _submission_content(self) -> bytes:
        if self.submission_name is None:
            self.service()
        path = self.submission_dir / self.submission_name
        try:
            with open(path, "rb") as stream:
                size = os.fstat(stream.fileno()).st_size
                if size > LARGEST_FILE_SENT_BYTES:
                    raise ServiceError(f"{path.name} is {size} bytes, far over the size limit for a submission; "
                                       f"make it smaller and click Assess again.")
                return stream.read(LARGEST_FILE_SENT_BYTES + 1)
        except FileNotFoundError:
            raise ServiceError(f"There is no {path.name} to assess: save your script as {path.name} (next to the "
                               f"assessment notebook) and click Assess again.") from None
        except IsADirectoryError:
            raise ServiceError(f"{path.name} is a folder; save your script as a plain file {path.name} and click "
                               f"Assess again.") from None
        except OSError as error:
            raise ServiceError(f"{path.name} cannot be read ({error.strerror}); save your script as a plain file "
                               f"{path.name} that you can read and click Assess again.") from None

    def service(self) -> dict:
        info = self._call("GET", "service")
        name = info.get("submission_file")
        # Only a plain name next to the notebook: the service's answer never points the kernel elsewhere.
        self.submission_name = name if isinstance(name, str) and SCRIPT_NAME.fullmatch(name) else DEFAULT_SCRIPT
        return info

    def submit(self) -> tuple[dict, bool]:
        content = self._submission_content() if self.hub else None
        body = self._call("POST", "assessments", content)
        return body["job"], body["created"]

    def job(self, job_id: int) -> dict:
        return self._call("GET", f"assessments/{job_id}")

    def history(self) -> list[dict]:
        return self._call("GET", "assessments")["assessments"]

    def board(self) -> dict:
        return self._call("GET", "board")


# --- rendering (pure functions of the job, so they are easy to test) --------------------------------------------

VERDICT_COLOURS = {"pass": "#1a7f37", "fail": "#cf222e", "timeout": "#bc4c00", "error": "#8250df"}
# A rerun's cause (the queue's RERUN_SERVER_STOPPED, RERUN_MACHINE_BUSY) in the student's terms.
RERUN_WHY = {"server stopped": "the grader stopped while it ran",
             "machine busy": "other work crowded the grading machine during its run"}


def _number(value, form: str, missing: str = "—") -> str:
    return missing if value is None else format(value, form)


def status_text(job: dict | None, script: str = DEFAULT_SCRIPT) -> str:
    """One line saying where the job is (``script``: the file the service grades)."""
    if job is None:
        return f"Not assessed yet: click Assess to grade your current {script}."
    state = job["state"]
    if state == "queued":
        position = job.get("position")
        why = RERUN_WHY.get((job.get("reruns") or [{}])[-1].get("cause"), RERUN_WHY["server stopped"])
        again = f" again ({why}; it is graded from scratch)" if job.get("reruns") else ""
        return (f"Assessment {job['id']}: queued{again}, position {position} in the queue." if position
                else f"Assessment {job['id']}: queued{again}.")
    if state == "running":
        progress = job.get("progress") or {}
        if progress.get("state") == "queued":  # the Slurm backend: the job waits in Slurm's own queue
            return (f"Assessment {job['id']}: waiting in Slurm's queue (job {progress.get('slurm_job_id')}, "
                    f"position {progress.get('queue_position') or '?'}, {progress.get('slurm_reason') or 'pending'}).")
        return (f"Assessment {job['id']}: running, {_number(progress.get('elapsed_s'), '.0f', '0')} s of "
                f"{_number(progress.get('time_budget_s') or job.get('time_budget_s'), '.0f')} s budget, "
                f"epochs seen {progress.get('epochs_seen') or 0}.")
    if state == "interrupted":
        return f"Assessment {job['id']}: interrupted, not graded."
    verdict = (job.get("verdict") or {}).get("verdict", "?")
    return f"Assessment {job['id']}: done. Verdict: {verdict.upper()}."


def track_html(info: dict) -> str:
    """What the service grades: the student's file, the track, its target and budget."""
    script = info.get("submission_file") or DEFAULT_SCRIPT
    return (f"<span class='scalelab-track'>Grades your <code>{html.escape(script)}</code> on track "
            f"<b>{html.escape(str(info.get('track')))}</b>: held-out accuracy ≥ "
            f"{_number(info.get('target_accuracy'), '.2f')} within {_number(info.get('time_budget_s'), '.0f')} s."
            f"</span>")


def _time_text(verdict: dict) -> str:
    if verdict.get("time_to_accuracy_s") is not None:
        return (f"time to accuracy {_number(verdict.get('time_to_accuracy_s'), '.1f')} s "
                f"(run {_number(verdict.get('wall_time_s'), '.1f')} s)")
    return f"time {_number(verdict.get('wall_time_s'), '.1f')} s"


def verdict_html(job: dict | None) -> str:
    """The verdict with its reasons, accuracy vs target and time vs budget (or the interruption's reason)."""
    if job is None or job["state"] not in FINAL_STATES:
        return ""
    if job["state"] == "interrupted":
        return (f"<div class='scalelab-verdict'><b style='color:#bc4c00'>INTERRUPTED</b> "
                f"{html.escape(job.get('reason') or '')}</div>")
    verdict = job.get("verdict") or {}
    name = verdict.get("verdict", "error")
    reasons = "".join(f"<li><pre style='white-space:pre-wrap;margin:0'>{html.escape(reason)}</pre></li>"
                      for reason in verdict.get("reasons") or [])
    return (f"<div class='scalelab-verdict'>"
            f"<b style='color:{VERDICT_COLOURS.get(name, '#000')};font-size:1.3em'>Verdict: {name.upper()}</b><br>"
            f"held-out accuracy {_number(verdict.get('heldout_accuracy'), '.4f')} "
            f"(target {_number(verdict.get('target_accuracy'), '.4f')}); "
            f"{_time_text(verdict)} (budget {_number(verdict.get('time_budget_s'), '.0f')} s); "
            f"ranks seen {html.escape(str(verdict.get('ranks_seen')))}"
            f"<ul>{reasons}</ul></div>")


BOLD = " style='font-weight:bold'"


def board_html(standing: dict | None) -> str:
    """The student's best time to accuracy and rank on the class board (names only where the course shows them)."""
    if not standing or not standing.get("on_board"):
        return "<i>No one has passed yet: the class board ranks passes by time to accuracy.</i>"
    if standing.get("rank") is None:
        own = "You are not on the board yet (it ranks passes only)."
    else:
        own = (f"Your best time to accuracy: <b>{_number(standing.get('best_time_to_accuracy_s'), '.1f')} s</b>, "
               f"rank <b>{int(standing['rank'])}</b> of {int(standing['on_board'])}.")
    rows = "".join(
        f"<tr{BOLD if place.get('you') else ''}><td>{int(place['rank'])}</td>"
        f"<td>{html.escape(place['student']) if place.get('student') else '—'}</td>"
        f"<td>{_number(place.get('time_to_accuracy_s'), '.1f')}</td></tr>"
        for place in (standing.get("board") or [])[:10])
    return (f"<div class='scalelab-board'>{own}<table><tr><th>rank</th><th>student</th>"
            f"<th>time to accuracy (s)</th></tr>{rows}</table></div>")


def history_html(jobs: list[dict]) -> str:
    """A table of the student's attempts, newest first."""
    if not jobs:
        return "<i>No earlier assessments.</i>"
    rows = []
    for job in jobs:
        verdict = job.get("verdict") or {}
        outcome = verdict.get("verdict") or job["state"]
        submitted = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job["submitted_at"]))
        rows.append(f"<tr><td>{job['id']}</td><td>{submitted}</td><td>{html.escape(job['track'])}</td>"
                    f"<td>{html.escape(outcome)}</td><td>{_number(verdict.get('heldout_accuracy'), '.4f')}</td>"
                    f"<td>{_number(verdict.get('time_to_accuracy_s') or verdict.get('wall_time_s'), '.1f')}</td>"
                    f"<td><code>{job['submission_sha256'][:10]}</code></td></tr>")
    return ("<table class='scalelab-history'><tr><th>#</th><th>submitted</th><th>track</th><th>result</th>"
            "<th>held-out accuracy</th><th>time to accuracy, or run time (s)</th><th>file sha256</th></tr>" + "".join(rows) + "</table>")


def accuracy_plot_png(points: list[dict], time_budget_s: float | None, target: float | None,
                      heldout: list[dict] = ()) -> bytes | None:
    """Accuracy vs elapsed time: rank 0's epoch lines as the grader saw them (the run's own claim), and the
    grader's held-out measurements of the snapshots (``heldout``: at_s, accuracy); None without either."""
    points = [point for point in points if point.get("accuracy") is not None and point.get("elapsed_s") is not None]
    heldout = [point for point in heldout if point.get("accuracy") is not None and point.get("at_s") is not None]
    if not points and not heldout:
        return None
    from matplotlib.figure import Figure  # no pyplot: safe from a background thread

    figure = Figure(figsize=(5, 2.6), dpi=90)
    axes = figure.add_subplot()
    if points:
        axes.plot([p["elapsed_s"] for p in points], [p["accuracy"] for p in points], marker="o",
                  label="your run's validation (printed)")
    if heldout:
        axes.plot([p["at_s"] for p in heldout], [p["accuracy"] for p in heldout], marker="s", color="tab:green",
                  label="held-out, measured by the grader")
    if target is not None:
        axes.axhline(target, color="grey", linestyle="--", label=f"target {target:.2f}")
    axes.legend(loc="upper left", fontsize=7)  # curves rise from the lower left
    if time_budget_s:
        axes.set_xlim(0, time_budget_s)
    axes.set_xlabel("elapsed time (s)")
    axes.set_ylabel("accuracy")
    axes.set_title("the grader's held-out points decide; the printed ones do not", fontsize=9)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


# --- the panel --------------------------------------------------------------------------------------------------

class AssessPanel(widgets.VBox):
    """Assess button, queue position, progress bar vs budget, accuracy-vs-time plot, verdict, history."""

    # Polling and drawing share the 2 cores with the run being timed: poll every 2 s, redraw only on new points.
    def __init__(self, client: AssessClient | None = None, poll_interval_s: float = 2.0):
        self.button = widgets.Button(description="Assess", button_style="primary", icon="check",
                                     tooltip="Grade your current script with the course's grader")
        self.status = widgets.HTML()
        self.track_line = widgets.HTML()  # which file, on which track, to which target: once the service says
        self.progress = widgets.FloatProgress(value=0.0, min=0.0, max=1.0, description="time",
                                              layout=widgets.Layout(width="60%"))
        self.plot = widgets.Image(format="png", layout=widgets.Layout(display="none"))
        self.verdict = widgets.HTML()
        self.history = widgets.HTML()
        self.board = widgets.HTML()
        self.error = widgets.HTML()
        super().__init__([widgets.HBox([self.button, self.status]), self.track_line, self.progress, self.plot,
                          self.verdict, self.error, widgets.HTML("<b>Your assessments</b>"), self.history,
                          widgets.HTML("<b>Class board</b>"), self.board])
        self.add_class("scalelab-assess-panel")
        self.poll_interval_s = poll_interval_s
        self.service_info: dict = {}
        self._follower: threading.Thread | None = None
        self._plotted: tuple | None = None  # what the plot shows now, so an unchanged plot is not drawn again
        self.button.on_click(lambda _button: self._start_in_background(self._submit_and_follow))
        self.client = client
        self._show_job(None)
        self._start_in_background(self._load)

    # Every network call runs in a thread: the kernel stays free, and the widgets update as the job moves.
    def _start_in_background(self, work) -> None:
        thread = threading.Thread(target=self._guarded, args=(work,), daemon=True)
        thread.start()
        self._follower = thread

    def _guarded(self, work) -> None:
        try:
            work()
        except ServiceError as error:
            self._show_error(str(error))
        except Exception as error:  # whatever happens, a sentence rather than a traceback
            self._show_error(f"The Assess panel hit an unexpected problem ({type(error).__name__}: {error}); "
                             f"run the cell again.")
        finally:
            self.button.disabled = False

    def _connect(self) -> AssessClient:
        if self.client is None:
            self.client = AssessClient.for_this_notebook()
        if not self.service_info:
            self.service_info = self.client.service()
        return self.client

    def _load(self) -> None:
        client = self._connect()
        info = self.service_info
        self.button.tooltip = (f"Grade your current {self._script()} on track {info['track']}: held-out accuracy "
                               f"≥ {info['target_accuracy']} within {info['time_budget_s']:.0f} s")
        self.track_line.value = track_html(info)
        jobs = client.history()
        self.history.value = history_html(jobs)
        self.board.value = board_html(client.board())
        self._show_job(jobs[0] if jobs else None)
        if jobs and jobs[0]["state"] not in FINAL_STATES:  # e.g. the page was reloaded during a run
            self._follow(jobs[0]["id"])

    def _submit_and_follow(self) -> None:
        self.button.disabled = True
        self.error.value = ""
        client = self._connect()
        job, created = client.submit()
        if not created:
            self._show_error(f"Assessment {job['id']} is still {job['state']}: it is followed below, and you can "
                             f"submit again once it has a verdict.")
        self._show_job(job)
        self._follow(job["id"])
        self.history.value = history_html(client.history())

    def _follow(self, job_id: int) -> None:
        self.button.disabled = True
        while True:
            job = self.client.job(job_id)
            self._show_job(job)
            if job["state"] in FINAL_STATES:
                self.history.value = history_html(self.client.history())
                self.board.value = board_html(self.client.board())
                return
            time.sleep(self.poll_interval_s)

    def _script(self) -> str:
        """The student's script the service grades, once it has said (assessment.py until then)."""
        return self.service_info.get("submission_file") or DEFAULT_SCRIPT

    def _show_job(self, job: dict | None) -> None:
        self.status.value = f"<span class='scalelab-status'>{html.escape(status_text(job, self._script()))}</span>"
        progress = (job or {}).get("progress") or {}
        budget = progress.get("time_budget_s") or (job or {}).get("time_budget_s") or self.service_info.get(
            "time_budget_s") or 1.0
        self.progress.max = float(budget)
        self.progress.value = min(float(progress.get("elapsed_s") or 0.0), float(budget))
        self.progress.description = f"{self.progress.value:.0f}/{budget:.0f} s"
        self.progress.bar_style = {"done": "success", "interrupted": "warning"}.get((job or {}).get("state"), "info")
        history = (job or {}).get("progress_history") or []
        heldout = progress.get("heldout_curve") or []
        plotted = (history, heldout, budget, self.service_info.get("target_accuracy"))
        if plotted != self._plotted:
            self._plotted = plotted
            png = accuracy_plot_png(history, budget, self.service_info.get("target_accuracy"), heldout)
            if png is not None:
                self.plot.value = png
                self.plot.layout.display = ""
        self.verdict.value = verdict_html(job)

    def _show_error(self, message: str) -> None:
        self.error.value = (f"<div class='scalelab-error' style='color:#cf222e'>{html.escape(message)}</div>")
