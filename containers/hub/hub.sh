#!/usr/bin/env bash
# `make hub`: installs what a class on one server needs, then serves JupyterHub (containers/hub/jupyterhub_config.py)
# in the foreground on http://$HUB_IP:$HUB_PORT. As root; every step is skipped when already done.
#
#   containers/hub/hub.sh [--install-only]     (--install-only: everything but serving; `make test` runs it as root
#                                               so that the hub tests download nothing)
#
#   HUB_IP (127.0.0.1), HUB_PORT (8000)          where students connect
#   HUB_DOMAIN, HUB_TLS_CERT, HUB_TLS_KEY        a class beyond this machine: one origin per user over HTTPS, the
#                                                Hub at https://HUB_DOMAIN, each user at https://<user>.HUB_DOMAIN;
#                                                a certificate for HUB_DOMAIN and *.HUB_DOMAIN, and its key. Needed
#                                                for any HUB_IP but the loopback (grader/classroom/hub_origin.py)
#   HUB_PROXY_API_PORT, HUB_INTERNAL_PORT        on 127.0.0.1: the proxy's API (HUB_PORT+1), the Hub (HUB_PORT+81)
#   SCALELAB_SERVICE_PORT                        on 127.0.0.1: the grader service (HUB_PORT+82)
#   HUB_GRADING_CPUS (auto)                      CPUs graded runs keep to themselves, the students' servers held to
#                                                the others: a list ("2-3"), "none", or auto (the upper half from 4
#                                                CPUs on; below that all are shared and the grader measures what
#                                                others take from each run: grader/classroom/server_limits.py)
#   HUB_VENV (/opt/scalelab/venv)                the environment every account runs: the stack, JupyterHub, the
#                                                course as a copy (containers/setup.sh --hub)
#   HUB_COURSE (/opt/scalelab/course)            what each student's ~/scalelab starts from: labs/release/ (made
#                                                here with nbgrader; the PyTorch edition's without the Keras labs)
#                                                and the assessment, never a solution
#   HUB_STATE (/var/lib/scalelab-hub)            the Hub's database, cookie secret and proxy token, mode 0700
#   HUB_NBGRADER (/srv/nbgrader)                 nbgrader's exchange (exchange/) and the instructors' course
#                                                directory (course/: sources, submissions, gradebook.db)
#   HUB_CONFIG_D (/etc/scalelab/hub.d)           the site's own additions to the Hub's config: every *.py there,
#                                                in name order, loaded last (containers/hub/sites/ has examples)
#
# Exit codes: 0 the Hub stopped normally; 1 an install step failed; 2 a setting is wrong (a port that is not a
# number; a class beyond the loopback without one origin per user, or its name or certificate; grading CPUs the
# machine has not, or all of them); 3 a port is in use; 4 not root.
set -euo pipefail

install_only=0
case "${1:-}" in
    "") ;;
    --install-only) install_only=1 ;;
    *) echo "hub.sh: unknown option '$1'" >&2; exit 2 ;;
esac
project_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HUB_IP="${HUB_IP:-127.0.0.1}"
HUB_PORT="${HUB_PORT:-8000}"
HUB_VENV="${HUB_VENV:-/opt/scalelab/venv}"
HUB_COURSE="${HUB_COURSE:-/opt/scalelab/course}"
HUB_STATE="${HUB_STATE:-/var/lib/scalelab-hub}"
HUB_NBGRADER="${HUB_NBGRADER:-/srv/nbgrader}"
HUB_CONFIG_D="${HUB_CONFIG_D:-/etc/scalelab/hub.d}"
EXIT_FAILED=1 EXIT_BAD_SETTING=2 EXIT_PORT_IN_USE=3 EXIT_NOT_ROOT=4

say() { printf '\033[1m==> %s\033[0m\n' "$*"; }
fail() { local code="$1"; shift; echo "make hub: $*" >&2; exit "$code"; }

