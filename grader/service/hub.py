"""The Assess service for a class: one process for every student, a JupyterHub managed service.

    python -m scalelab.grader.service.hub [--state-dir DIR] [--AssessService.track=NAME ...]

JupyterHub starts it (and starts it again whenever it exits) as the service ``scalelab`` at
``/services/scalelab/``, running as the system account ``scalelab``; :func:`register` is what a Hub config calls
to set that up. Routes, under the service's prefix, as the single-user extension's (``grader/serve.py``):

- ``GET  api/service``            what the service grades, and queue counts
- ``POST api/assessments``        submit: the body is the student's ``assessment.py``, raw (any content type but
                                  JSON) or as JSON ``{"source": "...", "filename": "assessment.py"}``; 201 with a
                                  new job, 200 with the student's active job, 413 over the size limit, 400 for
                                  what is not UTF-8 Python source, 429 with ``Retry-After`` when too soon
- ``GET  api/assessments``        the student's history, newest first
- ``GET  api/assessments/<id>``   one job of the student's (another student's is 404)
- ``class``, ``class.csv``, ``class/jobs/<id>``, ``class/regrade``: the instructors' view of the class
                                  (``classpage.py``)

Who the student is comes from the Hub only: the browser's OAuth cookie (``HubOAuthenticated``), or the user's
own API token in ``Authorization: token ...`` (a kernel's ``JUPYTERHUB_API_TOKEN``). Nothing in the request
names the student, and the service never reads a student's files: the script comes in the request.

Its state (queue database, results database, job directories, logs, the staged data sets with their held-out
splits) lives in one directory, ``/var/lib/scalelab`` unless ``$SCALELAB_SERVICE_STATE`` or ``--state-dir`` says
otherwise, private to the service's account (0700). Graded runs never see it: every run is started by the grader
in its bubblewrap allow-list sandbox (``sandbox.py``), which shows the system, the software, the run's own job
directory and a private ``/tmp`` and nothing else of the machine. Run by ``scalelab`` (not root), bubblewrap puts
the run in a user namespace of its own, as ``scalelab`` but with no capability, no way out of its mount, PID and
network namespaces, and so no path to the state. The service refuses to start where that cannot hold: a state
directory inside the software the sandbox shows, or ``allow_unsandboxed``.
"""

from __future__ import annotations

import asyncio
import html
import json
import logging
import os
import re
import secrets
import shutil
import signal
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

from jupyterhub.services.auth import HubOAuth, HubOAuthCallbackHandler, HubOAuthenticated
from jupyterhub.utils import url_path_join
from tornado import httputil, web
from tornado.ioloop import IOLoop
from traitlets import Unicode, default
from traitlets.config import Application

from scalelab import data as course_data
from scalelab.classroom import HUB_INSTRUCTORS_GROUP

from .. import sandbox
from ..pipeline import SUBMISSION_SIZE_LIMIT_BYTES
from ..queue import MAX_JOB_ID
from ..serve import AssessService, SubmissionProblem, send_problem

SERVICE_NAME = "scalelab"
SERVICE_USER = "scalelab"
DEFAULT_STATE_DIR = "/var/lib/scalelab"
STATE_DIR_VARIABLE = "SCALELAB_SERVICE_STATE"
# What a single-user server's kernel reads to find the service (set by register()).
SERVICE_URL_VARIABLE = "SCALELAB_ASSESS_SERVICE_URL"
# JSON escapes may take up to 6 characters per byte of source; beyond that a body cannot hold a submission.
JSON_BODY_LIMIT_BYTES = 6 * SUBMISSION_SIZE_LIMIT_BYTES + 4096
# What any other request may carry (the class page's regrade form): no page of the service takes more.
FORM_BODY_LIMIT_BYTES = 256 << 10
BODY_METHODS = ("POST", "PUT", "PATCH", "DELETE")
FILENAME = re.compile(r"[A-Za-z0-9_.-]{1,100}\.py")
# The Hub starts a managed service again as soon as it exits: a refusal waits first, so it is not a hot loop.
PAUSE_BEFORE_EXIT_S = 10.0
SERVICE_SETTINGS_KEY = "scalelab_assess_service"
SERVICE_PREFIX_KEY = "scalelab_service_prefix"


