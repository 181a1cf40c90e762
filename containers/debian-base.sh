#!/usr/bin/env bash
# Makes a local stand-in for python:3.11-slim-bookworm where no registry can be pulled from: a Debian 12 (bookworm)
# made by debootstrap from the Debian mirror apt's sources already name, imported into podman. Debian's Python 3.11 is
# linked where the official image has its own (/usr/local/bin/python3) and pip may install into it, as there.
# `make image-cpu IMAGE_BASE=NAME` then builds containers/Dockerfile.cpu on it (`podman build --from NAME`).
#
#   containers/debian-base.sh [NAME]     (default localhost/scalelab-base:bookworm)
#
# Needs root. Installs podman, runc and debootstrap when missing. Idempotent: an existing image NAME is kept.
# Exit codes: 0 the image exists; 1 it could not be made (the reason is printed); 2 bad usage or not root.
set -euo pipefail

name="${1:-localhost/scalelab-base:bookworm}"
suite=bookworm
say() { printf '==> %s\n' "$*"; }
fail() { echo "debian-base.sh: $*" >&2; exit 1; }

if [ $# -gt 1 ] || [[ "$name" == -* ]]; then
    echo "usage: containers/debian-base.sh [NAME]" >&2
    exit 2
fi
if [ "$(id -u)" != 0 ]; then
    echo "debian-base.sh: run as root (debootstrap and podman's image store need it)" >&2
    exit 2
fi

missing=()
for package in podman runc debootstrap; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if [ ${#missing[@]} -gt 0 ]; then
    say "Installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if podman image exists "$name"; then
    say "$name exists: kept (podman rmi $name to make it again)"
    exit 0
fi

# The mirror apt already uses for bookworm itself (not -updates or -security), as apt reads its sources.
# shellcheck disable=SC2016  # $(RELEASE) and $(REPO_URI) are apt's placeholders, not the shell's
mirror="$(apt-get indextargets --format '$(RELEASE) $(REPO_URI)' 'Identifier: Packages' 2>/dev/null |
    awk -v suite="$suite" '$1 == suite { print $2; exit }')"
[ -n "$mirror" ] || fail "apt's sources name no Debian mirror for $suite (apt-get indextargets lists none)"

root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
say "debootstrap $suite from $mirror"
if ! debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
        "$suite" "$root" "$mirror" > "$root.log" 2>&1; then
    tail -n 20 "$root.log" >&2
    rm -f "$root.log"
    fail "debootstrap failed (its log ends above)"
fi
rm -f "$root.log"
# Where python:3.11-slim-bookworm has its interpreter; and pip may install into it (that image has no
# EXTERNALLY-MANAGED marker either).
ln -sf /usr/bin/python3.11 "$root/usr/local/bin/python3"
ln -sf /usr/bin/python3.11 "$root/usr/local/bin/python"
rm -f "$root"/usr/lib/python3.*/EXTERNALLY-MANAGED
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*

say "Importing it as $name"
tar -C "$root" -c . | podman import --quiet --change 'CMD ["python3"]' - "$name" >/dev/null
say "$name ready ($(podman image inspect --format '{{.Size}}' "$name") bytes)"
