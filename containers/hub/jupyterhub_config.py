"""JupyterHub for a class on one server, as `make hub` serves it (containers/hub/hub.sh sets the variables below).

Stock PAMAuthenticator and LocalProcessSpawner: students log in with their system account (`scalelab class
add-student`) and each gets JupyterLab as their own uid, from the shared venv, on their own copy of the course, in
cgroups of its own.

  HUB_IP, HUB_PORT            where the Hub answers (127.0.0.1:8000)
  HUB_DOMAIN, HUB_TLS_CERT, HUB_TLS_KEY
                              one origin per user over HTTPS (grader/classroom/hub_origin.py): needed beyond the
                              loopback, refused without
  HUB_PROXY_API_PORT          the proxy's REST API on 127.0.0.1 (HUB_PORT + 1)
  HUB_INTERNAL_PORT           the Hub itself on 127.0.0.1, behind the proxy (HUB_PORT + 81)
  SCALELAB_HUB_STATE          the Hub's database, cookie secret and proxy token; root only (/var/lib/scalelab-hub)
  SCALELAB_HUB_VENV           the venv every account runs (/opt/scalelab/venv)
  SCALELAB_COURSE             what each student gets: released labs and the assessment (/opt/scalelab/course)
  SCALELAB_HUB_CONFIG_D       the site's own additions, loaded last: every *.py there in name order
                              (/etc/scalelab/hub.d; containers/hub/sites/ has examples)
"""

import asyncio
import json
import os
import pwd
import secrets
from pathlib import Path

from jupyterhub.spawner import LocalProcessSpawner

from scalelab.grader.classroom import server_limits
from scalelab.grader.classroom.accounts import HUB_INSTRUCTORS_GROUP, ROLE_GROUPS, in_group
from scalelab.grader.classroom.hub_origin import HubOrigin
from scalelab.grader.service.site_fragments import UntrustedFragment, trusted_fragments

c = get_config()  # noqa: F821 — provided by JupyterHub when it loads this file

hub_ip = os.environ.get("HUB_IP", "127.0.0.1")
hub_port = int(os.environ.get("HUB_PORT", "8000"))
proxy_api_port = int(os.environ.get("HUB_PROXY_API_PORT", hub_port + 1))
internal_port = int(os.environ.get("HUB_INTERNAL_PORT", hub_port + 81))
state = Path(os.environ.get("SCALELAB_HUB_STATE", "/var/lib/scalelab-hub"))
venv = Path(os.environ.get("SCALELAB_HUB_VENV", "/opt/scalelab/venv"))
course = Path(os.environ.get("SCALELAB_COURSE", "/opt/scalelab/course"))

# State: root's alone. The Hub's database holds every user's API tokens.
state.mkdir(mode=0o700, parents=True, exist_ok=True)
state.chmod(0o700)
c.JupyterHub.db_url = f"sqlite:///{state / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(state / "jupyterhub_cookie_secret")
token_file = state / "proxy_token"
if not token_file.exists():
    token_file.touch(mode=0o600)
    token_file.write_text(secrets.token_hex(32))
# Kept across restarts, so a Hub restarted while its proxy still runs can talk to it.
c.ConfigurableHTTPProxy.auth_token = token_file.read_text().strip()
c.ConfigurableHTTPProxy.pid_file = str(state / "proxy.pid")
# `scalelab class remove` (run as root) reaches the Hub's REST API as the service scalelab-class: it stops a removed
# student's server and deletes them, with their tokens, at once. Its token and the API's URL, root's alone.
class_admin_file = state / "class-admin.json"
try:
    class_admin_token = json.loads(class_admin_file.read_text())["token"]
except (OSError, ValueError, KeyError):
    class_admin_token = secrets.token_hex(32)
with open(f"{class_admin_file}.new", "w", opener=lambda name, flags: os.open(name, flags, 0o600)) as settings:
    json.dump({"api_url": f"http://127.0.0.1:{internal_port}/hub/api", "token": class_admin_token}, settings)
os.replace(f"{class_admin_file}.new", class_admin_file)
c.JupyterHub.services.append({"name": "scalelab-class", "api_token": class_admin_token})
c.JupyterHub.load_roles.append({"name": "scalelab-class", "services": ["scalelab-class"],
                                "scopes": ["admin:users", "admin:servers", "tokens"]})

c.JupyterHub.ip = hub_ip
c.JupyterHub.port = hub_port
# One origin for all on the loopback (one trusted machine), else one per user over HTTPS; a class beyond the
# loopback on one origin is refused here too, for a Hub started without hub.sh.
origin = HubOrigin.from_environment(os.environ)
origin.check()
if origin.per_user:
    c.JupyterHub.subdomain_host = origin.subdomain_host
    c.JupyterHub.ssl_cert, c.JupyterHub.ssl_key = origin.tls_cert, origin.tls_key
    c.JupyterHub.cookie_host_prefix_enabled = True  # no subdomain can set or shadow the Hub's cookies
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = internal_port
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{proxy_api_port}"
# Debian's node-configurable-http-proxy finds its modules there only with a Node.js that is not Debian's own.
if Path("/usr/share/nodejs").is_dir():
    os.environ["NODE_PATH"] = os.pathsep.join(filter(None, [os.environ.get("NODE_PATH"), "/usr/share/nodejs"]))

