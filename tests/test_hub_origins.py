"""`make hub` for a class beyond one machine: one origin per user over HTTPS (grader/classroom/hub_origin.py).

A Hub of `make hub` at https://class.localhost with a certificate the test makes (openssl: class.localhost and
*.class.localhost). Names under localhost are the loopback: Chromium resolves them so itself, and this process maps
them the same way for its own requests. A student controls what their server answers; here that is a page served
by a process of the student's own account, put on the student's origin through the proxy's routes as their server's
answers are. An instructor logged in opens it in Chromium: its script cannot read the class page, the Hub's token
page or the Hub's API, all of which the instructor reads on their own origins. The setups that would let a student's
page do that are refused before `make hub` installs anything.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import requests

from conftest import PROJECT_ROOT
from hubtools import SUBMISSIONS, free_port, running_hub
from scalelab.grader.classroom import server_limits
from test_serve_browser import CHROMIUM, CHROMIUM_ARGS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

DOMAIN = "class.localhost"
SERVICE_HOST = f"scalelab--service.{DOMAIN}"


def make_certificate(folder: Path, *names: str) -> tuple[Path, Path]:
    """A self-signed certificate for ``names`` and its key."""
    cert, key = folder / f"{names[0]}.pem", folder / f"{names[0]}.key"
    made = subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={names[0]}",
         "-addext", "subjectAltName=" + ",".join(f"DNS:{name}" for name in names),
         "-keyout", str(key), "-out", str(cert)], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    return cert, key


def make_hub_refuses(settings: dict[str, str]) -> str:
    """`make hub` with ``settings``: it must stop with exit status 2 before installing anything; its sentence."""
    ran = subprocess.run(["make", "--no-print-directory", "hub", f"HUB_PORT={free_port()}",
                          *(f"{name}={value}" for name, value in settings.items())],
                         cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 2, (ran.returncode, ran.stdout[-2000:], ran.stderr[-2000:])
    assert "Installing" not in ran.stdout and "==>" not in ran.stdout, ran.stdout
    return ran.stderr


def test_a_class_beyond_the_loopback_on_one_origin_or_with_a_certificate_that_does_not_fit_is_refused(tmp_path):
    said = make_hub_refuses({"HUB_IP": "0.0.0.0"})
    assert "HUB_IP=0.0.0.0 serves the class beyond this machine on one origin" in said, said
    assert "set HUB_DOMAIN" in said and "HUB_TLS_CERT" in said and "HUB_IP=127.0.0.1" in said, said
    said = make_hub_refuses({"HUB_IP": "0.0.0.0", "HUB_DOMAIN": DOMAIN})
    assert "HUB_TLS_CERT=(unset) is not a file" in said, said
    cert, key = make_certificate(tmp_path, DOMAIN)  # the name, not its wildcard
    said = make_hub_refuses({"HUB_DOMAIN": DOMAIN, "HUB_TLS_CERT": cert, "HUB_TLS_KEY": key})
    assert f"does not name *.{DOMAIN}" in said, said
    other_cert, other_key = make_certificate(tmp_path, "other.localhost", "*.other.localhost")
    said = make_hub_refuses({"HUB_DOMAIN": DOMAIN, "HUB_TLS_CERT": cert, "HUB_TLS_KEY": other_key})
    assert "are not a certificate and its key" in said, said
    said = make_hub_refuses({"HUB_DOMAIN": "localhost", "HUB_TLS_CERT": other_cert, "HUB_TLS_KEY": other_key})
    assert "not a host name of two labels or more" in said, said


def test_grading_cpus_the_machine_has_not_or_that_leave_the_students_none_are_refused():
    every_cpu = server_limits.format_cpus(os.sched_getaffinity(0))
    said = make_hub_refuses({"HUB_GRADING_CPUS": every_cpu})
    assert f"SCALELAB_GRADING_CPUS={every_cpu} leaves no CPU for the students' servers" in said, said
    said = make_hub_refuses({"HUB_GRADING_CPUS": "4095"})
    assert "names CPUs this machine does not have: 4095" in said, said
    said = make_hub_refuses({"HUB_GRADING_CPUS": "two"})
    assert "not a CPU list: 'two'" in said, said


# --- a Hub with one origin per user -------------------------------------------------------------------------------

_getaddrinfo = socket.getaddrinfo


def loopback_for_localhost_names(host, *arguments, **keywords):
    """Names under localhost are the loopback (RFC 6761), as browsers and systemd's resolver answer them."""
    if isinstance(host, str) and host.endswith(".localhost"):
        host = "127.0.0.1"
    return _getaddrinfo(host, *arguments, **keywords)


