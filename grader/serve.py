"""The Assess service: a Jupyter server extension with a REST API over the persistent queue (``queue.py``).

Enable it with ``--ServerApp.jpserver_extensions=scalelab.grader.serve=True`` (``make lab`` does). Routes,
all under ``/scalelab/api/`` and guarded by Jupyter's own authentication:

- ``GET  /scalelab/api/service``            what the service grades (track, budget, target, slots) and queue counts
- ``POST /scalelab/api/assessments``        submit: copies the student's ``assessment/assessment.py`` now
                                            (201 with a new job; 200 with the student's active job, if any;
                                            429 with ``Retry-After`` sooner than ``min_seconds_between_submissions``
                                            after the student's previous submission; 400 for a link or anything
                                            but a plain file, which is never followed or read)
- ``GET  /scalelab/api/assessments``        the student's history, newest first
- ``GET  /scalelab/api/assessments/<id>``   one job: queued (+ position), running (+ progress), done (+ verdict)
- ``GET  /scalelab/api/board``              the student's best time to accuracy and rank on the class board
                                            or interrupted (+ reason)

The same service behind JupyterHub, for a class, is ``service/hub.py``: one process for every student, the
script sent as content in the request, the student named by the Hub.

Grading happens in the server's worker threads (``workers.py``), each running ``scalelab assess`` as its own
process: never in the student's kernel. Settings are traitlets config on ``AssessService`` (see its traits), e.g.
``--AssessService.slots=2 --AssessService.track=fashion-mnist-cpu``.

What a student sees of a job is an allow-list (``public_view``): no server paths, host names, uids or
environment, and server paths or the host name inside messages are replaced by placeholders. Job directories
are private to the server's account (0700, files 0600); a student's older ones are removed from disk beyond
``keep_jobs_per_student`` or ``disk_quota_bytes_per_student`` (the verdicts stay in the database), and a run's
model is kept only for a pass.

Who the student is: Jupyter's current user. On a single-user server (``make lab``) Jupyter's stock identity
provider names every token-authenticated request as a fresh anonymous user, so there the student is the
server's owner (``student_identity = "auto"``); behind JupyterHub or any other identity provider it is the
user's name. ``student_identity = "jupyter-user"`` with a stock provider is refused at start-up: every request
would be a new student, and the one-active-job and rate-limit rules would hold for nobody.
"""

from __future__ import annotations

import atexit
import errno
import getpass
import hashlib
import math
import os
import re
import shutil
import socket
import stat
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

from . import board, spec, store
from .pipeline import SUBMISSION_SIZE_LIMIT_BYTES
from .queue import DONE, INTERRUPTED, MAX_JOB_ID, QUEUED, RUNNING, AssessQueue, QueueFull, TooSoon, sqlite_url
from .submission import NotASubmission, check_submission_file
from .workers import GraderSettings, GradingWorkers, JobRetention, open_private

API_PREFIX = "scalelab/api"
SERVICE_SETTINGS_KEY = "scalelab_assess_service"
# Jupyter's stock providers: a token names no person, so every request would be a new "Anonymous" user.
ANONYMOUS_IDENTITY_PROVIDERS = (IdentityProvider, PasswordIdentityProvider)

# What a student may see: allow-lists, so that a field added to the job or the verdict later stays private
# until someone decides otherwise.
JOB_FIELDS_FOR_STUDENTS = ("id", "student", "state", "track", "submission_sha256", "submitted_at", "started_at",
                           "finished_at", "reason", "reruns")
VERDICT_FIELDS_FOR_STUDENTS = (
    "verdict", "reasons", "notes", "heldout_accuracy", "target_accuracy", "wall_time_s", "time_budget_s", "np",
    "ranks_seen", "allreduce_count", "allreduced_tensors", "active_deciles", "trainable_variables", "epochs_seen",
    "exit_code", "track", "dataset", "submission_sha256", "student", "started_at", "finished_at", "backend",
    "sandboxed", "grader_version", "witnesses", "cpu_contention", "contended", "snapshots", "time_to_accuracy_s",
    "deciding_snapshot", "stopped_at_target", "memory")
PROGRESS_FIELDS_FOR_STUDENTS = ("state", "elapsed_s", "time_budget_s", "epochs_seen", "latest_accuracy",
                                "checkpoint_mtime", "verdict", "slurm_job_id", "slurm_state", "slurm_reason",
                                "queue_position", "heldout_curve")
