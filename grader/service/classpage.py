"""The instructor's view of the class, in the Hub service (``hub.py``), under ``/services/scalelab/``:

- ``GET  class``              one row per student: attempts, latest and best verdict, the best run's held-out
                              accuracy and wall time, when they last submitted; ``?sort=<column>&order=asc|desc``
- ``GET  class.csv``          the same rows, as a CSV attachment
- ``GET  class/jobs/<id>``    one run: its verdict, reasons and notes, the submitted script, and the tail of each
                              rank's log
- ``POST class/regrade``      ``student=<name>`` (repeatable) or ``all=1``: each student's latest submitted script,
                              queued again like any job (JSON with ``Accept: application/json``, else a page)

Instructors are the members of the Hub group ``instructors`` (``scalelab class add-instructor``), as the Hub's user
model says; anyone else gets 403 with a sentence. A browser's form carries the service's ``_xsrf`` token; a request
with an API token needs none. The pages run no script (their Content-Security-Policy forbids any), and everything
a student or a run wrote is escaped.

Rows come from the queue (every job and its verdict) and, for students who have logged in but never submitted,
from the Hub's user list (the service's role in ``register()``). A regrade copies the script kept in the latest
job's directory (checked against the hash recorded at submission); it does not count as an attempt.
"""

from __future__ import annotations

import csv
import hashlib
import html
import io
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from jupyterhub.utils import url_path_join
from tornado import web
from tornado.httpclient import AsyncHTTPClient, HTTPClientError
from tornado.httputil import url_concat

from .. import board, jobfiles
from ..classroom.accounts import HUB_INSTRUCTORS_GROUP
from ..pipeline import SUBMISSION_SIZE_LIMIT_BYTES
from ..queue import ACTIVE_STATES, DONE, MAX_JOB_ID
from ..serve import AssessService, SubmissionProblem
from ..workers import utc_iso
from .handlers import SERVICE_PREFIX_KEY, ServiceHandler

# Best first; a verdict not listed comes after these.
VERDICT_ORDER = ("pass", "fail", "timeout", "error")
# Recorded as a regrade job's origin; such a job is not one of the student's attempts.
REGRADE_ORIGIN = "regrade of job "
LOG_TAIL_BYTES = 64 << 10
GRADER_STDERR_TAIL_BYTES = 16 << 10
MAX_LOGS_SHOWN = 33  # launcher.log and 32 ranks
LOG_NAME = re.compile(r"(launcher|rank-(\d{1,4}))\.log")
CSV_COLUMNS = ("student", "attempts", "regrades", "latest_job", "latest_state", "latest_verdict",
               "latest_submitted_at", "best_job", "best_verdict", "best_heldout_accuracy", "best_wall_time_s",
               "best_finished_at", "best_time_to_accuracy_s", "board_rank")
# A spreadsheet takes a cell starting with these for a formula.
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
USERS_PAGE_LIMIT = 200
PAGINATION_MEDIA_TYPE = "application/jupyterhub-pagination+json"
# Nothing on these pages runs a script, whatever a run printed.
CONTENT_SECURITY_POLICY = ("default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; "
                           "frame-ancestors 'none'; base-uri 'none'")


# --- the rows ---------------------------------------------------------------------------------------------------

@dataclass
class StudentRow:
    student: str
    attempts: int = 0
    regrades: int = 0
    latest: dict | None = None  # the newest job, whatever its state
    best: dict | None = None  # the best finished job (see merit)
    jobs: list[dict] = field(default_factory=list)
    place: board.Place | None = None  # on the class board (passes only, by best time to accuracy)


def run_summary(job: dict) -> dict:
    """What the class page shows of a job."""
    verdict = job["verdict"] if job["state"] == DONE and isinstance(job["verdict"], dict) else {}
    return {"id": job["id"], "state": job["state"], "verdict": verdict.get("verdict"),
            "heldout_accuracy": verdict.get("heldout_accuracy"), "wall_time_s": verdict.get("wall_time_s"),
            "time_to_accuracy_s": board.time_to_accuracy(verdict) if job["state"] == DONE else None,
            "submitted_at": job["submitted_at"], "finished_at": job["finished_at"],
            "regrade": (job["submission_path"] or "").startswith(REGRADE_ORIGIN)}


