"""The container recipes (containers/Dockerfile.gpu, Dockerfile.cpu, scalelab.def) read as files: no Docker engine
runs here, so these tests check what can go wrong without building: versions that disagree with pyproject.toml,
paths that are not in the repository, a second install path, a root user, the wrong port."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[1]
CONTAINERS = PROJECT_ROOT / "containers"
DOCKERFILES = {"gpu": CONTAINERS / "Dockerfile.gpu", "cpu": CONTAINERS / "Dockerfile.cpu"}
APPTAINER_DEF = CONTAINERS / "scalelab.def"
PIN = re.compile(r"\b([A-Za-z][A-Za-z0-9_.\-]*)(?:\[[^\]]*\])?==([0-9][0-9A-Za-z.+\-]*)")


def project_pins() -> dict[str, str]:
    """Every name==version of pyproject.toml (dependencies and extras), by normalised name."""
    project = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    pins = {}
    for requirement in requirements:
        match = PIN.fullmatch(requirement.strip())
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
    assert minor(args["TENSORFLOW_VERSION"]) == minor(pins["tensorflow-cpu"]) == minor(pins["tensorflow"])
    assert args["HOROVOD_VERSION"] == pins["horovod"]
    # The comment says which versions the tag ships; it must name the same ones the build checks.
    text = dockerfile.read_text()
    assert f"TensorFlow {args['TENSORFLOW_VERSION']}" in text and f"Horovod {args['HOROVOD_VERSION']}" in text
    assert args["NGC_TENSORFLOW_TAG"] in text.split("ARG NGC_TENSORFLOW_TAG")[0]
    # The build verifies the base's versions before and after installing the course (pip must not replace them).
    run = " ".join(arguments for keyword, arguments in instructions(dockerfile) if keyword == "RUN")
    assert run.count("${TENSORFLOW_VERSION}") >= 2 and run.count("${HOROVOD_VERSION}") >= 2
    assert re.search(r"pip install [^&]*-e /opt/scalelab(\s|$)", run), "the course is installed without an extra"
    assert "[gpu" not in run and "[cpu" not in run, "an extra would install a TensorFlow wheel over NGC's"


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
    assert "--ServerApp.ip=0.0.0.0" in command  # reachable through -p 8888:8888
    assert f"docker run {'--gpus all ' if flavour == 'gpu' else ''}--rm -p 8888:8888" in \
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
