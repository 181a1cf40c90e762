"""The container recipes (containers/Dockerfile.gpu, Dockerfile.gpu-pytorch, Dockerfile.cpu, scalelab.def) read as files: no Docker engine
runs here, so these tests check what can go wrong without building: versions that disagree with pyproject.toml,
paths that are not in the repository, a second install path, a root user, the wrong port."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[1]
CONTAINERS = PROJECT_ROOT / "containers"
DOCKERFILES = {"gpu": CONTAINERS / "Dockerfile.gpu", "gpu-pytorch": CONTAINERS / "Dockerfile.gpu-pytorch",
               "cpu": CONTAINERS / "Dockerfile.cpu"}
APPTAINER_DEF = CONTAINERS / "scalelab.def"
PIN = re.compile(r"\b([A-Za-z][A-Za-z0-9_.\-]*)(?:\[[^\]]*\])?==([0-9][0-9A-Za-z.+\-]*)")


def project_pins() -> dict[str, str]:
    """Every name==version of pyproject.toml (dependencies and extras), by normalised name."""
    project = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    pins = {}
    for requirement in requirements:
        # An environment marker may follow the pin (tomli, for Python < 3.11 only).
        match = PIN.fullmatch(requirement.split(";")[0].strip())
        assert match, f"pyproject.toml has an unpinned requirement: {requirement}"
        pins[normalise(match.group(1))] = match.group(2)
    return pins


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    result, pending = [], ""
    for line in dockerfile.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        logical = pending + stripped
        pending = ""
        keyword, _, arguments = logical.partition(" ")
        result.append((keyword.upper(), arguments.strip()))
    assert not pending, f"{dockerfile.name} ends inside a continued line"
    return result


def args_of(dockerfile: Path) -> dict[str, str]:
    found = {}
    for keyword, arguments in instructions(dockerfile):
        if keyword == "ARG" and "=" in arguments:
            name, _, value = arguments.partition("=")
            found[name] = value
    return found


def copy_sources(dockerfile: Path) -> list[str]:
    sources = []
    for keyword, arguments in instructions(dockerfile):
        if keyword in ("COPY", "ADD"):
            words = [w for w in shlex.split(arguments) if not w.startswith("--")]
            assert len(words) >= 2, f"{dockerfile.name}: {keyword} {arguments} has no destination"
            sources += words[:-1]
    return sources


def ignore_patterns(dockerfile: Path) -> list[str]:
    ignore_file = dockerfile.with_name(dockerfile.name + ".dockerignore")
    return [line.strip() for line in ignore_file.read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def excluded_by_dockerignore(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches decides; `!` re-includes. Directories match their contents."""
    excluded = False
    path = path.rstrip("/")
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if pattern == "**" or fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/"):
            excluded = not negate
    return excluded


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_every_path_an_image_copies_exists_and_reaches_the_build_context(flavour):
    dockerfile = DOCKERFILES[flavour]
    sources = copy_sources(dockerfile)
    assert sources, f"{dockerfile.name} copies nothing"
    patterns = ignore_patterns(dockerfile)
    for source in sources:
        assert (PROJECT_ROOT / source).exists(), f"{dockerfile.name} copies {source}, which is not in the repository"
        assert not excluded_by_dockerignore(source, patterns), \
            f"{dockerfile.name} copies {source}, but its .dockerignore leaves it out of the build context"


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_images_keep_the_reference_solution_out(flavour):
    patterns = ignore_patterns(DOCKERFILES[flavour])
    assert excluded_by_dockerignore("assessment/solution/assessment.py", patterns)
    assert not excluded_by_dockerignore("assessment/assessment.py", patterns)


def test_every_version_the_container_files_name_agrees_with_pyproject():
    pins = project_pins()
    named = 0
    for path in [*DOCKERFILES.values(), APPTAINER_DEF, CONTAINERS / "README.md"]:
        for name, version in PIN.findall(path.read_text()):
            named += 1
            assert normalise(name) in pins, f"{path.name} pins {name}=={version}, which pyproject.toml does not pin"
            assert pins[normalise(name)] == version, \
                f"{path.name} pins {name}=={version}; pyproject.toml pins {pins[normalise(name)]}"
    # The images install through pyproject.toml, so they are expected to name no version of their own.
    assert named == 0


