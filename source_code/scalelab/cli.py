"""The ``scalelab`` command: ``doctor`` and ``lab-setup`` here; ``class`` (grader/classroom/commands.py), ``assess``,
``grade`` and ``calibrate`` come from the grader."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import __version__

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2


def track_warnings() -> list[str]:
    """A sentence for each track of the track file that was calibrated on another kind of machine: its budget
    and target may not hold here. The PyTorch edition leaves the Keras tracks out: it can neither grade nor
    re-calibrate them."""
    try:
        from scalelab import environment
        from scalelab.grader import grading, spec
        tracks = spec.load_tracks()
    except Exception as error:  # the grader or its track file is missing: say so, the rest still helps
        return [f"the assessment's tracks could not be read ({error})"]
    machine = grading.machine_facts()
    pytorch_only = environment.edition() == "pytorch"
    warnings = []
    for track in tracks.values():
        if pytorch_only and track.framework == "keras":
            continue
        differences = grading.machine_differences(track, machine)
        if differences:
            warnings.append(f"track {track.name} was calibrated on another machine ({'; '.join(differences)}): "
                            f"its budget and target may not hold here; re-calibrate with `scalelab calibrate "
                            f"--track {track.name} --runs 5 --record` (README: \"The assessment and the grader\")")
    return warnings


def doctor(args: argparse.Namespace) -> int:
    """Print what the course needs and whether this machine has it; one line for each missing piece."""
    from . import environment

    problems: list[str] = []
    facts = environment.describe()
    print(f"scalelab        {__version__}")
    print(f"python          {facts['python']}")
    edition = environment.edition()
    if edition == "pytorch":
        print(f"edition         PyTorch only: {environment.KERAS_LEFT_OUT}")
    print(f"tensorflow      {facts['tensorflow'] or ('not installed' if edition == 'pytorch' else 'missing')}")
    if edition is None:
        problems.append("Neither TensorFlow nor PyTorch is installed: run `make setup`.")
    elif facts["tensorflow"] is not None and facts["tensorflow"] != "2.15.1":
        problems.append(f"TensorFlow is {facts['tensorflow']}; the course needs 2.15.1 "
                        "(Horovod 0.28.1 does not allreduce with Keras 3): run `make setup`.")
    # The PyTorch edition is optional: an image whose base brings TensorFlow and Horovod alone (the GPU image) has none.
    print(f"torch           {facts['torch'] or 'missing (no PyTorch edition here: make setup installs it)'}")
    print(f"horovod         {facts['horovod'] or 'missing'}")
    build = environment.horovod_build()
    if build is None:
        problems.append("horovodrun is not installed: run `make setup`.")
    else:
        flags = "  ".join(f"{name} {'yes' if built else 'no'}" for name, built in build.items())
        print(f"horovod build   {flags}")
        needed = ("Gloo", "MPI") if edition == "pytorch" else ("TensorFlow", "Gloo", "MPI")
        problems += [f"Horovod was built without {name}: pip uninstall horovod, then `make setup`."
                     for name in needed if not build[name]]
        if facts["torch"] and not build["PyTorch"]:
            problems.append(f"torch {facts['torch']} is installed but Horovod was built without PyTorch: "
                            "pip uninstall horovod, then `make setup`.")
    mpi = environment.mpi_implementation()
    print(f"mpi             {mpi or 'missing'}")
    if mpi is None:
        problems.append("mpirun not found: install openmpi-bin and libopenmpi-dev.")
    rules, rules_problem = environment.openmpi_rules()
    print(f"mpi rules       {rules}")
    if rules_problem:
        problems.append(rules_problem)
    print(f"cpus            {facts['cpu_count']} × {facts['cpu_model']}")
    gpus = environment.gpus()
    print(f"gpus            {', '.join(gpus) if gpus else 'none'}")
    for name, location in environment.datasets().items():
        print(f"data {name:<10} {location or 'missing'}")
        if location is None and name == "fashion-mnist":
            problems.append("Fashion-MNIST is missing: sudo apt-get install dataset-fashion-mnist.")
        elif location is None:
            problems.append("CIFAR-10 is not available offline: set SCALELAB_CIFAR10_DIR to a directory "
                            "holding cifar-10-batches-py (or let the first run download it).")
    for warning in track_warnings():
        print(f"warning: {warning}")
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    if not problems:
        print("everything the course needs is here")
    return EXIT_PROBLEMS if problems else EXIT_OK


def lab_setup(args: argparse.Namespace) -> int:
    """The course's kernel and JupyterLab settings; with --student-view, the student's view of the course, and with
    --release-solutions, the worked solutions of those labs added to it."""
    from . import lab_setup as setup

    if args.release_solutions and not args.student_view:
        print("scalelab lab-setup: --release-solutions needs --student-view DIR, the view to release them into",
              file=sys.stderr)
        return EXIT_USAGE
    print(f"kernel          {setup.install_kernel()}")
    print(f"jupyterlab      {setup.install_jupyterlab_settings()}")
    if args.student_view:
        course = args.course or setup.COURSE_ROOT
        try:
            report = setup.build_student_view(args.student_view, course)
        except (OSError, RuntimeError) as error:
            print(f"scalelab lab-setup: the student's view could not be built: {error}", file=sys.stderr)
            return EXIT_PROBLEMS
        print(f"student view    {args.student_view}: {len(report['copied'])} files copied, "
              f"{len(report['kept'])} already there kept as they are")
        if report["left_out"]:
            from .environment import KERAS_LEFT_OUT

            print(f"student view    left out: {', '.join(report['left_out'])} ({KERAS_LEFT_OUT})")
        if report["replaced"]:
            print(f"student view    {args.student_view}: source_code/ was a link to the course's whole folder, "
                  "worked solutions included; now a folder without them")
        for lab in args.release_solutions or ():
            try:
                released = setup.release_solutions(args.student_view, lab, course)
            except OSError as error:
                print(f"scalelab lab-setup: {lab}'s worked solution could not be released: {error}", file=sys.stderr)
                return EXIT_PROBLEMS
            if released["added"]:
                print(f"released        {lab}'s worked solution, added to the view: {', '.join(released['added'])}")
            if released["kept"]:
                print(f"released        {lab}: already in the view, kept as it is: {', '.join(released['kept'])}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scalelab", description="ScaleLab: distributed deep learning course tools.")
    parser.add_argument("--version", action="version", version=f"scalelab {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    check = commands.add_parser("doctor", help="check the installed stack and the data sets")
    check.set_defaults(func=doctor)
    lab = commands.add_parser("lab-setup", help="install the course's Jupyter kernel and JupyterLab settings "
                              "(what `make lab` and `make test` run first)")
    lab.add_argument("--student-view", type=Path, metavar="DIR",
                     help="also fill DIR with the student's view: the released labs, the assessment, START.md "
                          "(no solution until --release-solutions; files already there are kept)")
    lab.add_argument("--course", type=Path, default=None, metavar="ROOT",
                     help="the course checkout the view comes from (default: the one this package lives in)")
    from .lab_setup import SOLUTIONS
    lab.add_argument("--release-solutions", nargs="+", choices=sorted(SOLUTIONS), metavar="LAB",
                     help="after the lab, add the worked solution of LAB to the student's view (with --student-view; "
                          f"labs with one: {', '.join(sorted(SOLUTIONS))})")
    lab.set_defaults(func=lab_setup)
    from scalelab.grader.classroom import commands as class_commands
    class_commands.register(commands)
    try:
        from scalelab.grader import commands as grader_commands
    except ImportError as error:  # the course library must stay usable if the grader is broken
        print(f"scalelab: grader commands unavailable ({error})", file=sys.stderr)
    else:
        grader_commands.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