check_port() {
    if ! [[ "${!1}" =~ ^[0-9]{1,5}$ ]] || [ "${!1}" -lt 1 ] || [ "${!1}" -gt 65535 ]; then
        fail $EXIT_BAD_SETTING "$1=${!1} is not a port number (1 to 65535)."
    fi
}
check_port HUB_PORT
HUB_PROXY_API_PORT="${HUB_PROXY_API_PORT:-$((HUB_PORT + 1))}"
HUB_INTERNAL_PORT="${HUB_INTERNAL_PORT:-$((HUB_PORT + 81))}"
SCALELAB_SERVICE_PORT="${SCALELAB_SERVICE_PORT:-$((HUB_PORT + 82))}"
check_port HUB_PROXY_API_PORT
check_port HUB_INTERNAL_PORT
check_port SCALELAB_SERVICE_PORT
# Written into a Python file (containers/hub/nbgrader_config.py): a plain absolute path only.
if ! [[ "$HUB_NBGRADER" =~ ^/[A-Za-z0-9._/-]+$ ]]; then
    fail $EXIT_BAD_SETTING "HUB_NBGRADER=$HUB_NBGRADER is not an absolute path of letters, digits, '.', '_', '-'" \
        "and '/'."
fi

# A class beyond the loopback only with one origin per user: the sentence says what to set.
HUB_IP="$HUB_IP" HUB_PORT="$HUB_PORT" python3 "$project_root/grader/classroom/hub_origin.py" || exit $EXIT_BAD_SETTING
export SCALELAB_GRADING_CPUS="${HUB_GRADING_CPUS:-auto}"
python3 "$project_root/grader/classroom/server_limits.py" || exit $EXIT_BAD_SETTING

if [ "$(id -u)" != 0 ]; then
    fail $EXIT_NOT_ROOT "the Hub must run as root (it logs students in with PAM and starts each one's server as" \
        "their own account): sudo make hub"
fi

# Before installing anything. SO_REUSEADDR as the proxy binds: a port left in TIME_WAIT by a stopped Hub is free.
port_in_use() {
    python3 - "$1" "$2" <<'PY'
import socket, sys
with socket.socket() as probe:
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        probe.bind((sys.argv[1], int(sys.argv[2])))
    except OSError:
        sys.exit(0)
sys.exit(1)
PY
}
for check in "$HUB_IP $HUB_PORT HUB_PORT" "127.0.0.1 $HUB_PROXY_API_PORT HUB_PROXY_API_PORT" \
             "127.0.0.1 $HUB_INTERNAL_PORT HUB_INTERNAL_PORT" \
             "127.0.0.1 $SCALELAB_SERVICE_PORT SCALELAB_SERVICE_PORT"; do
    read -r address port variable <<<"$check"
    if [ "$install_only" = 0 ] && port_in_use "$address" "$port"; then
        fail $EXIT_PORT_IN_USE "port $port on $address is already in use; stop what listens there or set $variable" \
            "to a free port."
    fi
done

# The proxy: Debian's package (no download when the Hub starts).
if ! dpkg-query -W -f='${Status}' node-configurable-http-proxy 2>/dev/null | grep -q "install ok installed"; then
    say "Installing Debian's node-configurable-http-proxy"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends node-configurable-http-proxy >/dev/null 2>&1 || {
        apt-get update -qq && apt-get install -y -qq --no-install-recommends node-configurable-http-proxy >/dev/null
    } || fail $EXIT_FAILED "apt-get could not install node-configurable-http-proxy."
fi

# sudo: instructors start each kernel that grades a student's notebook through it (below).
if ! command -v sudo >/dev/null 2>&1 || ! command -v visudo >/dev/null 2>&1; then
    say "Installing Debian's sudo"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends sudo >/dev/null 2>&1 || {
        apt-get update -qq && apt-get install -y -qq --no-install-recommends sudo >/dev/null
    } || fail $EXIT_FAILED "apt-get could not install sudo."
fi

# The grader's account, and the class's groups (`scalelab class` fills them).
if ! getent passwd scalelab >/dev/null; then
    say "Creating the system account scalelab (the grader)"
    useradd --system --user-group --create-home --home-dir /var/lib/scalelab --shell /usr/sbin/nologin \
        --comment "ScaleLab grader" scalelab
    chmod 0700 /var/lib/scalelab
fi
for group in scalelab-students scalelab-instructors; do
    getent group "$group" >/dev/null || groupadd --system "$group"
done

