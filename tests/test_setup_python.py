"""containers/setup.sh chooses its interpreter (TensorFlow 2.15.1 has wheels for Python 3.10 and 3.11 only; 3.12 and
3.13 get the PyTorch edition alone) and its installer before it installs anything. These tests run the script against shim interpreters on a PATH of their own:
no network, nothing installed, a second or so each."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[1]
SETUP = PROJECT_ROOT / "containers" / "setup.sh"
SETUP_TEXT = SETUP.read_text()
UV_VERSION = re.search(r'^uv_pin="uv==([\d.]+)"$', SETUP_TEXT, re.MULTILINE).group(1)
# Names the shims stand for: the PATH the script sees has none of the machine's own.
HIDDEN = re.compile(r"^(python|pip|pydoc|idle|2to3|pyenv|uv|uvx|apt-get|dpkg-query)")


def version_of(python: str) -> str:
    try:
        result = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                capture_output=True, text=True, timeout=30)
    except OSError:
        return ""
    return result.stdout.strip()


def a_real_python() -> str | None:
    """A real Python 3.10/3.11 (Debian's where there is one, else the one running these tests)."""
    for candidate in ("/usr/bin/python3.11", "/usr/bin/python3.10", os.path.realpath(sys._base_executable)):
        if os.path.exists(candidate) and version_of(candidate) in ("3.10", "3.11"):
            return candidate
    return None


REAL_PYTHON = a_real_python()
if REAL_PYTHON is None:
    # A host of the PyTorch edition (Python 3.12 or 3.13 alone): the choices are tested where a real 3.11 can stand
    # behind the shims, as on CI's machine.
    pytest.skip("these tests need a real Python 3.10 or 3.11 to stand for python3.11, and this host has none",
                allow_module_level=True)


def others_can_run(path: str) -> bool:
    """Every directory on the way to the real file, and the file, has the execute bit for others."""
    real = Path(os.path.realpath(path))
    return all(part.stat().st_mode & stat.S_IXOTH for part in [real, *real.parents])


def write_script(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def fake_python(path: Path, version: str) -> Path:
    """A Python `version` as setup.sh sees it: it answers `--version` and every `-c` query (setup.sh asks
    `print("%d.%d" % sys.version_info[:2], sys.executable)`) with its version and itself, and cannot make a venv
    (like Ubuntu 24.04's python3 without python3-venv). Each call is logged next to it."""
    return write_script(path, f"""#!/bin/bash
echo "$*" >> "{path}.log"
case "$1" in
    --version|-V) echo "Python {version}.1" ;;
    -c) echo "{version} $0" ;;
    -m) echo "Error: ensurepip is not available" >&2
        exit 1 ;;
    *) exit 1 ;;
esac
""")


class Machine:
    """A PATH of shims plus the machine's own tools, a home of its own, and setup.sh run against them."""

    def __init__(self, root: Path, tools: Path):
        self.root = root
        self.shims = root / "shims"
        self.shims.mkdir()
        self.home = root / "home"
        self.home.mkdir()
        self.venv = self.home / "scalelab" / ".venv"
        self.bootstrap = self.home / ".cache" / "scalelab" / "bootstrap"
        self.tools = tools
        self.env = {"PATH": f"{self.shims}:{tools}", "HOME": str(self.home), "LANG": "C.UTF-8",
                    # nothing every account can run unless a test says so
                    "SCALELAB_SHARED_PYTHONS": str(root / "no-shared-python")}
        # Installing anything starts with these: they record that they were called and stop the script.
        self.apt_log = root / "apt-get.log"
        write_script(self.shims / "apt-get", f'#!/bin/bash\necho "$*" >> "{self.apt_log}"\nexit 97\n')
        write_script(self.shims / "dpkg-query", "#!/bin/bash\nexit 1\n")  # every package missing

    def python(self, name: str, version: str) -> Path:
        return fake_python(self.shims / name, version)

    def real_python(self, name: str) -> Path:
        link = self.shims / name
        link.symlink_to(REAL_PYTHON)
        return link

    def uv(self, fetches: bool) -> Path:
        """uv, as if setup.sh had installed it before: `python install` fails as it does offline, or succeeds and
        then `python find` names a real Python 3.11."""
        self.uv_log = self.root / "uv.log"
        fetched = self.root / "uv-fetched"
        install = f'touch "{fetched}"' if fetches else (
            'echo "error: Failed to install cpython-3.11.18-linux-x86_64-gnu" >&2\n'
            '        echo "  cause: failed to lookup address information: Name or service not known" >&2\n'
            '        exit 1')
        return write_script(self.bootstrap / "bin" / "uv", f"""#!/bin/bash
echo "$*" >> "{self.uv_log}"
case "$1 $2" in
    "--version "*) echo "uv {UV_VERSION}" ;;
    "python install")
        {install} ;;
    "python find")
        if [ -f "{fetched}" ]; then echo "{REAL_PYTHON}"; else echo "error: No interpreter found" >&2; exit 2; fi ;;
    *) exit 1 ;;
esac
""")

    def setup(self, *args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(SETUP), "--venv", str(self.venv), *args], capture_output=True, text=True,
                              env={**self.env, **env}, timeout=120, cwd=self.root)

    def assert_nothing_installed(self, result: subprocess.CompletedProcess) -> None:
        assert result.returncode == 1, result.stdout + result.stderr
        assert not self.apt_log.exists(), "setup.sh went on to apt-get"
        assert "Debian packages are missing" not in result.stderr
        assert not self.venv.exists(), "setup.sh made the venv"


@pytest.fixture(scope="session")
def tools(tmp_path_factory) -> Path:
    """The machine's commands without any Python, pip, uv or apt."""
    tools = tmp_path_factory.mktemp("tools")
    for directory in ("/usr/local/bin", "/usr/bin", "/usr/sbin", "/bin", "/sbin"):
        if not os.path.isdir(directory) or os.path.islink(directory):
            continue
        for entry in os.scandir(directory):
            if not HIDDEN.match(entry.name) and not (tools / entry.name).exists():
                (tools / entry.name).symlink_to(entry.path)
    return tools


@pytest.fixture()
def machine(tmp_path, tools) -> Machine:
    return Machine(tmp_path, tools)


def plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def image_commands() -> list[str]:
    """The laptop section's docker build and docker run commands in containers/README.md, each on one line."""
    readme = (PROJECT_ROOT / "containers" / "README.md").read_text()
    block = readme.split("## On a laptop", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    joined = re.sub(r"\\\n\s*", "", block)
    return [re.sub(r"\s+", " ", line).strip() for line in joined.splitlines() if line.strip()]


# --- which interpreter --------------------------------------------------------------------------------------------


def test_python3_that_is_3_12_gives_way_to_python3_11_on_path(machine):
    machine.python("python3", "3.12")
    python311 = machine.real_python("python3.11")
    result = machine.setup("--choose-python")
    assert result.returncode == 0, result.stdout + result.stderr
    out = plain(result.stdout)
    assert f"Python 3.11: {python311} (python3 is 3.12; python3.11 is 3.11)" in out
    assert not machine.venv.exists() and not machine.apt_log.exists()


def test_python3_that_is_3_11_is_taken_first(machine):
    python3 = machine.real_python("python3")
    machine.python("python3.11", "3.12")  # never asked
    result = machine.setup("--choose-python")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Python 3.11: {python3} (python3 is 3.11)" in plain(result.stdout)
    assert not (machine.shims / "python3.11.log").exists()


def test_python3_10_is_the_last_one_looked_for_on_path(machine):
    machine.python("python3", "3.13")
    fake_python(machine.shims / "python3.10", "3.10")
    result = machine.setup("--choose-python")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "(python3 is 3.13; python3.11 is missing; python3.10 is 3.10)" in plain(result.stdout)


def test_PYTHON_is_taken_over_what_is_on_path(machine):
    machine.python("python3", "3.12")
    machine.real_python("python3.11")
    result = machine.setup("--choose-python", PYTHON=REAL_PYTHON)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Python 3.11: {REAL_PYTHON} (given by PYTHON=)" in plain(result.stdout)
    assert not (machine.shims / "python3.log").exists(), "setup.sh looked further than PYTHON="


@pytest.mark.parametrize("only", [["--choose-python"], []], ids=["choose-python", "install"])
def test_a_missing_PYTHON_stops_with_a_clear_error_before_installing(machine, only):
    machine.real_python("python3")
    result = machine.setup(*only, PYTHON=str(machine.root / "no" / "python3.11"))
    machine.assert_nothing_installed(result)
    assert f"PYTHON={machine.root}/no/python3.11 is not an interpreter" in result.stderr


@pytest.mark.parametrize("only", [["--choose-python"], []], ids=["choose-python", "install"])
def test_a_PYTHON_that_is_3_9_stops_with_a_clear_error_before_installing(machine, only):
    python39 = fake_python(machine.root / "elsewhere" / "python3.9", "3.9")
    machine.real_python("python3")  # would do, but PYTHON= says otherwise
    result = machine.setup(*only, PYTHON=str(python39))
    machine.assert_nothing_installed(result)
    assert f"PYTHON={python39} is Python 3.9; the course runs on Python 3.10 to 3.13 (its Keras edition on 3.10 and " \
           "3.11 only, where TensorFlow 2.15.1 has wheels)" in result.stderr


PYTORCH_EDITION = ("the PyTorch labs and assessment tracks, without the Keras labs and tracks, which need TensorFlow.")


def test_a_PYTHON_that_is_3_13_takes_the_pytorch_edition_and_says_in_one_sentence_what_it_leaves_out(machine):
    python313 = fake_python(machine.root / "elsewhere" / "python3.13", "3.13")
    machine.real_python("python3")
    result = machine.setup("--choose-python", PYTHON=str(python313))
    assert result.returncode == 0, result.stdout + result.stderr
    out = plain(result.stdout)
    assert f"Python 3.13: {python313} (given by PYTHON=)" in out
    assert "==> Edition: PyTorch only (TensorFlow 2.15.1 has no wheel for Python 3.13): " + PYTORCH_EDITION in out


def test_a_python_that_tensorflow_runs_on_gets_the_whole_course_and_no_edition_line(machine):
    machine.real_python("python3")
    result = machine.setup("--choose-python")
    assert result.returncode == 0 and "Edition" not in result.stdout, result.stdout + result.stderr


def test_SCALELAB_EDITION_pytorch_takes_the_pytorch_edition_on_the_machines_python3_and_fetches_nothing(machine):
    machine.python("python3", "3.12")
    machine.real_python("python3.11")
    machine.uv(fetches=True)
    result = machine.setup("--choose-python", SCALELAB_EDITION="pytorch")
    assert result.returncode == 0, result.stdout + result.stderr
    out = plain(result.stdout)
    assert f"Python 3.12: {machine.shims / 'python3'} (python3 is 3.12)" in out
    assert "Edition: PyTorch only (TensorFlow 2.15.1 has no wheel for Python 3.12)" in out
    assert not machine.uv_log.exists(), "setup.sh asked uv for a Python 3.11"


def test_SCALELAB_EDITION_pytorch_on_python_3_11_says_it_was_asked_for(machine):
    machine.real_python("python3")
    result = machine.setup("--choose-python", SCALELAB_EDITION="pytorch")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Edition: PyTorch only (SCALELAB_EDITION=pytorch): " + PYTORCH_EDITION in plain(result.stdout)


@pytest.mark.parametrize("setting", [{"SCALELAB_EDITION": "keras"}, {"SCALELAB_TORCH_BUILD": "cuda"}])
def test_an_unknown_edition_or_torch_build_stops_at_once(machine, setting):
    machine.real_python("python3")
    result = machine.setup("--choose-python", **setting)
    [(name, value)] = setting.items()
    assert result.returncode == 2 and f"{name} is " in result.stderr and f"not '{value}'" in result.stderr
    assert "Python 3.11" not in result.stdout


def test_an_existing_3_11_venv_is_kept_without_looking_for_an_interpreter(machine):
    subprocess.run([REAL_PYTHON, "-m", "venv", "--without-pip", str(machine.venv)], check=True, timeout=60)
    machine.python("python3", "3.12")
    machine.uv(fetches=True)
    result = machine.setup("--choose-python")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Python 3.11: {machine.venv}/bin/python (the virtual environment {machine.venv} exists: kept)" \
        in plain(result.stdout)
    assert not (machine.shims / "python3.log").exists(), "setup.sh looked for an interpreter"
    assert not machine.uv_log.exists(), "setup.sh asked uv for one"


def test_an_existing_venv_of_python_3_9_is_refused_with_how_to_start_over(machine):
    (machine.venv / "bin").mkdir(parents=True)
    fake_python(machine.venv / "bin" / "python", "3.9")
    machine.real_python("python3")
    result = machine.setup()
    assert result.returncode == 1 and not machine.apt_log.exists()
    assert f"{machine.venv} exists but its python is Python 3.9; the course runs on Python 3.10 to 3.13" \
        in result.stderr
    assert f"rm -rf {machine.venv}" in result.stderr


def test_an_existing_venv_of_python_3_12_is_kept_for_the_pytorch_edition(machine):
    (machine.venv / "bin").mkdir(parents=True)
    fake_python(machine.venv / "bin" / "python", "3.12")
    machine.real_python("python3")
    result = machine.setup("--choose-python")
    assert result.returncode == 0, result.stdout + result.stderr
    out = plain(result.stdout)
    assert f"Python 3.12: {machine.venv}/bin/python (the virtual environment {machine.venv} exists: kept)" in out
    assert "Edition: PyTorch only (TensorFlow 2.15.1 has no wheel for Python 3.12)" in out


# --- a CPython 3.11 from uv, or the sentence with the ways out -----------------------------------------------------


def test_without_python_3_10_or_3_11_a_cpython_managed_by_uv_is_taken(machine):
    machine.python("python3", "3.12")
    machine.uv(fetches=True)
    result = machine.setup("--choose-python")
    assert result.returncode == 0, result.stdout + result.stderr
    out = plain(result.stdout)
    assert f"Python 3.11: {REAL_PYTHON} (a CPython managed by uv: no Python 3.10 or 3.11 on PATH " \
           "(python3 is 3.12; python3.11 is missing; python3.10 is missing))" in out
    assert "python install --no-bin 3.11" in machine.uv_log.read_text()


def test_when_uv_cannot_fetch_a_3_11_the_machines_own_3_13_takes_the_pytorch_edition(machine):
    python3 = machine.python("python3", "3.13")
    machine.uv(fetches=False)
    result = machine.setup("--choose-python")
    assert result.returncode == 0, result.stdout + result.stderr
    out = plain(result.stdout)
    assert f"Python 3.13: {python3} (no Python 3.10 or 3.11 on PATH (python3 is 3.13; python3.11 is missing; " \
           "python3.10 is missing) and uv could not fetch a CPython 3.11 (failed to lookup address information: Name " \
           "or service not known): python3 for the PyTorch edition)" in out
    assert "Edition: PyTorch only (TensorFlow 2.15.1 has no wheel for Python 3.13): " + PYTORCH_EDITION in out
    assert "python install --no-bin 3.11" in machine.uv_log.read_text(), "a Python 3.11 is tried first"


def test_when_uv_cannot_fetch_one_setup_stops_before_installing_and_names_the_ways_out(machine):
    machine.python("python3", "3.9")
    machine.uv(fetches=False)
    result = machine.setup()
    machine.assert_nothing_installed(result)
    assert "python install --no-bin 3.11" in machine.uv_log.read_text()
    first = result.stderr.splitlines()[0]
    assert first.startswith("setup.sh: no Python 3.10 or 3.11 on PATH (python3 is 3.9; python3.11 is missing; "
                            "python3.10 is missing) and uv could not fetch a CPython 3.11 (failed to lookup address "
                            "information: Name or service not known), nor a Python 3.12 or 3.13 for the PyTorch "
                            "edition; ")
    for way_out in ("install a Python 3.11", "give one with PYTHON=/path/to/python3.11", "or use the CPU image"):
        assert way_out in first
    lines = [line.strip() for line in result.stderr.splitlines()]
    for command in image_commands():  # the very commands containers/README.md gives
        assert command in lines
    assert not any("-m venv" in line or "pip" in line for line in (machine.shims / "python3.log").read_text()
                   .splitlines()), "python3 was used to install something"


def test_when_uv_cannot_even_be_installed_setup_stops_before_installing(machine):
    machine.python("python3", "3.9")  # cannot make a venv: no python3-venv
    result = machine.setup()
    machine.assert_nothing_installed(result)
    assert not (machine.bootstrap / "bin" / "uv").exists()
    assert "python3 -m venv failed to make a venv for uv" in result.stderr
    assert "apt-get install python3-venv" in result.stderr
    assert "give one with PYTHON=/path/to/python3.11" in result.stderr


@pytest.mark.parametrize("version", ["3.9", "3.13"])
def test_system_python_install_never_fetches_an_interpreter(machine, version):
    machine.python("python3", version)
    machine.uv(fetches=True)
    result = machine.setup("--system-python", "--choose-python")
    assert not machine.uv_log.exists()
    if version == "3.9":
        assert result.returncode == 1
        assert "--system-python installs into an interpreter the machine has" in result.stderr
    else:  # the image's own Python 3.13 takes the PyTorch edition
        assert result.returncode == 0, result.stdout + result.stderr
        assert "Edition: PyTorch only (TensorFlow 2.15.1 has no wheel for Python 3.13)" in plain(result.stdout)


def test_supported_versions_are_pyprojects_requires_python():
    requires = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    low, high = re.fullmatch(r">=3\.(\d+),<3\.(\d+)", requires).groups()
    supported = re.search(r'^supported_pythons="([^"]*)"', SETUP_TEXT, re.MULTILINE).group(1).split()
    assert supported == [f"3.{minor}" for minor in range(int(low), int(high))]
    # The Keras edition's Pythons are those below the marker that keeps TensorFlow out of the extras.
    keras = re.search(r'^keras_pythons="([^"]*)"', SETUP_TEXT, re.MULTILINE).group(1).split()
    extras = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in ("cpu", "gpu"):
        [tensorflow] = [pin for pin in extras[extra] if pin.startswith("tensorflow")]
        below = int(re.search(r"python_version < '3\.(\d+)'", tensorflow).group(1))
        assert keras == [f"3.{minor}" for minor in range(int(low), below)], tensorflow
    assert not any(pin.startswith("tensorflow") for pin in extras["torch"]), "the PyTorch edition's extra"


# --- a venv other accounts run -------------------------------------------------------------------------------------


def private_python(machine: Machine) -> Path:
    """python3 installed in a directory only its owner can enter (like pyenv's under /root, mode 0700)."""
    private = machine.root / "private"
    (private / "bin").mkdir(parents=True)
    shutil.copy2(os.path.realpath(REAL_PYTHON), private / "bin" / "python3")  # finds its library by its prefix
    private.chmod(0o700)
    machine.shims.joinpath("python3").symlink_to(private / "bin" / "python3")
    return private


@pytest.mark.skipif(not others_can_run("/usr/bin/python3.11") or version_of("/usr/bin/python3.11") != "3.11",
                    reason="no Debian /usr/bin/python3.11 that every account can run")
def test_a_venv_outside_home_is_made_from_debians_python_not_one_under_a_private_directory(machine):
    private = private_python(machine)
    machine.venv = machine.root / "opt" / "scalelab-venv"
    result = machine.setup("--choose-python", SCALELAB_SHARED_PYTHONS="/usr/bin/python3.11")
    assert result.returncode == 0, result.stdout + result.stderr
    out = plain(result.stdout)
    assert f"is under {private}, which other accounts cannot enter" in out
    assert "Python 3.11: /usr/bin/python3.11 (python3 is 3.11, but under" in out


def test_a_venv_outside_home_with_only_a_private_python_stops_with_a_sentence(machine):
    private = private_python(machine)
    machine.venv = machine.root / "opt" / "scalelab-venv"
    result = machine.setup()
    machine.assert_nothing_installed(result)
    assert f"is under {private}, which other accounts cannot enter, and a venv outside your home" in result.stderr
    assert "install Debian's python3.11" in result.stderr


def test_a_private_PYTHON_for_a_venv_outside_home_is_refused(machine):
    private = private_python(machine)
    machine.venv = machine.root / "opt" / "scalelab-venv"
    result = machine.setup(PYTHON=str(private / "bin" / "python3"))
    machine.assert_nothing_installed(result)
    assert "give an interpreter every account can run" in result.stderr


def test_a_private_python_is_fine_for_a_venv_in_ones_own_home(machine):
    private_python(machine)
    result = machine.setup("--choose-python")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "other accounts" not in result.stdout


# --- uv or pip for the pinned packages -----------------------------------------------------------------------------


@pytest.fixture()
def venv_with_pip(machine) -> Machine:
    """An existing venv whose pip (the base interpreter's) reads only the configuration a test gives it."""
    subprocess.run([REAL_PYTHON, "-m", "venv", "--without-pip", "--system-site-packages", str(machine.venv)],
                   check=True, timeout=60)
    if subprocess.run([str(machine.venv / "bin" / "python"), "-m", "pip", "--version"],
                      capture_output=True).returncode != 0:
        pytest.skip(f"{REAL_PYTHON} has no pip to read a configuration with")
    machine.uv(fetches=False)
    machine.env["PIP_CONFIG_FILE"] = os.devnull  # none of the machine's pip.conf files
    return machine


def installer_line(machine: Machine, **env: str) -> str:
    result = machine.setup("--choose-installer", **env)
    assert result.returncode == 0, result.stdout + result.stderr
    if machine.uv_log.exists():  # asked for its version, never to install
        assert set(machine.uv_log.read_text().splitlines()) == {"--version"}
    assert not machine.apt_log.exists()
    return next(line for line in plain(result.stdout).splitlines() if line.startswith("==> Installer: "))


def test_uv_is_given_every_setting_of_pips_configuration(venv_with_pip):
    machine = venv_with_pip
    wheels = machine.root / "wheels"
    wheels.mkdir()
    constraints = machine.root / "constraints.txt"
    constraints.write_text("torch<=2.14.1\n")
    bundle = machine.root / "ca.pem"
    bundle.write_text("")
    line = installer_line(machine, PIP_EXTRA_INDEX_URL="file:///opt/pypi/simple file:///opt/pypi-more/simple",
                          PIP_FIND_LINKS=f"{wheels} {machine.root}/missing-wheels", PIP_CONSTRAINT=str(constraints),
                          PIP_CERT=str(bundle), PIP_TRUSTED_HOST="mirror.example", PIP_DEFAULT_TIMEOUT="180",
                          PIP_DISABLE_PIP_VERSION_CHECK="1")
    assert line.startswith("==> Installer: uv (pip's configuration translated: ")
    for expected in ("--extra-index-url file:///opt/pypi/simple --extra-index-url file:///opt/pypi-more/simple",
                     f"--find-links {wheels} ",
                     f"--constraint {constraints} --build-constraint {constraints}",
                     "--allow-insecure-host mirror.example", f"SSL_CERT_FILE={bundle}", "UV_HTTP_TIMEOUT=180"):
        assert expected in line
    assert "missing-wheels" not in line  # pip skips a find-links directory that is not there; uv would stop


def test_pip_configuration_files_apply_global_then_install_then_environment(venv_with_pip):
    machine = venv_with_pip
    config = machine.root / "pip.conf"
    config.write_text("[global]\nindex-url = https://global.example/simple\nfind-links =\n"
                      f"    {machine.root}\n[install]\nindex-url = https://install.example/simple\n"
                      "[download]\nindex-url = https://download.example/simple\n")
    line = installer_line(machine, PIP_CONFIG_FILE=str(config))
    assert "--index-url https://install.example/simple" in line and f"--find-links {machine.root}" in line
    assert "global.example" not in line and "download.example" not in line
    line = installer_line(machine, PIP_CONFIG_FILE=str(config), PIP_INDEX_URL="https://env.example/simple")
    assert "--index-url https://env.example/simple" in line and "install.example" not in line


def test_credentials_in_an_index_url_stay_out_of_the_log(venv_with_pip):
    line = installer_line(venv_with_pip, PIP_INDEX_URL="https://student:s3cret@mirror.example/simple")
    assert "--index-url https://***@mirror.example/simple" in line and "s3cret" not in line


def test_pip_is_kept_where_its_configuration_has_no_uv_equivalent(venv_with_pip):
    line = installer_line(venv_with_pip, PIP_REQUIRE_HASHES="1", PIP_NO_CACHE_DIR="1")
    assert line == "==> Installer: pip (pip's configuration sets require-hashes, which uv would not apply the " \
                   "same way)"


def test_pip_when_asked_for_and_for_the_system_interpreter(venv_with_pip):
    assert installer_line(venv_with_pip, SCALELAB_INSTALLER="pip") == "==> Installer: pip (SCALELAB_INSTALLER=pip)"
    result = venv_with_pip.setup("--system-python", "--choose-installer", PYTHON=REAL_PYTHON)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "==> Installer: pip (--system-python: " in plain(result.stdout)


def test_horovodrun_is_looked_up_where_the_interpreter_puts_scripts():
    assert 'sysconfig.get_path("scripts")' in SETUP_TEXT
    assert 'dirname "$python"' not in SETUP_TEXT


# --- the Makefile -------------------------------------------------------------------------------------------------


def test_make_setup_passes_PYTHON_to_setup_sh_and_make_test_keeps_the_venvs_python(tmp_path):
    for name in ("Makefile", "pyproject.toml"):
        (tmp_path / name).write_text((PROJECT_ROOT / name).read_text())
    record = tmp_path / "setup.args"
    write_script(tmp_path / "containers" / "setup.sh",
                 f'#!/bin/bash\necho "PYTHON=$PYTHON $*" > "{record}"\nmkdir -p .venv\n')
    env = {key: value for key, value in os.environ.items() if key != "PYTHON"}
    subprocess.run(["make", "setup", "PYTHON=/opt/python3.11/bin/python3.11"], cwd=tmp_path, env=env, check=True,
                   capture_output=True, timeout=60)
    assert record.read_text() == "PYTHON=/opt/python3.11/bin/python3.11 --venv .venv\n"
    dry_run = subprocess.run(["make", "-n", "test", "PYTHON=/opt/python3.11/bin/python3.11"], cwd=tmp_path,
                             env=env, check=True, capture_output=True, text=True, timeout=60).stdout
    assert ".venv/bin/python -m pytest" in dry_run and "python3.11 -m pytest" not in dry_run


@pytest.mark.parametrize("target", ["lab", "test", "bench", "autograde"])
def test_every_make_target_that_runs_the_notebooks_installs_the_courses_kernel_first(target):
    """From a fresh clone, each README command works by itself: nothing else has installed the kernel before."""
    recipe = subprocess.run(["make", "-n", "-W", "pyproject.toml", target], cwd=PROJECT_ROOT, check=True,
                            capture_output=True, text=True, timeout=60).stdout.splitlines()
    runs = {"lab": "jupyter lab", "test": "-m pytest", "bench": "-m benchmarks.run", "autograde": "nbgrader autograde"}
    installs = [number for number, line in enumerate(recipe) if "scalelab lab-setup" in line]
    [first_run] = [number for number, line in enumerate(recipe) if runs[target] in line][:1] or [None]
    assert first_run is not None, recipe
    assert installs and installs[0] < first_run, f"make {target} runs before it installs the kernel: {recipe}"


# --- the GPU image: TensorFlow and Horovod from the base ---------------------------------------------------------


def base_python(machine: Machine, frameworks: str) -> Path:
    """A Python 3.10 like NGC's, whose `import tensorflow, horovod` reports `frameworks` (or fails when empty)."""
    answer = (f'echo "{frameworks}"' if frameworks
              else 'echo "ModuleNotFoundError: No module named \'horovod\'" >&2; exit 1')
    return write_script(machine.shims / "python3", f"""#!/bin/bash
echo "$*" >> "$0.log"
case "$1 $2" in
    "-c "*"import tensorflow, horovod"*) {answer} ;;
    "-c "*) echo "3.10 $0" ;;
    *) exit 1 ;;
esac
""")


@pytest.mark.parametrize("frameworks", ["2.16.1 0.28.1", "2.15.0 0.27.0", ""])
def test_framework_from_base_stops_before_installing_unless_the_base_has_the_pinned_releases(machine, frameworks):
    base_python(machine, frameworks)
    result = machine.setup("--system-python", "--framework-from-base")
    assert result.returncode == 1, result.stdout + result.stderr
    assert not machine.apt_log.exists(), "setup.sh went on to apt-get"
    assert "--framework-from-base" in result.stderr
    if frameworks:
        assert f"the base ships TensorFlow {frameworks.split()[0]} and Horovod {frameworks.split()[1]}; the course " \
               "pins TensorFlow 2.15.1 (any 2.15.x) and Horovod 0.28.1" in result.stderr
    else:
        assert "cannot import TensorFlow and Horovod (ModuleNotFoundError: No module named 'horovod')" in result.stderr


def test_framework_from_base_is_refused_for_the_pytorch_edition(machine):
    base_python(machine, "2.15.0 0.28.1")
    result = machine.setup("--system-python", "--framework-from-base", SCALELAB_EDITION="pytorch")
    assert result.returncode == 1 and not machine.apt_log.exists(), result.stdout + result.stderr
    assert "--framework-from-base keeps a base's TensorFlow and Horovod (the Keras edition)" in result.stderr


def test_framework_from_base_keeps_ngcs_releases_and_installs_only_what_the_course_runs_with(machine):
    base_python(machine, "2.15.0 0.28.1")
    result = machine.setup("--system-python", "--framework-from-base")
    assert "TensorFlow 2.15.0 and Horovod 0.28.1 from the base: kept" in plain(result.stdout)
    # It went on to apt (the shim stops it there) for the runtime packages alone: no compilers, no MPI of its own.
    assert result.returncode == 97, result.stdout + result.stderr
    installing = "==> Installing Debian packages: bubblewrap util-linux procps dataset-fashion-mnist\n"
    assert installing in plain(result.stdout)