def merit(run: dict) -> tuple:
    """Smaller is better: pass before fail before timeout before error; a pass with a shorter time to accuracy,
    a more accurate other verdict, then the newer run."""
    verdict = run["verdict"]
    order = VERDICT_ORDER.index(verdict) if verdict in VERDICT_ORDER else len(VERDICT_ORDER)
    if verdict == "pass":
        second = run["time_to_accuracy_s"] if run.get("time_to_accuracy_s") is not None else math.inf
    else:
        second = -run["heldout_accuracy"] if run["heldout_accuracy"] is not None else math.inf
    return order, second, -run["id"]


def class_rows(jobs: list[dict], hub_students: list[str] | None = None) -> list[StudentRow]:
    """One row per student of ``jobs`` (the queue's, oldest first) and of ``hub_students``, by name."""
    rows = {name: StudentRow(name) for name in hub_students or ()}
    for job in jobs:
        row = rows.setdefault(job["student"], StudentRow(job["student"]))
        run = run_summary(job)
        row.jobs.append(run)
        if run["regrade"]:
            row.regrades += 1
        else:
            row.attempts += 1
        if row.latest is None or run["id"] > row.latest["id"]:
            row.latest = run
        if run["verdict"] is not None and (row.best is None or merit(run) < merit(row.best)):
            row.best = run
    for place in board.standings(jobs):
        rows[place.student].place = place
    return [rows[name] for name in sorted(rows)]


def _latest_verdict_order(row: StudentRow):
    if row.latest is None:
        return None
    verdict = row.latest["verdict"] or row.latest["state"]
    return VERDICT_ORDER.index(verdict) if verdict in VERDICT_ORDER else len(VERDICT_ORDER)


# column → (heading, key of a row; None sorts last whatever the order)
COLUMNS = {
    "student": ("Student", lambda row: row.student),
    "attempts": ("Attempts", lambda row: row.attempts),
    "latest": ("Latest verdict", _latest_verdict_order),
    "best": ("Best verdict", lambda row: merit(row.best) if row.best else None),
    "rank": ("Board", lambda row: row.place and row.place.rank),
    "time_to_accuracy": ("Time to accuracy (best pass)", lambda row: row.place and row.place.time_to_accuracy_s),
    "accuracy": ("Held-out accuracy (best run)", lambda row: row.best and row.best["heldout_accuracy"]),
    "wall_time": ("Wall time (best run)", lambda row: row.best and row.best["wall_time_s"]),
    "when": ("Last submitted", lambda row: row.latest and row.latest["submitted_at"]),
}


def sorted_rows(rows: list[StudentRow], column: str, descending: bool) -> list[StudentRow]:
    key = COLUMNS[column][1]
    known = [row for row in rows if key(row) is not None]
    unknown = [row for row in rows if key(row) is None]
    known.sort(key=lambda row: row.student)
    known.sort(key=key, reverse=descending)  # stable: equal keys stay in name order either way
    return known + unknown


def csv_text(rows: list[StudentRow]) -> str:
    def cell(value):
        if isinstance(value, str) and value.startswith(FORMULA_START):
            return "'" + value
        return "" if value is None else value

    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(CSV_COLUMNS)
    for row in rows:
        latest, best = row.latest or {}, row.best or {}
        writer.writerow([cell(value) for value in (
            row.student, row.attempts, row.regrades, latest.get("id"), latest.get("state"), latest.get("verdict"),
            utc_iso(latest.get("submitted_at")), best.get("id"), best.get("verdict"),
            best.get("heldout_accuracy"), best.get("wall_time_s"), utc_iso(best.get("finished_at")),
            row.place.time_to_accuracy_s if row.place else None, row.place.rank if row.place else None)])
    return out.getvalue()


# --- the Hub's students -----------------------------------------------------------------------------------------