PROGRESS_POINT_FIELDS_FOR_STUDENTS = ("elapsed_s", "accuracy", "epochs_seen")


class SubmissionProblem(Exception):
    """The student's file cannot be submitted; the message is a sentence for the student."""

    def __init__(self, status: int, message: str, retry_after_s: int | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


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
                                          f"{spec.DEFAULT_TRACK} ({spec.DEFAULT_PYTORCH_TRACK} on the PyTorch edition).")
    tracks_file = Unicode("", config=True, help="Track file. Default: $SCALELAB_TRACKS, else assessment/tracks.toml.")
    slots = Int(0, config=True, help="Jobs graded at once. 0: the machine's cores (or GPUs) ÷ the track's ranks.")
    backend = Enum(["local", "slurm"], default_value="local", config=True,
                   help="Where jobs run: this machine, or handed to Slurm by the grader.")
    max_queued = Int(200, config=True, help="Submissions that may wait at once; more are refused (queue full).")
    board_names = Bool(False, config=True, help=(
        "Show students the names on the class board (who is ranked where by best time to accuracy). Off: a "
        "student sees their own best time, their rank and the others' times without names."))
    allow_unsandboxed = Bool(False, config=True,
                             help="Grade even where bubblewrap cannot sandbox the submission (instructors only).")
    submission_path = Unicode("", config=True, help=(
        "The student's file, relative to the server's root directory. '{student}' is replaced by the student's "
        "name, for a server shared by several students, each in their own folder. Default: the track's script "
        "in assessment/ (assessment/assessment.py, or assessment/assessment_pytorch.py for a PyTorch track)."))
    student_identity = Enum(["auto", "jupyter-user", "server-owner"], default_value="auto", config=True, help=(
        "Who the student is: 'jupyter-user' (Jupyter's current user name), 'server-owner' (the account running "
        "the server), or 'auto': the owner when Jupyter's stock identity provider is in use (its token users "
        "are anonymous), else the Jupyter user."))
    poll_interval_s = Float(1.0, config=True, help="How often workers look for jobs and read progress.")
    min_seconds_between_submissions = Float(30.0, config=True, help=(
        "Seconds a student waits after a submission before the next one is accepted (429 before then); a click "
        "while their job is queued or running still shows that job. 0: no wait."))
    keep_jobs_per_student = Int(20, config=True, help=(
        "Job directories kept on disk per student; older ones are removed (their verdicts stay in the "
        "database). 0: keep all."))
    disk_quota_bytes_per_student = Int(1 << 30, config=True, help=(
        "Bytes a student's job directories may take; beyond it the oldest are removed first (their verdicts "
        "stay in the database). A queued or running job's directory is never removed. 0: no quota."))

    def __init__(self, root_dir: str | None, identity_provider=None, **kwargs):
        super().__init__(**kwargs)
        if self.student_identity == "jupyter-user" and type(identity_provider) in ANONYMOUS_IDENTITY_PROVIDERS:
            raise ValueError(
                f"AssessService.student_identity = 'jupyter-user' cannot be used with Jupyter's stock identity "
                f"provider ({type(identity_provider).__name__}): it names every token request as a new anonymous "
                f"user, so one student could queue any number of jobs. Use student_identity = 'auto' or "
                f"'server-owner', or an identity provider that names its users (JupyterHub's).")
        # None: the submission always comes as content in the request (the JupyterHub service, which never
        # reads a student's files); submit_content() is then the only way in.
        self.root_dir = Path(root_dir).resolve() if root_dir is not None else None
        self.identity_provider = identity_provider
        self.track_name = self.track or None
        self.track_spec = spec.load_track(self.track_name, self.tracks_file or None)
        self.track_name = self.track_spec.name
        if not self.submission_path:
            self.submission_path = f"assessment/{self.track_spec.submission_file}"
        home = store.scalelab_home() / "assess"
        if not (self.jobs_dir and self.database_url):  # a default lives there
            home.mkdir(mode=0o700, parents=True, exist_ok=True)
            home.chmod(0o700)  # the queue's database holds every student's verdicts: not for other accounts
        self.jobs_root = Path(self.jobs_dir) if self.jobs_dir else home / "jobs"
        self.jobs_root.mkdir(parents=True, exist_ok=True)
        self.jobs_root.chmod(0o700)  # students' files and grader output: not for other accounts
        self.queue = AssessQueue(self.database_url or sqlite_url(home / "queue.db"))
        self.slot_count = self.slots if self.slots > 0 else _slots_for_machine(self.track_spec)
        self.retention = JobRetention(self.jobs_root, keep_jobs_per_student=self.keep_jobs_per_student,
                                      disk_quota_bytes_per_student=self.disk_quota_bytes_per_student)
        self.workers = GradingWorkers(self.queue, GraderSettings(
            track=self.track_name, track_file=self.tracks_file or None, backend=self.backend,
            allow_unsandboxed=self.allow_unsandboxed, poll_interval_s=self.poll_interval_s),
            slots=self.slot_count, log=self.log, retention=self.retention)
        self._private_texts = _private_text_patterns(self.jobs_root, store.scalelab_home())
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
        """Clean stop: running jobs go back to the front of the queue (graded again from scratch at the next start,
        never by halves), queued ones wait."""
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
        if self.root_dir is None:
            raise SubmissionProblem(400, f"This Assess service reads no files: send the content of your "
                                         f"{self.track_spec.submission_file} with the request (the Assess panel "
                                         f"does).")
        relative = self.submission_path.format(student=safe_student_name(student))
        # Normalized, not resolved: links in the student's part of the path are refused when it is read.
        path = Path(os.path.normpath(self.root_dir / relative))
        if not path.is_relative_to(self.root_dir) or path == self.root_dir:
            raise SubmissionProblem(400, f"the configured submission path {relative} is outside the server's "
                                         f"root directory; ask your instructor to fix the Assess service.")
        return path

    def read_submission(self, source: Path) -> bytes:
        """The student's file, opened without following links, one path component at a time below the root.

        The server's account may read more than the student (other students' files, the grader's state): a
        link would have it copy such a file and grade it. Only a plain file under the size limit is read.
        """
        shown = source.relative_to(self.root_dir)
        limit = SUBMISSION_SIZE_LIMIT_BYTES
        *folders, name = shown.parts
        try:
            directory = os.open(self.root_dir, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            raise _missing(shown) from None
        try:
            for depth, folder in enumerate(folders, start=1):
                inner = _open_below(directory, folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, shown,
                                    Path(*shown.parts[:depth]))
                os.close(directory)
                directory = inner
            # O_NONBLOCK: a named pipe must not hang the request; it is refused just below.
            descriptor = _open_below(directory, name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, shown, shown)
        finally:
            os.close(directory)
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            os.close(descriptor)
            raise SubmissionProblem(400, f"{shown} is not a plain file; save your script as a plain file "
                                         f"{shown} and click Assess again.")
        with os.fdopen(descriptor, "rb") as stream:
            content = stream.read(limit + 1)  # bounded: the file may have grown since fstat
        size = max(status.st_size, len(content))
        if size > limit:
            raise SubmissionProblem(400, f"{shown} is {size} bytes, over the {limit} byte limit for a submission.")
        return content

    def submit(self, student: str) -> tuple[dict, bool]:
        """Copy the student's file into a new job directory and queue it (or return the active job)."""
        source = self.submission_file(student)
        shown = source.relative_to(self.root_dir)
        # The copy, made now, is what gets graded: later edits do not change a queued job.
        content = self.read_submission(source)
        return self.submit_content(student, content, shown=str(shown), origin=str(source))

    def submit_content(self, student: str, content: bytes, shown: str = "assessment.py",
                       origin: str | None = None, *, pause: bool = True) -> tuple[dict, bool]:
        """Queue ``content`` as the student's submission (or return the student's active job).

        ``shown`` names the file in messages to the student; ``origin`` is recorded as where it came from. What
        cannot be a submission at all (empty, binary, not UTF-8) is refused by ``check_submission_file``.
        ``pause=False`` (an instructor's regrade) skips the pause between a student's submissions."""
        limit = SUBMISSION_SIZE_LIMIT_BYTES
        if len(content) > limit:
            raise SubmissionProblem(413, f"{shown} is {len(content)} bytes, over the {limit} byte limit for a "
                                         f"submission; make it smaller and click Assess again.")
        job_dir = self.jobs_root / uuid.uuid4().hex
        job_dir.mkdir(mode=0o700)
        try:
            copy = job_dir / "assessment.py"
            with open_private(copy, "xb") as private_copy:
                private_copy.write(content)
            try:
                check_submission_file(copy)
            except NotASubmission as error:
                raise SubmissionProblem(400, f"{shown} cannot be assessed: "
                                             f"{str(error).replace(str(copy), 'the file')}.") from None
            job, created = self.queue.submit(
                student=student, track=self.track_name, backend=self.backend, job_dir=job_dir,
                submission_path=origin or shown, submission_sha256=hashlib.sha256(content).hexdigest(),
                max_queued=self.max_queued,
                min_seconds_between_submissions=self.min_seconds_between_submissions if pause else 0.0)
        except TooSoon as too_soon:
            shutil.rmtree(job_dir, ignore_errors=True)
            wait_s = max(1, math.ceil(too_soon.wait_s))
            raise SubmissionProblem(429, (
                f"Please wait {wait_s} more second{'s' if wait_s != 1 else ''} before clicking Assess again: "
                f"each student may submit once every {too_soon.min_seconds_between_submissions:g} seconds."),
                retry_after_s=wait_s) from None
        except QueueFull as full:
            shutil.rmtree(job_dir, ignore_errors=True)
            raise SubmissionProblem(503, f"The Assess queue is full ({full.args[0]} submissions are waiting); "
                                         f"try again in a few minutes.") from None
        except BaseException:
            shutil.rmtree(job_dir, ignore_errors=True)
            raise
        if created:
            self.workers.wake()
            self._prune(student)
        else:
            shutil.rmtree(job_dir, ignore_errors=True)
        return self.public_view(job), created

    def _prune(self, student: str) -> None:
        try:
            self.retention.prune(self.queue, student)
        except Exception as error:  # the job is queued; old directories can wait for the next chance
            self.log.warning("scalelab assess: could not prune the job directories of %s: %s", student, error)

    def job(self, student: str, job_id: int) -> dict | None:
        job = self.queue.get(job_id)
        if job is None or job["student"] != student:  # another student's job does not exist for this one
            return None
        return self.public_view(job)

    def history(self, student: str) -> list[dict]:
        return [self.public_view(job, with_position=False) for job in self.queue.history(student)]

    def public_view(self, job: dict, with_position: bool = True) -> dict:
        """What a student may see of a job: allow-listed fields, with server paths and host name masked."""
        view = {key: job[key] for key in JOB_FIELDS_FOR_STUDENTS}
        view["time_budget_s"] = self.track_spec.time_budget_s if job["track"] == self.track_name else None
        view["position"] = self.queue.position(job["id"]) if with_position and job["state"] == QUEUED else None
        progress = job["progress"] if job["state"] in (RUNNING, DONE, INTERRUPTED) else None
        view["progress"] = _allowed(progress, PROGRESS_FIELDS_FOR_STUDENTS)
        view["progress_history"] = [_allowed(point, PROGRESS_POINT_FIELDS_FOR_STUDENTS)
                                    for point in job["progress_history"] if isinstance(point, dict)]
        view["verdict"] = _allowed(job["verdict"], VERDICT_FIELDS_FOR_STUDENTS) if job["state"] == DONE else None
        return _masked(view, self._private_texts)

    def board(self, student: str) -> dict:
        """The class board as ``student`` sees it (see grader/board.py)."""
        return board.student_view(self.queue.all_jobs(), student, self.board_names)

    def describe(self) -> dict:
        return {"track": self.track_name, "dataset": self.track_spec.dataset,
                "target_accuracy": self.track_spec.target_accuracy, "time_budget_s": self.track_spec.time_budget_s,
                "slots": self.slot_count, "backend": self.backend, "max_queued": self.max_queued,
                "submission_path": (self.submission_path if self.root_dir is not None
                                    else self.track_spec.submission_file),
                # the file's name, for the panel to show (and, under the Hub, to send)
                "submission_file": (Path(self.submission_path).name if self.root_dir is not None
                                    else self.track_spec.submission_file),
                "framework": self.track_spec.framework,
                "min_seconds_between_submissions": self.min_seconds_between_submissions,
                "counts": self.queue.counts()}


def _missing(shown: Path) -> SubmissionProblem:
    return SubmissionProblem(404, f"There is no {shown} to assess: save your script as {shown} (next to the "
                                  f"assessment notebook) and click Assess again.")


def _open_below(directory: int, name: str, flags: int, shown: Path, opened: Path) -> int:
    """``os.open(name, flags, dir_fd=directory)``, its failure turned into a sentence for the student."""
    try:
        return os.open(name, flags, dir_fd=directory)
    except OSError as error:
        try:
            is_link = stat.S_ISLNK(os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode)
        except OSError:
            is_link = False
        if is_link:
            raise SubmissionProblem(400, f"{opened} is a link; save your script as a plain file {shown} (not a "
                                         f"link, nor in a linked folder) and click Assess again.") from None
        if error.errno in (errno.ENOENT, errno.ENOTDIR):
            raise _missing(shown) from None
        raise SubmissionProblem(400, f"{shown} cannot be read ({error.strerror}); save your script as a plain "
                                     f"file {shown} that you can read and click Assess again.") from None


def _allowed(record: dict | None, fields: tuple[str, ...]) -> dict | None:
    if not isinstance(record, dict):
        return None
    return {key: record[key] for key in fields if key in record}


def _private_text_patterns(jobs_root: Path, scalelab_home: Path) -> list[tuple[re.Pattern, str]]:
    """Server paths (as given and resolved, longest first) and the host name, with what a student sees instead."""
    paths = {}
    for path, placeholder in ((scalelab_home, "<scalelab home>"), (jobs_root, "<assess jobs>")):
        for form in {str(path), str(Path(path).resolve())}:
            if form not in ("", "/", "."):
                paths[form] = placeholder
    patterns = [(re.compile(re.escape(form)), paths[form]) for form in sorted(paths, key=len, reverse=True)]
    host = socket.gethostname()
    if host:
        patterns.append((re.compile(rf"(?<![\w.-]){re.escape(host)}(?![\w-])"), "<server>"))
    return patterns


def _masked(value, patterns: list[tuple[re.Pattern, str]]):
    """``value`` with every string in it (keys included) stripped of the server's private text."""
    if isinstance(value, str):
        for pattern, placeholder in patterns:
            value = pattern.sub(placeholder, value)
        return value
    if isinstance(value, dict):
        return {_masked(key, patterns): _masked(item, patterns) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_masked(item, patterns) for item in value]
    return value


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
            send_problem(self, problem)
            return
        self.set_status(201 if created else 200)
        self.finish({"job": job, "created": created})


def send_problem(handler: web.RequestHandler, problem: SubmissionProblem) -> None:
    """The refusal as the API's error JSON (``message``, ``reason``), with ``Retry-After`` when there is one."""
    if problem.retry_after_s is None:
        raise web.HTTPError(problem.status, str(problem)) from None
    # Written here: send_error would drop the Retry-After header.
    handler.set_status(problem.status)
    handler.set_header("Retry-After", str(problem.retry_after_s))
    handler.finish({"message": str(problem), "reason": None})


class BoardHandler(AssessHandler):
    @web.authenticated
    async def get(self):
        self.finish(await self.blocking(self.service.board, self.student))


class AssessmentHandler(AssessHandler):
    @web.authenticated
    async def get(self, job_id: str):
        # More digits than any id has never name a job (and Python refuses to convert thousands of them).
        job = (await self.blocking(self.service.job, self.student, int(job_id))
               if len(job_id) <= len(str(MAX_JOB_ID)) else None)
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
    # SIGTERM) is where running jobs are re-queued. A kill -9 is settled by the next start instead.
    atexit.register(service.stop)
    base = url_path_join(serverapp.base_url, API_PREFIX)
    serverapp.web_app.settings[SERVICE_SETTINGS_KEY] = service
    serverapp.web_app.add_handlers(".*$", [
        (url_path_join(base, "service"), ServiceHandler),
        (url_path_join(base, "assessments"), AssessmentsHandler),
        (url_path_join(base, r"assessments/([0-9]+)"), AssessmentHandler),
        (url_path_join(base, "board"), BoardHandler),
    ])
    serverapp.log.info("scalelab assess service at %s", base)


# Older jupyter_server/notebook names for the same hooks.
load_jupyter_server_extension = _load_jupyter_server_extension