class ServiceRefused(Exception):
    """The service will not start here; the message is a sentence for the operator."""


# --- the Hub's side ---------------------------------------------------------------------------------------------

def register(c, *, python: str, port: int, public_url: str, state_dir: str = DEFAULT_STATE_DIR,
             settings: dict | None = None, environment: dict | None = None, user: str = SERVICE_USER) -> dict:
    """Add the managed service ``scalelab`` to a JupyterHub config ``c``; returns the service's entry.

    ``python`` runs the service (an interpreter ``user`` can run, with this package and JupyterHub); ``port`` is
    where it listens on 127.0.0.1; ``public_url`` is the Hub's address as kernels reach it (the proxy, e.g.
    ``http://127.0.0.1:8000/``); ``settings`` are ``AssessService`` traits (``{"track": ..., "slots": 1}``).
    Every user may use the service, and single-user servers' tokens carry that permission, so the Assess panel
    in a kernel can call it with ``$JUPYTERHUB_API_TOKEN``. The service may list the Hub's users and their
    groups (its class page shows the students who have not submitted yet).
    """
    access = f"access:services!service={SERVICE_NAME}"
    _create_state_dir(Path(state_dir), user)
    command = [python, "-m", "scalelab.grader.service.hub", f"--state-dir={state_dir}"]
    command += [f"--AssessService.{name}={value}" for name, value in (settings or {}).items()]
    entry = {
        "name": SERVICE_NAME,
        "url": f"http://127.0.0.1:{port}",
        "command": command,
        "user": user,
        "cwd": state_dir,
        # Managed services inherit nothing of the Hub's environment: what the grader needs is said here.
        "environment": {"PATH": f"{Path(python).parent}:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
                        STATE_DIR_VARIABLE: state_dir, **(environment or {})},
        "oauth_no_confirm": True,
        "display": True,
        # The Hub waits this long for the service's first answer before giving up on starting at all; a busy
        # 2-core server takes a while to import it.
        "timeout": 120,
    }
    c.JupyterHub.services.append(entry)
    # The class page (classpage.py) lists the Hub's users, to show the students who have not submitted yet.
    c.JupyterHub.load_roles.append({"name": f"{SERVICE_NAME}-service", "services": [SERVICE_NAME],
                                    "scopes": ["list:users", "read:users:name", "read:users:groups"]})
    c.JupyterHub.extra_user_scopes.add(access)
    # A single-user server's token (its kernels' $JUPYTERHUB_API_TOKEN): the server role's scopes, and this one.
    c.Spawner.server_token_scopes = ["users:activity!user", "access:servers!server", access]
    c.Spawner.environment.update({SERVICE_URL_VARIABLE: url_path_join(public_url, "services", SERVICE_NAME) + "/"})
    return entry


def _create_state_dir(state: Path, user: str) -> None:
    """As the Hub (root) loads its config: a missing state directory is made, ``user``'s alone, so that the
    service can be started in it."""
    if state.exists() or os.geteuid() != 0:
        return
    import pwd

    account = pwd.getpwnam(user)
    state.mkdir(mode=0o700, parents=True)
    os.chown(state, account.pw_uid, account.pw_gid)


# --- the state directory and the data it grades with ------------------------------------------------------------

def prepare_state_dir(state: Path) -> Path:
    """The state directory, created if missing, this account's alone (0700), outside what a sandbox shows."""
    state = Path(os.path.abspath(state))
    shown = [*sandbox.software_paths(), *(Path(d) for d in sandbox.SYSTEM_DIRECTORIES if Path(d).is_dir())]
    for path in shown:
        if state == path.resolve() or path.resolve() in state.resolve().parents:
            raise ServiceRefused(f"the state directory {state} is inside {path}, which every graded run's sandbox "
                                 f"shows; choose a directory outside the software (e.g. {DEFAULT_STATE_DIR}).")
    try:
        state.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as error:
        raise ServiceRefused(f"the state directory {state} cannot be created ({error.strerror}); create it for "
                             f"the account {SERVICE_USER}, mode 0700.") from None
    owner = state.stat().st_uid
    if owner != os.geteuid():
        raise ServiceRefused(f"the state directory {state} belongs to uid {owner}, not to this service's account "
                             f"(uid {os.geteuid()}); `chown -R {SERVICE_USER}: {state}` as root.")
    state.chmod(0o700)
    return state