def test_gpu_image_is_ngc_tensorflow_with_the_projects_tensorflow_and_horovod():
    dockerfile = DOCKERFILES["gpu"]
    args = args_of(dockerfile)
    froms = [arguments for keyword, arguments in instructions(dockerfile) if keyword == "FROM"]
    assert froms == ["nvcr.io/nvidia/tensorflow:${NGC_TENSORFLOW_TAG}"]
    assert re.fullmatch(r"\d\d\.\d\d-tf2-py3", args["NGC_TENSORFLOW_TAG"]), args["NGC_TENSORFLOW_TAG"]
    pins = project_pins()
    minor = lambda version: version.split(".")[:2]  # noqa: E731
    # The comment says which versions the tag ships; setup.sh --framework-from-base stops the build on others.
    text = dockerfile.read_text()
    shipped = re.search(r"ships TensorFlow (\d+\.\d+\.\d+).*?with Horovod (\d+\.\d+\.\d+)", text, re.DOTALL)
    assert minor(shipped.group(1)) == minor(pins["tensorflow-cpu"]) == minor(pins["tensorflow"])
    assert shipped.group(2) == pins["horovod"]
    assert args["NGC_TENSORFLOW_TAG"] in text.split("ARG NGC_TENSORFLOW_TAG")[0]


def test_pytorch_gpu_image_is_ngc_pytorch_kept_with_horovod_built_against_it():
    dockerfile = DOCKERFILES["gpu-pytorch"]
    args = args_of(dockerfile)
    froms = [arguments for keyword, arguments in instructions(dockerfile) if keyword == "FROM"]
    assert froms == ["nvcr.io/nvidia/pytorch:${NGC_PYTORCH_TAG}"]
    assert re.fullmatch(r"\d\d\.\d\d-py3", args["NGC_PYTORCH_TAG"]), args["NGC_PYTORCH_TAG"]
    text = dockerfile.read_text()
    # The comment says which PyTorch the tag is expected to carry, and that it was not pulled; setup.sh
    # --torch-from-base stops the build on any other minor release.
    expected = re.search(rf"{re.escape(args['NGC_PYTORCH_TAG'].split('-')[0])} is the release expected to carry "
                         r"PyTorch (\d+\.\d+)", text)
    assert expected and expected.group(1) == ".".join(project_pins()["torch"].split(".")[:2])
    assert "was not pulled" in text
    runs = [" ".join(arguments.split()) for keyword, arguments in instructions(dockerfile) if keyword == "RUN"]
    assert runs[:2] == [
        "containers/setup.sh --system-python --torch-from-base --gpu --dependencies-only "
        "&& rm -rf /root/.cache/pip /var/lib/apt/lists/*",
        "containers/setup.sh --system-python --torch-from-base --gpu --skip-apt && rm -rf /root/.cache/pip"]
    # The course set up as in the other images, once Ubuntu 24.04's own account of uid 1000 is out of the way.
    normalised = lambda steps: [(keyword, " ".join(arguments.split())) for keyword, arguments in steps]  # noqa: E731
    ours, cpu = normalised(course_steps(dockerfile)), normalised(course_steps(DOCKERFILES["cpu"]))
    assert ours[0] == ("RUN", "if id -u ubuntu >/dev/null 2>&1; then userdel --remove ubuntu; fi && " + cpu[0][1])
    assert [step for step in ours[1:] if step[0] != "ENV"] == [step for step in cpu[1:] if step[0] != "ENV"]
    assert copy_sources(dockerfile) == copy_sources(DOCKERFILES["cpu"])
    # The Assess button grades on every GPU with DDP there.
    env_line = " ".join(arguments for keyword, arguments in instructions(dockerfile) if keyword == "ENV")
    track = dict(re.findall(r"(\w+)=(\S+)", env_line))["SCALELAB_TRACK"]
    from scalelab.grader import spec
    gpu_track = spec.load_track(track)
    assert (gpu_track.framework, gpu_track.launcher, gpu_track.ranks) == ("pytorch", "torchrun", spec.ALL_GPUS)