# Who may log in: the class, as `scalelab class` keeps it (checked at each login: no restart after adding someone).
c.JupyterHub.authenticator_class = "pam"
c.PAMAuthenticator.service = "scalelab-hub"  # make hub's PAM service: failed logins lock the account for a while
c.PAMAuthenticator.allowed_groups = set(ROLE_GROUPS.values())
c.Authenticator.allow_existing_users = False  # someone taken out of the class groups can no longer log in
c.Authenticator.delete_invalid_users = True  # an account deleted from the system leaves the Hub at its restart


# Instructors are the Hub group `instructors`, set from the Unix group at each login. (JupyterHub.load_groups
# would read it once at start-up, and cannot be combined with manage_groups.) Nobody is a Hub admin.
def instructors_group(authenticator, handler, authentication):
    is_instructor = in_group(authentication["name"], ROLE_GROUPS["instructor"])
    authentication["groups"] = [HUB_INSTRUCTORS_GROUP] if is_instructor else []
    return authentication


c.Authenticator.manage_groups = True
c.Authenticator.post_auth_hook = instructors_group

# Each student's JupyterLab: their own uid, the shared venv, their home, and cgroups of its own (memory, CPU weight,
# processes: SCALELAB_STUDENT_MEMORY_MB, SCALELAB_STUDENT_CPU_WEIGHT, SCALELAB_STUDENT_TASKS), so that one student's
# kernel cannot starve the others or the grader's runs (scalelab.grader.classroom.server_limits). Where the machine
# has the cores (SCALELAB_GRADING_CPUS, default auto: the upper half from 4 CPUs on), graded runs keep some to
# themselves and the students' servers are held to the others.
try:
    student_server_limits = server_limits.ServerLimits.from_environment()
    cpu_split = server_limits.split_cpus(os.environ.get("SCALELAB_GRADING_CPUS", ""), os.sched_getaffinity(0))
except ValueError as wrong:
    raise SystemExit(f"jupyterhub_config.py: {wrong}") from None


class LimitedLocalProcessSpawner(LocalProcessSpawner):
    async def start(self):
        # A student's own Jupyter config (~/.jupyter) could make their server answer anything, to anyone.
        self.disable_user_config = not in_group(self.user.name, ROLE_GROUPS["instructor"])
        address = await super().start()
        try:
            server_limits.confine(self.user.name, self.pid, student_server_limits)
        except OSError as error:
            self.log.error("scalelab: %s's server runs without its limits (%s): one busy kernel can slow the class",
                           self.user.name, error)
        return address

    async def stop(self, now=False):
        await super().stop(now=now)
        # What the server left (kernels in sessions of their own, background processes) ends with its cgroups.
        await asyncio.get_running_loop().run_in_executor(None, server_limits.release, self.user.name)


c.JupyterHub.spawner_class = LimitedLocalProcessSpawner
c.Spawner.cmd = [str(venv / "bin" / "jupyterhub-singleuser")]
c.Spawner.default_url = "/lab/tree/scalelab"
c.Spawner.notebook_dir = "~"
# The course's environment in kernels and terminals: the venv's horovodrun first on PATH, Open MPI's settings.
c.Spawner.environment = {
    "PATH": f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "OMPI_MCA_mpi_yield_when_idle": "1",
    "OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
    "OMPI_MCA_coll_tuned_dynamic_rules_filename": str(
        next(venv.glob("lib/python3*/site-packages/scalelab/openmpi-collective-rules.conf"), "")),
    # The scripts the labs run: the venv holds the library only (scalelab.environment.course_source_dir).
    "SCALELAB_SOURCE_DIR": str(course / "source_code"),
}
if os.environ.get("SCALELAB_CIFAR10_DIR"):
    c.Spawner.environment["SCALELAB_CIFAR10_DIR"] = os.environ["SCALELAB_CIFAR10_DIR"]
# A 2-core server that is busy takes a while to import JupyterLab.
c.Spawner.start_timeout = 180
c.Spawner.http_timeout = 180