def _copy_if_changed(source: Path, target: Path) -> None:
    if target.is_file() and target.stat().st_size == source.stat().st_size:
        return
    partial = target.with_name(f".{target.name}.partial")
    shutil.copyfile(source, partial)
    os.replace(partial, target)


def stage_grading_data(data_root: Path, dataset: str, log: logging.Logger) -> tuple[str, Path] | None:
    """Copy ``dataset`` (training and held-out splits) into the state, so the grader reads its own copy (which no
    student can read) even where the original is later locked away; returns (environment variable, folder)."""
    if dataset == "cifar10":
        target, variable = data_root / "cifar10" / course_data.CIFAR10_FOLDER, "SCALELAB_CIFAR10_DIR"
        needed = [*course_data.CIFAR10_BATCHES["train"], *course_data.CIFAR10_BATCHES["test"]]
        sources = {}
        for split in course_data.SPLITS:
            folder = course_data.find_cifar10(split)
            if folder is not None:
                sources.update({name: folder / name for name in course_data.CIFAR10_BATCHES[split]})
                if (folder / "batches.meta").is_file():
                    sources.setdefault("batches.meta", folder / "batches.meta")
    else:
        target, variable = data_root / "fashion-mnist", "SCALELAB_FASHION_MNIST_DIR"
        needed = [name for split in course_data.FASHION_MNIST_FILES.values() for name, _ in split.values()]
        folder = next((d for d in course_data.fashion_mnist_dirs() if course_data.fashion_mnist_available(d)), None)
        sources = {name: folder / name for name in needed} if folder is not None else {}
    target.mkdir(mode=0o700, parents=True, exist_ok=True)
    for name, source in sources.items():
        _copy_if_changed(source, target / name)
    if not all((target / name).is_file() for name in needed):
        log.error("scalelab hub service: %s is not complete in %s and could not be copied there from a readable "
                  "place; jobs on it will end with the grader's error until it is.", dataset, target)
        return None
    return variable, target


def grader_environment() -> dict[str, str]:
    """The service's environment for ``scalelab assess``, without the Hub's credentials."""
    return {name: value for name, value in os.environ.items()
            if not name.startswith(("JUPYTERHUB_", "JPY_")) and name != "CONFIGPROXY_AUTH_TOKEN"}


class HubAskedEveryTime(HubOAuth):
    """The Hub is asked about every request's token: one it revoked, or a student it removed, is refused at once
    (JupyterHub's cache would keep answering yes for its age; an age of 0 means for ever)."""

    def user_for_token(self, token, use_cache=True, session_id="", *, sync=True):
        return super().user_for_token(token, use_cache=False, session_id=session_id, sync=sync)


# --- the REST API -----------------------------------------------------------------------------------------------

