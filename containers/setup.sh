#!/usr/bin/env bash
# Installs the ScaleLab stack: Debian packages, a virtual environment with the pinned Python packages,
# Horovod compiled against TensorFlow with Gloo and MPI, and a check of Horovod's build.
# Used by `make setup`, by CI and by the CPU container image: the one install path of the project.
#
#   containers/setup.sh [--venv DIR] [--gpu] [--system-python] [--skip-apt]
#
#   --venv DIR        where the virtual environment goes (default: .venv in the project root)
#   --gpu             tensorflow[and-cuda] and Horovod with NCCL instead of the CPU build
#   --system-python   install into the current interpreter instead of a venv (container images)
#   --skip-apt        do not check or install Debian packages
set -euo pipefail

project_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$project_root/.venv"
flavour=cpu
use_venv=1
do_apt=1
while [ $# -gt 0 ]; do
    case "$1" in
        --venv) venv="$2"; shift 2 ;;
        --gpu) flavour=gpu; shift ;;
        --system-python) use_venv=0; shift ;;
        --skip-apt) do_apt=0; shift ;;
        *) echo "setup.sh: unknown option '$1'" >&2; exit 2 ;;
    esac
done

say() { printf '\033[1m==> %s\033[0m\n' "$*"; }

# Debian packages: the MPI Horovod links against, its build tools (and `patch` for containers/patches/),
# offline Fashion-MNIST, the grader's sandbox, Chromium for the browser tests, and Slurm + munge (the Slurm
# backend and its tests).
apt_packages=(openmpi-bin libopenmpi-dev cmake g++ make patch dataset-fashion-mnist bubblewrap chromium procps slurm-wlm slurm-client munge)
if [ "$do_apt" = 1 ]; then
    missing=()
    for package in "${apt_packages[@]}"; do
        dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        if [ "$(id -u)" != 0 ]; then
            echo "setup.sh: these Debian packages are missing: ${missing[*]}" >&2
            echo "Ask an administrator to run, then run this again:" >&2
            echo "  sudo apt-get update && sudo apt-get install -y ${missing[*]}" >&2
            exit 1
        fi
        say "Installing Debian packages: ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
    fi
fi

if [ "$use_venv" = 1 ]; then
    if [ ! -x "$venv/bin/python" ]; then
        say "Creating the virtual environment $venv"
        python3 -m venv "$venv"
    fi
    python="$venv/bin/python"
else
    python="$(command -v python3)"
fi
pip=("$python" -m pip --disable-pip-version-check)

# The pins live in pyproject.toml; read them from there rather than repeating them here.
pin() {
    "$python" - "$project_root/pyproject.toml" "$1" <<'PY'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
pins = project["dependencies"] + [p for extra in project["optional-dependencies"].values() for p in extra]
name = sys.argv[2]
for requirement in pins:
    if re.match(re.escape(name) + r"(\[.*\])?==", requirement):
        print(requirement)
        break
else:
    sys.exit(f"no pin for {name} in pyproject.toml")
PY
}

if [ "$use_venv" = 1 ]; then
    "${pip[@]}" install -q --upgrade "pip==25.3" "wheel==0.45.1" "setuptools==80.9.0"
fi

if [ "$flavour" = gpu ]; then
    tensorflow_pin="$(pin tensorflow)"
    horovod_gpu=(HOROVOD_GPU_OPERATIONS=NCCL)
else
    tensorflow_pin="$(pin tensorflow-cpu)"
    horovod_gpu=()
fi
installed_version() {
    "$python" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$1" 2>/dev/null || true
}
tensorflow_version="${tensorflow_pin##*==}"
if [ "$(installed_version "${tensorflow_pin%%[[=]*}")" != "$tensorflow_version" ]; then
    say "Installing $tensorflow_pin"
    "${pip[@]}" install -q "$tensorflow_pin"
fi

horovod_pin="$(pin horovod)"
horovod_version="${horovod_pin#horovod==}"
# Horovod is built from its sdist with the fixes in containers/patches/ applied. They set the local version label
# below, which tells a patched build from a plain one (pip still takes it for the horovod==X.Y.Z pin).
horovod_build="$horovod_version+scalelab.1"
if [ "$(installed_version horovod)" != "$horovod_build" ]; then
    say "Building Horovod $horovod_build against TensorFlow with Gloo and MPI (a few minutes)"
    horovod_source="$(mktemp -d)"
    trap 'rm -rf "$horovod_source"' EXIT
    "${pip[@]}" download -q --no-deps --no-binary :all: --no-build-isolation -d "$horovod_source" "$horovod_pin"
    tar -xzf "$horovod_source/horovod-$horovod_version.tar.gz" -C "$horovod_source"
    for fix in "$project_root"/containers/patches/horovod-"$horovod_version"-*.patch; do
        patch --quiet --forward -p1 -d "$horovod_source/horovod-$horovod_version" < "$fix"
    done
    # --no-build-isolation: Horovod's CMake must import the TensorFlow installed above.
    env HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
        HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 MAKEFLAGS="-j$(nproc)" "${horovod_gpu[@]}" \
        "${pip[@]}" install -q --no-build-isolation "$horovod_source/horovod-$horovod_version"
    if [ "$(installed_version horovod)" != "$horovod_build" ]; then
        echo "setup.sh: built Horovod $(installed_version horovod), expected $horovod_build (the patches set it)" >&2
        exit 1
    fi
fi

say "Installing the course and its pinned dependencies"
"${pip[@]}" install -q -e "$project_root[$flavour,test]"

export TF_CPP_MIN_LOG_LEVEL=2
say "Checking Horovod's build"
horovodrun="$(dirname "$python")/horovodrun"
build="$("$horovodrun" --check-build)"
for framework in TensorFlow MPI Gloo; do
    if ! grep -q "\[X\] $framework" <<<"$build"; then
        echo "$build" >&2
        echo "setup.sh: Horovod was built without $framework; remove it (pip uninstall horovod) and run again." >&2
        exit 1
    fi
done
say "ScaleLab stack ready ($python)"
