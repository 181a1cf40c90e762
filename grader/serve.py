"""The Assess service: a Jupyter server extension with a REST API over the persistent queue (``queue.py``).

Enable it with ``--ServerApp.jpserver_extensions=scalelab.grader.serve=True`` (``make lab`` does). Routes,
all under ``/scalelab/api/`` and guarded by Jupyter's own authentication:

- ``GET  /scalelab/api/service``            what the service grades (track, budget, target, slots) and queue counts
- ``POST /scalelab/api/assessments``        submit: copies the student's ``assessment/assessment.py`` now
                                            (201 with a new job; 200 with the student's active job, if any)
- ``GET  /scalelab/api/assessments``        the student's history, newest first
- ``GET  /scalelab/api/assessments/<id>``   one job: queued (+ position), running (+ progress), done (+ verdict)
                                            or interrupted (+ reason)

Grading happens in the server's worker threads (``GradingWorkers``), each running ``scalelab assess`` as its own
process: never in the student's kernel. Settings are traitlets config on ``AssessService`` (see its traits), e.g.
``--AssessService.slots=2 --AssessService.track=fashion-mnist-cpu``.

Who the student is: Jupyter's current user. On a single-user server (``make lab``) Jupyter's stock identity
provider names every token-authenticated request as a fresh anonymous user, so there the student is the
server's owner (``student_identity = "auto"``); behind JupyterHub or any other identity provider it is the
user's name.
"""

from __future__ import annotations

import atexit
import getpass
import hashlib
import re
import shutil
import uuid
from pathlib import Path

from jupyter_server.auth.identity import IdentityProvider, PasswordIdentityProvider
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web
from tornado.ioloop import IOLoop
from traitlets import Bool, Enum, Float, Int, Unicode
from traitlets.config import LoggingConfigurable

from scalelab.runtime import usable_cores

from . import commands, pipeline, spec, store
from .queue import (DONE, INTERRUPTED, QUEUED, RUNNING, AssessQueue, GraderSettings, GradingWorkers, QueueFull,
                    sqlite_url)

API_PREFIX = "scalelab/api"
SERVICE_SETTINGS_KEY = "scalelab_assess_service"
# Jupyter's stock providers: a token names no person, so every request would be a new "Anonymous" user.
ANONYMOUS_IDENTITY_PROVIDERS = (IdentityProvider, PasswordIdentityProvider)


class SubmissionProblem(Exception):
    """The student's file cannot be submitted; the message is a sentence for the student."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _slots_for_machine(track: spec.Track) -> int:
    """Cores (or GPUs) ÷ ranks per job: as many jobs at once as the machine holds without oversubscribing it."""
    from scalelab import environment
    gpu_count = len(environment.gpus())
    try:
        ranks = track.resolve_ranks(gpu_count)
    except spec.SpecError:
        return 1
    units = gpu_count if gpu_count else usable_cores()
    return max(1, units // max(1, ranks))


def safe_student_name(student: str) -> str:
    """A file-name form of the student's name (for per-student submission paths)."""
    return re.sub(r"[^A-Za-z0-9._@-]", "_", student).lstrip(".") or "_"


