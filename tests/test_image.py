"""The CPU image built and run for real. No Docker engine runs here, so podman builds it (`make image-cpu`) on a
Debian 12 base that containers/debian-base.sh makes with debootstrap (no registry can be pulled from here). Then the
container is started with the podman run line of containers/README.md, the very line users copy, and the Assess
service inside it grades the reference solution through the REST API the JupyterLab panel uses.

The run line is changed only where containers/README.md says a host needs it (runc, the host's limits), to publish on
a free loopback port instead of 8888, and to mount this machine's CIFAR-10 and a fresh volume.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import requests

from conftest import HOROVOD_BUILD_LABEL, PROJECT_ROOT

# Building the image is most of it: minutes on 2 cores (pyproject.toml's 900 s per test would cut a fresh build short).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

CONTAINERS = PROJECT_ROOT / "containers"
BASE_IMAGE = "localhost/scalelab-base:bookworm"
REFERENCE = PROJECT_ROOT / "assessment" / "solution" / "assessment.py"


def readme_run_line(engine: str, readme: Path = CONTAINERS / "README.md") -> str:
    """The one `ENGINE run` line of the laptop section, its continuation lines joined."""
    section = readme.read_text().split("## On a laptop", 1)[1].split("\n## ", 1)[0]
    joined = re.sub(r"\\\n\s*", "", section)
    lines = [re.sub(r"\s+", " ", line).strip() for line in joined.splitlines()
             if line.strip().startswith(f"{engine} run ")]
    assert len(lines) == 1, f"{readme.name} should have one `{engine} run` line in its laptop section: {lines}"
    return lines[0]


def podman_host_flags() -> tuple[list[str], list[str]]:
    """What a host like this one adds, as containers/README.md says: (podman's own flags, `run` flags)."""
    flags = subprocess.run([str(CONTAINERS / "build-image.sh"), "--podman-flags"], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    return flags[0].split(), flags[1].split()


def this_hosts_run_line(port: int, name: str, volume: str, cifar10: Path) -> list[str]:
    """The README's podman line, published on `port`, with this machine's data and a volume of its own."""
    argv = shlex.split(readme_run_line("podman"))
    assert argv[:2] == ["podman", "run"], argv
    global_flags, run_flags = podman_host_flags()
    adapted = ["podman", *global_flags, "run", "--detach", "--name", name, *run_flags]
    arguments = iter(argv[2:])
    for argument in arguments:
        if argument in ("-p", "--publish"):
            published = next(arguments)
            assert published == "127.0.0.1:8888:8888", f"the README publishes {published}, not on loopback"
            adapted += [argument, f"127.0.0.1:{port}:8888"]
        elif argument in ("-v", "--volume"):
            source, _, target = next(arguments).partition(":")
            if target.startswith("/data/cifar10:"):
                assert target.endswith(":ro"), "CIFAR-10 is mounted read-only"
                source = str(cifar10)
            else:
                assert source == "scalelab-home", source
                source = volume
            adapted += [argument, f"{source}:{target}"]
        else:
            adapted.append(argument)
    return adapted


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def podman(*arguments: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    global_flags, _ = podman_host_flags()
    return subprocess.run(["podman", *global_flags, *arguments], capture_output=True, text=True, timeout=timeout,
                          check=check)


@pytest.fixture(scope="module")
def image() -> str:
    """scalelab:cpu, built by `make image-cpu` on the debootstrap'd base (which also installs podman if missing)."""
    made = subprocess.run([str(CONTAINERS / "debian-base.sh"), BASE_IMAGE], capture_output=True, text=True,
                          timeout=1200)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    started = time.monotonic()
    built = subprocess.run(["make", "-C", str(PROJECT_ROOT), "image-cpu", f"IMAGE_BASE={BASE_IMAGE}"],
                           capture_output=True, text=True, timeout=3600)
    assert built.returncode == 0, built.stdout[-6000:] + built.stderr[-6000:]
    size = int(podman("image", "inspect", "--format", "{{.Size}}", "scalelab:cpu").stdout)
    print(f"\nmake image-cpu: {time.monotonic() - started:.0f} s, scalelab:cpu {size / 1e9:.2f} GB")
    return "scalelab:cpu"


@pytest.fixture(scope="module")
def lab(image, cifar10_dir):
    """The container, started with the README's run line; yields (base URL, token, container name)."""
    name, volume, port = f"scalelab-test-{uuid.uuid4().hex[:8]}", f"scalelab-test-home-{os.getpid()}", free_port()
    argv = this_hosts_run_line(port, name, volume, cifar10_dir)
    print("\n" + shlex.join(argv))
    started = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr
    try:
        token, deadline = None, time.monotonic() + 120
        while token is None and time.monotonic() < deadline:
            logs = podman("logs", name, check=False)
            found = re.search(r"[?&]token=([0-9a-f]{16,})", logs.stdout + logs.stderr)
            token = found.group(1) if found else None
            if token is None:
                time.sleep(1)
        assert token, f"JupyterLab printed no token:\n{logs.stdout[-3000:]}{logs.stderr[-3000:]}"
        url = f"http://127.0.0.1:{port}/"
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{url}api/status", headers=auth(token), timeout=5).ok:
                    break
            except requests.RequestException:
                time.sleep(1)
        yield url, token, name
    finally:
        logs = podman("logs", name, check=False)
        print(logs.stdout[-4000:] + logs.stderr[-4000:])
        podman("rm", "--force", "--time", "10", name, check=False)
        podman("volume", "rm", "--force", volume, check=False)


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"token {token}"}


def test_scalelab_doctor_is_clean_inside_the_image(lab):
    _, _, name = lab
    doctor = podman("exec", name, "scalelab", "doctor", timeout=300, check=False)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "/data/cifar10" in doctor.stdout, doctor.stdout


def test_the_image_keeps_no_downloaded_packages_or_apt_caches(lab):
    # As the official Debian images it stands in for: what apt downloaded would ship in every layer that ran it.
    _, _, name = lab
    left = podman("exec", "--user", "root", name, "find", "/var/cache/apt", "-type", "f", "(", "-name", "*.deb", "-o",
                  "-name", "*.bin", ")", check=False)
    assert left.returncode == 0 and left.stdout == "", left.stdout[-2000:] + left.stderr[-2000:]


def test_jupyterlab_answers_on_the_published_loopback_port_only(lab):
    url, token, name = lab
    assert requests.get(f"{url}lab", headers=auth(token), timeout=30).status_code == 200
    ports = podman("port", name).stdout
    assert re.fullmatch(r"8888/tcp -> 127\.0\.0\.1:\d+", ports.strip()), ports


def test_assess_in_the_container_passes_the_reference_solution(lab):
    url, token, _ = lab
    api = f"{url}scalelab/api/"
    # What a student does in JupyterLab: save the file, then press Assess (the panel posts to the same API).
    saved = requests.put(f"{url}api/contents/assessment/assessment.py", headers=auth(token), timeout=30,
                         json={"type": "file", "format": "text", "content": REFERENCE.read_text()})
    assert saved.status_code in (200, 201), saved.text
    service = requests.get(f"{api}service", headers=auth(token), timeout=30).json()
    assert service["track"] == "cifar10-cpu", service
    submitted = requests.post(f"{api}assessments", headers=auth(token), timeout=60)
    assert submitted.status_code == 201, submitted.text
    job_id = submitted.json()["job"]["id"]
    deadline = time.monotonic() + service["time_budget_s"] + 600
    while True:
        job = requests.get(f"{api}assessments/{job_id}", headers=auth(token), timeout=30).json()
        if job["state"] in ("done", "interrupted") or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert job["state"] == "done", job
    verdict = job["verdict"]
    print(f"\nverdict {verdict['verdict']}: held-out {verdict['heldout_accuracy']:.3f} "
          f"in {verdict['wall_time_s']:.1f} s (budget {verdict['time_budget_s']} s), sandboxed {verdict['sandboxed']}")
    assert verdict["verdict"] == "pass", verdict["reasons"]
    assert verdict["sandboxed"] and verdict["ranks_seen"] == [0, 1]
    assert verdict["heldout_accuracy"] >= verdict["target_accuracy"]


def test_setup_sh_keeps_the_framework_a_base_brings_as_for_the_gpu_image(image):
    # The GPU image's install path (NGC's TensorFlow and Horovod kept) on the one base these machines can build: the
    # CPU image, whose TensorFlow and Horovod stand for NGC's. As root, on the host's network and certificates (pip
    # builds the course's editable wheel), without apt (the packages are there).
    bundle = os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt"
    mounts = ["--volume", f"{os.path.realpath(bundle)}:/etc/ssl/certs/ca-certificates.crt:ro"] \
        if os.path.isfile(bundle) else []
    _, run_flags = podman_host_flags()
    done = podman("run", "--rm", "--user", "root", "--network", "host", *run_flags, *mounts,
                  "--workdir", "/opt/scalelab", image,
                  "containers/setup.sh", "--system-python", "--framework-from-base", "--skip-apt",
                  timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    kept = re.findall(r"TensorFlow (\S+) and Horovod (\S+) from the base: kept", done.stdout)
    # Before installing the course, and after.
    assert kept == [("2.15.1", f"0.28.1+{HOROVOD_BUILD_LABEL}")] * 2, done.stdout
    assert "ScaleLab stack ready" in done.stdout
