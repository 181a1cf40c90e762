"""`make hub` and `scalelab class`: a real JupyterHub with PAM logins of real accounts, each student's JupyterLab
running as that student, on their own copy of the course. As root (CI runs as root): the tests create system
accounts, and remove them, their homes and their processes afterwards."""

from __future__ import annotations

import json
import os
import pwd
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import requests

from conftest import HAS_TENSORFLOW, PROJECT_ROOT
from hubtools import (HUB_VENV, accounts, hub, processes_of, random_name, remove_account,  # noqa: F401
                      scalelab_class, spawn)

from scalelab import environment
from scalelab.lab_setup import KERAS_LABS
from scalelab.grader.classroom import server_limits

# The first `make hub` on a machine installs the shared venv (Horovod is compiled unless .venv's wheel is kept).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

ARTIFACTS = PROJECT_ROOT / "tests" / "artifacts"


@pytest.fixture(scope="module")
def student_a_server(hub, accounts):
    """Student A logged in and spawned, as a browser does: (session, the server's URL, its _xsrf token)."""
    name = accounts["student_a"]
    session, answer = hub.login(name, hub.passwords[name])
    assert answer.status_code == 302 and answer.headers["Location"].endswith("/hub/spawn"), \
        f"{answer.status_code} {answer.headers.get('Location')}\n{hub.log_text()}"
    spawn_seconds = spawn(hub, session, name)
    server = f"{hub.url}/user/{name}"
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "hub-timings.json").write_text(json.dumps(
        {"make_hub_to_answer_s": round(hub.start_seconds, 1), "student_spawn_to_lab_s": round(spawn_seconds, 2)}))
    xsrf = session.cookies.get("_xsrf", path=f"/user/{name}/")
    return session, server, {"X-XSRFToken": xsrf}


def test_the_right_password_redirects_to_spawn_and_the_server_runs_as_the_student(hub, accounts, student_a_server):
    name = accounts["student_a"]
    account = pwd.getpwnam(name)
    servers = []
    for process in psutil.process_iter(["cmdline"]):
        try:
            if "jupyterhub-singleuser" in " ".join(process.info["cmdline"] or []) and \
                    process.environ().get("JUPYTERHUB_USER") == name:
                servers.append(process)
        except psutil.Error:
            continue
    assert servers, f"no jupyterhub-singleuser process for {name}"
    for process in servers:
        assert {process.uids().real, process.uids().effective} == {account.pw_uid}
        assert {process.gids().real, process.gids().effective} == {account.pw_gid}
        assert process.environ()["PATH"].startswith(f"{HUB_VENV}/bin:"), "kernels must find the venv's horovodrun"
        assert process.cwd() == account.pw_dir
    # The labs run the course's scripts, which the venv (the library alone) does not hold: staged, solution-free.
    scripts = Path(servers[0].environ()["SCALELAB_SOURCE_DIR"])
    assert sorted(path.name for path in scripts.iterdir()) == sorted(environment.COURSE_SCRIPTS)
    for name_of_script in environment.COURSE_SCRIPTS:
        assert (scripts / name_of_script).read_bytes() == (PROJECT_ROOT / "source_code" / name_of_script).read_bytes()
    found = subprocess.run(["runuser", "-u", name, "--", "env", f"SCALELAB_SOURCE_DIR={scripts}",
                            f"{HUB_VENV}/bin/python", "-I", "-c",
                            "from scalelab import environment; print(environment.course_source_dir())"],
                           capture_output=True, text=True, timeout=120, cwd="/")
    assert found.returncode == 0 and found.stdout.strip() == str(scripts), found.stdout + found.stderr


FORK_UNTIL_REFUSED = """
import os, sys, time
started = 0
while True:
    try:
        if os.fork() == 0:
            os.close(1)  # the test reads the count until every writer is gone
            os.close(2)
            time.sleep(600)
            os._exit(0)
        started += 1
    except OSError:
        print(started, flush=True)
        break
"""