def setup_sh(*options: str, python: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {name: value for name, value in os.environ.items()
           if name not in ("SCALELAB_EDITION", "PYTHONPATH", "VIRTUAL_ENV")}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([str(CONTAINERS / "setup.sh"), *options], capture_output=True, text=True, timeout=120,
                          env={**env, "PYTHON": python})


def fake_torch(tmp_path: Path, version: str, cuda: str | None) -> Path:
    package = tmp_path / "site" / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"from . import version\n__version__ = {version!r}\n")
    (package / "version.py").write_text(f"cuda = {cuda!r}\n")
    return package.parent


@pytest.mark.parametrize("base, message", [
    ("no torch", "cannot import PyTorch"),
    ("2.9.0a0+5228986c39.nv25.09 12.9", "the base ships PyTorch 2.9.0a0+5228986c39.nv25.09; the course pins PyTorch "),
    ("cpu build", "a CPU build (no CUDA); the GPU image needs NVIDIA's CUDA build"),
])
def test_setup_with_the_bases_pytorch_stops_before_installing_anything_on_another_release_or_a_cpu_build(
        tmp_path, base, message):
    python, pythonpath = sys.executable, None
    if base == "no torch":
        pythonpath = tmp_path / "site"
        (pythonpath / "torch").mkdir(parents=True)
        (pythonpath / "torch" / "__init__.py").write_text("raise ImportError('no module named torch here')\n")
    elif base == "cpu build":
        pythonpath = fake_torch(tmp_path, f"{project_pins()['torch']}+cpu", None)
    else:
        version, cuda = base.split()
        pythonpath = fake_torch(tmp_path, version, cuda)
    done = setup_sh("--system-python", "--torch-from-base", "--gpu", "--skip-apt", python=python,
                    pythonpath=pythonpath)
    assert done.returncode == 1, done.stdout + done.stderr
    assert message in done.stderr, done.stderr
    assert "Edition: PyTorch only (--torch-from-base: the base's PyTorch, no TensorFlow)" in done.stdout
    assert "Installing" not in done.stdout  # stopped before pip or apt-get ran


def test_cpu_image_installs_through_the_setup_script_that_make_setup_and_ci_run():
    dockerfile = DOCKERFILES["cpu"]
    froms = [arguments for keyword, arguments in instructions(dockerfile) if keyword == "FROM"]
    assert froms == ["python:3.11-slim-bookworm"]
    python = re.search(r"python:(\d+)\.(\d+)", froms[0]).groups()
    requires = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    low, high = re.fullmatch(r">=(\d+\.\d+),<(\d+\.\d+)", requires).groups()
    as_tuple = lambda text: tuple(int(part) for part in text.split("."))  # noqa: E731
    assert as_tuple(low) <= tuple(map(int, python)) < as_tuple(high)
    runs = [arguments for keyword, arguments in instructions(dockerfile) if keyword == "RUN"]
    assert any(re.match(r"containers/setup\.sh --system-python(\s|$)", run) for run in runs), runs
    assert "containers/setup.sh" in copy_sources(dockerfile)
    # setup.sh builds Horovod with the patches in containers/patches/: the image must have them too.
    assert "containers/patches/" in copy_sources(dockerfile)
    assert not any("pip install" in run for run in runs), "the CPU image must not install packages on its own"
    # The script the image runs is the one CI runs: .ci/run → make test → make setup → containers/setup.sh.
    assert "make test" in (PROJECT_ROOT / ".ci" / "run").read_text()
    makefile = (PROJECT_ROOT / "Makefile").read_text()
    assert re.search(r"^test: setup\b", makefile, re.MULTILINE)
    assert re.search(r"^\tcontainers/setup\.sh\b", makefile, re.MULTILINE)


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_images_serve_jupyterlab_on_8888_as_a_non_root_user(flavour):
    steps = instructions(DOCKERFILES[flavour])
    users = [arguments for keyword, arguments in steps if keyword == "USER"]
    assert users, "no USER: the image would run as root"
    assert users[-1] not in ("root", "0") and not users[-1].startswith(("root:", "0:"))
    assert [keyword for keyword, _ in steps].index("USER") > max(
        i for i, (keyword, _) in enumerate(steps) if keyword == "RUN"), "commands after USER would need root"
    assert ("EXPOSE", "8888") in steps
    command = json.loads(dict(steps)["CMD"])
    assert command[:2] == ["jupyter", "lab"] and "--ServerApp.port=8888" in command
    assert "--ServerApp.ip=0.0.0.0" in command  # the container's own network: reachable through -p only
    assert f"docker run {'--gpus all ' if flavour.startswith('gpu') else ''}--rm -p 127.0.0.1:8888:8888" in \
        DOCKERFILES[flavour].read_text()