class AssessService(LoggingConfigurable):
    """The queue, the workers and the settings of one Jupyter server's Assess service."""

    database_url = Unicode("", config=True, help=(
        "SQLAlchemy URL of the queue's database, e.g. postgresql://user@host/scalelab. "
        "Default: a SQLite file, $SCALELAB_HOME/assess/queue.db."))
    jobs_dir = Unicode("", config=True, help="Where submitted files and grader output go. "
                                             "Default: $SCALELAB_HOME/assess/jobs.")
    track = Unicode("", config=True, help=f"Track students are graded on. Default: $SCALELAB_TRACK, else "
                                          f"{spec.DEFAULT_TRACK}.")
    tracks_file = Unicode("", config=True, help="Track file. Default: $SCALELAB_TRACKS, else assessment/tracks.toml.")
    slots = Int(0, config=True, help="Jobs graded at once. 0: the machine's cores (or GPUs) ÷ the track's ranks.")
    backend = Enum(["local", "slurm"], default_value="local", config=True,
                   help="Where jobs run: this machine, or handed to Slurm by the grader.")
    max_queued = Int(200, config=True, help="Submissions that may wait at once; more are refused (queue full).")
    allow_unsandboxed = Bool(False, config=True,
                             help="Grade even where bubblewrap cannot sandbox the submission (instructors only).")
    submission_path = Unicode("assessment/assessment.py", config=True, help=(
        "The student's file, relative to the server's root directory. '{student}' is replaced by the student's "
        "name, for a server shared by several students, each in their own folder."))
    student_identity = Enum(["auto", "jupyter-user", "server-owner"], default_value="auto", config=True, help=(
        "Who the student is: 'jupyter-user' (Jupyter's current user name), 'server-owner' (the account running "
        "the server), or 'auto': the owner when Jupyter's stock identity provider is in use (its token users "
        "are anonymous), else the Jupyter user."))
    poll_interval_s = Float(1.0, config=True, help="How often workers look for jobs and read progress.")

    def __init__(self, root_dir: str, identity_provider=None, **kwargs):
        super().__init__(**kwargs)
        self.root_dir = Path(root_dir).resolve()
        self.identity_provider = identity_provider
        self.track_name = self.track or None
        self.track_spec = spec.load_track(self.track_name, self.tracks_file or None)
        self.track_name = self.track_spec.name
        home = store.scalelab_home() / "assess"
        self.jobs_root = Path(self.jobs_dir) if self.jobs_dir else home / "jobs"
        self.jobs_root.mkdir(parents=True, exist_ok=True)
        self.queue = AssessQueue(self.database_url or sqlite_url(home / "queue.db"))
        self.slot_count = self.slots if self.slots > 0 else _slots_for_machine(self.track_spec)
        self.workers = GradingWorkers(self.queue, GraderSettings(
            track=self.track_name, track_file=self.tracks_file or None, backend=self.backend,
            allow_unsandboxed=self.allow_unsandboxed, poll_interval_s=self.poll_interval_s),
            slots=self.slot_count, log=self.log)
        self._stopped = False

    # --- life cycle -----------------------------------------------------------------------------------------

    def start(self) -> None:
        for job in self.workers.recover():
            self.log.warning("scalelab assess: job %s of %s left by a stopped server is now %s",
                             job["id"], job["student"], job["state"])
        self.workers.start()
        self.log.info("scalelab assess: track %s, %d slot(s), backend %s, queue %s", self.track_name,
                      self.slot_count, self.backend, self.queue.database_url)

    def stop(self) -> None:
        """Clean stop: running jobs become ``interrupted`` (never graded by halves), queued ones wait."""
        if self._stopped:
            return
        self._stopped = True
        self.workers.stop()
        self.queue.close()

    # --- students -------------------------------------------------------------------------------------------

    def student_of(self, user) -> str:
        mode = self.student_identity
        if mode == "auto":
            mode = ("server-owner" if type(self.identity_provider) in ANONYMOUS_IDENTITY_PROVIDERS
                    else "jupyter-user")
        if mode == "server-owner":
            return getpass.getuser()
        return getattr(user, "username", None) or str(user)

    def submission_file(self, student: str) -> Path:
        relative = self.submission_path.format(student=safe_student_name(student))
        path = (self.root_dir / relative).resolve()
        if not path.is_relative_to(self.root_dir):
            raise SubmissionProblem(400, f"the configured submission path {relative} is outside the server's "
                                         f"root directory; ask your instructor to fix the Assess service.")
        return path

    def submit(self, student: str) -> tuple[dict, bool]:
        """Copy the student's file into a new job directory and queue it (or return the active job)."""
        source = self.submission_file(student)
        shown = source.relative_to(self.root_dir)
        if not source.is_file():
            raise SubmissionProblem(404, f"There is no {shown} to assess: save your script as {shown} "
                                         f"(next to the assessment notebook) and click Assess again.")
        size = source.stat().st_size
        if size > pipeline.SUBMISSION_SIZE_LIMIT_BYTES:
            raise SubmissionProblem(400, f"{shown} is {size} bytes, over the "
                                         f"{pipeline.SUBMISSION_SIZE_LIMIT_BYTES} byte limit for a submission.")
        job_dir = self.jobs_root / uuid.uuid4().hex
        job_dir.mkdir(parents=True)
        try:
            # The copy, made now, is what gets graded: later edits do not change a queued job.
            copy = job_dir / "assessment.py"
            shutil.copyfile(source, copy)
            try:
                commands.check_submission_file(copy)
            except commands.UsageError as error:
                raise SubmissionProblem(400, f"{shown} cannot be assessed: "
                                             f"{str(error).replace(str(copy), 'the file')}.") from None
            job, created = self.queue.submit(
                student=student, track=self.track_name, backend=self.backend, job_dir=job_dir,
                submission_path=str(source), submission_sha256=hashlib.sha256(copy.read_bytes()).hexdigest(),
                max_queued=self.max_queued)
        except QueueFull as full:
            shutil.rmtree(job_dir, ignore_errors=True)
            raise SubmissionProblem(503, f"The Assess queue is full ({full.args[0]} submissions are waiting); "
                                         f"try again in a few minutes.") from None
        except BaseException:
            shutil.rmtree(job_dir, ignore_errors=True)
            raise
        if created:
            self.workers.wake()
        else:
            shutil.rmtree(job_dir, ignore_errors=True)
        return self.public_view(job), created

    def job(self, student: str, job_id: int) -> dict | None:
        job = self.queue.get(job_id)
        if job is None or job["student"] != student:  # another student's job does not exist for this one
            return None
        return self.public_view(job)

    def history(self, student: str) -> list[dict]:
        return [self.public_view(job, with_position=False) for job in self.queue.history(student)]

    def public_view(self, job: dict, with_position: bool = True) -> dict:
        """What a student may see of a job (no server paths or process ids)."""
        view = {key: job[key] for key in ("id", "student", "state", "track", "submission_sha256", "submitted_at",
                                          "started_at", "finished_at", "reason")}
        view["time_budget_s"] = self.track_spec.time_budget_s if job["track"] == self.track_name else None
        view["position"] = self.queue.position(job["id"]) if with_position and job["state"] == QUEUED else None
        view["progress"] = job["progress"] if job["state"] in (RUNNING, DONE, INTERRUPTED) else None
        view["progress_history"] = job["progress_history"]
        view["verdict"] = job["verdict"] if job["state"] == DONE else None
        return view

    def describe(self) -> dict:
        return {"track": self.track_name, "dataset": self.track_spec.dataset,
                "target_accuracy": self.track_spec.target_accuracy, "time_budget_s": self.track_spec.time_budget_s,
                "slots": self.slot_count, "backend": self.backend, "max_queued": self.max_queued,
                "submission_path": self.submission_path, "counts": self.queue.counts()}