@pytest.fixture(scope="module")
def hub():
    folder = Path(tempfile.mkdtemp(prefix="scalelab-test-origins-", dir="/tmp"))
    try:
        cert, key = make_certificate(folder, DOMAIN, f"*.{DOMAIN}")
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("REQUESTS_CA_BUNDLE", str(cert))  # this process trusts the class's certificate
            patch.setattr(socket, "getaddrinfo", loopback_for_localhost_names)
            # Graded runs get CPU 1 to themselves, the students' servers CPU 0.
            settings = {"HUB_DOMAIN": DOMAIN, "HUB_TLS_CERT": str(cert), "HUB_TLS_KEY": str(key),
                        "HUB_GRADING_CPUS": "1"}
            with running_hub(student_roles=("A",), instructor_roles=("I",), settings=settings) as running:
                running.port = int(running.url.rsplit(":", 1)[1])
                yield running
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def start_server(hub, name: str) -> psutil.Process:
    """``name``'s JupyterLab, started through the Hub's API unless it runs; its process."""
    if not hub.admin("GET", f"users/{name}").json()["servers"].get("", {}).get("ready"):
        answer = hub.admin("POST", f"users/{name}/server")
        assert answer.status_code in (201, 202), answer.text
    deadline = time.monotonic() + 300
    while not hub.admin("GET", f"users/{name}").json()["servers"].get("", {}).get("ready"):
        assert time.monotonic() < deadline, f"{name}'s server did not start:\n{hub.log_text()}"
        time.sleep(1)
    uid = pwd.getpwnam(name).pw_uid
    [server] = [process for process in psutil.process_iter(["uids", "cmdline"])
                if process.info["uids"] and process.info["uids"].real == uid
                and any("jupyterhub-singleuser" in part for part in process.info["cmdline"] or [])]
    return server


def test_the_hub_serves_https_with_host_only_cookies_and_the_service_on_an_origin_of_its_own(hub):
    instructor, student = hub.instructors["I"], hub.students["A"]
    session = hub.login(instructor)
    sessions = [cookie for cookie in session.cookies if cookie.name.startswith("__Host-")]
    assert sessions, [cookie.name for cookie in session.cookies]
    assert all(cookie.secure and cookie.path == "/" and not cookie.domain_specified for cookie in sessions)
    # The grader service answers on its own name, and nowhere on the Hub's.
    assert hub.service_url.startswith(f"https://{SERVICE_HOST}:")
    assert hub.api("GET", "service", hub.tokens[student]).status_code == 200
    on_hub = requests.get(f"{hub.url}/services/scalelab/api/service", timeout=30,
                          headers={"Authorization": f"token {hub.tokens[student]}"}, allow_redirects=False)
    assert on_hub.status_code != 200 or "track" not in on_hub.text, on_hub.text[:500]
    with pytest.raises(requests.RequestException):  # no plain HTTP
        requests.get(f"http://127.0.0.1:{hub.port}/hub/login", timeout=30)


def test_a_students_server_reads_no_config_of_theirs_and_its_kernels_reach_the_service(hub):
    student = hub.students["A"]
    account = pwd.getpwnam(student)
    # What the student's own Jupyter config would make their server say to everyone.
    config = Path(account.pw_dir) / ".jupyter" / "jupyter_server_config.py"
    config.parent.mkdir(exist_ok=True)
    config.write_text('c.ServerApp.tornado_settings = {"headers": {"X-Student-Config": "loaded"}}\n')
    for path in (config.parent, config):
        os.chown(path, account.pw_uid, account.pw_gid)
    server = start_server(hub, student)
    status = requests.get(f"https://{student}.{DOMAIN}:{hub.port}/user/{student}/api/status", timeout=60,
                          headers={"Authorization": f"token {hub.tokens[student]}"})
    assert status.status_code == 200, status.text[:500]
    assert "X-Student-Config" not in status.headers
    environment = server.environ()
    assert environment.get("JUPYTERHUB_DISABLE_USER_CONFIG") == "1"
    # A kernel of theirs reaches the service on this machine, with neither the class's DNS name nor its certificate.
    service_url = environment["SCALELAB_ASSESS_SERVICE_URL"]
    assert service_url.startswith("http://127.0.0.1:") and service_url.endswith("/services/scalelab/"), service_url
    answer = requests.get(f"{service_url}api/service", timeout=60,
                          headers={"Authorization": f"token {hub.tokens[student]}"})
    assert answer.status_code == 200 and answer.json()["track"], answer.text[:500]


def cpus_of(process: psutil.Process) -> str:
    return next(line.split(":", 1)[1].strip() for line in Path(f"/proc/{process.pid}/status").read_text().splitlines()
                if line.startswith("Cpus_allowed_list:"))