def test_images_enable_the_assess_service_extension_that_the_grader_provides():
    config = json.loads((CONTAINERS / "jupyter_server_config.json").read_text())
    extensions = [name for name, enabled in config["ServerApp"]["jpserver_extensions"].items() if enabled]
    assert extensions == ["scalelab.grader.serve"]
    assert (PROJECT_ROOT / "grader" / "serve.py").is_file(), "the Assess service module grader/serve.py is missing"
    for dockerfile in DOCKERFILES.values():
        assert ("COPY", "containers/jupyter_server_config.json "
                        "/etc/jupyter/jupyter_server_config.d/scalelab.json") in instructions(dockerfile)


def test_apptainer_definition_bootstraps_from_the_gpu_image_and_documents_run_nv():
    text = APPTAINER_DEF.read_text()
    header = dict(re.findall(r"^(Bootstrap|From):\s*(\S+)", text, re.MULTILINE))
    assert header["Bootstrap"] == "docker-daemon"
    tag = re.search(r"docker build -f containers/Dockerfile\.gpu -t (\S+) \.", DOCKERFILES["gpu"].read_text()).group(1)
    assert header["From"] == tag, "the definition must start from the image Dockerfile.gpu documents building"
    assert "apptainer run --nv scalelab.sif" in text
    sections = set(re.findall(r"^%(\w+)", text, re.MULTILINE))
    assert {"environment", "runscript", "test"} <= sections
    runscript = text.split("%runscript", 1)[1].split("\n%", 1)[0]
    assert "jupyter lab" in runscript and "8888" in runscript


def test_container_readme_covers_gpu_server_laptop_and_hpc_site():
    readme = (CONTAINERS / "README.md").read_text()
    for heading in ("## On a GPU server", "## On a laptop", "## On an HPC site"):
        assert heading in readme
    for command in ("docker run --gpus all", "docker build -f containers/Dockerfile.cpu",
                    "apptainer run --nv scalelab.sif", "horovodrun -np 8 -H", "srun --nodes=2"):
        assert command in readme


# --- where JupyterLab listens -------------------------------------------------------------------------------------


def run_lines(text: str) -> list[str]:
    """Every `docker run` / `podman run` command in a text (README code, a Dockerfile's comment), on one line."""
    joined = re.sub(r"\\\n[\s#]*", "", text)
    return [re.sub(r"\s+", " ", line.strip(" #")) for line in joined.splitlines()
            if re.match(r"\s*#?\s*(docker|podman) run ", line)]


DOCUMENTS = [PROJECT_ROOT / "README.md", CONTAINERS / "README.md", *DOCKERFILES.values(), CONTAINERS / "setup.sh"]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(PROJECT_ROOT)))
def test_every_documented_run_line_publishes_on_loopback_only(document):
    lines = run_lines(document.read_text())
    assert lines, f"{document.name} has no run line"
    for line in lines:
        published = re.findall(r"(?:-p|--publish) (\S+)", line)
        assert published and all(port.startswith("127.0.0.1:") for port in published), line


