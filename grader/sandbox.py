"""The bubblewrap sandbox every process the grader starts on a submission's behalf runs in: an allow-list.

A sandbox shows what a Python + Open MPI + TensorFlow program needs and nothing else:

- the system: ``/usr`` and the ``/bin``, ``/sbin``, ``/lib*`` links (or directories), a read-only ``/sys``
  (hwloc and TensorFlow read the CPU topology there), a fresh ``/proc`` and ``/dev``, the GPU devices if any;
- a few files of ``/etc`` (the loader's cache, Open MPI's settings, the alternatives links) and generated
  ``passwd``, ``group`` and ``hosts`` that name no account or address of the host;
- the Python installation, the venv and the course library, read-only;
- a private ``/tmp``, ``/dev/shm`` and ``/run``, each a tmpfs of bounded size (:data:`TMPFS_SIZES`: a tmpfs lives
  in memory, and without a size it may take half of it); a loopback-only network; its own host name, PID and IPC
  space;
- what the caller binds in (:class:`Bind`): the job directory for a run, the model and the held-out split for
  the measurement.

Everything else (home directories, ``/srv``, ``/opt`` beyond the software, the folders around the checkout,
mounts, the grader's state, the reference solution, other jobs) is absent, not hidden. Data directories that
lie inside a bound system directory (Debian's Fashion-MNIST under ``/usr/share``) are covered by an empty tmpfs.

As root the sandboxed command drops to an unprivileged uid of its own (:func:`allocate_uid`) with no
capabilities; as another user bubblewrap runs it in a user namespace as that user.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import psutil

from scalelab import data as course_data

# Dedicated uids for sandboxed processes when the grader runs as root: one per job (and one per measurement),
# so that the process limit counts only that job's processes and no job can signal or read another's.
SANDBOX_UID_RANGE = range(61000, 62000)
SANDBOX_HOSTNAME = "scalelab-sandbox"
# What a program reads in /etc (absent entries are skipped): the dynamic loader, name-service switch, time zone,
# TLS certificates, Open MPI's settings and the Debian alternatives that `mpirun` resolves through.
ETC_ENTRIES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "nsswitch.conf", "host.conf", "gai.conf", "localtime",
               "timezone", "protocols", "services", "alternatives", "openmpi", "ssl", "ca-certificates",
               "os-release", "debian_version")
SYSTEM_DIRECTORIES = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# The sandbox's own writable directories, in memory. Enough for what the course's programs put there (Open MPI's
# shared-memory segments, caches under HOME=/tmp); a program that fills one gets ENOSPC, not the machine's RAM.
TMPFS_SIZES = {"/tmp": 1024 * 1024**2, "/dev/shm": 512 * 1024**2, "/run": 16 * 1024**2}


class SandboxError(RuntimeError):
    """The sandbox cannot be built or started here (the grader's problem, not the submission's)."""


@dataclasses.dataclass(frozen=True)
class Bind:
    """One path the caller shows inside the sandbox: ``source`` on the host at ``target`` inside."""

    source: Path
    target: Path
    writable: bool = False
    # An open directory to show instead of ``source``'s path (bubblewrap's --bind-fd): what was checked is what is
    # shown, even if the path is swapped for a link in between.
    fd: int | None = None


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


def software_paths() -> list[Path]:
    """What every sandboxed Python needs to read: the Python installation, the venv and the course library."""
    import scalelab
    import scalelab.grader

    paths = {Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve(),
             Path(scalelab.__file__).resolve().parent, Path(scalelab.grader.__file__).resolve().parent}
    # Installed packages outside the venv (a venv that reuses another's site-packages through a .pth file):
    # only directories named site-packages or dist-packages, which hold installed software and nothing else.
    paths |= {Path(entry).resolve() for entry in sys.path
              if entry and Path(entry).name in ("site-packages", "dist-packages") and Path(entry).is_dir()}
    # A path inside another shown one adds nothing.
    return sorted(path for path in paths if not any(other != path and _is_under(path, other) for other in paths))


def data_directories(cifar10_dir: str | None = None, fashion_mnist_dir: str | None = None) -> list[Path]:
    """Every place the course's data sets may be read from (the settings given, else the environment's)."""
    return sorted({Path(d).resolve() for d in [*course_data.cifar10_dirs(cifar10_dir),
                                               *course_data.fashion_mnist_dirs(fashion_mnist_dir)]})


def _is_under(path: Path, ancestor: Path) -> bool:
    return path == ancestor or ancestor in path.parents


def _system_binds() -> list[str]:
    argv = []
    for name in SYSTEM_DIRECTORIES:
        path = Path(name)
        if path.is_symlink():
            argv += ["--symlink", os.readlink(path), name]
        elif path.is_dir():
            argv += ["--ro-bind", name, name]
    argv += ["--ro-bind", "/sys", "/sys", "--proc", "/proc", "--dev", "/dev"]
    for path, size in TMPFS_SIZES.items():
        argv += (["--perms", "1777"] if path != "/run" else []) + ["--size", str(size), "--tmpfs", path]
    argv += ["--perms", "0755", "--dir", "/etc"]
    for name in ETC_ENTRIES:
        path = Path("/etc") / name
        if path.exists():
            argv += ["--ro-bind", str(path), str(path)]
    return argv


def write_identity_files(directory: Path, uid: int) -> dict[str, Path]:
    """passwd, group and hosts for the sandbox: only root, the sandbox's own account and the loopback."""
    files = {
        "passwd": f"root:x:0:0:root:/root:/usr/sbin/nologin\n"
                  f"scalelab-job:x:{uid}:{uid}:graded run:/tmp:/usr/sbin/nologin\n"
                  f"nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "group": f"root:x:0:\nscalelab-job:x:{uid}:\nnogroup:x:65534:\n",
        # Gloo and Open MPI bind the address the host name resolves to: inside, that is the loopback.
        "hosts": f"127.0.0.1\tlocalhost {SANDBOX_HOSTNAME}\n::1\tlocalhost ip6-localhost ip6-loopback\n",
    }
    written = {}
    for name, text in files.items():
        path = directory / name
        path.write_text(text)
        path.chmod(0o644)
        written[name] = path
    return written


