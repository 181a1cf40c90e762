#!/usr/bin/env bash
# Installs the ScaleLab stack: Debian packages, a virtual environment with the pinned Python packages,
# Horovod compiled against TensorFlow and PyTorch with Gloo and MPI, and a check of Horovod's build.
# Used by `make setup`, by CI and by every container image: the one install path of the project.
#
#   containers/setup.sh [--venv DIR] [--gpu] [--hub] [--system-python] [--framework-from-base] [--torch-from-base]
#                       [--skip-apt] [--dependencies-only] [--choose-python] [--choose-installer]
#
#   --venv DIR          where the virtual environment goes (default: .venv in the project root)
#   --hub               the environment of a class server (`make hub`): the course installed as a copy rather than in
#                       editable mode, so that students' servers never need to read the checkout (it holds the
#                       solutions)
#   --gpu               tensorflow[and-cuda], PyTorch's default (CUDA) build and Horovod with NCCL instead of the CPU
#                       builds
#   --system-python     install into the chosen interpreter instead of a venv (container images), without what only
#                       the test suite runs (Chromium, a one-node Slurm, the test extra)
#   --framework-from-base  keep the TensorFlow and Horovod the interpreter already has (the GPU image: NVIDIA's NGC
#                       build, with NCCL); stop unless they are the pinned releases (TensorFlow's minor release,
#                       Horovod exactly), install only what the course runs with from Debian/Ubuntu, and the course
#                       with the rest of the pins, no extra
#   --torch-from-base   the PyTorch edition on the PyTorch the interpreter already has (the PyTorch GPU image:
#                       NVIDIA's NGC build, with CUDA and NCCL); stop unless it is the pinned minor release (and a
#                       CUDA build with --gpu); Horovod is built against it, with NCCL under --gpu; no extra
#   --skip-apt          do not check or install Debian packages
#   --dependencies-only  everything but the course itself: Debian packages, TensorFlow, Horovod and the pins of
#                       pyproject.toml (needs pyproject.toml only: an image installs these in a layer of their own,
#                       which its engine rebuilds only when the pins or this script change, not when the course does)
#   --choose-python     only choose the interpreter: print which and why, exit 0 (1 with the reason when none works)
#   --choose-installer  only say whether the pinned packages would be installed with uv or pip, and why
#
# The interpreter: TensorFlow 2.15.1 has wheels for Python 3.10 and 3.11 only, so the whole course (its Keras and
# its PyTorch edition) needs one of those; on Python 3.12 or 3.13 the PyTorch edition alone is installed (no
# TensorFlow: the Keras labs and tracks are left out). pyproject.toml's requires-python is 3.10 to 3.13.
#   1. an existing venv whose python runs 3.10 to 3.13 is kept;
#   2. PYTHON=/path (the environment, or `make setup PYTHON=/path`), 3.10 to 3.13;
#   3. python3 if it is 3.10 or 3.11, then python3.11, then python3.10 on PATH;
#   4. a CPython 3.11 managed by uv (uv is pip-installed into ~/.cache/scalelab/bootstrap; the interpreter goes
#      where `uv python install` puts it, ~/.local/share/uv/python unless UV_PYTHON_INSTALL_DIR says otherwise);
#   5. where none of those can be had: python3, python3.13 or python3.12 on PATH, for the PyTorch edition.
#   SCALELAB_EDITION=pytorch installs the PyTorch edition alone on whichever interpreter: steps 3 and 4 take any
#   of 3.10 to 3.13 then (python3, python3.13, python3.12, python3.11, python3.10), and uv fetches none.
#   A venv outside the invoking user's home is taken to be one other accounts run (a hub under /opt): it is never
#   made from an interpreter under a directory they cannot enter; Debian's /usr/bin/python3.11 is taken instead.
#   Where nothing works, the script stops before installing anything and says what to do.
#   (SCALELAB_SHARED_PYTHONS names those shared interpreters, SCALELAB_BOOTSTRAP_DIR where uv goes.)
# SCALELAB_INSTALLER=pip installs with pip even where uv could (see choose_installer below).
# SCALELAB_TORCH_BUILD=default takes PyPI's torch (with its CUDA libraries) on a CPU host too, where PyTorch's CPU
#   build cannot be had (no index of it reachable); cpu (the default on a CPU host) insists on the CPU build.
# SCALELAB_TORCH_INDEX is an extra package index for PyTorch alone. PyPI's torch for Linux is the CUDA build (GBs of
#   NVIDIA libraries); on a CPU-only host set it to PyTorch's CPU wheel index, https://download.pytorch.org/whl/cpu,
#   whose torch==X+cpu the pin takes. Unset, torch comes from pip's configured indexes like everything else.
# SCALELAB_WHEELS: local folders of wheels PyTorch may also come from (an image build: the host's, mounted).
set -euo pipefail

project_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$project_root/.venv"
flavour=cpu
use_venv=1
framework_source=build
do_apt=1
hub=0
dependencies_only=0
only=""
while [ $# -gt 0 ]; do
    case "$1" in
        --venv) venv="$2"; shift 2 ;;
        --gpu) flavour=gpu; shift ;;
        --hub) hub=1; shift ;;
        --system-python) use_venv=0; shift ;;
        --framework-from-base) framework_source=base; shift ;;
        --torch-from-base) framework_source="torch-base"; shift ;;
        --skip-apt) do_apt=0; shift ;;
        --dependencies-only) dependencies_only=1; shift ;;
        --choose-python) only=python; shift ;;
        --choose-installer) only=installer; shift ;;
        *) echo "setup.sh: unknown option '$1'" >&2; exit 2 ;;
    esac
done