async def hub_students(api_url: str, api_token: str) -> list[str]:
    """The Hub's users outside the group ``instructors`` (the service's token must list users and read their
    names and groups); raises ``OSError`` with a sentence when the Hub does not tell."""
    client = AsyncHTTPClient()
    names, offset = [], 0
    while True:
        url = url_concat(url_path_join(api_url, "users"), {"offset": offset, "limit": USERS_PAGE_LIMIT})
        try:
            response = await client.fetch(url, headers={"Authorization": f"token {api_token}",
                                                        "Accept": PAGINATION_MEDIA_TYPE}, request_timeout=20)
        except HTTPClientError as error:
            if error.code == 599:  # tornado's code for no answer at all
                raise OSError(f"the Hub did not answer ({error.message})") from None
            raise OSError(f"the Hub refused to list its users ({error.code}): the service needs the scopes "
                          f"list:users, read:users:name and read:users:groups (register() gives them)") from None
        except OSError as error:
            raise OSError(f"the Hub did not answer ({error})") from None
        page = json.loads(response.body)
        for user in page["items"]:
            if HUB_INSTRUCTORS_GROUP not in (user.get("groups") or []):
                names.append(user["name"])
        pagination = page["_pagination"]
        if not pagination.get("next") or not page["items"]:
            return names
        offset = pagination["offset"] + len(page["items"])


# --- regrading --------------------------------------------------------------------------------------------------

def regrade(service: AssessService, students: list[str], instructor: str) -> list[dict]:
    """Queue each student's latest submitted script again; one outcome per student, with a sentence."""
    return [_regrade_one(service, student, instructor) for student in students]


def _regrade_one(service: AssessService, student: str, instructor: str) -> dict:
    outcome = {"student": student, "job": None, "regrade_of": None}
    history = service.queue.history(student, limit=1)
    if not history:
        return {**outcome, "outcome": "nothing", "message": f"{student} has submitted nothing to regrade."}
    latest = history[0]
    outcome["regrade_of"] = latest["id"]
    if latest["state"] in ACTIVE_STATES:
        return {**outcome, "outcome": "active", "job": latest["id"],
                "message": f"{student}'s job {latest['id']} is {latest['state']}: it is graded as it is, and "
                           f"nothing more is queued."}
    try:
        content = jobfiles.read_regular_file(Path(latest["job_dir"]), "assessment.py", owner_uid=os.geteuid(),
                                             limit_bytes=SUBMISSION_SIZE_LIMIT_BYTES)
    except jobfiles.UntrustedFile as error:
        return {**outcome, "outcome": "missing",
                "message": f"the script of {student}'s job {latest['id']} is no longer kept ({error}); ask "
                           f"{student} to click Assess again."}
    if hashlib.sha256(content).hexdigest() != latest["submission_sha256"]:
        return {**outcome, "outcome": "missing",
                "message": f"the script kept for {student}'s job {latest['id']} is not the one submitted (its "
                           f"hash differs); nothing was queued."}
    try:
        job, created = service.submit_content(student, content, origin=f"{REGRADE_ORIGIN}{latest['id']} by "
                                                                      f"{instructor}", pause=False)
    except SubmissionProblem as problem:
        return {**outcome, "outcome": "refused", "message": f"{student}: {problem}"}
    if not created:  # the student clicked Assess meanwhile
        return {**outcome, "outcome": "active", "job": job["id"],
                "message": f"{student}'s job {job['id']} is {job['state']}: nothing more is queued."}
    return {**outcome, "outcome": "queued", "job": job["id"],
            "message": f"job {job['id']} queued for {student}: the script of job {latest['id']}, graded again."}


# --- one job, as an instructor sees it ----------------------------------------------------------------------------