def test_a_students_server_runs_in_cgroups_of_its_own_that_stop_a_fork_bomb(hub, accounts, student_a_server):
    """One student's processes stay within their server's limits: the class and the Hub go on."""
    name = accounts["student_a"]
    servers = [process.pid for process in processes_of(pwd.getpwnam(name).pw_uid)
               if "jupyterhub-singleuser" in " ".join(process.info["cmdline"] or [])]
    assert servers and set(servers) <= server_limits.members(name), "the server is in its own cgroups"
    limits = server_limits.ServerLimits.from_environment({})
    if server_limits.uses_v1():
        memory, cpu, pids = server_limits.server_cgroups(name)
        assert int((memory / "memory.limit_in_bytes").read_text()) == limits.memory_bytes
        assert (cpu / "cpu.shares").read_text().strip() == "1024"
    else:
        [pids] = server_limits.server_cgroups(name)
    assert (pids / "pids.max").read_text().strip() == str(limits.tasks)
    # As the student, in the server's cgroups (as a kernel of theirs would be): forks until the limit refuses one.
    tasks_before = int((pids / "pids.current").read_text())  # the server's threads, its kernels'
    procs = " ".join(str(group / "cgroup.procs") for group in server_limits.server_cgroups(name))
    bomb = subprocess.run(["sh", "-c", f'for group in {procs}; do echo $$ > "$group"; done; exec runuser -u {name} '
                                       f'-- {HUB_VENV}/bin/python -c "$0"', FORK_UNTIL_REFUSED],
                          capture_output=True, text=True, timeout=300)
    try:
        started = int(bomb.stdout.strip())
        assert limits.tasks - tasks_before - 8 <= started < limits.tasks - tasks_before, bomb.stdout + bomb.stderr
        assert requests.get(f"{hub.url}/hub/api/", timeout=30).status_code == 200, "the Hub still answers"
    finally:
        for pid in server_limits.members(name) - set(servers):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_the_server_opens_on_the_students_own_copy_of_the_course(accounts, student_a_server):
    session, server, headers = student_a_server
    listing = session.get(f"{server}/api/contents/scalelab/labs", headers=headers, timeout=30)
    assert listing.status_code == 200, listing.text
    # The Keras labs too, unless this is the PyTorch edition (no TensorFlow), whose copy leaves them out as make lab's
    # view does.
    labs = {entry["name"] for entry in listing.json()["content"]}
    assert labs >= {"lab3_ddp", "quiz"} and HAS_TENSORFLOW is (labs >= set(KERAS_LABS)), labs
    assert HAS_TENSORFLOW or not labs & set(KERAS_LABS), labs
    kernels = session.get(f"{server}/api/kernelspecs", headers=headers, timeout=30).json()["kernelspecs"]
    assert "scalelab" in kernels, "the notebooks name the course's kernel"
    home = Path(pwd.getpwnam(accounts["student_a"]).pw_dir)
    course = home / "scalelab"
    files = [path for path in course.rglob("*") if path.is_file()]
    names = {str(path.relative_to(course)) for path in files}
    assert {"assessment/assessment.py", "assessment/assessment_pytorch.py", "assessment/assessment.ipynb",
            "labs/lab3_ddp/fashion_mnist_ddp_student.py"} <= names
    assert HAS_TENSORFLOW is ({"labs/lab1/lab1_gradient_descent.ipynb", "labs/lab4/allreduce_bandwidth.py"} <= names)
    for script in ("assessment.py", "assessment_pytorch.py"):
        assert (course / "assessment" / script).read_bytes() == \
            (PROJECT_ROOT / "assessment" / script).read_bytes(), "the serial script, not the solution"
    for path in files:
        assert "solution" not in str(path.relative_to(course)) and "source" not in path.parts
        text = path.read_text(errors="replace")
        assert "BEGIN SOLUTION" not in text and "BEGIN HIDDEN TESTS" not in text, f"{path} holds instructor material"
        assert path.stat().st_uid == pwd.getpwnam(accounts["student_a"]).pw_uid


def test_the_hubs_state_is_root_only_and_outside_the_checkout(hub, accounts):
    assert hub.state.stat().st_mode & 0o777 == 0o700 and hub.state.stat().st_uid == 0
    assert {"jupyterhub.sqlite", "jupyterhub_cookie_secret", "proxy_token"} <= {p.name for p in hub.state.iterdir()}
    assert not list(PROJECT_ROOT.glob("jupyterhub*")) and not list(PROJECT_ROOT.glob("containers/hub/*.sqlite"))


def test_a_new_start_of_the_server_keeps_the_students_work_and_restores_what_they_deleted(hub, accounts):
    name = accounts["student_b"]
    course = Path(pwd.getpwnam(name).pw_dir) / "scalelab"
    session, answer = hub.login(name, hub.passwords[name])
    assert answer.status_code == 302
    spawn(hub, session, name)
    edit = subprocess.run(["runuser", "-u", name, "--", "sh", "-c", f"echo '# my work' >> {course}/assessment/"
                           f"assessment.py && rm {course}/labs/quiz/quiz.ipynb"], capture_output=True, text=True)
    assert edit.returncode == 0, edit.stderr
    stop = session.delete(f"{hub.url}/hub/api/users/{name}/server", timeout=60,
                          headers={"X-XSRFToken": session.cookies.get("_xsrf", path="/hub/")})
    assert stop.status_code in (202, 204), stop.text
    deadline = time.monotonic() + 60
    while session.get(f"{hub.url}/hub/api/user", timeout=30).json()["servers"]:
        assert time.monotonic() < deadline, f"{name}'s server did not stop:\n{hub.log_text()}"
        time.sleep(0.5)
    spawn(hub, session, name)
    assert (course / "assessment" / "assessment.py").read_text().endswith("# my work\n")
    assert (course / "labs" / "quiz" / "quiz.ipynb").is_file()