def test_readme_gives_the_run_lines_of_containers_readme_which_tests_test_image_runs():
    laptop = (CONTAINERS / "README.md").read_text().split("## On a laptop", 1)[1].split("\n## ", 1)[0]
    expected = run_lines(laptop)
    assert [line.split()[0] for line in expected] == ["docker", "podman"], expected
    assert set(expected) <= set(run_lines((PROJECT_ROOT / "README.md").read_text()))
    podman, docker = expected[1], expected[0]
    assert "--security-opt 'unmask=/proc/*'" in podman and "unmask=ALL" not in podman
    assert "systempaths" not in podman and "apparmor" not in podman
    assert "--security-opt systempaths=unconfined" in docker
    # The same container otherwise: the image, the data and the volume.
    assert podman.split("--security-opt")[0] == docker.split("--security-opt")[0].replace("docker", "podman")
    assert podman.split()[-3:] == docker.split()[-3:]


def test_apptainer_serves_the_nodes_loopback_unless_told_otherwise():
    runscript = APPTAINER_DEF.read_text().split("%runscript", 1)[1].split("\n%", 1)[0]
    assert '--ServerApp.ip="${SCALELAB_LAB_IP:-127.0.0.1}"' in runscript
    assert "0.0.0.0" not in runscript.replace("SCALELAB_LAB_IP=0.0.0.0", "")
    config = json.loads((CONTAINERS / "jupyter_server_config.json").read_text())
    assert config["ServerApp"]["ip"] == "127.0.0.1"  # any other jupyter started in the images


# --- lint, and one install path ------------------------------------------------------------------------------------


def tool(name: str) -> str:
    """A linter from the test extra (pyproject.toml pins it; `make setup` installs it into the venv)."""
    found = shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if found is None:
        pytest.fail(f"{name} is missing: it comes with the test extra (make setup, or pip install -e '.[test]')")
    return found


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_dockerfiles_pass_hadolint(flavour):
    linted = subprocess.run([tool("hadolint"), "--config", str(CONTAINERS / "hadolint.yaml"),
                             str(DOCKERFILES[flavour])], capture_output=True, text=True, timeout=120)
    assert linted.returncode == 0, linted.stdout + linted.stderr


