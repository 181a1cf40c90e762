#!/usr/bin/env bash
# Builds a ScaleLab image from the repository root with whichever container engine this machine has: Docker when
# its daemon answers, else podman. `make image-cpu` runs it.
#
#   containers/build-image.sh cpu|gpu [TAG]      (default tag scalelab:cpu / scalelab:gpu)
#   containers/build-image.sh --podman-flags     the flags this host needs: podman's own (line 1), `run`'s (line 2)
#   containers/build-image.sh --torch-wheel-folders   pip's local wheel folders that hold PyTorch's pinned CPU build
#
#   IMAGE_ENGINE=docker|podman   choose the engine instead of finding one
#   IMAGE_BASE=NAME              build on a local image instead of the Dockerfile's FROM (podman only:
#                                `podman build --from NAME`; the Dockerfile keeps its FROM for everyone else).
#                                containers/debian-base.sh makes one where no registry can be reached.
#   IMAGE_CA_BUNDLE=FILE         the certificates the build's downloads trust (podman: mounted over the image's
#                                bundle during the build only). Default: the host's, $SSL_CERT_FILE or
#                                /etc/ssl/certs/ca-certificates.crt, so a build behind a TLS-inspecting proxy works.
#   SCALELAB_TORCH_INDEX=URL     where the CPU image takes PyTorch's CPU build (default: PyTorch's CPU index, or none
#                                where this host's wheel folders below already hold it)
#
# Under podman the build runs with runc when it is installed (crun refuses a cgroup v1/hybrid host), with the host's
# hard limits on open files and processes (podman's defaults can exceed them: "setrlimit ...: Operation not
# permitted") and on the host's network, as apt and pip on the host reach their mirrors,
# and with this machine's Horovod wheel cache and pip's local wheel folders (its find-links) mounted: no compiling
# when `make setup` already did, and the wheels this host's pip has that no index the build reaches may have.
set -euo pipefail

# podman's default limits can exceed the host's hard ones; the host's open files, and as many processes as podman's
# own build default (larger ones were refused here although the hard limit allowed them).
podman_ulimits() {
    local files processes
    files="$(ulimit -Hn)" processes="$(ulimit -Hu)"
    [ "$files" = unlimited ] && files=1048576
    if [ "$processes" = unlimited ] || [ "$processes" -gt 32768 ]; then processes=32768; fi
    echo "--ulimit nofile=$files:$files --ulimit nproc=$processes:$processes"
}

podman_run=()
read -r -a podman_run <<<"$(podman_ulimits)"
# runc when it is installed: crun refuses a cgroup v1 or hybrid host ("cgroups in hybrid mode not supported").
podman_global=()
if [ -n "${PODMAN_RUNTIME:-}" ]; then
    podman_global=(--runtime "$PODMAN_RUNTIME")
elif command -v runc >/dev/null; then
    podman_global=(--runtime runc)
fi
if [ "${1:-}" = --podman-flags ]; then
    echo "${podman_global[*]}"
    echo "${podman_run[*]}"
    exit 0
fi

# pip's local wheel folders (its find-links), resolved, one a line; and whether one holds PyTorch's pinned CPU build.
pip_wheel_folders() {
    local folder
    for folder in ${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}; do
        folder="${folder#file://}"
        if [ -d "$folder" ]; then readlink -f "$folder"; fi
    done
}
torch_version="$(sed -n 's/.*"torch==\([^"]*\)".*/\1/p' "$(dirname "${BASH_SOURCE[0]}")/../pyproject.toml" | head -n 1)"
holds_torch_cpu() { compgen -G "$1/torch-$torch_version+cpu-*.whl" >/dev/null; }
if [ "${1:-}" = --torch-wheel-folders ]; then
    while read -r folder; do if holds_torch_cpu "$folder"; then echo "$folder"; fi; done < <(pip_wheel_folders)
    exit 0
fi

flavour="${1:-}"
case "$flavour" in
    cpu|gpu) ;;
    *) echo "usage: containers/build-image.sh cpu|gpu [TAG], --podman-flags or --torch-wheel-folders" >&2; exit 2 ;;
