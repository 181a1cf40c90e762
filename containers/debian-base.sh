#!/usr/bin/env bash
# Makes a local stand-in for python:3.11-slim-bookworm where no registry can be pulled from: a Debian 12 (bookworm)
# made by debootstrap from the Debian mirror apt's sources already name, imported into podman. Debian's Python 3.11 is
# linked where the official image has its own (/usr/local/bin/python3) and pip may install into it, as there.
# `make image-cpu IMAGE_BASE=NAME` then builds containers/Dockerfile.cpu on it (`podman build --from NAME`).
# With --suite trixie: a fresh Debian 13 host instead, as debootstrap leaves it (Python 3.13, `make`, nothing of the
# course), on which containers/debian13-check.sh runs `make setup` and `make test`.
#
#   containers/debian-base.sh [--suite bookworm|trixie] [NAME]
#                                        (default localhost/scalelab-base:bookworm, localhost/scalelab-host:trixie)
#
# Needs root. Installs podman, runc and debootstrap when missing, and nftables where podman's netavark needs it.
# Idempotent: an existing image NAME is kept.
# Exit codes: 0 the image exists; 1 it could not be made (the reason is printed); 2 bad usage or not root.
set -euo pipefail

suite=bookworm
if [ "${1:-}" = --suite ]; then suite="${2:-}"; shift 2 || true; fi
case "$suite" in
    bookworm) name="${1:-localhost/scalelab-base:bookworm}" ;;
    trixie) name="${1:-localhost/scalelab-host:trixie}" ;;
    *) echo "usage: containers/debian-base.sh [--suite bookworm|trixie] [NAME]" >&2; exit 2 ;;
esac
say() { printf '==> %s\n' "$*"; }
fail() { echo "debian-base.sh: $*" >&2; exit 1; }

if [ $# -gt 1 ] || [[ "$name" == -* ]]; then
    echo "usage: containers/debian-base.sh [--suite bookworm|trixie] [NAME]" >&2
    exit 2
fi
if [ "$(id -u)" != 0 ]; then
    echo "debian-base.sh: run as root (debootstrap and podman's image store need it)" >&2
    exit 2
fi

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
missing=()
for package in podman runc debootstrap; do
    installed "$package" || missing+=("$package")
done
if [ ${#missing[@]} -gt 0 ]; then
    say "Installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# Podman 5 (Debian 13) publishes a container's ports through netavark, whose firewall driver runs `nft`: nftables
# is only recommended, so a host without it can build images but not run one with --publish.
if installed netavark && ! command -v nft >/dev/null; then
    say "Installing nftables (netavark publishes ports with it)"
    [ ${#missing[@]} -gt 0 ] || apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nftables >/dev/null
fi

if podman image exists "$name"; then
    say "$name exists: kept (podman rmi $name to make it again)"
    exit 0
fi

# The mirror apt already uses for the host's own release (not -updates or -security), as apt reads its sources:
# Debian's mirrors carry bookworm and trixie alike, whichever of them (or a later one) the host runs.
# shellcheck disable=SC2016  # $(RELEASE) and $(REPO_URI) are apt's placeholders, not the shell's
mirror="$(apt-get indextargets --format '$(RELEASE) $(REPO_URI)' 'Identifier: Packages' 2>/dev/null |
    awk '$1 ~ /^[a-z]+$/ && $2 !~ /security/ { print $2; exit }')"
[ -n "$mirror" ] || fail "apt's sources name no Debian mirror (apt-get indextargets lists none for a release)"
packages=python3,python3-venv,python3-pip,ca-certificates
if [ "$suite" = trixie ]; then packages+=,make; fi

root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
say "debootstrap $suite from $mirror"
if ! debootstrap --variant=minbase --include="$packages" "$suite" "$root" "$mirror" > "$root.log" 2>&1; then
    tail -n 20 "$root.log" >&2
    rm -f "$root.log"
    fail "debootstrap failed (its log ends above)"
fi
rm -f "$root.log"
if [ "$suite" = bookworm ]; then
    # Where python:3.11-slim-bookworm has its interpreter; and pip may install into it (that image has no
    # EXTERNALLY-MANAGED marker either).
    ln -sf /usr/bin/python3.11 "$root/usr/local/bin/python3"
    ln -sf /usr/bin/python3.11 "$root/usr/local/bin/python"
    rm -f "$root"/usr/lib/python3.*/EXTERNALLY-MANAGED
    # Nor does apt keep what it downloads there (Debian's images are configured so): without this, an image built on
    # this base carries a few hundred MB of .deb files and package caches in its layers.
    clean='rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true'
    printf '%s\n' "DPkg::Post-Invoke { \"$clean\"; };" "APT::Update::Post-Invoke { \"$clean\"; };" \
        'Dir::Cache::pkgcache "";' 'Dir::Cache::srcpkgcache "";' > "$root/etc/apt/apt.conf.d/docker-clean"
fi
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*

say "Importing it as $name"
tar -C "$root" -c . | podman import --quiet --change 'CMD ["python3"]' - "$name" >/dev/null
say "$name ready ($(podman image inspect --format '{{.Size}}' "$name") bytes)"
