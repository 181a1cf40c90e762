"""ScaleLab on The Littlest JupyterHub: copy to /opt/tljh/config/jupyterhub_config.d/scalelab.py, then
`sudo tljh-config reload`. Not tested here (sites/README.md says what is).

Expects what `sudo containers/hub/hub.sh --install-only` makes on this machine: the course's venv VENV (the
pinned stack, JupyterHub 6.1.1, the course, its kernel), the students' copy of the course COURSE, and the system
account `scalelab` with its state directory STATE_DIR. TLJH keeps its own environments (/opt/tljh/hub for the Hub,
/opt/tljh/user for users): this file leaves the Hub's alone and runs the students' servers and the grader from
VENV instead of /opt/tljh/user.

What it sets up: the grader as the Hub's managed service `scalelab` (grader/service/hub.py), the students' servers
from VENV with the course copied into ~/scalelab before each start, and the Hub group `instructors` (the class
page's) from INSTRUCTORS. Logins, admins and the system accounts (jupyter-NAME) stay TLJH's.
"""

import json
import subprocess
from pathlib import Path

# --- this site --------------------------------------------------------------------------------------------------
VENV = "/opt/scalelab/venv"
COURSE = "/opt/scalelab/course"
STATE_DIR = "/var/lib/scalelab"
SERVICE_PORT = 15020  # where the grader listens on 127.0.0.1: any free port
# Where kernels reach TLJH's proxy: this machine on port 80, or the https:// address once HTTPS is on.
PUBLIC_URL = "http://127.0.0.1/"
TRACK = "cifar10-cpu"  # or fashion-mnist-cpu (its data set is Debian's dataset-fashion-mnist)
CIFAR10_DIR = ""  # a directory holding cifar-10-batches-py; empty: the course's default places
INSTRUCTORS = set()  # Hub user names that see the class page, e.g. {"carol"}

c = get_config()  # noqa: F821 — provided by JupyterHub (TLJH's load_subconfig) when it loads this file

data = {"SCALELAB_CIFAR10_DIR": CIFAR10_DIR} if CIFAR10_DIR else {}

# register() (grader/service/hub.py) imports the whole course, which TLJH's Hub environment does not have: VENV's
# Python runs it on a config of its own and reports what it set.
REGISTER = """
import json, sys
from traitlets.config import Config
from scalelab.grader.service.hub import register
c = Config()
register(c, **json.loads(sys.argv[1]))
print(json.dumps({"services": c.JupyterHub.services.get_value([]),
                  "load_roles": c.JupyterHub.load_roles.get_value([]),
                  "extra_user_scopes": sorted(c.JupyterHub.extra_user_scopes.get_value(set())),
                  "server_token_scopes": c.Spawner.server_token_scopes,
                  "spawner_environment": c.Spawner.environment.get_value({})}))
"""
arguments = {"python": f"{VENV}/bin/python", "port": SERVICE_PORT, "public_url": PUBLIC_URL, "state_dir": STATE_DIR,
             "settings": {"track": TRACK, "tracks_file": f"{COURSE}/tracks.toml"}, "environment": data}
registering = subprocess.run([f"{VENV}/bin/python", "-I", "-c", REGISTER, json.dumps(arguments)],
                             capture_output=True, text=True, timeout=300)
if registering.returncode != 0:
    said = registering.stderr.strip().splitlines()
    raise RuntimeError(f"the ScaleLab grader service could not be registered from {VENV} (did containers/hub/hub.sh "
                       f"--install-only run?): {said[-1] if said else registering.returncode}")
registered = json.loads(registering.stdout.strip().splitlines()[-1])
c.JupyterHub.services.extend(registered["services"])
c.JupyterHub.load_roles.extend(registered["load_roles"])
c.JupyterHub.extra_user_scopes.update(set(registered["extra_user_scopes"]))
c.Spawner.server_token_scopes = registered["server_token_scopes"]
c.Spawner.environment.update(registered["spawner_environment"])

# Students' servers: VENV's JupyterLab, with the course copied into ~/scalelab first, as the student (files they
# already have are left alone, files released since arrive), as make hub's pre-spawn hook does.
c.Spawner.cmd = ["/bin/sh", "-c",
                 f'{VENV}/bin/python -I -m scalelab.grader.classroom.course {COURSE} "$HOME/scalelab" && '
                 f'exec {VENV}/bin/jupyterhub-singleuser "$@"',
                 "scalelab-server"]
c.Spawner.default_url = "/lab/tree/scalelab"
c.SystemdSpawner.extra_paths = [f"{VENV}/bin"]  # VENV's horovodrun and python first on PATH, not /opt/tljh/user's
c.Spawner.environment.update({
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "OMPI_MCA_mpi_yield_when_idle": "1",
    "OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
    "OMPI_MCA_coll_tuned_dynamic_rules_filename": str(
        next(Path(VENV).glob("lib/python3*/site-packages/scalelab/openmpi-collective-rules.conf"), "")),
    **data,
})
# A busy small server takes a while to import JupyterLab (the values make hub uses).
c.Spawner.start_timeout = 180
c.Spawner.http_timeout = 180

# The class page admits the Hub group `instructors` (scalelab.grader.classroom.accounts.HUB_INSTRUCTORS_GROUP).
# load_groups only adds: someone removed from INSTRUCTORS leaves the group through the admin page.
if INSTRUCTORS:
    c.JupyterHub.load_groups = {"instructors": {"users": sorted(INSTRUCTORS)}}