def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def job_files(job: dict) -> dict:
    """The submitted script and the tails of the run's logs, read without following links (the run wrote some
    of the job directory's names); a file that cannot be read is a sentence instead."""
    root, owner = Path(job["job_dir"]), os.geteuid()
    try:
        source = _text(jobfiles.read_regular_file(root, "assessment.py", owner_uid=owner,
                                                  limit_bytes=SUBMISSION_SIZE_LIMIT_BYTES))
    except jobfiles.UntrustedFile as error:
        source = None
        source_problem = f"not kept ({error}): older job directories are removed beyond the retention limits."
    else:
        source_problem = None
    names = [name for name in jobfiles.list_folder(root, "grader/logs") if LOG_NAME.fullmatch(name)]
    names.sort(key=lambda name: (name == "launcher.log", int(LOG_NAME.fullmatch(name).group(2) or 0)))
    logs = []
    for name in names[:MAX_LOGS_SHOWN]:
        logs.append(_tail(root, f"grader/logs/{name}", name, owner, LOG_TAIL_BYTES))
    if job["state"] != "queued":
        stderr = _tail(root, "grader.stderr", "grader.stderr (the grader's own messages)", owner,
                       GRADER_STDERR_TAIL_BYTES)
        if stderr["text"] or stderr["problem"]:
            logs.append(stderr)
    return {"source": source, "source_problem": source_problem, "logs": logs}


def _tail(root: Path, relative: str, title: str, owner: int, limit: int) -> dict:
    try:
        data, skipped = jobfiles.read_tail(root, relative, owner_uid=owner, limit_bytes=limit)
    except jobfiles.UntrustedFile as error:
        return {"title": title, "text": "", "skipped": 0, "problem": str(error)}
    return {"title": title, "text": _text(data), "skipped": skipped, "problem": None}