def test_a_wrong_password_is_refused(hub, accounts):
    name = accounts["student_b"]
    session, answer = hub.login(name, hub.passwords[name] + "x")
    assert answer.status_code == 403
    assert "jupyterhub-hub-login" not in session.cookies


def test_an_account_outside_the_class_cannot_log_in(hub):
    name, password = random_name("slo"), secrets.token_urlsafe(12)
    try:
        subprocess.run(["useradd", "--create-home", name], check=True)
        subprocess.run(["chpasswd"], input=f"{name}:{password}\n", text=True, check=True)
        _, answer = hub.login(name, password)
        assert answer.status_code == 403, "only members of the class's groups may log in"
    finally:
        remove_account(name)


def test_the_students_home_is_theirs_alone(accounts, student_a_server):
    student_a, student_b = accounts["student_a"], accounts["student_b"]
    home = Path(pwd.getpwnam(student_a).pw_dir)
    assert home.stat().st_mode & 0o777 == 0o700 and home.stat().st_uid == pwd.getpwnam(student_a).pw_uid
    script = home / "scalelab" / "assessment" / "assessment.py"
    own = subprocess.run(["runuser", "-u", student_a, "--", "cat", str(script)], capture_output=True, text=True)
    assert own.returncode == 0, own.stderr
    other = subprocess.run(["runuser", "-u", student_b, "--", "cat", str(script)], capture_output=True, text=True)
    assert other.returncode != 0 and "Permission denied" in other.stderr
    listing = subprocess.run(["runuser", "-u", student_b, "--", "ls", str(home)], capture_output=True, text=True)
    assert listing.returncode != 0 and "Permission denied" in listing.stderr


def test_a_student_cannot_read_the_instructors_material_in_the_checkout(accounts, student_a_server):
    for private in ("assessment/solution/assessment.py", "labs/source/lab1/lab1_gradient_descent.ipynb",
                    "source_code/fashion_mnist_horovod.py", "source_code/horovod_steps/step5_broadcast.py"):
        attempt = subprocess.run(["runuser", "-u", accounts["student_a"], "--", "cat", str(PROJECT_ROOT / private)],
                                 capture_output=True, text=True)
        assert attempt.returncode != 0 and "Permission denied" in attempt.stderr, private
    # Nor through Git's history, which holds the same files.
    for history in (["cat", str(PROJECT_ROOT / ".git" / "HEAD")], ["ls", str(PROJECT_ROOT / ".git" / "objects")]):
        attempt = subprocess.run(["runuser", "-u", accounts["student_a"], "--", *history], capture_output=True,
                                 text=True)
        assert attempt.returncode != 0 and "Permission denied" in attempt.stderr, history


def test_instructors_are_the_hub_group_instructors_and_nobody_is_admin(hub, accounts):
    for key, groups in (("instructor", ["instructors"]), ("student_b", [])):
        name = accounts[key]
        session, answer = hub.login(name, hub.passwords[name])
        assert answer.status_code == 302, hub.log_text()
        model = session.get(f"{hub.url}/hub/api/user", timeout=30).json()
        assert model["name"] == name and model["groups"] == groups and model["admin"] is False


def test_adding_a_student_again_says_so_and_changes_nothing(accounts):
    name = accounts["student_b"]
    shadow_before = Path("/etc/shadow").read_text()
    again = scalelab_class("add-student", name, "--password-stdin", password="another-password")
    assert again.returncode == 0
    assert f"{name} is already a student of the class: nothing changed." in again.stdout
    assert Path("/etc/shadow").read_text() == shadow_before


@pytest.mark.parametrize("password", ["", "short-pass1", "has:colon-in-it"])
def test_a_password_that_is_short_or_not_one_line_is_refused_and_nothing_is_created(accounts, password):
    name = random_name("slp")
    attempt = scalelab_class("add-student", name, "--password-stdin", password=password)
    assert attempt.returncode == 2, attempt.stderr
    assert ("at least 12" in attempt.stderr) if ":" not in password else ("holds a ':'" in attempt.stderr)
    assert name not in {entry.pw_name for entry in pwd.getpwall()}