@web.stream_request_body
class ServiceHandler(HubOAuthenticated, web.RequestHandler):
    """Common ground: the Hub's user, JSON errors, blocking database work off the event loop.

    A body is read only once its sender is known: Tornado hands it over after :meth:`prepare`, which answers 401,
    403 or 413 first when the credentials or the declared length say no, and caps what is read at
    ``body_limit_bytes`` (beyond it Tornado closes the connection)."""

    body_limit_bytes = FORM_BODY_LIMIT_BYTES

    @property
    def service(self) -> AssessService:
        return self.settings[SERVICE_SETTINGS_KEY]

    def initialize(self):
        self._body_parts: list[bytes] = []

    async def prepare(self):
        # Asks the Hub once, without blocking the loop; current_user then reads the cached answer.
        await self.hub_auth.get_user(self, sync=False)
        self._sender_known_after_form = False
        if self.request.method not in BODY_METHODS:
            return
        limit = self.body_limit_bytes
        if self.current_user is None and self._browser_form():
            # A browser's form carries its _xsrf token in the body, and the Hub's cookie counts only with it: its
            # sender is checked once the form, capped small, is read (read_form).
            self._sender_known_after_form = True
            limit = min(limit, FORM_BODY_LIMIT_BYTES)
        else:
            self.check_sender()
        declared = self.request.headers.get("Content-Length", "")
        if declared.isdigit() and int(declared) > limit:
            raise web.HTTPError(413, f"The request is {int(declared)} bytes, more than this page takes ({limit} "
                                     f"bytes); nothing of it was read.")
        self.request.connection.set_max_body_size(limit)

    def _browser_form(self) -> bool:
        content_type = self.request.headers.get("Content-Type", "").split(";")[0].strip().lower()
        return (bool(self.get_cookie(self.hub_auth.cookie_name))
                and content_type in ("application/x-www-form-urlencoded", "multipart/form-data"))

    def check_sender(self) -> None:
        """Who may send a body here (401/403 otherwise): a Hub user."""
        _ = self.student

    def data_received(self, chunk: bytes) -> None:
        if not self._finished and self.request.method in BODY_METHODS:
            self._body_parts.append(chunk)

    @property
    def body(self) -> bytes:
        return b"".join(self._body_parts)

    async def read_form(self) -> None:
        """The form body parsed into Tornado's body arguments (Tornado parses no streamed body); a browser's
        sender is checked now, with the form's _xsrf token."""
        httputil.parse_body_arguments(self.request.headers.get("Content-Type", ""), self.body,
                                      self.request.body_arguments, self.request.files, self.request.headers)
        for name, values in self.request.body_arguments.items():
            self.request.arguments.setdefault(name, []).extend(values)
        if self._sender_known_after_form:
            # JupyterHub and Tornado keep their answer for the request, given before the form's _xsrf was seen.
            for answer in ("_cached_hub_user", "_hub_auth_user_cache", "_current_user"):
                self.__dict__.pop(answer, None)
            await self.hub_auth.get_user(self, sync=False)
            self._sender_known_after_form = False
        self.check_sender()

    def set_default_headers(self):
        self.set_header("Content-Type", "application/json; charset=UTF-8")
        self.set_header("Cache-Control", "no-store")
        self.set_header("X-Content-Type-Options", "nosniff")

    def write_error(self, status_code, **kwargs):
        error = kwargs.get("exc_info", (None, None))[1]
        message = error.log_message if isinstance(error, web.HTTPError) and error.log_message else self._reason
        if status_code == 401:
            self.set_header("WWW-Authenticate", 'token realm="JupyterHub"')
        self.finish({"message": message, "reason": None})

    @property
    def student(self) -> str:
        """The Hub user making the request; 401 without credentials, 403 with ones the Hub did not accept."""
        user = self.current_user
        if user is None:
            presented = self.request.headers.get("Authorization") or self.get_cookie(self.hub_auth.cookie_name)
            if presented:
                raise web.HTTPError(403, "JupyterHub did not accept these credentials for the Assess service: "
                                         "log in to the Hub again, or use your own API token.")
            raise web.HTTPError(401, "Log in to JupyterHub first: the Assess service takes the Hub's login "
                                     "cookie or your own API token (Authorization: token ...).")
        if user.get("kind", "user") != "user":
            raise web.HTTPError(403, f"{user.get('kind')} {user.get('name')} is not a student: only a Hub user "
                                     f"can submit and see assessments.")
        return user["name"]

    async def blocking(self, function, *args):
        # SQLite may wait for its write lock; keep the service answering meanwhile.
        return await IOLoop.current().run_in_executor(None, function, *args)


class NotFoundHandler(ServiceHandler):
    async def prepare(self):
        raise web.HTTPError(404, "There is no such page in the Assess service.")


class IndexHandler(ServiceHandler):
    """The service's page: through the Hub's login (OAuth) for a browser, then who is signed in."""

    @web.authenticated
    def get(self):
        self.set_header("Content-Type", "text/html; charset=UTF-8")
        name = html.escape(self.current_user["name"])
        class_page = ""
        if HUB_INSTRUCTORS_GROUP in (self.current_user.get("groups") or []):
            class_page = f' <a href="{html.escape(url_path_join(self.request.path, "class"))}">The class</a>.'
        self.finish(f"<!doctype html><title>ScaleLab Assess</title><p>ScaleLab Assess service: signed in as "
                    f"<b>{name}</b>. Assess from the panel in your assessment notebook.{class_page}</p>")


