"""Where ``make hub`` serves a class, and the check that refuses a setup that students could turn against it.

Two ways, set by containers/hub/hub.sh's variables:

- **One trusted machine** (``HUB_IP`` on the loopback, no ``HUB_DOMAIN``): the Hub, the grader's pages and every
  student's server share one origin over plain HTTP. A page a student's server answers runs, in the browser of
  whoever opens it, on the Hub's own origin: fine where the users trust each other, never for a class.
- **A class** (``HUB_DOMAIN``, with ``HUB_TLS_CERT`` and ``HUB_TLS_KEY``): one origin per user over HTTPS. The Hub is
  ``https://HUB_DOMAIN``, each user's server ``https://<user>.HUB_DOMAIN``, the grader service
  ``https://scalelab--service.HUB_DOMAIN`` (JupyterHub's ``subdomain_host``), and the Hub's cookies are
  ``__Host-`` cookies (``cookie_host_prefix_enabled``). A student's page then cannot read the class page, the
  Hub's pages or another user's server. The operator needs the name and its wildcard (``*.HUB_DOMAIN``) pointing
  to the server, and a certificate for both.

Serving beyond the loopback (any other ``HUB_IP``) takes the second way; a setup that does not is refused before
anything starts, with a sentence saying what to set.

    python3 grader/classroom/hub_origin.py      (hub.sh, before it installs anything: exit 2 with the sentence)

The standard library only: hub.sh runs it with the system's Python, before the Hub's venv exists.
"""

from __future__ import annotations

import ipaddress
import os
import re
import ssl
import sys
from dataclasses import dataclass

EXIT_UNSAFE_SETUP = 2
# Labels of letters, digits and '-', two at least: a wildcard certificate cannot cover one label's subdomains.
DOMAIN = re.compile(r"^(?=.{1,200}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)+$")
FIX = ("set HUB_DOMAIN to a name whose wildcard (*.NAME) points to this machine too, and HUB_TLS_CERT and "
       "HUB_TLS_KEY to a certificate for NAME and *.NAME and its key (README: \"A class beyond this machine\"); "
       "or keep HUB_IP=127.0.0.1 for one trusted machine")


class UnsafeSetup(Exception):
    """A setup that would let a student's page act as whoever opens it; the message says what to set."""


@dataclass(frozen=True)
class HubOrigin:
    ip: str
    port: int
    domain: str = ""
    tls_cert: str = ""
    tls_key: str = ""

    @classmethod
    def from_environment(cls, environ=os.environ) -> "HubOrigin":
        return cls(ip=environ.get("HUB_IP", "127.0.0.1"), port=int(environ.get("HUB_PORT", "8000")),
                   domain=environ.get("HUB_DOMAIN", "").strip().lower(), tls_cert=environ.get("HUB_TLS_CERT", ""),
                   tls_key=environ.get("HUB_TLS_KEY", ""))

    @property
    def per_user(self) -> bool:
        return bool(self.domain)

    @property
    def subdomain_host(self) -> str:
        """JupyterHub's ``subdomain_host``: the Hub's own origin, under which each user gets a name."""
        return f"https://{self.domain}" + ("" if self.port == 443 else f":{self.port}")

    @property
    def hub_url(self) -> str:
        return self.subdomain_host if self.per_user else f"http://{self.ip}:{self.port}"

    def check(self) -> None:
        """Raise :class:`UnsafeSetup` for a class served beyond the loopback on one origin, or a per-user setup
        that cannot serve (a bad name, a certificate that is missing, does not fit its key or does not cover the
        name and its wildcard)."""
        if not self.per_user:
            if not is_loopback(self.ip):
                raise UnsafeSetup(
                    f"HUB_IP={self.ip} serves the class beyond this machine on one origin: the Hub, the grader's "
                    f"pages and every student's server would share it, so a page a student's server answers could "
                    f"read the class page and act as any instructor who opens it; {FIX}.")
            return
        if not DOMAIN.match(self.domain):
            raise UnsafeSetup(f"HUB_DOMAIN={self.domain} is not a host name of two labels or more (for example "
                              f"class.example.org, or class.localhost on one machine); {FIX}.")
        for variable, path in (("HUB_TLS_CERT", self.tls_cert), ("HUB_TLS_KEY", self.tls_key)):
            if not path or not os.path.isfile(path):
                raise UnsafeSetup(f"HUB_DOMAIN={self.domain} is served over HTTPS, and {variable}="
                                  f"{path or '(unset)'} is not a file; {FIX}.")
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(self.tls_cert, self.tls_key)
            names = certificate_names(self.tls_cert)
        except (ssl.SSLError, OSError, ValueError) as error:
            raise UnsafeSetup(f"HUB_TLS_CERT={self.tls_cert} and HUB_TLS_KEY={self.tls_key} are not a certificate "
                              f"and its key ({error}); {FIX}.") from None
        missing = [name for name in (self.domain, f"*.{self.domain}") if name not in names]
        if missing:
            raise UnsafeSetup(f"the certificate HUB_TLS_CERT={self.tls_cert} does not name {' and '.join(missing)} "
                              f"(it names {', '.join(sorted(names)) or 'nothing'}); {FIX}.")


def is_loopback(ip: str) -> bool:
    if ip == "localhost":
        return True
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return False  # a host name or '' (every address): beyond the loopback


def certificate_names(path: str) -> set[str]:
    """The DNS names a PEM certificate's subjectAltName lists."""
    decoded = ssl._ssl._test_decode_cert(path)  # the standard library's own decoder, as ssl's tests use it
    return {value.lower() for kind, value in decoded.get("subjectAltName", ()) if kind == "DNS"}


def main() -> int:
    try:
        HubOrigin.from_environment().check()
    except (UnsafeSetup, ValueError) as refusal:
        print(f"make hub: {refusal}", file=sys.stderr)
        return EXIT_UNSAFE_SETUP
    return 0


if __name__ == "__main__":
    sys.exit(main())