def apptainer_sections(text: str) -> dict[str, str]:
    parts = re.split(r"^%(\w+)[^\n]*\n", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def test_apptainer_definition_is_well_formed_and_its_scripts_pass_shellcheck():
    text = APPTAINER_DEF.read_text()
    header = text.split("\n%", 1)[0]
    keys = re.findall(r"^(\w+):", header, re.MULTILINE)
    assert keys == ["Bootstrap", "From"], keys
    sections = apptainer_sections(text)
    known = {"setup", "files", "environment", "post", "runscript", "startscript", "test", "labels", "help",
             "arguments"}
    assert set(sections) <= known, set(sections) - known
    for name in ("environment", "runscript", "test", "post", "setup", "startscript"):
        if name in sections:  # Apptainer runs these with /bin/sh
            checked = subprocess.run([tool("shellcheck"), "--shell=sh", "-"], input=sections[name],
                                     capture_output=True, text=True, timeout=120)
            assert checked.returncode == 0, f"%{name}:\n{checked.stdout}"


def test_container_scripts_pass_shellcheck():
    scripts = sorted(str(path) for path in CONTAINERS.rglob("*.sh"))
    checked = subprocess.run([tool("shellcheck"), *scripts], capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0, checked.stdout


def course_steps(dockerfile: Path) -> list[tuple[str, str]]:
    """What an image does once its stack is installed: the student's account and course, the settings, the server."""
    steps = instructions(dockerfile)
    first = next(i for i, (keyword, arguments) in enumerate(steps)
                 if keyword == "RUN" and re.search(r"(^|&& )useradd ", arguments))
    return steps[first:]


def test_both_images_install_through_setup_sh_and_set_up_the_course_alike():
    runs = {flavour: [" ".join(arguments.split()) for keyword, arguments in instructions(path) if keyword == "RUN"]
            for flavour, path in DOCKERFILES.items()}
    # The dependencies in a layer that needs only the pins, then the course on them.
    assert runs["cpu"][:2] == [
        "containers/setup.sh --system-python --dependencies-only && rm -rf /root/.cache/pip /var/lib/apt/lists/*",
        "containers/setup.sh --system-python --skip-apt && rm -rf /root/.cache/pip"]
    assert runs["gpu"][:2] == [
        "containers/setup.sh --system-python --framework-from-base --dependencies-only "
        "&& rm -rf /root/.cache/pip /var/lib/apt/lists/*",
        "containers/setup.sh --system-python --framework-from-base --skip-apt && rm -rf /root/.cache/pip"]
    for flavour, path in DOCKERFILES.items():  # the course's sources come after the dependencies' layer
        steps = instructions(path)
        first_run = next(i for i, (keyword, _) in enumerate(steps) if keyword == "RUN")
        before = [arguments.split()[0] for keyword, arguments in steps[:first_run] if keyword == "COPY"]
        assert before == ["pyproject.toml", "containers/setup.sh", "containers/patches/"], (flavour, before)
    for flavour in DOCKERFILES:  # nothing installed around setup.sh
        assert not any(re.search(r"pip install|apt-get", run) for run in runs[flavour]), runs[flavour]
    assert copy_sources(DOCKERFILES["gpu"]) == copy_sources(DOCKERFILES["cpu"])
    assert course_steps(DOCKERFILES["gpu"]) == course_steps(DOCKERFILES["cpu"])


def test_what_the_gpu_image_installs_from_ubuntu_is_what_make_setup_installs_to_run_the_course():
    setup = (CONTAINERS / "setup.sh").read_text()
    packages = lambda name: set(re.search(rf"^{name}=\(([^)]*)\)", setup, re.MULTILINE).group(1).split())  # noqa: E731
    # util-linux (setpriv) is essential in Debian and Ubuntu, so the full list never needs to name it.
    assert packages("runtime_packages") - {"util-linux"} <= packages("apt_packages")
    assert {"bubblewrap", "procps", "dataset-fashion-mnist"} <= packages("runtime_packages")


def test_apptainer_definition_runs_the_course_as_the_images_do():
    sections = apptainer_sections(APPTAINER_DEF.read_text())
    exported = dict(re.findall(r'^\s*export (\w+)="?([^"\n]*)"?', sections["environment"], re.MULTILINE))
    env_line = " ".join(arguments for keyword, arguments in instructions(DOCKERFILES["gpu"]) if keyword == "ENV")
    image_env = dict(re.findall(r"(\w+)=(\S+)", env_line))
    for name, value in image_env.items():
        assert name in exported, f"scalelab.def does not export {name}"
        if name != "SCALELAB_HOME":  # the image is read-only under Apptainer: state goes to the user's home
            assert value in exported[name], (name, value, exported[name])
    command = json.loads(dict(instructions(DOCKERFILES["gpu"]))["CMD"])
    runscript = sections["runscript"]
    for argument in command:
        if not argument.startswith(("--ServerApp.ip=", "--ServerApp.port=", "--ServerApp.root_dir=")):
            assert argument in runscript, argument


# --- make image-cpu -------------------------------------------------------------------------------------------------


def engine_path(tmp_path: Path, **engines: str) -> str:
    """A PATH with the machine's basic tools and shims for the engines given (name → script body); no other engine."""
    shims = tmp_path / "shims"
    shims.mkdir(exist_ok=True)
    for tool in ("bash", "sh", "env", "dirname", "sed", "head", "readlink", "cat", "make", "mkdir"):
        found = shutil.which(tool)
        if found and not (shims / tool).exists():
            (shims / tool).symlink_to(found)
    for name, body in engines.items():
        (shims / name).write_text(f"#!/bin/bash\n{body}\n")
        (shims / name).chmod(0o755)
    return str(shims)


def build_image(tmp_path: Path, path: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-C", str(PROJECT_ROOT), "image-cpu", *(f"{k}={v}" for k, v in env.items())],
                          capture_output=True, text=True, timeout=60, env={"PATH": path, "HOME": str(tmp_path)})


def test_make_image_cpu_without_an_engine_says_what_to_install(tmp_path):
    built = build_image(tmp_path, engine_path(tmp_path))
    assert built.returncode != 0
    assert "no container engine: install Docker" in built.stderr and "apt-get install podman runc" in built.stderr
    silent_docker = engine_path(tmp_path, docker='[ "$1" = info ] && exit 1; exit 0')
    built = build_image(tmp_path, silent_docker)
    assert built.returncode != 0 and "no Docker daemon answers" in built.stderr


def test_make_image_cpu_uses_docker_when_its_daemon_answers_and_keeps_the_dockerfiles_from(tmp_path):
    log = tmp_path / "docker.log"
    path = engine_path(tmp_path, docker=f'echo "$@" >> {log}', podman="exit 99")
    built = build_image(tmp_path, path)
    assert built.returncode == 0, built.stderr
    assert log.read_text().splitlines()[-1] == "build -f containers/Dockerfile.cpu -t scalelab:cpu ."
    built = build_image(tmp_path, path, IMAGE_BASE="localhost/base")
    assert built.returncode != 0 and "IMAGE_BASE=localhost/base needs podman" in built.stderr


def test_make_image_cpu_with_podman_builds_on_a_local_base_with_the_hosts_flags(tmp_path):
    log = tmp_path / "podman.log"
    bundle = tmp_path / "ca.pem"
    bundle.write_text("certificates")
    # pip's local wheel folder on this host, holding PyTorch's pinned CPU build
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / f"torch-{project_pins()['torch']}+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    path = engine_path(tmp_path, podman=f'echo "$@" >> {log}', runc="exit 0")
    built = build_image(tmp_path, path, IMAGE_BASE="localhost/base", IMAGE_CA_BUNDLE=str(bundle),
                        PIP_FIND_LINKS=f"{wheels} {tmp_path}/missing")
    assert built.returncode == 0, built.stderr
    argv = log.read_text().splitlines()
    assert argv[0] == "image exists localhost/base"
    build = argv[-1].split()
    assert build[:3] == ["--runtime", "runc", "build"] and build[-1] == "."
    command = " ".join(build)
    for expected in ("--from localhost/base", "-f containers/Dockerfile.cpu -t scalelab:cpu",
                     "--ignorefile containers/Dockerfile.cpu.dockerignore", "--network host",
                     f"--volume {bundle}:/etc/ssl/certs/ca-certificates.crt:ro", "--ulimit nofile=", "--ulimit nproc=",
                     # the Horovod wheels `make setup` compiled on this machine (HOME is tmp_path here)
                     f"--volume {tmp_path.resolve()}/.cache/scalelab/horovod-wheels:"
                     "/root/.cache/scalelab/horovod-wheels",
                     # the wheel folder (not the missing one), and no index for PyTorch's CPU build, which it holds
                     f"--volume {wheels.resolve()}:{wheels.resolve()}:ro",
                     f"--build-arg SCALELAB_WHEELS={wheels.resolve()}",
                     "--build-arg SCALELAB_TORCH_INDEX= "):
        assert expected in command, command
    assert "missing" not in command, command
    (wheels / f"torch-{project_pins()['torch']}+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").unlink()
    built = build_image(tmp_path, path, IMAGE_BASE="localhost/base", PIP_FIND_LINKS=str(wheels))
    assert built.returncode == 0, built.stderr
    command = log.read_text().splitlines()[-1]
    assert f"--build-arg SCALELAB_WHEELS={wheels.resolve()}" in command and "SCALELAB_TORCH_INDEX" not in command