def test_failed_logins_lock_the_account_out_of_the_hub_for_a_while(hub, accounts):
    """Password guessing: after 5 failures the right password is refused too, until the lock ends or is reset."""
    name = accounts["student_b"]
    try:
        for _attempt in range(5):
            _, answer = hub.login(name, "not-the-password-" + secrets.token_hex(4))
            assert answer.status_code == 403
        _, answer = hub.login(name, hub.passwords[name])
        assert answer.status_code == 403, "a locked account is refused even with its password"
        tally = subprocess.run(["faillock", "--user", name], capture_output=True, text=True, check=True).stdout
        counted = [line for line in tally.splitlines()[2:] if line.split()[-1:] == ["V"]]
        assert len(counted) >= 5, tally
    finally:
        subprocess.run(["faillock", "--user", name, "--reset"], check=True)
    _, answer = hub.login(name, hub.passwords[name])
    assert answer.status_code == 302, hub.log_text()


def test_removing_a_student_ends_their_server_tokens_and_logins_at_once(hub):
    """A removed student has no token, no process and no login left, at once."""
    name, password = random_name("slr"), secrets.token_urlsafe(12)
    try:
        assert scalelab_class("add-student", name, "--password-stdin", password=password).returncode == 0
        session, answer = hub.login(name, password)
        assert answer.status_code == 302, hub.log_text()
        spawn(hub, session, name)
        admin = json.loads((hub.state / "class-admin.json").read_text())
        assert (hub.state / "class-admin.json").stat().st_mode & 0o077 == 0, "the class service's token is root's"
        issued = requests.post(f"{admin['api_url']}/users/{name}/tokens", timeout=30, json={"note": "test"},
                               headers={"Authorization": f"token {admin['token']}"})
        assert issued.status_code == 201, issued.text
        token = issued.json()["token"]
        assert requests.get(f"{hub.url}/hub/api/user", headers={"Authorization": f"token {token}"},
                            timeout=30).status_code == 200
        uid = pwd.getpwnam(name).pw_uid
        assert processes_of(uid), "their server runs"

        removed = scalelab_class("remove", name, "--hub-state", str(hub.state))
        assert removed.returncode == 0, removed.stderr
        assert f"removed student {name}" in removed.stdout and "forgot them and their tokens" in removed.stdout

        assert requests.get(f"{hub.url}/hub/api/user", headers={"Authorization": f"token {token}"},
                            timeout=30).status_code == 403, "their token ended"
        assert not processes_of(uid), "their server and kernels ended"
        assert not any(group.exists() for group in server_limits.server_cgroups(name)), "their cgroups are gone"
        _, answer = hub.login(name, password)
        assert answer.status_code == 403, "they cannot log in again"
        groups = subprocess.run(["id", "-nG", name], capture_output=True, text=True).stdout
        assert "scalelab-students" not in groups
        again = scalelab_class("remove", name, "--hub-state", str(hub.state))
        assert again.returncode == 2 and "is not in the class" in again.stderr
    finally:
        remove_account(name)


def test_an_instructor_cannot_change_the_nbgrader_configuration_every_instructor_runs(hub, accounts):
    course = hub.nbgrader_home / "course"
    instructor = accounts["instructor"]
    for attempt in (["mv", str(course / "nbgrader_config.py"), str(course / "moved.py")],
                    ["rm", "-f", str(course / "nbgrader_config.json")],
                    ["sh", "-c", f"echo '{{\"Exchange\": {{}}}}' > {course / 'nbgrader_config.json'}"]):
        done = subprocess.run(["runuser", "-u", instructor, "--", *attempt], capture_output=True, text=True)
        said = done.stderr + done.stdout
        assert done.returncode != 0 and ("Permission denied" in said or "Operation not permitted" in said), attempt
    assert (course / "nbgrader_config.json").read_text() == "{}\n"
    # The course directory is still theirs to work in.
    work = subprocess.run(["runuser", "-u", instructor, "--", "sh", "-c", f"echo notes > {course / 'notes.txt'} && "
                           f"rm {course / 'notes.txt'}"], capture_output=True, text=True)
    assert work.returncode == 0, work.stderr


def test_a_student_is_not_made_an_instructor_too(accounts):
    name = accounts["student_b"]
    attempt = scalelab_class("add-instructor", name)
    assert attempt.returncode == 3 and f"{name} is already a student of the class" in attempt.stderr
    assert "scalelab-instructors" not in subprocess.run(["id", "-nG", name], capture_output=True, text=True).stdout


