"""The course's Open MPI collective rules (source_code/scalelab/openmpi-collective-rules.conf).

Open MPI says nothing when the file is wrong or missing (it falls back to its fixed decisions), so these tests
check that the file has the structure Open MPI 4.1 reads, that Open MPI really applies it (a copy naming an
algorithm that does not exist makes only the allreduces above the size switch fail), that every way the course
starts `horovodrun --mpi` points at it, and that allreduces on both sides of the switch still sum exactly.
Its speed is measured by `make bench` (P6, variants "mpi" and "mpi-fixed").
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from scalelab import environment
from scalelab.grader import launch, sandbox
from conftest import HAS_TENSORFLOW, VENV_BIN, subprocess_env

PROJECT_ROOT = Path(__file__).resolve().parents[1]
RULES = environment.OPENMPI_COLLECTIVE_RULES
ALLREDUCE_ID = 2  # ALLREDUCE in Open MPI's coll_base_functions.h
SWITCH_BYTES = 1 << 20
COURSE_SETTINGS = environment.openmpi_settings({})
# The two-rank scripts below allreduce numpy arrays through the installed edition's Horovod binding.
if HAS_TENSORFLOW:
    HOROVOD_IMPORTS = "import horovod.tensorflow as hvd\nimport tensorflow as tf\nas_tensor = tf.constant\n"
else:
    HOROVOD_IMPORTS = "import horovod.torch as hvd\nimport torch\nas_tensor = torch.from_numpy\n"


def run_two_ranks_under_mpi(horovodrun: str, script: Path, settings: dict) -> subprocess.CompletedProcess:
    return subprocess.run([horovodrun, "-np", "2", "--mpi", str(VENV_BIN / "python"), str(script)],
                          capture_output=True, text=True, timeout=180, env=subprocess_env(**settings))


def read_rules(text: str) -> dict[int, list[tuple[int, list[tuple[int, int, int, int]]]]]:
    """The rules as Open MPI 4.1's reader walks them: {collective id: [(communicator size, [(message bytes,
    algorithm, fan-in/out, segment bytes), ...]), ...]}. Every number must be used, none may be missing."""
    numbers = [int(word) for line in text.splitlines() for word in line.split("#", 1)[0].split()]
    position = 0

    def take() -> int:
        nonlocal position
        assert position < len(numbers), "the rules end early"
        position += 1
        return numbers[position - 1]

    rules = {}
    for _ in range(take()):
        collective = take()
        rules[collective] = [(take(), [(take(), take(), take(), take()) for _ in range(take())])
                             for _ in range(take())]
    assert position == len(numbers), f"{len(numbers) - position} numbers left over after the last rule"
    return rules


def test_the_rules_are_what_open_mpi_reads_and_switch_large_allreduces_to_the_segmented_ring():
    rules = read_rules(RULES.read_text())
    assert list(rules) == [ALLREDUCE_ID]
    [(communicator_size, by_message)] = rules[ALLREDUCE_ID]
    assert communicator_size == 2, "the rule must cover the smallest job (2 ranks)"
    sizes = [rule[0] for rule in by_message]
    # Without a rule for size 0, Open MPI drops the whole collective's rules silently.
    assert sizes[0] == 0 and sizes == sorted(set(sizes))
    assert by_message[0][1] == 0, "small messages keep Open MPI's fixed decision"
    [large] = [rule for rule in by_message if rule[0] == SWITCH_BYTES]
    assert large[1] == 5 and large[3] == 1 << 20, "1 MiB and up: segmented ring with 1 MiB segments"


def test_the_reader_rejects_rules_with_a_missing_or_extra_number():
    good = RULES.read_text()
    with pytest.raises(AssertionError, match="end early"):
        read_rules(good.replace("1048576 5 0 1048576", "1048576 5 0"))
    with pytest.raises(AssertionError, match="left over"):
        read_rules(good + "\n7\n")


def test_course_settings_point_open_mpi_at_the_rules_unless_the_caller_set_its_own():
    assert COURSE_SETTINGS == {
        "OMPI_MCA_mpi_yield_when_idle": "1",
        "OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
        "OMPI_MCA_coll_tuned_dynamic_rules_filename": str(RULES)}
    own = {"OMPI_MCA_coll_tuned_use_dynamic_rules": "0"}
    assert environment.openmpi_settings(own)["OMPI_MCA_coll_tuned_use_dynamic_rules"] == "0"


def test_the_makefile_exports_the_rules_file():
    env = subprocess_env()
    for name in COURSE_SETTINGS:
        env.pop(name, None)  # what `make` sets by itself, not what this shell has
    shown = subprocess.run(
        ["make", "--no-print-directory", "-C", str(PROJECT_ROOT), "--eval",
         "show-rules: ; @echo $$OMPI_MCA_coll_tuned_use_dynamic_rules $$OMPI_MCA_coll_tuned_dynamic_rules_filename",
         "show-rules"], capture_output=True, text=True, timeout=60, env=env)
    assert shown.returncode == 0, shown.stderr
    switch, path = shown.stdout.split()
    assert switch == "1" and Path(path) == RULES


@pytest.mark.parametrize("recipe", ["Dockerfile.cpu", "Dockerfile.gpu", "Dockerfile.gpu-pytorch", "scalelab.def"])
def test_the_images_point_open_mpi_at_the_rules_file_they_copy(recipe):
    text = (PROJECT_ROOT / "containers" / recipe).read_text()
    assert re.search(r"OMPI_MCA_coll_tuned_use_dynamic_rules=\"?(\$\{[^}]*:-)?1", text)
    path = re.search(r"OMPI_MCA_coll_tuned_dynamic_rules_filename=\"?(?:\$\{[^}]*:-)?(/[^\s\"}]+)", text).group(1)
    # The course is copied to /opt/scalelab in both images (the Apptainer image is built from the GPU one).
    assert path.startswith("/opt/scalelab/")
    assert PROJECT_ROOT / path.removeprefix("/opt/scalelab/") == RULES


def test_a_graded_run_gets_the_course_settings_and_can_read_the_rules_in_its_sandbox(tmp_path, monkeypatch):
    submission = tmp_path / "assessment.py"
    submission.write_text("print('hello')\n")

    def prepare(name):
        return launch.prepare_job(submission, tmp_path / name, dataset="fashion-mnist", track_name="test", np=2,
                                  launcher="mpi", launcher_options=(), time_budget_s=60, grace_s=5,
                                  logs_dir=tmp_path / f"{name}-logs", hidden_paths=[], sandbox=False)

    for name in COURSE_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    job = prepare("job")
    assert {name: job.env[name] for name in COURSE_SETTINGS} == COURSE_SETTINGS
    assert any(RULES.resolve().is_relative_to(path) for path in sandbox.software_paths())  # shown in the sandbox

    monkeypatch.setenv("OMPI_MCA_coll_tuned_use_dynamic_rules", "0")  # an operator's own choice wins
    assert prepare("job2").env["OMPI_MCA_coll_tuned_use_dynamic_rules"] == "0"


@pytest.mark.parametrize(("environ", "shown", "problem"), [
    ({}, "fixed decisions (no rules file set)", None),
    ({"OMPI_MCA_coll_tuned_dynamic_rules_filename": str(RULES)}, "is not 1", None),
    ({"OMPI_MCA_coll_tuned_use_dynamic_rules": "1", "OMPI_MCA_coll_tuned_dynamic_rules_filename": str(RULES)},
     str(RULES), None),
    ({"OMPI_MCA_coll_tuned_use_dynamic_rules": "1", "OMPI_MCA_coll_tuned_dynamic_rules_filename": "/no/such.conf"},
     "/no/such.conf (missing)", "silently ignores it"),
])
def test_doctor_says_which_rules_open_mpi_will_use(environ, shown, problem):
    rules, found_problem = environment.openmpi_rules(environ)
    assert shown in rules
    assert (found_problem is None) if problem is None else (problem in found_problem)


@pytest.mark.slow
def test_allreduces_around_the_switch_sum_exactly_under_the_rules(horovodrun, tmp_path):
    script = tmp_path / "sums.py"
    script.write_text(
        "import os\n"
        "import numpy as np\n"
        + HOROVOD_IMPORTS +
        "hvd.init()\n"
        f"assert os.environ['OMPI_MCA_coll_tuned_dynamic_rules_filename'] == {str(RULES)!r}\n"
        # Element counts below, at and above the switch, none a multiple of the 1 MiB segment.
        "for count in (262_143, 262_147, 1_310_719, 4_194_311):\n"
        "    mine = (np.arange(count) % 1000).astype(np.float32) * (hvd.rank() + 1)\n"
        "    total = np.asarray(hvd.allreduce(as_tensor(mine), op=hvd.Sum, name=f'sum_{count}'))\n"
        "    expected = (np.arange(count) % 1000).astype(np.float32) * sum(range(1, hvd.size() + 1))\n"
        "    assert np.array_equal(total, expected), (count, np.flatnonzero(total != expected)[:5])\n"
        "    print(f'rank {hvd.rank()} count {count} exact', flush=True)\n")
    finished = run_two_ranks_under_mpi(horovodrun, script, COURSE_SETTINGS)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    for rank in (0, 1):
        assert f"rank {rank} count 4194311 exact" in finished.stdout, finished.stdout


@pytest.mark.slow
def test_open_mpi_really_reads_the_rules_file(horovodrun, tmp_path):
    # The same file with an algorithm Open MPI does not have for 1 MiB and up: if Open MPI reads the file (its
    # comments included) and applies the size switch, a 64 KiB allreduce still works and a 2 MiB one fails.
    broken_rules = tmp_path / "rules-with-no-such-algorithm.conf"
    broken_rules.write_text(RULES.read_text().replace("\n1048576 5 0 1048576", "\n1048576 99 0 1048576"))
    assert broken_rules.read_text() != RULES.read_text()
    script = tmp_path / "two_sizes.py"
    script.write_text(
        "import numpy as np\n"
        + HOROVOD_IMPORTS +
        "hvd.init()\n"
        "for name, count in (('small', 16_384), ('large', 524_288)):\n"
        "    total = np.asarray(hvd.allreduce(as_tensor(np.ones(count, np.float32)), op=hvd.Sum, name=name))\n"
        "    print(f'rank {hvd.rank()} {name} {total[0]:.0f}', flush=True)\n")
    finished = run_two_ranks_under_mpi(
        horovodrun, script, {**COURSE_SETTINGS, "OMPI_MCA_coll_tuned_dynamic_rules_filename": str(broken_rules)})
    output = finished.stdout + finished.stderr
    assert "rank 0 small 2" in output and "rank 1 small 2" in output, output
    assert finished.returncode != 0 and "large 2" not in output, output
    # Open MPI's error report names MPI_ERR_ARG; when both ranks abort at once its help system can lose the text
    # and log the loss in show_help.c instead. Either is Open MPI reporting an MPI error (not a crash or a kill),
    # and the test above sums the same sizes under the course's file, which differs from this one by one number.
    assert "MPI_ERR_ARG" in output or "show_help.c" in output, output