# The shared venv, again when the stack or the course's code changed since.
stamp="$HUB_VENV/.scalelab-hub-done"
if [ ! -e "$stamp" ] || [ -n "$(cd "$project_root" && find pyproject.toml containers/setup.sh source_code/scalelab \
        grader -name __pycache__ -prune -o -newer "$stamp" -print -quit)" ]; then
    say "Installing the shared environment $HUB_VENV"
    mkdir -p "$(dirname "$HUB_VENV")"
    chmod a+rx "$(dirname "$HUB_VENV")"
    (umask 022 && "$project_root/containers/setup.sh" --venv "$HUB_VENV" --hub) || \
        fail $EXIT_FAILED "containers/setup.sh could not install $HUB_VENV (its output above says why)."
    touch "$stamp"
fi
# The course's kernel (the notebooks name it) and JupyterLab settings, in the shared venv, readable by all.
(umask 022 && "$HUB_VENV/bin/scalelab" lab-setup >/dev/null) || \
    fail $EXIT_FAILED "scalelab lab-setup could not install the course's kernel into $HUB_VENV."

# The students' release of the labs when a source is newer, as `make lab` makes it (scalelab.lab_setup: nbgrader,
# one process at a time).
"$HUB_VENV/bin/python" - "$project_root/labs" <<'PY' || fail $EXIT_FAILED "nbgrader could not release the labs."
import sys
from pathlib import Path

from scalelab.lab_setup import locked, release_is_stale, release_labs

labs = Path(sys.argv[1])
with locked(labs):
    if release_is_stale(labs):
        print("\033[1m==> Releasing the labs for students (nbgrader generate_assignment)\033[0m", flush=True)
        release_labs(labs)
PY