def test_graded_runs_have_a_cpu_of_their_own_and_the_students_servers_the_other(hub):
    student = hub.students["A"]
    server = start_server(hub, student)
    assert cpus_of(server) == "0", "the student's server keeps to CPU 0"
    cpuset = server_limits.every_cgroup(student)[-1]  # v1: the cpuset controller's; v2: the server's one cgroup
    assert (cpuset / "cpuset.cpus").read_text().strip() == "0", "held there by a cpuset nothing of theirs can widen"
    [service] = hub.service_processes()
    assert cpus_of(service) == "1"
    # A run that tries to take every CPU: the ranks say what they got (a failing run, so it ends at once).
    source = (SUBMISSIONS / "service" / "widens_its_cpus.py").read_text()
    answer = hub.submit(student, source)
    assert answer.status_code == 201, answer.text
    job = hub.wait_for_job(student, answer.json()["job"]["id"])
    assert job["state"] == "done" and job["verdict"]["verdict"] == "fail", job
    [job_dir] = [path.parent for path in (hub.state / "assess" / "jobs").glob("*/assessment.py")
                 if path.read_text() == source]
    stored = json.loads((job_dir / "grader" / "verdict.json").read_text())
    said = [line for rank in (0, 1) for line in (Path(stored["logs_dir"]) / f"rank-{rank}.log").read_text().splitlines()
            if line.startswith("cpus ")]
    assert said == ["cpus [1] then [1]"] * 2, said
    assert stored["cpu_contention"]["cpus"] == 1, stored["cpu_contention"]


def test_a_page_a_student_serves_cannot_read_the_class_page_or_the_hubs_pages_of_an_instructor_who_opens_it(hub):
    from playwright.sync_api import sync_playwright

    instructor, student = hub.instructors["I"], hub.students["A"]
    hub_origin, service_origin = hub.url, f"https://{SERVICE_HOST}:{hub.port}"
    targets = {"the Hub's token page": f"{hub_origin}/hub/token", "the Hub's API": f"{hub_origin}/hub/api/user",
               "the class page": f"{service_origin}/services/scalelab/class"}
    page_path = f"/user/{student}/evil/"
    site = Path(tempfile.mkdtemp(prefix="scalelab-test-student-site-", dir="/tmp"))
    site.chmod(0o755)
    (site / page_path.strip("/")).mkdir(parents=True)
    (site / page_path.strip("/") / "index.html").write_text(textwrap.dedent(f"""\
        <!doctype html><title>loading</title><pre id=out></pre>
        <script>
        const targets = {json.dumps(targets)};
        (async () => {{
          const found = {{}};
          for (const [what, url] of Object.entries(targets)) {{
            try {{
              const answer = await fetch(url, {{credentials: "include"}});
              found[what] = "READ " + answer.status + " " + (await answer.text()).length;
            }} catch (error) {{
              found[what] = "BLOCKED " + error.name;
            }}
          }}
          document.getElementById("out").textContent = JSON.stringify(found);
          document.title = "done";
        }})();
        </script>
        """))
    for path in [site, *site.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    port = free_port()
    served = subprocess.Popen(["runuser", "-u", student, "--", "python3", "-m", "http.server", str(port),
                               "--bind", "127.0.0.1", "--directory", str(site)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")
    proxy = {"Authorization": f"token {(hub.hub_state / 'proxy_token').read_text().strip()}"}
    route = f"{hub.proxy_api_url}/api/routes/{student}.{DOMAIN}{page_path}"
    try:
        answer = requests.post(route, headers=proxy, json={"target": f"http://127.0.0.1:{port}"}, timeout=30)
        assert answer.status_code == 201, answer.text
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_context(ignore_https_errors=True).new_page()
                page.goto(f"{hub_origin}/hub/login")
                page.locator("#username_input").fill(instructor)
                page.locator("#password_input").fill(hub.passwords[instructor])
                page.locator("#login_submit").click()
                page.wait_for_load_state()
                # On their own origins the instructor reads all three.
                for what, url in targets.items():
                    seen = page.goto(url)
                    assert seen.status == 200, (what, seen.status, page.content()[:500])
                assert "<h1>Class: " in page.content()
                # The student's page, on the student's origin, in the same browser.
                page.goto(f"https://{student}.{DOMAIN}:{hub.port}{page_path}")
                page.wait_for_function("document.title === 'done'", timeout=60_000)
                found = json.loads(page.locator("#out").inner_text())
            finally:
                browser.close()
    finally:
        requests.delete(route, headers=proxy, timeout=30)
        served.kill()
        served.wait()
        shutil.rmtree(site, ignore_errors=True)
    assert found == {what: "BLOCKED TypeError" for what in targets}, found