class ServiceInfoHandler(ServiceHandler):
    async def get(self):
        student = self.student
        info = await self.blocking(self.service.describe)
        self.finish({**info, "student": student})


class AssessmentsHandler(ServiceHandler):
    body_limit_bytes = JSON_BODY_LIMIT_BYTES

    async def get(self):
        student = self.student
        self.finish({"student": student, "assessments": await self.blocking(self.service.history, student)})

    async def post(self):
        student = self.student
        try:
            content, filename = self.submitted_content()
            job, created = await self.blocking(self.service.submit_content, student, content, filename,
                                               f"sent through JupyterHub as {filename}")
        except SubmissionProblem as problem:
            send_problem(self, problem)
            return
        self.set_status(201 if created else 200)
        self.finish({"job": job, "created": created})

    def submitted_content(self) -> tuple[bytes, str]:
        """(the script's bytes, its file name) from the body: raw, or JSON {"source", "filename"}."""
        body = self.body
        limit = SUBMISSION_SIZE_LIMIT_BYTES
        content_type = self.request.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if content_type != "application/json":
            if len(body) > limit:
                raise SubmissionProblem(413, f"The request is {len(body)} bytes, over the {limit} byte limit for "
                                             f"a submission; make assessment.py smaller and click Assess again.")
            return body, "assessment.py"
        if len(body) > JSON_BODY_LIMIT_BYTES:
            raise SubmissionProblem(413, f"The request is {len(body)} bytes, more than any submission under the "
                                         f"{limit} byte limit takes; make assessment.py smaller.")
        try:
            document = json.loads(body)
        except UnicodeDecodeError:
            raise SubmissionProblem(400, "The request is not UTF-8 text; send assessment.py as UTF-8.") from None
        except ValueError as error:
            raise SubmissionProblem(400, f"The request is not valid JSON ({error}); send "
                                         f'{{"source": "<the script>", "filename": "assessment.py"}}.') from None
        if not isinstance(document, dict) or not isinstance(document.get("source"), str):
            raise SubmissionProblem(400, 'The request needs the script as text in "source": '
                                         '{"source": "<the script>", "filename": "assessment.py"}.')
        filename = document.get("filename") or "assessment.py"
        if not isinstance(filename, str) or not FILENAME.fullmatch(filename):
            raise SubmissionProblem(400, "The file name must be a plain Python file name such as assessment.py.")
        try:
            return document["source"].encode("utf-8"), filename
        except UnicodeEncodeError:  # a lone surrogate escaped in the JSON
            raise SubmissionProblem(400, f"{filename} is not UTF-8 text, so not Python source; save it as UTF-8 "
                                         f"and click Assess again.") from None


class AssessmentHandler(ServiceHandler):
    async def get(self, job_id: str):
        student = self.student
        # More digits than any id has never name a job.
        job = (await self.blocking(self.service.job, student, int(job_id))
               if len(job_id) <= len(str(MAX_JOB_ID)) else None)
        if job is None:
            raise web.HTTPError(404, f"There is no assessment {job_id} of yours.")
        self.finish(job)


def make_app(service: AssessService, prefix: str, cookie_secret: bytes) -> web.Application:
    from . import classpage  # its handlers build on this module's

    api = url_path_join(prefix, "api")
    return web.Application([
        (prefix, IndexHandler),
        (url_path_join(prefix, "oauth_callback"), HubOAuthCallbackHandler),
        (url_path_join(api, "service"), ServiceInfoHandler),
        (url_path_join(api, "assessments"), AssessmentsHandler),
        (url_path_join(api, r"assessments/([0-9]+)"), AssessmentHandler),
        *classpage.routes(prefix),
    ], default_handler_class=NotFoundHandler, cookie_secret=cookie_secret,
        **{SERVICE_SETTINGS_KEY: service, SERVICE_PREFIX_KEY: prefix})


