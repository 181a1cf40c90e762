"""What every page of the Hub's grader service shares (hub.py's REST API, classpage.py's class view): who is
asking, according to the Hub, before a byte of the body is read; JSON errors; blocking work off the event loop."""

from __future__ import annotations

from jupyterhub.services.auth import HubOAuth, HubOAuthenticated
from tornado import httputil, web
from tornado.ioloop import IOLoop

from ..serve import AssessService

# What a request may carry unless its handler takes more (the class page's regrade form): a submission's JSON is
# the most any page takes (hub.py's AssessmentsHandler).
FORM_BODY_LIMIT_BYTES = 256 << 10
BODY_METHODS = ("POST", "PUT", "PATCH", "DELETE")
# Where the application's settings hold the service and its URL prefix.
SERVICE_SETTINGS_KEY = "scalelab_assess_service"
SERVICE_PREFIX_KEY = "scalelab_service_prefix"


class HubAskedEveryTime(HubOAuth):
    """The Hub is asked about every request's token: one it revoked, or a student it removed, is refused at once
    (JupyterHub's cache would keep answering yes for its age; an age of 0 means for ever)."""

    def user_for_token(self, token, use_cache=True, session_id="", *, sync=True):
        return super().user_for_token(token, use_cache=False, session_id=session_id, sync=sync)


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
