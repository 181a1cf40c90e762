"""The accounts of a class on one server (``make hub``): who is in it, with which role; added and removed.

The class is kept where the system keeps accounts: two Unix groups. JupyterHub admits their members and nobody else
(``PAMAuthenticator.allowed_groups``) and puts the members of ``scalelab-instructors`` in its group ``instructors``
at each login (containers/hub/jupyterhub_config.py), so a change here needs no restart of the Hub.

Removing someone takes effect at once: the account leaves the class groups and is locked, the Hub (through its
REST API, with the token of its service ``scalelab-class`` that only root can read in the Hub's state) stops their
server and forgets them with every token they had, and whatever still runs as them is killed. Their home stays.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import re
import secrets
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

ROLE_GROUPS = {"student": "scalelab-students", "instructor": "scalelab-instructors"}
HUB_INSTRUCTORS_GROUP = "instructors"
# The grader's account, and names whose owner would have powers a student must not get.
RESERVED_NAMES = {"root", "scalelab", "nobody", *ROLE_GROUPS.values()}
# Portable POSIX user names, lowercase only: JupyterHub lowercases the name typed in its login form.
VALID_NAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
# The Hub is reachable by the class, and its logins are throttled, not refused: passwords long enough not to guess.
MIN_PASSWORD_LENGTH = 12
PASSWORD_ALPHABET = "abcdefghjkmnpqrstuvwxyz23456789"  # nothing that reads as another character

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_NAME_TAKEN, EXIT_NOT_ROOT = 0, 1, 2, 3, 4
# Written by containers/hub/jupyterhub_config.py at each start of the Hub: its API's URL and the class service's token.
HUB_STATE_VARIABLE = "SCALELAB_HUB_STATE"
DEFAULT_HUB_STATE = "/var/lib/scalelab-hub"
CLASS_ADMIN_FILE = "class-admin.json"


class ClassError(Exception):
    """A sentence for the person at the terminal, and the exit code that goes with it."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def check_name(name: str) -> None:
    if not VALID_NAME.fullmatch(name):
        raise ClassError(f"{name!r} is not a valid user name: use 1 to 32 lowercase letters, digits, '_' or '-', "
                         "starting with a letter or '_'.", EXIT_BAD_INPUT)
    if name in RESERVED_NAMES:
        raise ClassError(f"{name!r} is reserved (the system or the grader uses it): choose another name.",
                         EXIT_BAD_INPUT)


def account(name: str) -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        return None


def group_exists(group: str) -> bool:
    try:
        grp.getgrnam(group)
    except KeyError:
        return False
    return True


def in_group(name: str, group: str) -> bool:
    """Whether the account ``name`` belongs to ``group``, as its primary or a supplementary group."""
    user = account(name)
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        return False
    return user is not None and gid in os.getgrouplist(name, user.pw_gid)


def role_of(name: str) -> str | None:
    for role, group in ROLE_GROUPS.items():
        if in_group(name, group):
            return role
    return None


def members() -> list[tuple[str, str, bool]]:
    """(name, role, whether the account exists) for everyone the class groups list, sorted by name."""
    rows = []
    for role, group in ROLE_GROUPS.items():
        try:
            names = grp.getgrnam(group).gr_mem
        except KeyError:
            continue
        rows += [(name, role, account(name) is not None) for name in names]
    return sorted(rows)


def run(command: list[str], input_text: str | None = None) -> None:
    result = subprocess.run(command, input=input_text, capture_output=True, text=True)
    if result.returncode != 0:
        said = (result.stderr or result.stdout).strip().splitlines()
        raise ClassError(f"{command[0]} failed ({said[-1] if said else f'exit code {result.returncode}'}).",
                         EXIT_FAILED)


def ensure_group(group: str) -> None:
    if not group_exists(group):
        run(["groupadd", "--system", group])


def check_password(password: str) -> None:
    if "\n" in password or ":" in password:
        raise ClassError("the password given on standard input holds a ':' or a line break.", EXIT_BAD_INPUT)
    if len(password) < MIN_PASSWORD_LENGTH:
        raise ClassError(f"the password given on standard input has {len(password)} characters; a class account's "
                         f"takes at least {MIN_PASSWORD_LENGTH} (or leave --password-stdin out for a generated one).",
                         EXIT_BAD_INPUT)


def generated_password() -> str:
    return "-".join("".join(secrets.choice(PASSWORD_ALPHABET) for _ in range(4)) for _ in range(4))