def _cookie_secret(state: Path) -> bytes:
    """Kept in the state, so a restarted service still knows its browsers' login cookies."""
    path = state / "cookie_secret"
    if not path.is_file():
        with open(path, "wb", opener=lambda name, flags: os.open(name, flags, 0o600)) as stream:
            stream.write(secrets.token_bytes(32))
    return path.read_bytes()


# --- the process ------------------------------------------------------------------------------------------------

class HubAssessService(Application):
    """``python -m scalelab.grader.service.hub``: the Assess service as JupyterHub's managed service."""

    name = "scalelab-hub-service"
    description = __doc__
    classes = [AssessService]
    aliases = {"state-dir": "HubAssessService.state_dir"}

    state_dir = Unicode(config=True, help=f"The service's state, private to its account. Default: "
                                          f"${STATE_DIR_VARIABLE}, else {DEFAULT_STATE_DIR}.")

    @default("state_dir")
    def _state_dir_default(self):
        return os.environ.get(STATE_DIR_VARIABLE) or DEFAULT_STATE_DIR

    def start(self) -> None:
        state = prepare_state_dir(Path(self.state_dir))
        os.umask(0o077)
        os.environ["SCALELAB_HOME"] = str(state)  # the grader's runs, jobs and results.db go there too
        (state / "logs").mkdir(mode=0o700, exist_ok=True)
        to_file = logging.FileHandler(state / "logs" / "service.log")
        to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        self.log.addHandler(to_file)
        url = urlparse(os.environ.get("JUPYTERHUB_SERVICE_URL", ""))
        if not url.port:
            raise ServiceRefused("$JUPYTERHUB_SERVICE_URL names no port: this service is started by JupyterHub "
                                 "(see register() in grader/service/hub.py), not by hand.")
        prefix = os.environ.get("JUPYTERHUB_SERVICE_PREFIX") or f"/services/{SERVICE_NAME}/"
        HubAskedEveryTime.instance(parent=self)
        service = AssessService(None, parent=self, log=self.log)
        if service.allow_unsandboxed:
            raise ServiceRefused("AssessService.allow_unsandboxed cannot be used by the Hub service: an "
                                 "unsandboxed run would run as this service's account with its state in reach.")
        staged = stage_grading_data(state / "data", service.track_spec.dataset, self.log)
        if staged is not None:
            os.environ[staged[0]] = str(staged[1])
        service.workers.settings.environment = grader_environment()
        service.workers.server_name = "the course's grader service"
        problem = sandbox.sandbox_works()
        if problem:
            self.log.error("scalelab hub service: %s; every job will end with the grader's error until bubblewrap "
                           "works for the account %s.", problem, SERVICE_USER)
        asyncio.run(self._serve(service, url.hostname or "127.0.0.1", url.port, prefix, _cookie_secret(state)))

    async def _serve(self, service: AssessService, host: str, port: int, prefix: str, cookie_secret: bytes):
        try:
            # Each handler caps its own body once it knows the sender; nothing takes more than a submission.
            server = make_app(service, prefix, cookie_secret).listen(port, address=host,
                                                                     max_body_size=JSON_BODY_LIMIT_BYTES)
        except OSError as error:
            raise ServiceRefused(f"cannot listen on {host}:{port} ({error.strerror}); is another service "
                                 f"there?") from None
        service.start()
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):  # the Hub stops its services with SIGINT, then SIGTERM
            loop.add_signal_handler(signum, stopping.set)
        self.log.info("scalelab hub service: %s on %s:%d as uid %d, state in %s", prefix, host, port, os.getuid(),
                      self.state_dir)
        await stopping.wait()
        server.stop()
        # Running jobs go back to the front of the queue (graded again from scratch, never by halves); queued ones wait.
        await loop.run_in_executor(None, service.stop)


def main(argv=None) -> int:
    app = HubAssessService()
    try:
        app.initialize(argv)
        app.start()
    except ServiceRefused as refused:
        print(f"scalelab hub service: {refused}", file=sys.stderr, flush=True)
        time.sleep(PAUSE_BEFORE_EXIT_S)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