say() { printf '\033[1m==> %s\033[0m\n' "$*"; }
fail() { echo "setup.sh: $*" >&2; exit 1; }
last_line() {  # the last thing a tool said, without its "error:" or "cause:"
    printf '%s\n' "$1" | sed -e '/^[[:space:]]*$/d' -e 's/^[[:space:]]*\(error\|cause\|ERROR\): *//' | tail -n 1
}

# pyproject.toml's requires-python (tests/test_setup_python.py checks they agree); TensorFlow 2.15.1, and so the
# Keras edition, has wheels for the first two only.
supported_pythons="3.10 3.11 3.12 3.13"
keras_pythons="3.10 3.11"
case "${SCALELAB_EDITION:-}" in
    ""|pytorch) edition_wanted="${SCALELAB_EDITION:-}" ;;
    *) echo "setup.sh: SCALELAB_EDITION is pytorch (the PyTorch edition alone) or unset, not '$SCALELAB_EDITION'" >&2
       exit 2 ;;
esac
# A base that brings PyTorch brings no TensorFlow for it (NVIDIA's PyTorch image): the PyTorch edition.
if [ "$framework_source" = torch-base ]; then edition_wanted=pytorch; fi
case "${SCALELAB_TORCH_BUILD:-}" in
    ""|cpu|default) ;;
    *) echo "setup.sh: SCALELAB_TORCH_BUILD is cpu or default, not '$SCALELAB_TORCH_BUILD'" >&2; exit 2 ;;
esac
# A tool for setting up only, not part of the course's environment: it fetches a Python 3.11 where the machine
# has none, and installs the pinned packages much faster than pip.
uv_pin="uv==0.13.8"
bootstrap_dir="${SCALELAB_BOOTSTRAP_DIR:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/scalelab/bootstrap}"
uv="$bootstrap_dir/bin/uv"
# Interpreters every account can run (Debian's and Ubuntu's), for a venv that other accounts use.
shared_pythons="${SCALELAB_SHARED_PYTHONS:-/usr/bin/python3.11 /usr/bin/python3.10}"
# The way out where no interpreter works: the CPU image, built and run as containers/README.md says.
# shellcheck disable=SC2016  # $HOME is for the reader's shell
image_commands='docker build -f containers/Dockerfile.cpu -t scalelab:cpu .
  docker run --rm -p 127.0.0.1:8888:8888 --shm-size=1g --security-opt seccomp=unconfined --security-opt apparmor=unconfined --security-opt systempaths=unconfined -v "$HOME/cifar10:/data/cifar10:ro" -v scalelab-home:/home/scalelab/.scalelab scalelab:cpu'

# "3.11 /usr/bin/python3.11": the version and sys.executable of an interpreter; nothing when it does not run.
probe() {
    "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2], sys.executable)' 2>/dev/null | head -n 1 || true
}
joined() { local IFS=';' all; all="$*"; echo "${all//;/; }"; }
described() { if [ -n "$1" ]; then echo "Python $1"; else echo "not a Python that runs"; fi; }
is_supported() { [ -n "$1" ] && [[ " $supported_pythons " == *" $1 "* ]]; }
has_keras() { [ -n "$1" ] && [[ " $keras_pythons " == *" $1 "* ]]; }
# What the search on PATH takes: TensorFlow's Pythons for the whole course, any supported one for the PyTorch edition.
is_wanted() { if [ "$edition_wanted" = pytorch ]; then is_supported "$1"; else has_keras "$1"; fi; }