class AssessHandler(APIHandler):
    """Common ground: the service, the student, blocking database work off the event loop."""

    @property
    def service(self) -> AssessService:
        return self.settings[SERVICE_SETTINGS_KEY]

    @property
    def student(self) -> str:
        return self.service.student_of(self.current_user)

    async def blocking(self, function, *args):
        # SQLite may wait for its write lock; keep the server answering meanwhile.
        return await IOLoop.current().run_in_executor(None, function, *args)


class ServiceHandler(AssessHandler):
    @web.authenticated
    async def get(self):
        info = await self.blocking(self.service.describe)
        self.finish({**info, "student": self.student})


class AssessmentsHandler(AssessHandler):
    @web.authenticated
    async def get(self):
        self.finish({"student": self.student, "assessments": await self.blocking(self.service.history, self.student)})

    @web.authenticated
    async def post(self):
        try:
            job, created = await self.blocking(self.service.submit, self.student)
        except SubmissionProblem as problem:
            raise web.HTTPError(problem.status, str(problem)) from None
        self.set_status(201 if created else 200)
        self.finish({"job": job, "created": created})


class AssessmentHandler(AssessHandler):
    @web.authenticated
    async def get(self, job_id: str):
        job = await self.blocking(self.service.job, self.student, int(job_id))
        if job is None:
            raise web.HTTPError(404, f"There is no assessment {job_id} of yours.")
        self.finish(job)


def _jupyter_server_extension_points():
    return [{"module": "scalelab.grader.serve"}]


def _load_jupyter_server_extension(serverapp):
    service = AssessService(serverapp.root_dir, identity_provider=serverapp.identity_provider,
                            parent=serverapp, log=serverapp.log)
    service.start()
    # Function extensions get no stop hook from Jupyter; the interpreter's exit (after a clean server stop or
    # SIGTERM) is where running jobs are marked interrupted. A kill -9 is settled by the next start instead.
    atexit.register(service.stop)
    base = url_path_join(serverapp.base_url, API_PREFIX)
    serverapp.web_app.settings[SERVICE_SETTINGS_KEY] = service
    serverapp.web_app.add_handlers(".*$", [
        (url_path_join(base, "service"), ServiceHandler),
        (url_path_join(base, "assessments"), AssessmentsHandler),
        (url_path_join(base, r"assessments/(\d+)"), AssessmentHandler),
    ])
    serverapp.log.info("scalelab assess service at %s", base)


# Older jupyter_server/notebook names for the same hooks.
load_jupyter_server_extension = _load_jupyter_server_extension