@pytest.mark.parametrize("name", ["Alice", "1st", "two words", "a.b", "café", "a" * 33, "root", "scalelab"])
def test_a_bad_name_is_refused_with_a_sentence(accounts, name):
    attempt = scalelab_class("add-student", name, "--password-stdin", password="some-password")
    assert attempt.returncode == 2
    assert attempt.stderr.startswith("scalelab class: ") and ("not a valid user name" in attempt.stderr
                                                             or "is reserved" in attempt.stderr)
    if name not in ("root", "scalelab"):
        assert name not in {entry.pw_name for entry in pwd.getpwall()}


def test_the_name_of_a_system_account_outside_the_class_is_refused(accounts):
    attempt = scalelab_class("add-student", "daemon", "--password-stdin", password="some-password")
    assert attempt.returncode == 3 and "belongs to an account of this system that is not in the class" in attempt.stderr
    assert "scalelab-students" not in subprocess.run(["id", "-nG", "daemon"], capture_output=True, text=True).stdout


def test_adding_someone_is_refused_to_a_user_who_is_not_root(accounts):
    name = random_name("sln")
    attempt = scalelab_class("add-student", name, "--password-stdin", password="some-password", as_user="nobody")
    assert attempt.returncode == 4 and "must run as root" in attempt.stderr, attempt.stderr
    assert name not in {entry.pw_name for entry in pwd.getpwall()}


def test_class_list_gives_name_role_and_whether_the_account_exists(accounts):
    listing = scalelab_class("list")
    assert listing.returncode == 0
    rows = {line.split()[0]: line.split()[1:] for line in listing.stdout.splitlines()[1:]}
    assert rows[accounts["student_a"]] == ["student", "exists"]
    assert rows[accounts["student_b"]] == ["student", "exists"]
    assert rows[accounts["instructor"]] == ["instructor", "exists"]


def test_make_hub_with_its_port_in_use_stops_with_a_sentence():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        sentence = f"make hub: port {port} on 127.0.0.1 is already in use; stop what listens there or set " \
                   "HUB_PORT to a free port."
        through_make = subprocess.run(["make", "hub", f"HUB_PORT={port}"], cwd=PROJECT_ROOT, capture_output=True,
                                      text=True, timeout=120)
        assert through_make.returncode != 0 and sentence in through_make.stderr, through_make.stderr
        script = subprocess.run([str(PROJECT_ROOT / "containers" / "hub" / "hub.sh")], capture_output=True,
                                text=True, timeout=120, env={**os.environ, "HUB_PORT": str(port)})
        assert script.returncode == 3 and script.stderr.strip() == sentence


@pytest.mark.parametrize("loose", ["group-writable fragment", "fragment of another account",
                                   "link to a file of root's", "folder above hub.d another account may write"])
def test_a_site_fragment_another_account_could_change_stops_the_hub_before_it_serves(tmp_path, loose):
    """The Hub runs HUB_CONFIG_D's files as root: one that someone else could write or swap is refused (a link is
    never followed, every folder above is checked), and nothing runs."""
    from hubtools import free_port

    above = tmp_path / "site"
    above.mkdir(mode=0o755)
    config_d = above / "hub.d"
    config_d.mkdir(mode=0o755)
    proof = tmp_path / "ran"
    fragment = config_d / "50-site.py"
    code = f"open({str(proof)!r}, 'w').close()\n"
    refusal = f"{fragment} is not root's alone"
    if loose == "link to a file of root's":
        elsewhere = tmp_path / "elsewhere.py"
        elsewhere.write_text(code)
        fragment.symlink_to(elsewhere)
        refusal = f"{fragment} cannot be read as a file of root's: a symbolic link"
    else:
        fragment.write_text(code)
    if loose == "group-writable fragment":
        fragment.chmod(0o664)
    elif loose == "fragment of another account":
        os.chown(fragment, pwd.getpwnam("nobody").pw_uid, -1)
    elif loose == "folder above hub.d another account may write":
        above.chmod(0o777)
        refusal = f"{above} is not root's alone"
    port = free_port()
    started = subprocess.run(
        ["make", "hub", f"HUB_PORT={port}", f"HUB_PROXY_API_PORT={free_port()}", f"HUB_INTERNAL_PORT={free_port()}",
         f"HUB_STATE={tmp_path / 'state'}", f"HUB_NBGRADER={tmp_path / 'nbgrader'}", f"HUB_CONFIG_D={config_d}"],
        cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "SCALELAB_SERVICE_STATE": str(tmp_path / "service"),
             "SCALELAB_SERVICE_PORT": str(free_port())})
    assert started.returncode != 0
    assert refusal in started.stdout + started.stderr, started.stderr[-3000:]
    assert not proof.exists()
