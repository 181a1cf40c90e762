"""A class on a Slurm cluster: each student's JupyterLab is a Slurm job (batchspawner's SlurmSpawner), and the
grader service hands every graded run to Slurm (AssessService.backend = "slurm", grader/slurm.py).

A fragment for make hub's config on a Slurm submit host: copy it into /etc/scalelab/hub.d/ (sites/README.md). Not
tested here. Needs batchspawner==1.3.0 in the Hub's venv, which compute nodes must see at the same path. What it
changes in jupyterhub_config.py's setup:

- students' servers: SlurmSpawner instead of LocalProcessSpawner; the Hub's API listens on all interfaces so that
  servers on compute nodes reach it (at HUB_HOST);
- the grader service `scalelab`: registered again with the Slurm backend and replacing the one jupyterhub_config.py
  registered (same name, port and state). Its runs' job directories go to JOBS_DIR, on a file system the compute
  nodes share; it still verifies every model on this host, with the held-out split only this host has.
"""

import os

from traitlets.config import Config

from scalelab.grader.service.hub import SERVICE_URL_VARIABLE, register

# --- this site --------------------------------------------------------------------------------------------------
HUB_HOST = "login1.cluster.example.edu"  # this host's name as compute nodes reach it
PARTITION = "teaching"
SLURM_ACCOUNT = ""  # --account for both kinds of jobs, where the site charges one
SERVER_RUNTIME = "04:00:00"  # a student's JupyterLab job
SERVER_MEMORY = "8G"
SERVER_CPUS = "2"
# Graded runs' job directories: on the shared file system, the account scalelab's, mode 0700 (the service makes it).
JOBS_DIR = "/shared/scalelab/jobs"
GRADER_SLOTS = 4  # graded runs at once: each waits in Slurm's queue, then is verified on this host
SLURM_BIN = "/usr/bin"  # where sbatch, squeue, scancel and scontrol are

c = get_config()  # noqa: F821 — provided by JupyterHub when it loads this file

venv = os.environ.get("SCALELAB_HUB_VENV", "/opt/scalelab/venv")
course = os.environ.get("SCALELAB_COURSE", "/opt/scalelab/course")
hub_port = int(os.environ.get("HUB_PORT", "8000"))
public_url = f"http://{HUB_HOST}:{hub_port}/"  # the proxy, as kernels on compute nodes reach it

# --- students' servers as Slurm jobs ---------------------------------------------------------------------------
c.JupyterHub.spawner_class = "batchspawner.SlurmSpawner"
c.JupyterHub.hub_ip = "0.0.0.0"
c.JupyterHub.hub_connect_ip = HUB_HOST
# batchspawner's wrapper picks the server's port on the node and tells the Hub; it then runs Spawner.cmd (the venv's
# jupyterhub-singleuser, set by jupyterhub_config.py).
c.SlurmSpawner.batchspawner_singleuser_cmd = f"{venv}/bin/batchspawner-singleuser"
c.SlurmSpawner.req_partition = PARTITION
c.SlurmSpawner.req_runtime = SERVER_RUNTIME
c.SlurmSpawner.req_memory = SERVER_MEMORY
c.SlurmSpawner.req_nprocs = SERVER_CPUS
if SLURM_ACCOUNT:
    c.SlurmSpawner.req_options = f"--account={SLURM_ACCOUNT}"  # the default batch_script has no {account}
c.SlurmSpawner.start_timeout = 600  # includes the wait in Slurm's queue

# --- the grader service with the Slurm backend ------------------------------------------------------------------
# Its settings are its command line, which register() writes: register it again, on a config of its own, and let
# that entry replace the list jupyterhub_config.py built (a plain list here replaces it; it holds only this one).
environment = {
    # The service inherits nothing from the Hub: sbatch & co. must be on its PATH.
    "PATH": f"{venv}/bin:{SLURM_BIN}:/usr/local/bin:/usr/bin:/bin",
    "SCALELAB_SLURM_PARTITION": PARTITION,
    **({"SCALELAB_SLURM_ACCOUNT": SLURM_ACCOUNT} if SLURM_ACCOUNT else {}),
    **{name: os.environ[name] for name in ("SCALELAB_CIFAR10_DIR", "SCALELAB_FASHION_MNIST_DIR",
                                           "SCALELAB_SLURM_GPUS_PER_NODE", "SCALELAB_SLURM_QUEUE_TIMEOUT_S")
       if os.environ.get(name)},
}
grader = Config()
entry = register(
    grader,
    python=f"{venv}/bin/python",
    port=int(os.environ.get("SCALELAB_SERVICE_PORT", hub_port + 82)),
    public_url=public_url,
    state_dir=os.environ.get("SCALELAB_SERVICE_STATE", "/var/lib/scalelab"),
    # The track: SCALELAB_TRACK, else the grader's default (cifar10-cpu; cifar10-ddp-cpu on the PyTorch edition).
    settings={**({"track": os.environ["SCALELAB_TRACK"]} if os.environ.get("SCALELAB_TRACK") else {}),
              "tracks_file": os.environ.get("SCALELAB_TRACKS", f"{course}/tracks.toml"),
              "backend": "slurm", "jobs_dir": JOBS_DIR, "slots": GRADER_SLOTS},
    environment=environment,
)
c.JupyterHub.services = [entry]
# Kernels on compute nodes reach the service through the proxy at HUB_HOST, not at 127.0.0.1.
c.Spawner.environment.update({SERVICE_URL_VARIABLE: grader.Spawner.environment.get_value({})[SERVICE_URL_VARIABLE]})
