"""The Assess service for a class: one process for every student, a JupyterHub managed service.

    python -m scalelab.grader.service.hub [--state-dir DIR] [--AssessService.track=NAME ...]

JupyterHub starts it (and starts it again whenever it exits) as the service ``scalelab`` at
``/services/scalelab/``, running as the system account ``scalelab``; :func:`register` is what a Hub config calls
to set that up. Routes, under the service's prefix, as the single-user extension's (``grader/serve.py``):

- ``GET  api/service``            what the service grades, and queue counts
- ``POST api/assessments``        submit: the body is the student's script (``assessment.py``, or the PyTorch
                                  track's ``assessment_pytorch.py``), raw (any content type but JSON) or as JSON
                                  ``{"source": "...", "filename": "assessment.py"}``; 201 with a
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
directory and a private ``/tmp`` and nothing else of the machine. The service is not root, so it grades through
root's helper (``--privileged-helper``, ``grader/assess_helper.py``; ``make hub`` installs it and lets only this
account run it through sudo): each run gets a throw-away uid, a process limit on that uid and a memory cgroup,
cannot signal or read the service, and the service still gets the verdict, logs and model, as its own files.
Without the helper a run is ``scalelab`` in a user namespace (no capability, no way out of its mount, PID and
network namespaces) but without those limits. The service refuses to start where that cannot hold: a state
directory inside the software the sandbox shows, ``allow_unsandboxed``, or a helper it was given that sudo does
not let it run.
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
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

from jupyterhub.services.auth import HubOAuthCallbackHandler
from jupyterhub.utils import url_path_join
from tornado import web
from traitlets import Unicode, default
from traitlets.config import Application

from scalelab import data as course_data

from .. import sandbox
from ..classroom.accounts import HUB_INSTRUCTORS_GROUP
from ..classroom.server_limits import format_cpus, parse_cpus
from ..pipeline import SUBMISSION_SIZE_LIMIT_BYTES
from ..queue import MAX_JOB_ID
from ..serve import AssessService, SubmissionProblem, send_problem
from .handlers import SERVICE_PREFIX_KEY, SERVICE_SETTINGS_KEY, HubAskedEveryTime, ServiceHandler

SERVICE_NAME = "scalelab"
SERVICE_USER = "scalelab"
DEFAULT_STATE_DIR = "/var/lib/scalelab"
STATE_DIR_VARIABLE = "SCALELAB_SERVICE_STATE"
# What a single-user server's kernel reads to find the service (set by register()).
SERVICE_URL_VARIABLE = "SCALELAB_ASSESS_SERVICE_URL"
# JSON escapes may take up to 6 characters per byte of source; beyond that a body cannot hold a submission.
JSON_BODY_LIMIT_BYTES = 6 * SUBMISSION_SIZE_LIMIT_BYTES + 4096
FILENAME = re.compile(r"[A-Za-z0-9_.-]{1,100}\.py")
# The Hub starts a managed service again as soon as it exits: a refusal waits first, so it is not a hot loop.
PAUSE_BEFORE_EXIT_S = 10.0


class ServiceRefused(Exception):
    """The service will not start here; the message is a sentence for the operator."""


# --- the Hub's side ---------------------------------------------------------------------------------------------

def register(c, *, python: str, port: int, public_url: str, state_dir: str = DEFAULT_STATE_DIR,
             settings: dict | None = None, environment: dict | None = None, user: str = SERVICE_USER,
             privileged_helper: str | None = None, grading_cpus=None) -> dict:
    """Add the managed service ``scalelab`` to a JupyterHub config ``c``; returns the service's entry.

    ``python`` runs the service (an interpreter ``user`` can run, with this package and JupyterHub); ``port`` is
    where it listens on 127.0.0.1; ``public_url`` is the Hub's address as kernels reach it (the proxy, e.g.
    ``http://127.0.0.1:8000/``); ``settings`` are ``AssessService`` traits (``{"track": ..., "slots": 1}``);
    ``privileged_helper``: root's helper that ``user`` may run through sudo (``HubAssessService.privileged_helper``);
    ``grading_cpus``: the CPUs graded runs keep to (``HubAssessService.grading_cpus``; None: all).
    Every user may use the service, and single-user servers' tokens carry that permission, so the Assess panel
    in a kernel can call it with ``$JUPYTERHUB_API_TOKEN``. The service may list the Hub's users and their
    groups (its class page shows the students who have not submitted yet).
    """
    access = f"access:services!service={SERVICE_NAME}"
    _create_state_dir(Path(state_dir), user)
    command = [python, "-m", "scalelab.grader.service.hub", f"--state-dir={state_dir}"]
    command += [f"--AssessService.{name}={value}" for name, value in (settings or {}).items()]
    if privileged_helper:
        command.append(f"--privileged-helper={privileged_helper}")
    if grading_cpus:
        command.append(f"--grading-cpus={format_cpus(grading_cpus)}")
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
    # Root's grader reads the held-out split as a sandbox uid of its own, through a bind of the files themselves:
    # they are readable by all; the state directory (0700) keeps every account from reaching them.
    for path in [target, *target.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    if not all((target / name).is_file() for name in needed):
        log.error("scalelab hub service: %s is not complete in %s and could not be copied there from a readable "
                  "place; jobs on it will end with the grader's error until it is.", dataset, target)
        return None
    return variable, target


def grader_environment() -> dict[str, str]:
    """The service's environment for ``scalelab assess``, without the Hub's credentials."""
    return {name: value for name, value in os.environ.items()
            if not name.startswith(("JUPYTERHUB_", "JPY_")) and name != "CONFIGPROXY_AUTH_TOKEN"}


# --- the REST API -----------------------------------------------------------------------------------------------

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
        expected = self.service.track_spec.submission_file  # assessment.py, or the PyTorch track's script
        content_type = self.request.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if content_type != "application/json":
            if len(body) > limit:
                raise SubmissionProblem(413, f"The request is {len(body)} bytes, over the {limit} byte limit for "
                                             f"a submission; make {expected} smaller and click Assess again.")
            return body, expected
        if len(body) > JSON_BODY_LIMIT_BYTES:
            raise SubmissionProblem(413, f"The request is {len(body)} bytes, more than any submission under the "
                                         f"{limit} byte limit takes; make {expected} smaller.")
        try:
            document = json.loads(body)
        except UnicodeDecodeError:
            raise SubmissionProblem(400, f"The request is not UTF-8 text; send {expected} as UTF-8.") from None
        except ValueError as error:
            raise SubmissionProblem(400, f"The request is not valid JSON ({error}); send "
                                         f'{{"source": "<the script>", "filename": "{expected}"}}.') from None
        if not isinstance(document, dict) or not isinstance(document.get("source"), str):
            raise SubmissionProblem(400, f'The request needs the script as text in "source": '
                                         f'{{"source": "<the script>", "filename": "{expected}"}}.')
        filename = document.get("filename") or expected
        if not isinstance(filename, str) or not FILENAME.fullmatch(filename):
            raise SubmissionProblem(400, f"The file name must be a plain Python file name such as {expected}.")
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


class BoardHandler(ServiceHandler):
    async def get(self):
        student = self.student
        self.finish(await self.blocking(self.service.board, student))


def make_app(service: AssessService, prefix: str, cookie_secret: bytes) -> web.Application:
    from . import classpage

    api = url_path_join(prefix, "api")
    return web.Application([
        (prefix, IndexHandler),
        (url_path_join(prefix, "oauth_callback"), HubOAuthCallbackHandler),
        (url_path_join(api, "service"), ServiceInfoHandler),
        (url_path_join(api, "assessments"), AssessmentsHandler),
        (url_path_join(api, r"assessments/([0-9]+)"), AssessmentHandler),
        (url_path_join(api, "board"), BoardHandler),
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


def helper_command(helper: str) -> list[str]:
    """How the service runs root's helper; refused unless sudo lets this account run it without a password."""
    command = ["sudo", "-n", helper]
    try:
        allowed = subprocess.run(["sudo", "-n", "-l", helper], stdin=subprocess.DEVNULL, capture_output=True,
                                 timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        allowed = False
    if not allowed:
        raise ServiceRefused(f"sudo does not let the account {SERVICE_USER} run {helper} without a password: run "
                             f"`make hub` (containers/hub/hub.sh) as root again, which installs the helper and its "
                             f"rule in /etc/sudoers.d, or drop --privileged-helper.")
    return command


# --- the process ------------------------------------------------------------------------------------------------

class HubAssessService(Application):
    """``python -m scalelab.grader.service.hub``: the Assess service as JupyterHub's managed service."""

    name = "scalelab-hub-service"
    description = __doc__
    classes = [AssessService]
    aliases = {"state-dir": "HubAssessService.state_dir", "privileged-helper": "HubAssessService.privileged_helper",
               "grading-cpus": "HubAssessService.grading_cpus"}

    state_dir = Unicode(config=True, help=f"The service's state, private to its account. Default: "
                                          f"${STATE_DIR_VARIABLE}, else {DEFAULT_STATE_DIR}.")

    privileged_helper = Unicode("", config=True, help=(
        "Root's helper that grades each local job with a uid and limits of its own (grader/assess_helper.py), "
        "run through `sudo -n`; make hub installs it as /usr/local/sbin/scalelab-assess. Empty: runs are this "
        "account in a user namespace, without a process or memory limit."))

    grading_cpus = Unicode("", config=True, help=(
        "The CPUs graded runs have to themselves (a list such as '2-3'; make hub's SCALELAB_GRADING_CPUS, whose "
        "other CPUs hold the students' servers): the service keeps to them, and every run it starts inherits them. "
        "Empty: every CPU this process may use."))

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
        if self.grading_cpus:
            keep_to_cpus(self.grading_cpus)  # before the service counts its cores: its slots and contention use these
        service = AssessService(None, parent=self, log=self.log)
        if service.allow_unsandboxed:
            raise ServiceRefused("AssessService.allow_unsandboxed cannot be used by the Hub service: an "
                                 "unsandboxed run would run as this service's account with its state in reach.")
        staged = stage_grading_data(state / "data", service.track_spec.dataset, self.log)
        if staged is not None:
            os.environ[staged[0]] = str(staged[1])
        service.workers.settings.environment = grader_environment()
        if self.privileged_helper:
            service.workers.settings.privileged_helper = helper_command(self.privileged_helper)
        else:
            self.log.warning("scalelab hub service: no privileged helper: graded runs are this account in a user "
                             "namespace, with no process or memory limit of their own.")
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


def keep_to_cpus(cpu_list: str) -> None:
    """This process, and what it starts from now on, on ``cpu_list`` alone."""
    try:
        cpus = parse_cpus(cpu_list)
        os.sched_setaffinity(0, cpus)
    except (ValueError, OSError) as error:
        raise ServiceRefused(f"--grading-cpus={cpu_list} cannot be kept to ({error}); this process may use CPUs "
                             f"{format_cpus(os.sched_getaffinity(0))}.") from None


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