# --- HTML -----------------------------------------------------------------------------------------------------

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; } th, td { border: 1px solid #ccc; padding: .3em .6em; text-align: left; }
th a { color: inherit; } td.number { text-align: right; font-variant-numeric: tabular-nums; }
.pass { color: #176f2c; font-weight: 600; } .fail, .timeout, .error { color: #a4161a; font-weight: 600; }
pre { background: #f6f6f6; padding: .6em; overflow-x: auto; white-space: pre-wrap; max-width: 110em; }
form.inline { display: inline; margin: 0; } .muted { color: #666; }
"""


def escape(value) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def page(title: str, body: str) -> str:
    return (f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{escape(title)}</title>"
            f"<style>{STYLE}</style></head><body>{body}</body></html>")


def _verdict_cell(run: dict | None, jobs_url: str) -> str:
    if run is None:
        return '<span class="muted">none</span>'
    shown = run["verdict"] or run["state"]
    regrade = " (regrade)" if run["regrade"] else ""
    return (f'<a class="{escape(shown)}" href="{escape(url_path_join(jobs_url, str(run["id"])))}">'
            f'{escape(shown)}</a> <span class="muted">#{run["id"]}{regrade}</span>')


def _number(value, digits: int, unit: str = "") -> str:
    return "" if value is None else f"{value:.{digits}f}{unit}"


def _when(unix_seconds) -> str:
    shown = utc_iso(unix_seconds)
    return "" if shown is None else shown.replace("T", " ").replace("+00:00", " UTC")


def _regrade_form(action: str, xsrf: str, fields: dict, label: str) -> str:
    hidden = "".join(f'<input type="hidden" name="{escape(name)}" value="{escape(value)}">'
                     for name, value in {"_xsrf": xsrf, **fields}.items())
    return f'<form class="inline" method="post" action="{escape(action)}">{hidden}<button>{escape(label)}</button></form>'


def curve_svg(points: list, track, width: int = 120, height: int = 28) -> str:
    """A small inline SVG of held-out accuracy against the grader's time (0 to the budget, 0 to 1), with the
    target as a dashed line; empty without points. Numbers only: nothing a run wrote reaches the markup."""
    points = [(float(at_s), float(accuracy)) for at_s, accuracy in points][:64]
    if not points:
        return ""
    budget = float(track.time_budget_s) or 1.0

    def x(at_s):
        return round(min(max(at_s / budget, 0.0), 1.0) * width, 1)

    def y(accuracy):
        return round((1.0 - min(max(accuracy, 0.0), 1.0)) * height, 1)
    line = " ".join(f"{x(at_s)},{y(accuracy)}" for at_s, accuracy in points)
    target = y(track.target_accuracy)
    return (f'<svg class="curve" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">'
            f'<title>held-out accuracy per snapshot</title>'
            f'<line x1="0" y1="{target}" x2="{width}" y2="{target}" stroke="grey" stroke-dasharray="3,2"/>'
            f'<polyline points="{line}" fill="none" stroke="green"/></svg>')


def class_page(rows: list[StudentRow], *, service: AssessService, prefix: str, column: str, descending: bool,
               xsrf: str, instructor: str, hub_problem: str | None) -> str:
    class_url = url_path_join(prefix, "class")
    jobs_url = url_path_join(class_url, "jobs")
    regrade_url = url_path_join(class_url, "regrade")
    track = service.track_spec
    headings = []
    for name, (heading, _key) in COLUMNS.items():
        flip = "asc" if name == column and descending else ("desc" if name == column else "asc")
        arrow = (" ▼" if descending else " ▲") if name == column else ""
        link = url_concat(class_url, {"sort": name, "order": flip})
        headings.append(f'<th><a href="{escape(link)}">{escape(heading)}</a>{arrow}</th>')
    body_rows = []
    for row in rows:
        best = row.best or {}
        attempts = f"{row.attempts}" + (f' <span class="muted">+{row.regrades} regrade</span>' if row.regrades else "")
        action = (_regrade_form(regrade_url, xsrf, {"student": row.student}, "Regrade")
                  if row.latest is not None else "")
        body_rows.append(
            f"<tr><td>{escape(row.student)}</td><td class=number>{attempts}</td>"
            f"<td>{_verdict_cell(row.latest, jobs_url)}</td><td>{_verdict_cell(row.best, jobs_url)}</td>"
            f"<td class=number>{row.place.rank if row.place else ''}</td>"
            f"<td class=number>{_number(row.place and row.place.time_to_accuracy_s, 1, ' s')} "
            f"{curve_svg(row.place.curve, track) if row.place else ''}</td>"
            f"<td class=number>{_number(best.get('heldout_accuracy'), 4)}</td>"
            f"<td class=number>{_number(best.get('wall_time_s'), 0, ' s')}</td>"
            f"<td>{escape(_when(row.latest and row.latest['submitted_at']))}</td><td>{action}</td></tr>")
    note = (f'<p class="muted">Students who logged in but never submitted are not listed: {escape(hub_problem)}.</p>'
            if hub_problem else "")
    csv_url = url_path_join(prefix, "class.csv")
    body = (
        f"<h1>Class: {escape(track.name)}</h1>"
        f"<p>Target held-out accuracy {track.target_accuracy:.2f} within {track.time_budget_s:.0f} s. "
        f"{len(rows)} students. Signed in as {escape(instructor)}. <a href=\"{escape(csv_url)}\">Download CSV</a> "
        f"{_regrade_form(regrade_url, xsrf, {'all': '1'}, 'Regrade all')}</p>{note}"
        f"<table><thead><tr>{''.join(headings)}<th></th></tr></thead><tbody>{''.join(body_rows)}</tbody></table>"
        f'<p class="muted">Best: a pass before a fail, a timeout, an error; the pass with the shortest time to '
        f"accuracy (when the grader saw the first snapshot at the target), else the most accurate run. The board "
        f"ranks passes by that time; each curve is the best pass's held-out accuracy per snapshot, as the grader "
        f"measured it (the dashed line is the target). Held-out accuracy and wall time are the best run's. Regrade queues the student's latest submitted "
        f"script again, like any job; it is not counted as an attempt.</p>")
    return page(f"Class: {track.name}", body)


def job_page(job: dict, files: dict, prefix: str) -> str:
    verdict = job["verdict"] if isinstance(job["verdict"], dict) else {}
    facts = [("Student", job["student"]), ("State", job["state"]), ("Verdict", verdict.get("verdict")),
             ("Track", job["track"]), ("Origin", job["submission_path"]),
             ("Submitted", _when(job["submitted_at"])), ("Started", _when(job["started_at"])),
             ("Finished", _when(job["finished_at"])),
             ("Held-out accuracy", _number(verdict.get("heldout_accuracy"), 4)),
             ("Target accuracy", _number(verdict.get("target_accuracy"), 4)),
             ("Wall time", _number(verdict.get("wall_time_s"), 1, " s")),
             ("Time budget", _number(verdict.get("time_budget_s"), 0, " s")),
             ("Ranks", verdict.get("np")), ("Ranks seen allreducing", verdict.get("ranks_seen")),
             ("Allreduces", verdict.get("allreduce_count")), ("Epochs seen", verdict.get("epochs_seen")),
             ("Exit status", verdict.get("exit_code")), ("Sandboxed", verdict.get("sandboxed")),
             ("Submission SHA-256", job["submission_sha256"]), ("Interrupted", job["reason"])]
    table = "".join(f"<tr><th>{escape(name)}</th><td>{escape(value)}</td></tr>"
                    for name, value in facts if value not in (None, "", []))
    reasons = "".join(f"<pre>{escape(reason)}</pre>" for reason in verdict.get("reasons") or [])
    notes = "".join(f"<li>{escape(note)}</li>" for note in verdict.get("notes") or [])
    sections = [f"<h2>Reasons</h2>{reasons or '<p class=muted>none yet</p>'}"]
    if notes:
        sections.append(f"<h2>Notes</h2><ul>{notes}</ul>")
    for log in files["logs"]:
        if log["problem"]:
            shown = f'<p class="muted">{escape(log["problem"])}</p>'
        else:
            skipped = (f'<p class="muted">The first {log["skipped"]} bytes are not shown; the last '
                       f"{len(log['text'].encode())} are.</p>" if log["skipped"] else "")
            shown = f"{skipped}<pre>{escape(log['text']) or '(empty)'}</pre>"
        sections.append(f"<h2>{escape(log['title'])}</h2>{shown}")
    if not any(log["title"].endswith(".log") for log in files["logs"]):
        sections.append('<p class="muted">No rank logs: the run was not launched (or its directory was removed).'
                        "</p>")
    source = (f"<pre>{escape(files['source'])}</pre>" if files["source"] is not None
              else f'<p class="muted">{escape(files["source_problem"])}</p>')
    sections.append(f"<h2>Submitted script</h2>{source}")
    back = url_path_join(prefix, "class")
    body = (f'<p><a href="{escape(back)}">← Class</a></p><h1>Job {job["id"]} of {escape(job["student"])}</h1>'
            f"<table>{table}</table>{''.join(sections)}")
    return page(f"Job {job['id']} of {job['student']}", body)


def regrade_page(outcomes: list[dict], prefix: str) -> str:
    items = "".join(f"<li>{escape(outcome['message'])}</li>" for outcome in outcomes)
    back = url_path_join(prefix, "class")
    return page("Regrade", f"<h1>Regrade</h1><ul>{items or '<li>Nobody to regrade.</li>'}</ul>"
                           f'<p><a href="{escape(back)}">← Class</a></p>')


# --- handlers ---------------------------------------------------------------------------------------------------

class InstructorPage(ServiceHandler):
    """A page of the class view: HTML (errors too), instructors only."""

    def set_default_headers(self):
        self.set_header("Content-Type", "text/html; charset=UTF-8")
        self.set_header("Cache-Control", "no-store")
        self.set_header("X-Content-Type-Options", "nosniff")
        self.set_header("Content-Security-Policy", CONTENT_SECURITY_POLICY)

    def write_error(self, status_code, **kwargs):
        error = kwargs.get("exc_info", (None, None))[1]
        message = error.log_message if isinstance(error, web.HTTPError) and error.log_message else self._reason
        if status_code == 401:
            self.set_header("WWW-Authenticate", 'token realm="JupyterHub"')
        self.set_header("Content-Type", "text/html; charset=UTF-8")
        self.finish(page(f"{status_code} {self._reason}", f"<h1>{status_code} {escape(self._reason)}</h1>"
                                                          f"<p>{escape(message)}</p>"))

    @property
    def prefix(self) -> str:
        return self.settings[SERVICE_PREFIX_KEY]

    @property
    def instructor(self) -> str:
        """The Hub user making the request, if an instructor; else 401/403 with a sentence."""
        name = self.student  # 401 or 403 without credentials the Hub accepts, 403 for a service
        groups = self.current_user.get("groups")
        if groups is None:
            raise web.HTTPError(403, f"The Hub did not say which groups {name} is in, so the class page cannot "
                                     f"tell an instructor; log in to the Hub again.")
        if HUB_INSTRUCTORS_GROUP not in groups:
            raise web.HTTPError(403, f"{name} is not an instructor: the class page is for the Hub group "
                                     f"'{HUB_INSTRUCTORS_GROUP}' only (scalelab class add-instructor).")
        return name

    def check_sender(self) -> None:
        _ = self.instructor

    async def rows(self) -> tuple[list[StudentRow], str | None]:
        try:
            students = await hub_students(self.hub_auth.api_url, self.hub_auth.api_token)
            problem = None
        except OSError as error:
            students, problem = None, str(error)
            self.service.log.warning("scalelab class page: %s", problem)
        jobs = await self.blocking(self.service.queue.all_jobs)
        return class_rows(jobs, students), problem


class ClassHandler(InstructorPage):
    @web.authenticated
    async def get(self):
        instructor = self.instructor
        column = self.get_query_argument("sort", "student")
        if column not in COLUMNS:
            raise web.HTTPError(400, f"sort must be one of {', '.join(COLUMNS)}, not {column!r}.")
        descending = self.get_query_argument("order", "asc") == "desc"
        rows, problem = await self.rows()
        self.finish(class_page(sorted_rows(rows, column, descending), service=self.service, prefix=self.prefix,
                               column=column, descending=descending, xsrf=self.xsrf_token.decode("ascii"),
                               instructor=instructor, hub_problem=problem))


class ClassCsvHandler(InstructorPage):
    @web.authenticated
    async def get(self):
        self.instructor
        rows, _problem = await self.rows()
        name = re.sub(r"[^A-Za-z0-9._-]", "_", self.service.track_name)
        self.set_header("Content-Type", "text/csv; charset=UTF-8")
        self.set_header("Content-Disposition", f'attachment; filename="scalelab-class-{name}.csv"')
        self.finish(csv_text(rows))


class JobPageHandler(InstructorPage):
    @web.authenticated
    async def get(self, job_id: str):
        self.instructor
        job = (await self.blocking(self.service.queue.get, int(job_id))
               if len(job_id) <= len(str(MAX_JOB_ID)) else None)
        if job is None:
            raise web.HTTPError(404, f"There is no job {job_id}.")
        files = await self.blocking(job_files, job)
        self.finish(job_page(job, files, self.prefix))


class RegradeHandler(InstructorPage):
    async def post(self):
        await self.read_form()
        instructor = self.instructor
        if self.get_body_argument("all", "") == "1":
            jobs = await self.blocking(self.service.queue.all_jobs)
            students = sorted({job["student"] for job in jobs})
        else:
            students = list(dict.fromkeys(self.get_body_arguments("student")))
            if not students:
                raise web.HTTPError(400, "Say whom to regrade: student=<name> (one or more), or all=1.")
        outcomes = await self.blocking(regrade, self.service, students, instructor)
        for outcome in outcomes:
            self.service.log.info("scalelab class page: %s asked for a regrade: %s", instructor, outcome["message"])
        if any(outcome["outcome"] == "queued" for outcome in outcomes):
            self.set_status(202)
        if "application/json" in self.request.headers.get("Accept", ""):
            self.set_header("Content-Type", "application/json; charset=UTF-8")
            self.finish({"regrades": outcomes})
        else:
            self.finish(regrade_page(outcomes, self.prefix))


def routes(prefix: str) -> list[tuple]:
    return [
        (url_path_join(prefix, "class"), ClassHandler),
        (url_path_join(prefix, "class.csv"), ClassCsvHandler),
        (url_path_join(prefix, r"class/jobs/([0-9]+)"), JobPageHandler),
        (url_path_join(prefix, "class/regrade"), RegradeHandler),
    ]