async def copy_course(spawner):
    """The course into ~/scalelab, copied as the student (their home, their files): files they already have are
    left alone, files released since arrive."""
    user = pwd.getpwnam(spawner.user.name)
    # -I: the student's home, the working directory, must not shadow the course's package.
    copying = await asyncio.create_subprocess_exec(
        str(venv / "bin" / "python"), "-I", "-m", "scalelab.grader.classroom.course", str(course),
        f"{user.pw_dir}/scalelab",
        user=user.pw_uid, group=user.pw_gid, extra_groups=[], umask=0o077, cwd=user.pw_dir,
        env={"HOME": user.pw_dir, "PATH": "/usr/bin:/bin"},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    output, _ = await asyncio.wait_for(copying.communicate(), timeout=120)
    if copying.returncode != 0:
        said = output.decode(errors="replace").strip().splitlines()
        raise RuntimeError(f"the course could not be copied into {user.pw_dir}/scalelab: "
                           f"{said[-1] if said else copying.returncode}")


# nbgrader's formgrader works only on a course directory inside the server's root (the home): an instructor gets
# ~/nbgrader-course, a link to the class's one course directory, which containers/hub/nbgrader_config.py then uses.
nbgrader_course = Path(os.environ.get("SCALELAB_HUB_NBGRADER", "/srv/nbgrader")) / "course"


async def link_course_directory(spawner):
    user = pwd.getpwnam(spawner.user.name)
    if not in_group(user.pw_name, ROLE_GROUPS["instructor"]):
        return
    # As the instructor: `ln` refuses to replace what is there (their own file of that name stays theirs).
    linking = await asyncio.create_subprocess_exec(
        "ln", "-sn", str(nbgrader_course), f"{user.pw_dir}/nbgrader-course", user=user.pw_uid, group=user.pw_gid,
        cwd=user.pw_dir, env={"PATH": "/usr/bin:/bin"}, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL)
    await asyncio.wait_for(linking.wait(), timeout=30)


async def prepare_home(spawner):
    await copy_course(spawner)
    await link_course_directory(spawner)


c.Spawner.pre_spawn_hook = prepare_home


# --- ScaleLab: the grader as the Hub's managed service `scalelab` (grader/service/hub.py) -------------------------
# One Assess service for the class at /services/scalelab/, started (and restarted) by the Hub as the system account
# scalelab; its state (queue and results databases, job directories, logs, the staged data sets) in
# SCALELAB_SERVICE_STATE (/var/lib/scalelab, 0700, scalelab's). SCALELAB_SERVICE_PORT: where it listens on
# 127.0.0.1 (HUB_PORT + 82). SCALELAB_TRACK / SCALELAB_TRACKS: the track students are graded on, and its file.
from scalelab.grader.service.hub import register as register_assess_service  # noqa: E402

service_port = int(os.environ.get("SCALELAB_SERVICE_PORT", hub_port + 82))

assess_service = register_assess_service(
    c,
    python=str(venv / "bin" / "python"),
    port=service_port,
    # Kernels reach it on this machine: through the proxy on one origin, else at its own address (a kernel needs
    # neither the class's DNS name nor its certificate).
    public_url=(f"http://127.0.0.1:{service_port}/" if origin.per_user
                else f"http://{'127.0.0.1' if hub_ip in ('', '0.0.0.0', '::') else hub_ip}:{hub_port}/"),
    state_dir=os.environ.get("SCALELAB_SERVICE_STATE", "/var/lib/scalelab"),
    # The track: SCALELAB_TRACK, else the grader's default (cifar10-cpu; cifar10-ddp-cpu on the PyTorch edition).
    settings={**({"track": os.environ["SCALELAB_TRACK"]} if os.environ.get("SCALELAB_TRACK") else {}),
              "tracks_file": os.environ.get("SCALELAB_TRACKS", str(course / "tracks.toml"))},
    environment={name: os.environ[name] for name in ("SCALELAB_CIFAR10_DIR", "SCALELAB_FASHION_MNIST_DIR")
                 if os.environ.get(name)},
    # hub.sh installs it: each graded run as a uid with limits of its own (grader/assess_helper.py).
    privileged_helper="/usr/local/sbin/scalelab-assess" if os.path.exists("/usr/local/sbin/scalelab-assess") else None,
    grading_cpus=cpu_split[0] if cpu_split else None,
)
# --- end of ScaleLab's grader service ------------------------------------------------------------------------------

# --- ScaleLab: the labs through nbgrader's exchange (containers/hub/nbgrader_config.py) ----------------------------
# hub.sh gives everyone's nbgrader the course id and the exchange, and turns nbgrader's instructor tools (formgrader,
# create-assignment, course list) off in the shared venv: students see the Assignments tab. An instructor's server
# also reads HUB_VENV/etc/jupyter-instructors, where hub.sh turns them on again.
instructor_jupyter_config = str(venv / "etc" / "jupyter-instructors")
c.Spawner.environment["JUPYTER_CONFIG_PATH"] = lambda spawner: (
    instructor_jupyter_config if in_group(spawner.user.name, ROLE_GROUPS["instructor"]) else "")
# --- end of ScaleLab's nbgrader exchange ---------------------------------------------------------------------------

# --- the site's own additions (HUB_CONFIG_D), last, so that they can change anything above ------------------------
# Run as part of this file (they see `c` and the names above, e.g. `assess_service`, the grader service's entry).
# Root's to write: the Hub runs as root and executes them. A file any other account could change or swap (a link,
# a folder above it that is not root's alone) is refused: scalelab.grader.service.site_fragments.
site_config = Path(os.environ.get("SCALELAB_HUB_CONFIG_D", "/etc/scalelab/hub.d"))
try:
    site_fragments = trusted_fragments(site_config)
except UntrustedFragment as refusal:
    raise SystemExit(f"jupyterhub_config.py: {refusal}; the Hub would run what another account wrote.") from None
for fragment, text in site_fragments:
    exec(compile(text, str(fragment), "exec"), globals())  # noqa: S102 — root's own config, checked as opened