def add_member(name: str, role: str, password: str | None) -> str:
    """Create the account ``name`` in the class with ``role``; returns what was done, in a sentence.
    ``password`` None: a generated one is set and returned in the sentence."""
    check_name(name)
    if password is not None:
        check_password(password)
    if os.geteuid() != 0:
        raise ClassError(f"scalelab class add-{role} must run as root (it creates a system account): "
                         f"sudo scalelab class add-{role} {name}", EXIT_NOT_ROOT)
    current = role_of(name)
    if current == role:
        return f"{name} is already a{'n' if role == 'instructor' else ''} {role} of the class: nothing changed."
    if current is not None:
        raise ClassError(f"{name} is already a{'n' if current == 'instructor' else ''} {current} of the class: "
                         "one account has one role.", EXIT_NAME_TAKEN)
    existing = account(name)
    if existing is not None:
        raise ClassError(f"the name {name} belongs to an account of this system that is not in the class "
                         f"(uid {existing.pw_uid}): choose another name.", EXIT_NAME_TAKEN)
    if group_exists(name):
        raise ClassError(f"the name {name} belongs to a group of this system: choose another name.",
                         EXIT_NAME_TAKEN)

    ensure_group(ROLE_GROUPS[role])
    run(["useradd", "--create-home", "--user-group", "--shell", "/bin/bash", "--groups", ROLE_GROUPS[role],
         "--comment", f"ScaleLab {role}", name])
    try:
        home = Path(pwd.getpwnam(name).pw_dir)
        home.chmod(0o700)  # other students must not read each other's work
        chosen = password if password is not None else generated_password()
        run(["chpasswd"], input_text=f"{name}:{chosen}\n")
    except BaseException:
        subprocess.run(["userdel", "--remove", name], capture_output=True)
        raise
    done = f"added {role} {name} (home {home}, readable by {name} only)."
    if password is None:
        done += (f"\none-time password for {name}: {chosen}\n(shown only now; {name} can change it with `passwd` "
                 "in a JupyterLab terminal)")
    return done


def remove_member(name: str, hub_state: Path) -> str:
    """Take ``name`` out of the class at once (see the module docstring); returns what was done, in a sentence."""
    check_name(name)
    if os.geteuid() != 0:
        raise ClassError(f"scalelab class remove must run as root: sudo scalelab class remove {name}", EXIT_NOT_ROOT)
    role = role_of(name)
    if role is None:
        raise ClassError(f"{name} is not in the class: nothing to remove.", EXIT_BAD_INPUT)
    uid = account(name).pw_uid
    # First no new login (PAM: not a member, account locked), then the Hub, then what still runs.
    for group in ROLE_GROUPS.values():
        if in_group(name, group):
            run(["gpasswd", "--delete", name, group])
    run(["usermod", "--lock", "--expiredate", "1", name])
    hub_said = forget_at_the_hub(name, hub_state)
    subprocess.run(["pkill", "--signal", "KILL", "--uid", str(uid)], capture_output=True)
    return (f"removed {role} {name}: out of the class's groups, account locked, its processes ended; {hub_said} "
            f"Their home {account(name).pw_dir} is kept.")


def forget_at_the_hub(name: str, hub_state: Path) -> str:
    """Stop ``name``'s server and delete them, with their tokens, from the Hub; a sentence on how it went."""
    try:
        settings = json.loads((Path(hub_state) / CLASS_ADMIN_FILE).read_text())
        api_url, token = settings["api_url"], settings["token"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ClassError(f"the Hub's class settings in {hub_state} cannot be read ({error}); the account is out of "
                         f"the class, but the Hub still has its server and tokens: run this again once `make hub` "
                         f"has started (HUB_STATE / {HUB_STATE_VARIABLE} names its state).", EXIT_FAILED) from None
    request = urllib.request.Request(f"{api_url.rstrip('/')}/users/{name}", method="DELETE",
                                     headers={"Authorization": f"token {token}"})
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(request, timeout=60):
                return "the Hub stopped their server and forgot them and their tokens."
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return "the Hub had no record of them."
            if error.code == 400 and time.monotonic() < deadline:  # their server is stopping: asked again
                time.sleep(1)
                continue
            problem = f"the Hub answered {error.code} {error.reason}"
        except OSError as error:
            problem = f"the Hub at {api_url} did not answer ({error})"
        raise ClassError(f"{problem}; the account is out of the class, but the Hub may still have its server and "
                         f"tokens: run this again once the Hub runs.", EXIT_FAILED)