# The first directory (or the file itself) on the way to PATH that other accounts cannot enter or run.
closed_to_others() {
    local path mode
    path="$(readlink -f "$1" 2>/dev/null)" || return 0
    while [ -n "$path" ]; do
        mode="$(stat -c %A "$path" 2>/dev/null)" || return 0
        case "${mode:9:1}" in x|t) ;; *) echo "$path"; return 0 ;; esac
        [ "$path" = / ] && return 0
        path="$(dirname "$path")"
    done
}
# ... of an interpreter: as named, its sys.executable and its standard library.
closed_dirs() {
    local path closed paths=()
    mapfile -t paths < <("$1" 2>/dev/null -c \
        'import sys, sysconfig; print(sys.executable, sysconfig.get_path("stdlib"), sep="\n")')
    for path in "$1" "${paths[@]}"; do
        closed="$(closed_to_others "$path")"
        if [ -n "$closed" ]; then echo "$closed"; return 0; fi
    done
}
inside_home() {
    local home target
    [ -n "${HOME:-}" ] || return 1
    home="$(readlink -m "$HOME")"
    target="$(readlink -m "$1")"
    [ "$home" != / ] && { [ "$target" = "$home" ] || [[ "$target" == "$home"/* ]]; }
}

# uv in its own small venv, made by the interpreter $1. Sets uv_problem and fails when it cannot be had.
ensure_uv() {
    local bootstrap_python output
    if [ -x "$uv" ] && [ "$("$uv" --version 2>/dev/null | cut -d' ' -f2)" = "${uv_pin#uv==}" ]; then
        return 0
    fi
    bootstrap_python="$(command -v "$1" 2>/dev/null)" || { uv_problem="there is no $1 to install uv with"; return 1; }
    say "Installing $uv_pin into $bootstrap_dir"
    if ! output="$("$bootstrap_python" -m venv --clear "$bootstrap_dir" 2>&1)"; then
        uv_problem="$1 -m venv failed to make a venv for uv ($(last_line "$output");"
        uv_problem+=" Debian and Ubuntu: apt-get install python3-venv)"
        return 1
    fi
    if ! output="$("$bootstrap_dir/bin/python" -m pip install -q --disable-pip-version-check "$uv_pin" 2>&1)"; then
        uv_problem="pip could not install $uv_pin ($(last_line "$output"))"
        return 1
    fi
}

managed_find() {  # uv's own CPython 3.11, never a venv's: from /, with no VIRTUAL_ENV
    (cd / && env -u VIRTUAL_ENV "$uv" python find --managed-python --no-project 3.11 2>/dev/null) || true
}

# Sets python_base (the interpreter to make the venv from, or to install into with --system-python),
# python_version, python_why and keep_venv; or stops, before anything is installed, saying what to do.
choose_python() {
    local version="" executable="" found candidate tried=()
    keep_venv=0
    given=""
    if [ -n "${PYTHON:-}" ]; then
        given="$(command -v -- "$PYTHON" 2>/dev/null)" || true
        if [ -z "$given" ] || [ ! -f "$given" ]; then
            fail "PYTHON=$PYTHON is not an interpreter (no such executable file);" \
                "give the path of a Python 3.10 to 3.13, e.g. PYTHON=/usr/bin/python3.11."
        fi
        read -r version executable <<<"$(probe "$given")" || true
        if ! is_supported "$version"; then
            fail "PYTHON=$PYTHON is $(described "$version"); the course runs on Python 3.10 to 3.13 (its Keras" \
                "edition on 3.10 and 3.11 only, where TensorFlow 2.15.1 has wheels): give one of those."
        fi
    fi

    if [ "$use_venv" = 1 ] && { [ -e "$venv/bin/python" ] || [ -L "$venv/bin/python" ]; }; then
        read -r version executable <<<"$(probe "$venv/bin/python")" || true
        if ! is_supported "$version"; then
            fail "$venv exists but its python is $(described "$version"); the course runs on Python 3.10 to 3.13:" \
                "remove it (rm -rf $venv) and run this again."
        fi
        python_base="$venv/bin/python" python_version="$version" keep_venv=1
        python_why="the virtual environment $venv exists: kept${given:+ (PYTHON= only makes a new one)}"
        return 0
    fi

    if [ -n "$given" ]; then
        python_base="$given" python_version="$version" python_why="given by PYTHON="
        return 0
    fi

    local candidates=(python3 python3.11 python3.10)
    if [ "$edition_wanted" = pytorch ]; then candidates=(python3 python3.13 python3.12 python3.11 python3.10); fi
    for candidate in "${candidates[@]}"; do
        if ! found="$(command -v "$candidate" 2>/dev/null)"; then
            tried+=("$candidate is missing")
            continue
        fi
        read -r version executable <<<"$(probe "$found")" || true
        tried+=("$candidate is ${version:-broken}")
        if is_wanted "$version"; then
            # sys.executable rather than a version manager's shim, which may pick another Python elsewhere
            if [ -n "$executable" ] && [ -x "$executable" ]; then found="$executable"; fi
            python_base="$found" python_version="$version"
            python_why="$(joined "${tried[@]}")"
            return 0
        fi
    done

    local why_none
    if [ "$edition_wanted" = pytorch ]; then
        fail "no Python 3.10 to 3.13 on PATH ($(joined "${tried[@]}")) for SCALELAB_EDITION=pytorch; install one" \
            "or give one with PYTHON=/path/to/python3"
    fi
    why_none="no Python 3.10 or 3.11 on PATH ($(joined "${tried[@]}"))"
    if [ "$use_venv" = 0 ]; then
        uv_problem="--system-python installs into an interpreter the machine has, not a fetched one"
    elif ensure_uv python3; then
        found="$(managed_find)"
        if [ -z "$found" ]; then
            say "Fetching a CPython 3.11 with uv: $why_none"
            local output
            if output="$("$uv" python install --no-bin 3.11 2>&1)"; then
                found="$(managed_find)"
            else
                uv_problem="uv could not fetch a CPython 3.11 ($(last_line "$output"))"
            fi
        fi
        if [ -n "$found" ]; then
            read -r version executable <<<"$(probe "$found")" || true
            if is_supported "$version"; then
                python_base="$found" python_version="$version"
                python_why="a CPython managed by uv: $why_none"
                return 0
            fi
            uv_problem="uv's CPython 3.11 ($found) does not run"
        fi
    fi
    # No Python for TensorFlow can be had: the machine's own 3.12 or 3.13 takes the PyTorch edition.
    for candidate in python3 python3.13 python3.12; do
        found="$(command -v "$candidate" 2>/dev/null)" || continue
        read -r version executable <<<"$(probe "$found")" || true
        if is_supported "$version" && ! has_keras "$version"; then
            if [ -n "$executable" ] && [ -x "$executable" ]; then found="$executable"; fi
            python_base="$found" python_version="$version"
            python_why="$why_none and ${uv_problem:-uv found none}: $candidate for the PyTorch edition"
            return 0
        fi
    done
    fail "$why_none and ${uv_problem:-uv found none}, nor a Python 3.12 or 3.13 for the PyTorch edition; install a" \
        "Python 3.11 (python3.11, python3.11-venv and python3.11-dev from your distribution or the deadsnakes PPA)," \
        "give one with PYTHON=/path/to/python3.11, or use the CPU image (from the repository root):"$'\n'"" \
        " $image_commands"
}

# A venv outside the invoking user's home is one other accounts run (a multi-user hub under /opt, say): made from
# an interpreter under a directory they cannot enter (a home of mode 0700), it fails for them with
# "Permission denied". Take a shared interpreter instead, or stop.
check_shared() {
    local closed shared version executable message real
    if [ "$use_venv" = 0 ] || inside_home "$venv"; then return 0; fi
    closed="$(closed_dirs "$python_base")"
    [ -n "$closed" ] || return 0
    if [ "$keep_venv" = 1 ]; then
        say "Note: $venv is outside your home, but its Python is under $closed, which other accounts cannot enter;" \
            "to let them run it, remove it and run this again"
        return 0
    fi
    real="$(readlink -f "$python_base")"
    [ "$real" != "$python_base" ] || real=""
    message="$python_base${real:+ ($real)} is under $closed, which other accounts cannot enter,"
    message+=" and a venv outside your home ($venv) is for them too"
    if [ -n "$given" ]; then
        fail "PYTHON=$PYTHON: $message; give an interpreter every account can run (e.g. /usr/bin/python3.11)," \
            "or put the venv under your home."
    fi
    for shared in $shared_pythons; do
        [ -x "$shared" ] || continue
        read -r version executable <<<"$(probe "$shared")" || true
        # (never a Python without TensorFlow in place of one with it)
        if is_supported "$version" && { has_keras "$version" || ! has_keras "$python_version"; } \
                && [ -z "$(closed_dirs "$shared")" ]; then
            say "Note: $message: taking $shared instead"
            python_base="$shared" python_version="$version"
            python_why="$python_why, but under $closed: this one every account can run"
            return 0
        fi
    done
    if [[ "$python_why" == "a CPython managed by uv"* ]]; then
        message+=" (UV_PYTHON_INSTALL_DIR can put uv's Python where they can)"
    fi
    fail "$message, and there is no ${shared_pythons// / or } that they can run; install Debian's python3.11" \
        "(apt-get install python3.11 python3.11-venv python3.11-dev), give PYTHON= an interpreter every account" \
        "can run, or put the venv under your home."
}

# uv installs the pinned packages several times faster than pip but reads none of pip's configuration (pip.conf,
# PIP_* variables): it is taken only where every setting pip would apply to `pip install` has a uv equivalent
# (indexes, find-links, constraints, certificates, trusted hosts, proxy, timeout), and pip otherwise.
# Horovod is always built by pip: the compiler is its slow part. Sets installer, installer_why, uv_args, uv_env
# (variables to set) and uv_unset.
choose_installer() {
    local translation kind value
    installer=pip uv_args=() uv_env=() uv_unset=()
    if [ "${SCALELAB_INSTALLER:-}" = pip ]; then
        installer_why="SCALELAB_INSTALLER=pip"
        return 0
    fi
    if [ "$use_venv" = 0 ]; then
        installer_why="--system-python: an image keeps uv's cache in its layer (the Dockerfile removes pip's)"
        return 0
    fi
    if ! translation="$("$python" - <<'PY'
import ast, os, subprocess, sys

def keep_pip(why):
    print(why)
    sys.exit(1)

listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
if listing.returncode != 0:
    keep_pip(f"`pip config list` failed: {(listing.stderr.strip().splitlines() or ['?'])[-1]}")
# What `pip install` applies: [global], then [install], then PIP_* variables (pip's own order).
rank = {"global": 0, "install": 1, ":env:": 2}
found = []
for line in listing.stdout.splitlines():
    key, _, value = line.partition("=")
    section, _, name = key.rpartition(".")
    if section in rank:
        found.append((rank[section], name, ast.literal_eval(value)))
settings = {name: value for _, name, value in sorted(found, key=lambda item: item[0])}

def true(value):
    return value.strip().lower() in ("1", "true", "yes", "on")

def local_path_missing(location):
    path = location[len("file://"):] if location.startswith("file://") else location
    return "://" not in path and not os.path.exists(path)

# Settings that change nothing about what gets installed.
harmless = {"disable-pip-version-check", "no-cache-dir", "cache-dir", "quiet", "verbose", "progress-bar",
            "no-input", "retries", "root-user-action", "no-color", "no-python-version-warning", "yes", "log",
            "config-file", "require-virtualenv", "exists-action", "no-warn-script-location", "no-warn-conflicts"}
args, env, untranslated = [], {}, []
for name, value in settings.items():
    if name == "index-url":
        args += ["--index-url", value]
    elif name == "extra-index-url":
        for url in value.split():
            args += ["--extra-index-url", url]
    elif name == "find-links":
        for location in value.split():
            if not local_path_missing(location):  # pip skips a missing one with a warning, uv would stop
                args += ["--find-links", location]
    elif name == "constraint":
        for path in value.split():  # pip's build environments read the same configuration
            args += ["--constraint", path, "--build-constraint", path]
    elif name == "trusted-host":
        for host in value.split():
            args += ["--allow-insecure-host", host]
    elif name == "no-index":
        args += ["--no-index"] if true(value) else []
    elif name == "pre":
        args += ["--prerelease", "allow"] if true(value) else []
    elif name in ("only-binary", "no-binary"):
        args += [f"--{name}", value]
    elif name == "break-system-packages":
        args += ["--break-system-packages"] if true(value) else []
    elif name == "cert":
        env["SSL_CERT_FILE"] = value
    elif name == "client-cert":
        env["SSL_CLIENT_CERT"] = value
    elif name == "proxy":
        env["HTTPS_PROXY"] = env["HTTP_PROXY"] = value
    elif name in ("timeout", "default-timeout"):
        env["UV_HTTP_TIMEOUT"] = value
    elif name not in harmless:
        untranslated.append(name)
if untranslated:
    keep_pip(f"pip's configuration sets {', '.join(sorted(untranslated))}, which uv would not apply the same way")
for arg in args:
    print(f"arg\t{arg}")
for name, value in env.items():
    print(f"env\t{name}={value}")
PY
)"; then
        installer_why="$(last_line "$translation")"
        [ -n "$installer_why" ] || installer_why="pip's configuration could not be read"
        return 0
    fi
    if ! ensure_uv "$python"; then
        installer_why="$uv_problem"
        return 0
    fi
    while IFS=$'\t' read -r kind value; do
        case "$kind" in
            arg) uv_args+=("$value") ;;
            env) uv_env+=("$value") ;;
        esac
    done <<<"$translation"
    # uv then takes nothing but that: not the UV_* settings a shell may carry for other projects (its cache aside).
    local name
    for name in $(compgen -e); do
        case "$name" in
            UV_CACHE_DIR|UV_NO_CACHE|UV_LINK_MODE) ;;
            UV_*) uv_unset+=(-u "$name") ;;
        esac
    done
    installer=uv
    # (credentials in an index URL stay out of the log)
    installer_why="pip's configuration translated: ${uv_args[*]:-no options}${uv_env[*]:+ with ${uv_env[*]}}"
    installer_why="$(sed -E 's#://[^/@ ]+@#://***@#g' <<<"$installer_why")"
}
# Installs with the chosen installer what pip would install with `pip install -q ARGS`.
install_pinned() {
    if [ "$installer" = uv ]; then
        env ${uv_unset[@]+"${uv_unset[@]}"} ${uv_env[@]+"${uv_env[@]}"} \
            "$uv" --no-config pip install --quiet --python "$python" --index-strategy unsafe-best-match \
            --compile-bytecode ${uv_args[@]+"${uv_args[@]}"} "$@"
    else
        "${pip[@]}" install -q "$@"
    fi
}

choose_python
check_shared
say "Python $python_version: $python_base ($python_why)"
# The edition: the whole course where TensorFlow 2.15.1 installs, else (or when asked) the PyTorch edition alone.
edition=all
if [ "$edition_wanted" = pytorch ] || ! has_keras "$python_version"; then
    edition=pytorch
    if [ "$framework_source" = torch-base ]; then why_pytorch="--torch-from-base: the base's PyTorch, no TensorFlow"
    elif has_keras "$python_version"; then why_pytorch="SCALELAB_EDITION=pytorch"; else
        why_pytorch="TensorFlow 2.15.1 has no wheel for Python $python_version"; fi
    say "Edition: PyTorch only ($why_pytorch): the PyTorch labs and assessment tracks, without the Keras labs and" \
        "tracks, which need TensorFlow."
fi
if [ "$only" = python ]; then exit 0; fi

if [ "$use_venv" = 1 ] && [ "$keep_venv" = 1 ]; then python="$venv/bin/python"; else python="$python_base"; fi
pip=("$python" -m pip --disable-pip-version-check)
if [ "$only" = installer ]; then
    choose_installer
    say "Installer: $installer ($installer_why)"
    exit 0
fi

# "TENSORFLOW HOROVOD": the versions the interpreter $1 has, or the reason it has none.
framework_versions() {
    { "$1" -c 'import tensorflow, horovod; print(tensorflow.__version__, horovod.__version__)' 2>&1 || true; } |
        tail -n 1
}
# --framework-from-base: the base's TensorFlow and Horovod must be the releases pyproject.toml pins (read without
# tomllib, which Python 3.10 lacks); checked before anything is installed, and again after (pip must keep them).
check_base_framework() {
    local versions tensorflow horovod tensorflow_pinned horovod_pinned
    tensorflow_pinned="$(grep -oE '"tensorflow(-cpu)?(\[[^]]*\])?==[0-9.]+[";]' "$project_root/pyproject.toml" |
        head -n 1 | sed -E 's/.*==([0-9.]+)[";]/\1/')"
    horovod_pinned="$(grep -oE '"horovod==[0-9.]+"' "$project_root/pyproject.toml" | head -n 1 |
        sed -E 's/.*==([0-9.]+)"/\1/')"
    versions="$(framework_versions "$1")"
    read -r tensorflow horovod <<<"$versions" || true
    if [[ ! "$tensorflow" =~ ^[0-9]+\.[0-9]+ ]] || [[ ! "$horovod" =~ ^[0-9]+\.[0-9]+ ]]; then
        fail "--framework-from-base: $1 cannot import TensorFlow and Horovod ($versions); use a base that ships" \
            "both (NVIDIA's NGC TensorFlow image), or leave the option out to install them"
    fi
    if [ "$(cut -d. -f1-2 <<<"$tensorflow")" != "$(cut -d. -f1-2 <<<"$tensorflow_pinned")" ] \
            || [ "${horovod%%+*}" != "$horovod_pinned" ]; then
        fail "--framework-from-base: ${2:-the base ships} TensorFlow $tensorflow and Horovod $horovod; the course" \
            "pins TensorFlow $tensorflow_pinned (any $(cut -d. -f1-2 <<<"$tensorflow_pinned").x) and Horovod" \
            "$horovod_pinned (pyproject.toml)"
    fi
    say "TensorFlow $tensorflow and Horovod $horovod from the base: kept"
}
if [ "$framework_source" = base ]; then
    if [ "$edition" = pytorch ]; then
        fail "--framework-from-base keeps a base's TensorFlow and Horovod (the Keras edition), which needs Python" \
            "3.10 or 3.11, not the PyTorch edition on Python $python_version"
    fi
    check_base_framework "$python_base"
fi
# --torch-from-base: the base's PyTorch must be the minor release pyproject.toml pins (NVIDIA's builds are pre-releases
# of it, 2.13.0a0+...: any 2.13), a CUDA build for --gpu; checked before anything is installed and again after.
check_base_torch() {
    local found torch cuda torch_pinned
    torch_pinned="$(grep -oE '"torch==[0-9.]+"' "$project_root/pyproject.toml" | head -n 1 |
        sed -E 's/.*==([0-9.]+)"/\1/')"
    found="$({ "$1" -c 'import torch; print(torch.__version__, torch.version.cuda or "none")' 2>&1 || true; } |
        tail -n 1)"
    read -r torch cuda <<<"$found" || true
    if [[ ! "$torch" =~ ^[0-9]+\.[0-9]+ ]]; then
        fail "--torch-from-base: $1 cannot import PyTorch ($found); use a base that ships it (NVIDIA's NGC PyTorch" \
            "image), or leave the option out to install it"
    fi
    if [ "$(cut -d. -f1-2 <<<"$torch")" != "$(cut -d. -f1-2 <<<"$torch_pinned")" ]; then
        fail "--torch-from-base: ${2:-the base ships} PyTorch $torch; the course pins PyTorch $torch_pinned (any" \
            "$(cut -d. -f1-2 <<<"$torch_pinned").x, a pre-release of it included; pyproject.toml): take a base" \
            "release that carries it"
    fi
    if [ "$flavour" = gpu ] && [ "$cuda" = none ]; then
        fail "--torch-from-base --gpu: ${2:-the base ships} PyTorch $torch, a CPU build (no CUDA); the GPU image" \
            "needs NVIDIA's CUDA build"
    fi
    say "PyTorch $torch (CUDA $cuda) from the base: kept"
}
if [ "$framework_source" = torch-base ]; then check_base_torch "$python_base"; fi

# Debian packages: the MPI Horovod links against, its build tools (and `patch` for containers/patches/),
# offline Fashion-MNIST, the grader's sandbox and Slurm's commands (the Slurm backend).
apt_packages=(openmpi-bin libopenmpi-dev cmake g++ make patch dataset-fashion-mnist bubblewrap procps slurm-client)
# What only the test suite runs: Chromium (the browser tests) and a one-node Slurm (its daemons and munge), with the
# test extra; a venv has them (`make setup` is also `make test`'s), an image (--system-python) does not.
test_packages=(chromium slurm-wlm munge)
with_tests="$use_venv"
if [ "$with_tests" = 1 ]; then apt_packages+=("${test_packages[@]}"); fi
# With the base's TensorFlow and Horovod (and its MPI), only what the course runs with: the grader's sandbox and
# what it needs, offline Fashion-MNIST. (util-linux, for setpriv, is essential in Debian and Ubuntu.)
runtime_packages=(bubblewrap util-linux procps dataset-fashion-mnist)
if [ "$framework_source" = base ]; then apt_packages=("${runtime_packages[@]}"); fi
# With the base's PyTorch, that and what Horovod is built with; the base's MPI where it has one (NGC's HPC-X).
if [ "$framework_source" = torch-base ]; then
    apt_packages=("${runtime_packages[@]}" cmake g++ make patch)
    if ! command -v mpicc >/dev/null 2>&1; then apt_packages+=(openmpi-bin libopenmpi-dev); fi
fi
# Debian's and Ubuntu's own Python keep `venv` and the headers Horovod compiles against in packages of their own.
if [ "$framework_source" != base ] && [[ "$(readlink -f "$python_base")" =~ ^/usr/bin/python(3\.[0-9]+)$ ]]; then
    apt_packages+=("python${BASH_REMATCH[1]}-dev")
    if [ "$use_venv" = 1 ]; then apt_packages+=("python${BASH_REMATCH[1]}-venv"); fi
fi
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
    if [ "$keep_venv" = 0 ]; then
        say "Creating the virtual environment $venv"
        "$python_base" -m venv "$venv"
    fi
    python="$venv/bin/python"
    # A venv made while Debian's pythonX.Y-venv was missing has no pip; ensurepip is there now.
    "$python" -m pip --version >/dev/null 2>&1 || "$python" -m ensurepip --upgrade >/dev/null
fi
pip=("$python" -m pip --disable-pip-version-check)

# The pins live in pyproject.toml; read them from there rather than repeating them here.
pin() {
    "$python" - "$project_root/pyproject.toml" "$1" <<'PY'
import re, sys
# The pins are the quoted "NAME==VERSION" strings outside comments, an environment marker perhaps after them (no
# tomllib: Python 3.10 lacks it).
name = sys.argv[2]
code = "\n".join(line.split("#")[0] for line in open(sys.argv[1]))
pins = re.findall(r'"(' + re.escape(name) + r'(?:\[[^\]]*\])?==[^";\s]+)\s*(?:;[^"]*)?"', code)
if not pins:
    sys.exit(f"no pin for {name} in pyproject.toml")
print(pins[0])
PY
}

if [ "$use_venv" = 1 ]; then
    "${pip[@]}" install -q --upgrade "pip==25.3" "wheel==0.45.1" "setuptools==80.9.0"
fi
choose_installer
say "Installing with $installer ($installer_why)"

# TensorFlow and PyTorch from their wheels and Horovod compiled against both (the PyTorch edition: PyTorch alone),
# unless the base brought TensorFlow and Horovod (then there is no PyTorch edition), or PyTorch (then Horovod is
# compiled against the base's).
if [ "$framework_source" != base ]; then
    if [ "$flavour" = gpu ]; then
        tensorflow_pin="$(pin tensorflow)"
        horovod_device=(HOROVOD_GPU_OPERATIONS=NCCL)
        # PyPI's CUDA torch brings NCCL as a Python package (nvidia-nccl); NGC's images have it in /usr.
        nccl_home="$("$python" -c 'import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)"
        if [ -z "${HOROVOD_NCCL_HOME:-}${HOROVOD_NCCL_INCLUDE:-}" ] && [ -d "$nccl_home/include" ]; then
            horovod_device+=(HOROVOD_NCCL_INCLUDE="$nccl_home/include" HOROVOD_NCCL_LIB="$nccl_home/lib")
        fi
        # CUDA 13 compiles for Turing (7.5) and newer only, and Horovod's default list starts earlier.
        nvcc_major="$(nvcc --version 2>/dev/null | sed -nE 's/.*release ([0-9]+)\..*/\1/p' | head -n 1)"
        if [ -z "${HOROVOD_BUILD_CUDA_CC_LIST:-}" ] && [ "${nvcc_major:-0}" -ge 13 ]; then
            horovod_device+=("HOROVOD_BUILD_CUDA_CC_LIST=75,80,86,89,90")
        fi
    else
        tensorflow_pin="$(pin tensorflow-cpu)"
        # No CUDA in Horovod's PyTorch extension, even against PyTorch's CUDA build (containers/patches/ says why).
        horovod_device=(HOROVOD_PYTORCH_WITHOUT_CUDA=1)
    fi
    installed_version() {
        "$python" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$1" 2>/dev/null || true
    }
    if [ "$edition" = pytorch ]; then
        tensorflow_pin="" horovod_frameworks=(HOROVOD_WITHOUT_TENSORFLOW=1)
    else
        horovod_frameworks=(HOROVOD_WITH_TENSORFLOW=1)
        tensorflow_version="${tensorflow_pin##*==}"
        if [ "$(installed_version "${tensorflow_pin%%[[=]*}")" != "$tensorflow_version" ]; then
            say "Installing $tensorflow_pin"
            install_pinned "$tensorflow_pin"
        fi
    fi
    # The CPU flavour asks for PyTorch's CPU build by its local label (2.13.0+cpu, which also satisfies the pin
    # 2.13.0): where no index has it, this stops rather than download PyPI's CUDA build, GBs a CPU never uses.
    torch_pin="$(pin torch)"
    if [ "$flavour" = cpu ] && [ "${SCALELAB_TORCH_BUILD:-cpu}" = cpu ]; then torch_pin+="+cpu"; fi
    if [ "$framework_source" = build ] && [ "$(installed_version torch)" != "${torch_pin##*==}" ]; then
        torch_index=()
        if [ -n "${SCALELAB_TORCH_INDEX:-}" ]; then torch_index=(--extra-index-url "$SCALELAB_TORCH_INDEX"); fi
        for folder in ${SCALELAB_WHEELS:-}; do torch_index+=(--find-links "$folder"); done
        say "Installing $torch_pin${SCALELAB_TORCH_INDEX:+ (also from $SCALELAB_TORCH_INDEX)}"
        if ! install_pinned ${torch_index[@]+"${torch_index[@]}"} "$torch_pin"; then
            if [[ "$torch_pin" == *+cpu ]]; then
                fail "$torch_pin, PyTorch's CPU build, is in none of pip's indexes; give PyTorch's CPU wheel index:" \
                    "make setup SCALELAB_TORCH_INDEX=https://download.pytorch.org/whl/cpu, or take PyPI's default" \
                    "build, CUDA libraries and all (GBs): make setup SCALELAB_TORCH_BUILD=default"
            fi
            fail "could not install $torch_pin"
        fi
    fi

    horovod_pin="$(pin horovod)"
    horovod_version="${horovod_pin#horovod==}"
    # Horovod is built from its sdist with the fixes in containers/patches/ applied. They set the local version label
    # below, which tells a patched build from a plain one (pip still takes it for the horovod==X.Y.Z pin).
    horovod_build="$horovod_version+scalelab.4"
    # The built wheel is kept, keyed by everything it was compiled against, so that a second venv on this machine
    # (the hub's under /opt next to .venv), or an image podman builds here, installs it in seconds instead of
    # compiling for minutes. A kept wheel whose TensorFlow ops do not load here (built on another system) is removed
    # and Horovod compiled.
    compiled_against="${tensorflow_pin:-no-tensorflow}-$(installed_version torch)"
    horovod_wheels="$(dirname "$bootstrap_dir")/horovod-wheels/$flavour-${compiled_against//[^[:alnum:].=_+-]/_}-$(
        cat "$project_root"/containers/patches/horovod-"$horovod_version"-*.patch | sha256sum | cut -c1-16)"
    python_tag="$("$python" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')"
    if [ "$(installed_version horovod)" != "$horovod_build" ]; then
        horovod_wheel="$(compgen -G "$horovod_wheels/horovod-$horovod_build-$python_tag-*.whl" | head -n 1 || true)"
        if [ -n "$horovod_wheel" ]; then
            say "Installing Horovod $horovod_build built earlier on this machine ($horovod_wheel)"
            "${pip[@]}" install -q --no-deps "$horovod_wheel"
            if ! loading="$(TF_CPP_MIN_LOG_LEVEL=2 "$python" - "$edition" 2>&1 <<'PY'
# Horovod's TensorFlow ops and its PyTorch extension, loaded as Horovod loads them (its Python dependencies are not
# installed yet).
import importlib.util, pathlib, sys, sysconfig
import torch
package = pathlib.Path(importlib.util.find_spec("horovod").submodule_search_locations[0])
suffix = sysconfig.get_config_var("EXT_SUFFIX")
if sys.argv[1] != "pytorch":
    import tensorflow as tf
    tf.load_op_library(str(package / "tensorflow" / ("mpi_lib" + suffix)))
extension = importlib.util.spec_from_file_location("mpi_lib_v2", package / "torch" / ("mpi_lib_v2" + suffix))
extension.loader.exec_module(importlib.util.module_from_spec(extension))
PY
)"; then
                say "That wheel does not load here ($(tail -n 1 <<<"$loading")): compiling Horovod instead"
                "${pip[@]}" uninstall -q -y horovod
                horovod_wheel=""
            fi
        fi
        if [ -z "$horovod_wheel" ]; then
            if [ "$edition" = pytorch ]; then against=PyTorch; else against="TensorFlow and PyTorch"; fi
            say "Building Horovod $horovod_build against $against with Gloo and MPI (a few minutes)"
            # GCC 13 and later no longer include <cstdint>, <string> and <stdexcept> through other headers, and
            # Horovod's sources rely on it.
            compiler_flags=()
            if [ "$(g++ -dumpversion 2>/dev/null | cut -d. -f1)" -ge 13 ] 2>/dev/null; then
                compiler_flags=(CXXFLAGS="${CXXFLAGS:-} -include cstdint -include string -include stdexcept")
            fi
            horovod_source="$(mktemp -d)"
            trap 'rm -rf "$horovod_source"' EXIT
            "${pip[@]}" download -q --no-deps --no-binary :all: --no-build-isolation -d "$horovod_source" "$horovod_pin"
            tar -xzf "$horovod_source/horovod-$horovod_version.tar.gz" -C "$horovod_source"
            for fix in "$project_root"/containers/patches/horovod-"$horovod_version"-*.patch; do
                patch --quiet --forward -p1 -d "$horovod_source/horovod-$horovod_version" < "$fix"
            done
            # --no-build-isolation: Horovod's CMake must import the TensorFlow and PyTorch installed above.
            # CMake 4 refuses Gloo's old cmake_minimum_required unless told which policies to assume.
            env "${horovod_frameworks[@]}" HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
                CMAKE_POLICY_VERSION_MINIMUM=3.5 \
                HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 MAKEFLAGS="-j$(nproc)" "${horovod_device[@]}" \
                ${compiler_flags[@]+"${compiler_flags[@]}"} \
                "${pip[@]}" wheel -q --no-deps --no-build-isolation -w "$horovod_source/wheel" \
                "$horovod_source/horovod-$horovod_version"
            "${pip[@]}" install -q --no-deps "$horovod_source"/wheel/horovod-*.whl
            mkdir -p "$horovod_wheels"
            cp "$horovod_source"/wheel/horovod-*.whl "$horovod_wheels"/ || true  # only a time saver
        fi
        if [ "$(installed_version horovod)" != "$horovod_build" ]; then
            echo "setup.sh: built Horovod $(installed_version horovod), expected $horovod_build" \
                "(the patches set it)" >&2
            exit 1
        fi
    fi
fi

# pyproject.toml's extra: the flavour's TensorFlow and PyTorch, or PyTorch alone for the PyTorch edition.
extra="$flavour"
tests_extra=""
if [ "$with_tests" = 1 ]; then tests_extra=",test"; fi
if [ "$edition" = pytorch ]; then extra=torch; fi
if [ "$dependencies_only" = 1 ]; then
    say "Installing the course's pinned dependencies (the course itself comes later)"
    requirements="$(mktemp)"
    "$python" - "$project_root/pyproject.toml" "$framework_source" "$extra" "$with_tests" > "$requirements" <<'PY'
import sys
try:
    import tomllib
except ImportError:  # Python 3.10: the TOML reader pip brings
    from pip._vendor import tomli as tomllib

project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = project["optional-dependencies"]
# With the base's framework, no flavour extra: it would install a TensorFlow wheel over the base's.
wanted = project["dependencies"] + (extras[sys.argv[3]] if sys.argv[2] == "build" else [])
wanted += extras["test"] if sys.argv[2] == "build" and sys.argv[4] == "1" else []
print("\n".join(wanted))
PY
    install_pinned -r "$requirements"
    rm -f "$requirements"
    if [ "$framework_source" = base ]; then check_base_framework "$python" "installing the dependencies left"; fi
    if [ "$framework_source" = torch-base ]; then check_base_torch "$python" "installing the dependencies left"; fi
else
    say "Installing the course and its pinned dependencies"
    if [ "$hub" = 1 ]; then
        # A copy, rebuilt every time (pip always rebuilds a project given by its directory; uv needs telling): the
        # version number does not change when the course's code does.
        refresh=()
        if [ "$installer" = uv ]; then refresh=(--reinstall-package scalelab); fi
        install_pinned ${refresh[@]+"${refresh[@]}"} "${project_root}[$extra$tests_extra]"
    elif [ "$framework_source" = base ]; then
        # No extra: the cpu and gpu extras would install a TensorFlow wheel over the base's.
        install_pinned -e "${project_root}"
        check_base_framework "$python" "installing the course left"
    elif [ "$framework_source" = torch-base ]; then
        # No extra: the torch extra would install PyPI's PyTorch over the base's.
        install_pinned -e "${project_root}"
        check_base_torch "$python" "installing the course left"
    else
        install_pinned -e "${project_root}[$extra$tests_extra]"
    fi
fi

export TF_CPP_MIN_LOG_LEVEL=2
say "Checking Horovod's build"
# Where the interpreter's scripts land: the venv's bin/, or /usr/local/bin for Debian's Python without a venv.
horovodrun="$("$python" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/horovodrun"
if [ ! -x "$horovodrun" ] && [ "$framework_source" = base ]; then horovodrun="$(command -v horovodrun)"; fi
build="$("$horovodrun" --check-build)"
# The base's build is taken as it is beyond TensorFlow (NGC's has NCCL and its own MPI).
required="TensorFlow PyTorch MPI Gloo"
if [ "$edition" = pytorch ]; then required="PyTorch MPI Gloo"; fi
if [ "$framework_source" = base ]; then required=TensorFlow; fi
if [ "$framework_source" = torch-base ] && [ "$flavour" = gpu ]; then required+=" NCCL"; fi
for framework in $required; do
    if ! grep -q "\[X\] $framework" <<<"$build"; then
        echo "$build" >&2
        echo "setup.sh: Horovod was built without $framework; remove it (pip uninstall horovod) and run again." >&2
        exit 1
    fi
done
if [ "$edition" = pytorch ]; then say "ScaleLab stack ready, the PyTorch edition ($python)"; else
    say "ScaleLab stack ready ($python)"; fi
