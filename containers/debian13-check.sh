#!/usr/bin/env bash
# The course on a fresh Debian 13 host (Python 3.13, for which TensorFlow 2.15.1 has no wheel): `make setup` installs
# the PyTorch edition there where no Python 3.11 can be had (uv cannot fetch one from here), and `make test` runs the
# suite with the Keras tests skipped, each with the reason. The host is a podman container of the image
# `containers/debian-base.sh --suite trixie` makes with debootstrap: Debian's minimal system, its Python 3.13 and
# make, nothing of the course. It gets a copy of this checkout's committed files, the CIFAR-10 folder
# SCALELAB_CIFAR10_DIR names (read-only), this machine's certificates (SSL_CERT_FILE, which uv and pip both read,
# names them: a proxy that inspects TLS signs with them) and a network of its own (podman network scalelab-debian13,
# reaching out through podman's NAT): its own podman, which runs test_image's containers, makes its bridge on
# 10.88.0.0/16 as on any host, so the host must not sit on that subnet, as it would on this machine's network or on
# podman's default one. It runs privileged, as a host's root would (the grader's sandbox, the Hub's accounts and
# Slurm need it).
#
#   containers/debian13-check.sh [--keep | --again] [PYTEST_ARGUMENT...]   (default: the whole suite, as make test)
#
#   --keep    leave the host standing afterwards (container and network scalelab-debian13, its copy of the course
#             in /var/tmp/scalelab-debian13), for --again
#   --again   run the tests again on the host --keep left (make setup finds everything installed), and keep it
#
# PyPI's torch for Linux is the CUDA build, the one a host without PyTorch's CPU index can have
# (SCALELAB_TORCH_BUILD=default); SCALELAB_TORCH_INDEX passes PyTorch's CPU index on instead where it is reachable.
# The CPU image test_image builds there (Debian 12, Python 3.11) takes PyTorch's CPU build: where this machine's pip
# finds it in a local wheel folder, that folder is shown to the host read-only, and named to `make test` only
# (PIP_FIND_LINKS, which containers/build-image.sh reads), never to the host's own `make setup`.
# It prints how long `make setup` took and what the venv weighs, then make test's summary.
# Exit codes: make test's; 3 when make setup failed; 1 when the host could not be made; 2 bad usage or not root.
set -euo pipefail

project_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
image=localhost/scalelab-host:trixie
name=scalelab-debian13
checkout=/var/tmp/scalelab-debian13
# The host's own podman storage (test_image builds the CPU image there): on this machine's disk, since podman's
# overlay driver cannot stack on the container's own overlay root.
storage=/var/tmp/scalelab-debian13-containers
network=scalelab-debian13
subnet=10.213.13.0/24
mode=once
case "${1:-}" in
    --keep) mode=keep; shift ;;
    --again) mode=again; shift ;;
esac
if [ "$(id -u)" != 0 ]; then
    echo "debian13-check.sh: run as root (podman's image store and a privileged container need it)" >&2
    exit 2
fi
if [ -z "${SCALELAB_CIFAR10_DIR:-}" ] || [ ! -d "$SCALELAB_CIFAR10_DIR" ]; then
    echo "debian13-check.sh: SCALELAB_CIFAR10_DIR must name the CIFAR-10 folder the tests use" >&2
    exit 2
fi

# podman's own flags and `run`'s that this machine needs (runc, its limits), as for the course's images.
mapfile -t host_flags < <("$project_root/containers/build-image.sh" --podman-flags)
read -r -a podman_global <<<"${host_flags[0]}"
read -r -a podman_run <<<"${host_flags[1]}"
podman() { command podman "${podman_global[@]}" "$@"; }

if [ "$mode" = again ]; then
    if ! podman container exists "$name"; then
        echo "debian13-check.sh: no host kept (run with --keep first)" >&2
        exit 2
    fi
    podman start "$name" >/dev/null
else
    podman rm --force "$name" >/dev/null 2>&1 || true
    "$project_root/containers/debian-base.sh" --suite trixie "$image" || exit 1
    podman network exists "$network" || podman network create --subnet "$subnet" "$network" >/dev/null || exit 1
    # A fresh clone of the committed files, Git's history with them (the Hub's tests check that students cannot
    # read it).
    rm -rf "$checkout" "$storage" && mkdir -p "$storage"
    git clone --quiet --no-hardlinks "$project_root" "$checkout"
    bundle="$(realpath "${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}")"
    mapfile -t wheel_folders < <("$project_root/containers/build-image.sh" --torch-wheel-folders)
    wheel_mounts=()
    for folder in ${wheel_folders[@]+"${wheel_folders[@]}"}; do wheel_mounts+=(--volume "$folder:$folder:ro"); done
    # PID 1 reaps the orphans it inherits, as a host's init does: the tests check that a stopped run leaves no
    # process behind, and a zombie nobody reaps (`sleep infinity` as PID 1) would count as one.
    reaping_init='trap "exit 0" TERM; while :; do sleep 86400 & wait; done'
    podman run --detach --name "$name" --privileged --user root --network "$network" "${podman_run[@]}" \
        --volume "$checkout:/scalelab" --volume "$storage:/var/lib/containers" \
        --volume "$bundle:/etc/ssl/certs/ca-certificates.crt:ro" \
        --volume "$SCALELAB_CIFAR10_DIR:/data/cifar10:ro" --env SCALELAB_CIFAR10_DIR=/data/cifar10 \
        --env SCALELAB_TORCH_INDEX="${SCALELAB_TORCH_INDEX:-}" --env SCALELAB_TORCH_BUILD="${SCALELAB_TORCH_BUILD:-}" \
        --env SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt --env CI=true --workdir /scalelab \
        ${wheel_mounts[@]+"${wheel_mounts[@]}"} --env SCALELAB_IMAGE_WHEELS="${wheel_folders[*]}" \
        "$image" bash -c "$reaping_init" >/dev/null
fi
if [ "$mode" = once ]; then
    trap 'podman rm --force "$name" >/dev/null 2>&1; podman network rm "$network" >/dev/null 2>&1
          rm -rf "$checkout" "$storage"' EXIT
fi

# shellcheck disable=SC2016  # expanded inside the container
inside='set -uo pipefail
export SCALELAB_TORCH_BUILD="${SCALELAB_TORCH_BUILD:-default}"
started=$(date +%s)
if ! make setup; then
    echo "debian13-check: make setup failed after $(( $(date +%s) - started )) s"; exit 3
fi
echo "debian13-check: make setup took $(( $(date +%s) - started )) s on $(nproc) cores; .venv is $(du -sh .venv | cut -f1)"
.venv/bin/scalelab doctor || true
if [ -n "${SCALELAB_IMAGE_WHEELS:-}" ]; then export PIP_FIND_LINKS="$SCALELAB_IMAGE_WHEELS"; fi
make test PYTEST_ARGS="-rs --durations=30 $*"'
podman exec --workdir /scalelab "$name" bash -c "$inside" debian13-check "$@"