esac
tag="${2:-scalelab:$flavour}"
project_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dockerfile="containers/Dockerfile.$flavour"
fail() { echo "build-image.sh: $*" >&2; exit 1; }

engine="${IMAGE_ENGINE:-}"
if [ -z "$engine" ]; then
    if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
        engine=docker
    elif command -v podman >/dev/null; then
        engine=podman
    elif command -v docker >/dev/null; then
        fail "docker is installed but no Docker daemon answers (docker info fails), and podman is not installed:" \
            "start Docker, or install podman (Debian/Ubuntu: apt-get install podman runc)"
    else
        fail "no container engine: install Docker (https://docs.docker.com/engine/install/) or podman" \
            "(Debian/Ubuntu: apt-get install podman runc), or run the course without an image: make lab"
    fi
fi
case "$engine" in
    docker|podman) command -v "$engine" >/dev/null || fail "IMAGE_ENGINE=$engine, but $engine is not installed" ;;
    *) fail "IMAGE_ENGINE is docker or podman, not '$engine'" ;;
esac

cd "$project_root"
if [ "$engine" = docker ]; then
    if [ -n "${IMAGE_BASE:-}" ]; then
        fail "IMAGE_BASE=$IMAGE_BASE needs podman (podman build --from); with Docker, tag that image as the" \
            "Dockerfile's FROM ($(sed -n 's/^FROM //p' "$dockerfile" | head -n 1)) instead"
    fi
    set -x
    exec docker build -f "$dockerfile" -t "$tag" .
fi

build=(build --network host --ignorefile "$dockerfile.dockerignore" -f "$dockerfile" -t "$tag")
build+=("${podman_run[@]}")
ca_bundle="${IMAGE_CA_BUNDLE:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}"
if [ -n "${IMAGE_CA_BUNDLE:-}" ] && [ ! -f "$ca_bundle" ]; then fail "IMAGE_CA_BUNDLE=$ca_bundle is not a file"; fi
if [ -f "$ca_bundle" ]; then
    build+=(--volume "$(readlink -f "$ca_bundle"):/etc/ssl/certs/ca-certificates.crt:ro")
fi
# The Horovod wheels `make setup` compiled on this machine: the build installs a matching one instead of compiling
# for minutes (setup.sh compiles anyway when it does not load in the image), and keeps what it compiles there.
wheel_cache="$(dirname "${SCALELAB_BOOTSTRAP_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/scalelab/bootstrap}")/horovod-wheels"
mkdir -p "$wheel_cache"
build+=(--volume "$(readlink -f "$wheel_cache"):/root/.cache/scalelab/horovod-wheels")
# pip's local wheel folders, read-only at the same paths, for setup.sh (SCALELAB_WHEELS); where one holds PyTorch's
# pinned CPU build, the build needs no index for it.
torch_index=()
if [ -n "${SCALELAB_TORCH_INDEX+set}" ]; then torch_index=(--build-arg "SCALELAB_TORCH_INDEX=$SCALELAB_TORCH_INDEX"); fi
wheel_folders=()
while read -r folder; do
    wheel_folders+=("$folder")
    build+=(--volume "$folder:$folder:ro")
    if [ -z "${SCALELAB_TORCH_INDEX+set}" ] && holds_torch_cpu "$folder"; then
        torch_index=(--build-arg "SCALELAB_TORCH_INDEX=")
    fi
done < <(pip_wheel_folders)
if [ ${#wheel_folders[@]} -gt 0 ]; then build+=(--build-arg "SCALELAB_WHEELS=${wheel_folders[*]}"); fi
build+=(${torch_index[@]+"${torch_index[@]}"})
if [ -n "${IMAGE_BASE:-}" ]; then
    podman image exists "$IMAGE_BASE" || fail "IMAGE_BASE=$IMAGE_BASE is not an image podman has" \
        "(containers/debian-base.sh $IMAGE_BASE makes a Debian 12 one)"
    build+=(--from "$IMAGE_BASE")
fi
set -x
exec podman ${podman_global[@]+"${podman_global[@]}"} "${build[@]}" .