def bwrap_argv(command: list[str], *, binds: list[Bind], env: dict[str, str], chdir: Path, private_dir: Path,
               uid: int | None, hidden: list[Path] = (), devices: list[Path] = ()) -> list[str]:
    """The argv that runs ``command`` in a sandbox showing the system, the software and ``binds`` only.

    ``private_dir`` is a directory of the grader's (outside the sandbox) for the generated /etc files; ``uid`` is
    the unprivileged uid to drop to when the grader is root (None: keep the caller's uid).
    """
    bwrap = bwrap_path()
    if bwrap is None:
        raise SandboxError("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")
    argv = [bwrap, *_system_binds()]
    identity = write_identity_files(private_dir, uid if uid is not None else os.getuid())
    for name, path in identity.items():
        argv += ["--ro-bind", str(path), f"/etc/{name}"]
    for device in devices:
        argv += ["--dev-bind", str(device), str(device)]
    # Data directories inside a bound system directory (e.g. /usr/share/datasets) are emptied.
    system = [Path(d).resolve() for d in SYSTEM_DIRECTORIES if Path(d).is_dir() and not Path(d).is_symlink()]
    covered = sorted({p for p in (Path(h).resolve() for h in hidden)
                      if p.is_dir() and any(_is_under(p, s) and p != s for s in system)},
                     key=lambda p: len(p.parts))
    for path in covered:
        argv += ["--tmpfs", str(path)]
    shown = [Bind(path, path) for path in software_paths()] + list(binds)
    created: set[Path] = set()
    for bind in sorted(shown, key=lambda b: len(b.target.parts)):
        if any(_is_under(bind.target, s) for s in system) and not bind.writable \
                and not any(_is_under(bind.target, c) for c in covered):
            continue  # already shown, read-only, with its system directory
        # bwrap would create missing parents as 0700 root: an unprivileged uid could not pass them.
        for parent in reversed(bind.target.parents):
            if parent != Path("/") and parent not in created and not any(_is_under(parent, s) for s in system):
                argv += ["--perms", "0755", "--dir", str(parent)]
                created.add(parent)
        if bind.fd is not None:
            argv += ["--bind-fd" if bind.writable else "--ro-bind-fd", str(bind.fd), str(bind.target)]
        else:
            argv += ["--bind" if bind.writable else "--ro-bind", str(bind.source), str(bind.target)]
    argv += ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--hostname", SANDBOX_HOSTNAME,
             "--die-with-parent", "--new-session", "--chdir", str(chdir), "--clearenv"]
    argv += [arg for name, value in env.items() for arg in ("--setenv", name, value)]
    argv.append("--")
    if uid is not None:
        argv += [shutil.which("setpriv") or "/usr/bin/setpriv", f"--reuid={uid}", f"--regid={uid}",
                 "--clear-groups", "--no-new-privs", "--inh-caps=-all"]
    return argv + list(command)


def sandbox_works() -> str | None:
    """None if bubblewrap can start a process with the grader's options here, else why it cannot."""
    bwrap = bwrap_path()
    if bwrap is None:
        return "bubblewrap (bwrap) is not installed (apt-get install bubblewrap)"
    try:
        # The namespaces and the host name the real sandbox (sandbox_argv) asks for, so that what a container
        # forbids is found here, before a run, rather than as a failed run.
        probe = subprocess.run([bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-net",
                                "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--hostname", SANDBOX_HOSTNAME,
                                "--die-with-parent", "true"],
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"bubblewrap could not start: {error}"
    if probe.returncode != 0:
        reason = f"bubblewrap could not start a sandbox here: {probe.stderr.strip()}"
        if "mount proc" in probe.stderr:
            # Container engines mask parts of /proc, which forbids a fresh proc mount inside the container.
            reason += (" (inside a container: start it with `--security-opt 'unmask=/proc/*'` under podman or "
                       "`--security-opt systempaths=unconfined` under docker, as containers/README.md shows)")
        elif "set hostname" in probe.stderr:
            # podman's default seccomp profile refuses sethostname to a container without CAP_SYS_ADMIN.
            reason += (" (inside a container: start it with `--security-opt seccomp=unconfined`, as "
                       "containers/README.md shows)")
        return reason
    return None


_uids_in_use: set[int] = set()
_uids_lock = threading.Lock()


def allocate_uid() -> int | None:
    """A uid from SANDBOX_UID_RANGE that no process uses now (None when the grader is not root)."""
    if os.geteuid() != 0:
        return None
    busy = {process.info["uids"].real for process in psutil.process_iter(["uids"]) if process.info["uids"]}
    with _uids_lock:
        free = [uid for uid in SANDBOX_UID_RANGE if uid not in busy and uid not in _uids_in_use]
        if not free:
            raise SandboxError("no free sandbox uid: too many jobs are running")
        uid = free[secrets.randbelow(len(free))]
        _uids_in_use.add(uid)
        return uid


def release_uid(uid: int | None) -> None:
    with _uids_lock:
        _uids_in_use.discard(uid)