# What every student's ~/scalelab starts from: readable by all, replaced whole.
say "Staging the course for students in $HUB_COURSE"
staging="$HUB_COURSE.new"
course_scripts=$("$HUB_VENV/bin/python" -I -c 'from scalelab.environment import COURSE_SCRIPTS
print(" ".join(COURSE_SCRIPTS))') && [ -n "$course_scripts" ] ||
    fail $EXIT_FAILED "the list of the course's scripts could not be read from $HUB_VENV."
# The labs the students' copy leaves out, as `make lab`'s view does: the Keras labs on the PyTorch edition.
labs_left_out=$("$HUB_VENV/bin/python" -I -c 'from scalelab.lab_setup import labs_left_out
print(" ".join(labs_left_out()))') ||
    fail $EXIT_FAILED "the labs of this edition could not be read from $HUB_VENV."
rm -rf "$staging"
(
    umask 022
    mkdir -p "$staging/labs" "$staging/assessment" "$staging/source_code"
    cp -R "$project_root/labs/release/." "$staging/labs/"
    for lab in $labs_left_out; do rm -rf "${staging:?}/labs/$lab"; done
    # The scripts the labs run (the library itself is in the venv); never a worked solution. Student servers find
    # them through SCALELAB_SOURCE_DIR (jupyterhub_config.py).
    for script in $course_scripts; do
        cp "$project_root/source_code/$script" "$staging/source_code/"
    done
    cp "$project_root/assessment/assessment.ipynb" "$project_root/assessment/assessment.py" \
        "$project_root/assessment/assessment_pytorch.py" "$staging/assessment/"
    # The tracks the grader service reads (as scalelab, which cannot read a checkout under a private home).
    cp "$project_root/assessment/tracks.toml" "$staging/tracks.toml"
)
chmod -R a+rX "$staging"
rm -rf "$HUB_COURSE.old"
if [ -e "$HUB_COURSE" ]; then mv "$HUB_COURSE" "$HUB_COURSE.old"; fi
mv "$staging" "$HUB_COURSE"
rm -rf "$HUB_COURSE.old"

# nbgrader's exchange and the instructors' course directory (containers/hub/nbgrader_config.py says who reads what).
say "Setting up nbgrader's exchange and the instructors' course directory in $HUB_NBGRADER"
exchange="$HUB_NBGRADER/exchange" course_dir="$HUB_NBGRADER/course"
shared_dir() {  # MODE DIRECTORY...: root's, group scalelab-instructors
    local mode="$1"; shift
    mkdir -p "$@"
    chown root:scalelab-instructors "$@"
    chmod "$mode" "$@"
}
mkdir -p "$HUB_NBGRADER"
chmod 0755 "$HUB_NBGRADER"
mkdir -p "$exchange"
chown root:root "$exchange"
chmod 1777 "$exchange"  # nbgrader's documented mode for the exchange's root
# Made here with the instructors' group (nbgrader would make them its first user's): instructors release into
# outbound/ (everyone reads it); students write into inbound/ and cannot list it (-wx); feedback/ is read by hash.
shared_dir 2775 "$exchange/scalelab" "$exchange/scalelab/outbound"
shared_dir 2773 "$exchange/scalelab/inbound"
shared_dir 2771 "$exchange/scalelab/feedback"
shared_dir 2770 "$course_dir" "$course_dir/source"
# The sources: a file newer in the checkout replaces the course's; an instructor's later edit there stays.
cp -R --update "$project_root/labs/source/." "$course_dir/source/"
find "$course_dir/source" -type d -exec chmod 2770 {} +
find "$course_dir/source" -type f -exec chmod 0660 {} +
chgrp -R scalelab-instructors "$course_dir/source"
# The course's configuration (root, gradebook, autograding), as in the checkout; code every instructor's nbgrader
# runs, so only root writes it.
install -m 0640 -o root -g scalelab-instructors "$project_root/labs/nbgrader_config.py" "$course_dir/nbgrader_config.py"
# nbgrader reads nbgrader_config.json beside it too: an empty one of root's, so that no instructor can add one. The
# folder is sticky: instructors make and change their own files there, but cannot rename, replace or remove root's.
printf '{}\n' > "$course_dir/nbgrader_config.json"
chown root:scalelab-instructors "$course_dir/nbgrader_config.json"
chmod 0640 "$course_dir/nbgrader_config.json"
chmod 3770 "$course_dir"
# The one gradebook, made here so that it is the group's: every instructor writes it (SQLite gives its journal the
# database's mode).
if [ ! -e "$course_dir/gradebook.db" ]; then
    PATH="$HUB_VENV/bin:$PATH" "$HUB_VENV/bin/python" -I -c 'import sys; from nbgrader.api import Gradebook
Gradebook("sqlite:///" + sys.argv[1], course_id="scalelab").close()' "$course_dir/gradebook.db" || \
        fail $EXIT_FAILED "nbgrader could not create the gradebook $course_dir/gradebook.db."
fi
chown root:scalelab-instructors "$course_dir/gradebook.db"
chmod 0660 "$course_dir/gradebook.db"
# Everyone's nbgrader configuration (course id, exchange; the course directory for instructors), in the shared venv.
mkdir -p "$HUB_VENV/etc/jupyter"
sed "s|^NBGRADER_HOME = .*|NBGRADER_HOME = \"$HUB_NBGRADER\"  # HUB_NBGRADER of make hub|" \
    "$project_root/containers/hub/nbgrader_config.py" > "$HUB_VENV/etc/jupyter/nbgrader_config.py.new"
chmod 0644 "$HUB_VENV/etc/jupyter/nbgrader_config.py.new"
mv "$HUB_VENV/etc/jupyter/nbgrader_config.py.new" "$HUB_VENV/etc/jupyter/nbgrader_config.py"
# nbgrader's instructor tools: off in the shared venv with nbgrader's documented commands (students keep the
# Assignments tab and validation), locked there so that JupyterLab's plugin manager cannot turn them back on, and on
# again in etc/jupyter-instructors, which the Hub adds to instructors' servers (JUPYTER_CONFIG_PATH; written here
# as JSON: JupyterLab refuses `labextension enable` below a lock).
instructor_tools_lab=(@jupyter/nbgrader:formgrader @jupyter/nbgrader:create-assignment @jupyter/nbgrader:course-list)
instructor_tools_server=(nbgrader.server_extensions.formgrader nbgrader.server_extensions.course_list)
instructors_config="$HUB_VENV/etc/jupyter-instructors"
# Each jupyter command takes seconds to start: they run only when the files they write say otherwise.
tools_already_off() {
    "$HUB_VENV/bin/python" -I - "$HUB_VENV/etc/jupyter" "$instructors_config" "${instructor_tools_lab[*]}" \
        "${instructor_tools_server[*]}" <<'PY'
import json
import sys
from pathlib import Path

shared, instructors = Path(sys.argv[1]), Path(sys.argv[2])
lab_tools, server_tools = sys.argv[3].split(), sys.argv[4].split()

def read(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}

page = read(shared / "labconfig" / "page_config.json")
off = all(page.get(key, {}).get(tool) is True
          for tool in lab_tools for key in ("disabledExtensions", "lockedExtensions"))
off = off and all(read(shared / "jupyter_server_config.d" / f"{tool}.json").get("ServerApp", {})
                  .get("jpserver_extensions", {}).get(tool) is False for tool in server_tools)
on_for_instructors = read(instructors / "labconfig" / "page_config.json") == {
    "disabledExtensions": {tool: False for tool in lab_tools}} and read(
    instructors / "jupyter_server_config.d" / "scalelab-instructors.json") == {
    "ServerApp": {"jpserver_extensions": {tool: True for tool in server_tools}}}
sys.exit(0 if off and on_for_instructors else 1)
PY
}
tools_already_off || (
    umask 022
    "$HUB_VENV/bin/jupyter" labextension disable --level=sys_prefix "${instructor_tools_lab[@]}" >/dev/null 2>&1 &&
    "$HUB_VENV/bin/jupyter" labextension lock --level=sys_prefix "${instructor_tools_lab[@]}" >/dev/null 2>&1 &&
    "$HUB_VENV/bin/jupyter" server extension disable --sys-prefix "${instructor_tools_server[@]}" >/dev/null 2>&1 &&
    mkdir -p "$instructors_config/labconfig" "$instructors_config/jupyter_server_config.d" &&
    "$HUB_VENV/bin/python" -I - "$instructors_config" "${instructor_tools_lab[*]}" \
        "${instructor_tools_server[*]}" <<'PY'
import json
import sys
from pathlib import Path

directory, lab_tools, server_tools = Path(sys.argv[1]), sys.argv[2].split(), sys.argv[3].split()
(directory / "labconfig" / "page_config.json").write_text(
    json.dumps({"disabledExtensions": {tool: False for tool in lab_tools}}, indent=2) + "\n")
(directory / "jupyter_server_config.d" / "scalelab-instructors.json").write_text(
    json.dumps({"ServerApp": {"jpserver_extensions": {tool: True for tool in server_tools}}}, indent=2) + "\n")
PY
) || fail $EXIT_FAILED "jupyter could not turn nbgrader's instructor tools off for students in $HUB_VENV."

# The Hub's logins (c.PAMAuthenticator.service): the account's system password, with failed attempts counted per
# account by pam_faillock: after 5 within 15 minutes the account cannot log in to the Hub for 5 minutes, the right
# password included (`faillock --user NAME --reset` lets it in sooner). Only this service counts them.
pam_service=/etc/pam.d/scalelab-hub
faillock_options="deny=5 fail_interval=900 unlock_time=300"
cat > "$pam_service.new" <<PAM
# Installed by ScaleLab's make hub: JupyterHub's logins, throttled (see containers/hub/hub.sh).
auth     requisite                pam_faillock.so preauth $faillock_options
auth     [success=1 default=bad]  pam_unix.so
auth     [default=die]            pam_faillock.so authfail $faillock_options
auth     sufficient               pam_faillock.so authsucc $faillock_options
auth     required                 pam_deny.so
account  required                 pam_faillock.so
@include common-account
PAM
chmod 0644 "$pam_service.new"
mv "$pam_service.new" "$pam_service"

# Autograding runs each student's notebook in the grading sandbox as a throw-away uid, which takes root: instructors
# may run exactly this helper as root, nothing else (scalelab.grader.nbgrading.kernel_sandbox checks that the
# folders it is given are the caller's own). Root's files: the wrapper, the rule and the venv it runs.
kernel_helper=/usr/local/sbin/scalelab-kernel-sandbox
kernel_rule=/etc/sudoers.d/scalelab-kernel-sandbox
printf '#!/bin/sh\n# Installed by ScaleLab'"'"'s make hub: a grading kernel in its sandbox (see %s).\nexec %s -I -m scalelab.grader.nbgrading.kernel_sandbox "$@"\n' \
    "$kernel_rule" "$HUB_VENV/bin/python" > "$kernel_helper.new"
chown root:root "$kernel_helper.new"
chmod 0755 "$kernel_helper.new"
mv "$kernel_helper.new" "$kernel_helper"
printf '# Installed by ScaleLab'"'"'s make hub: instructors start grading kernels in the sandbox, as root, without a password.\n%%scalelab-instructors ALL=(root) NOPASSWD: %s\n' \
    "$kernel_helper" > "$kernel_rule.new"
chmod 0440 "$kernel_rule.new"
visudo -cqf "$kernel_rule.new" || fail $EXIT_FAILED "visudo refused the rule for $kernel_helper."
mv "$kernel_rule.new" "$kernel_rule"

# The grader service's account is not root, and only root can give a graded run a uid, a process limit and a
# memory cgroup of its own: the account scalelab may run exactly this helper as root, nothing else
# (scalelab.grader.assess_helper reads nothing for it that scalelab could not read itself).
assess_helper=/usr/local/sbin/scalelab-assess
assess_rule=/etc/sudoers.d/scalelab-assess
printf '#!/bin/sh\n# Installed by ScaleLab'"'"'s make hub: the grader service'"'"'s runs with uids of their own (see %s).\nexec %s -I -m scalelab.grader.assess_helper "$@"\n' \
    "$assess_rule" "$HUB_VENV/bin/python" > "$assess_helper.new"
chown root:root "$assess_helper.new"
chmod 0755 "$assess_helper.new"
mv "$assess_helper.new" "$assess_helper"
printf '# Installed by ScaleLab'"'"'s make hub: the grader service grades each run as root, without a password.\nscalelab ALL=(root) NOPASSWD: %s\n' \
    "$assess_helper" > "$assess_rule.new"
chmod 0440 "$assess_rule.new"
visudo -cqf "$assess_rule.new" || fail $EXIT_FAILED "visudo refused the rule for $assess_helper."
mv "$assess_rule.new" "$assess_rule"

# The instructor's material in the checkout is no student's business: solutions (lab 3's worked conversion too),
# hidden tests, the gradebook.
for private in labs/source assessment/solution labs/gradebook.db labs/submitted labs/autograded labs/feedback \
        source_code/fashion_mnist_horovod.py source_code/horovod_steps; do
    if [ -e "$project_root/$private" ]; then chmod go-rwx "$project_root/$private"; fi
done
# Git's history holds every one of them too (`git show HEAD:assessment/solution/assessment.py`): its folder is
# root's alone, wherever it is (a worktree's .git is a file naming it).
git_dir="$project_root/.git"
if [ -f "$git_dir" ]; then
    git_dir="$(sed -n 's/^gitdir: //p' "$git_dir")"
    case "$git_dir" in /*) ;; *) git_dir="$project_root/$git_dir" ;; esac
fi
if [ -d "$git_dir" ]; then chmod go-rwx "$git_dir"; fi

mkdir -p "$HUB_STATE"
chmod 0700 "$HUB_STATE"
if [ "$install_only" = 1 ]; then
    say "Everything make hub needs is installed"
    exit 0
fi
if [ -n "${HUB_DOMAIN:-}" ]; then
    hub_url="https://$HUB_DOMAIN:$HUB_PORT (each user at https://<user>.$HUB_DOMAIN:$HUB_PORT)"
else
    hub_url="http://$HUB_IP:$HUB_PORT (one origin for all: one trusted machine only)"
fi
say "JupyterHub on $hub_url, state in $HUB_STATE; Ctrl-C stops it and the students' servers"
cd "$HUB_STATE"
export HUB_IP HUB_PORT HUB_PROXY_API_PORT HUB_INTERNAL_PORT SCALELAB_SERVICE_PORT
export HUB_DOMAIN="${HUB_DOMAIN:-}" HUB_TLS_CERT="${HUB_TLS_CERT:-}" HUB_TLS_KEY="${HUB_TLS_KEY:-}"
export SCALELAB_TRACKS="${SCALELAB_TRACKS:-$HUB_COURSE/tracks.toml}"
export SCALELAB_HUB_VENV="$HUB_VENV" SCALELAB_COURSE="$HUB_COURSE" SCALELAB_HUB_STATE="$HUB_STATE"
export SCALELAB_HUB_CONFIG_D="$HUB_CONFIG_D" SCALELAB_HUB_NBGRADER="$HUB_NBGRADER"
exec "$HUB_VENV/bin/jupyterhub" -f "$project_root/containers/hub/jupyterhub_config.py"
