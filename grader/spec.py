"""What an assessment asks: the tracks of ``assessment/tracks.toml`` as ``Track`` dataclasses.

A track names the data set, the number of ranks, the held-out accuracy to reach, the time budget and the
launcher. ``load_tracks()`` reads the file named by ``--track-file``, else ``$SCALELAB_TRACKS``, else the
course's ``assessment/tracks.toml``.
"""

from __future__ import annotations

import dataclasses
import os
try:
    import tomllib
except ImportError:  # Python 3.10 (Ubuntu 22.04): the same parser as the tomli package
    import tomli as tomllib
from pathlib import Path

COURSE_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACKS_FILE = COURSE_ROOT / "assessment" / "tracks.toml"
DEFAULT_TRACK = "cifar10-cpu"
# Where `make setup` installed the PyTorch edition alone (no TensorFlow: Python 3.12 or 3.13), the DDP track instead.
DEFAULT_PYTORCH_TRACK = "cifar10-ddp-cpu"
DATASETS = ("cifar10", "fashion-mnist")
# A framework is what the student trains with: it decides the model file the grader measures and how.
FRAMEWORKS = ("keras", "pytorch")
MODEL_FILES = {"keras": "model.keras", "pytorch": "model.pt2"}
# The script a student converts (assessment/ holds both): the file the Assess panel and class grading take.
SUBMISSION_FILES = {"keras": "assessment.py", "pytorch": "assessment_pytorch.py"}
# horovodrun --gloo / --mpi (Horovod for Keras or PyTorch), or torchrun (PyTorch's DDP, on Gloo).
LAUNCHERS = ("gloo", "mpi", "torchrun")
ALL_GPUS = "all-gpus"


# A track is calibrated when in at least MIN_CALIBRATION_RUNS runs the reference reached the target, each time to
# accuracy (the referee's clock: when the grader saw the first snapshot at the target) within BUDGET_SHARE of the
# budget (the budget measures speed, yet an honest run is not cut off), and the unmodified serial script failed.
# Tables recorded before the referee (no reference_time_to_accuracy_s) are judged by their wall times, and their
# final models had to clear the target by ACCURACY_MARGIN.
MIN_CALIBRATION_RUNS = 5
BUDGET_SHARE = (0.6, 0.8)
ACCURACY_MARGIN = 0.03


class SpecError(ValueError):
    """The track file or the track asked for is not usable; the message says what to fix."""


@dataclasses.dataclass(frozen=True)
class Track:
    name: str
    dataset: str
    ranks: int | str                 # a number, or "all-gpus" (one rank per GPU of the machine)
    target_accuracy: float           # held-out accuracy the saved model must reach
    time_budget_s: float             # from launch to exit, measured by the grader
    grace_s: float = 10.0            # after the budget: SIGTERM, then SIGKILL after the grace
    launcher: str = "gloo"           # horovodrun --gloo or --mpi, or torchrun
    framework: str = "keras"         # keras or pytorch: the model file and how it is measured
    launcher_options: tuple[str, ...] = ()   # more horovodrun arguments, e.g. ("--cycle-time-ms", "1")
    min_spread_deciles: int = 8      # allreduces must happen in at least this many tenths of the training
    memory_limit_gib: float = 8.0    # all the run's processes together (where the grader is root)
    description: str = ""
    calibration: dict = dataclasses.field(default_factory=dict)  # the figures the track was calibrated with

    def calibration_problems(self) -> list[str]:
        """Why the recorded calibration does not meet the rule (see BUDGET_SHARE); empty when it does.
        A track measured on no machine yet says so in its table: ``status = "uncalibrated"``."""
        figures = self.calibration
        if not figures or figures.get("status") == "uncalibrated":
            return [f"track {self.name!r} is not calibrated: run `scalelab calibrate --track {self.name} --runs "
                    f"{MIN_CALIBRATION_RUNS} --record` on the grading machine"]
        problems = []
        referee = "reference_time_to_accuracy_s" in figures
        times = figures.get("reference_time_to_accuracy_s" if referee else "reference_wall_time_s") or []
        accuracies = figures.get("reference_heldout_accuracy") or []
        if len(times) < MIN_CALIBRATION_RUNS or len(accuracies) != len(times):
            problems.append(f"{len(times)} reference runs recorded, {MIN_CALIBRATION_RUNS} needed")
        low, high = (share * self.time_budget_s for share in BUDGET_SHARE)
        took = "reached the target after" if referee else "took"
        problems += [f"a reference run {took} {seconds} s, outside {low:.0f}-{high:.0f} s ({BUDGET_SHARE[0]:.0%}-"
                     f"{BUDGET_SHARE[1]:.0%} of the {self.time_budget_s:.0f} s budget)"
                     for seconds in times if not low <= seconds <= high]
        if referee:
            problems += [f"reference run {run} ended {verdict}, without reaching the target"
                         for run, verdict in enumerate(figures.get("reference_verdicts") or [], start=1)
                         if verdict != "pass"]
        else:
            problems += [f"a reference run reached {accuracy}, less than {ACCURACY_MARGIN} over the target "
                         f"{self.target_accuracy}" for accuracy in accuracies
                         if accuracy < self.target_accuracy + ACCURACY_MARGIN - 1e-9]
        if figures.get("baseline_verdict") not in ("fail", "timeout"):
            problems.append(f"the unmodified serial script's verdict was {figures.get('baseline_verdict')!r}, "
                            f"not a fail or timeout")
        return problems

    @property
    def model_file(self) -> str:
        """The file the run saves its model to, under $SCALELAB_OUTPUT_DIR."""
        return MODEL_FILES[self.framework]

    @property
    def submission_file(self) -> str:
        """The name of the student's script in assessment/ (the grader runs it as assessment.py all the same)."""
        return SUBMISSION_FILES[self.framework]

    @property
    def horovod(self) -> bool:
        """Whether the run is launched by horovodrun (and so writes Horovod's timeline)."""
        return self.launcher != "torchrun"

    def resolve_ranks(self, gpu_count: int) -> int:
        """The number of ranks to launch on a machine with ``gpu_count`` GPUs."""
        if self.ranks == ALL_GPUS:
            if gpu_count < 1:
                raise SpecError(f"track {self.name!r} runs one rank per GPU, and this machine has no GPU; "
                                f"choose a CPU track or give --np")
            return gpu_count
        return int(self.ranks)


def tracks_file(path: str | os.PathLike | None = None) -> Path:
    return Path(path or os.environ.get("SCALELAB_TRACKS") or DEFAULT_TRACKS_FILE)


def _track_from_table(name: str, table: dict, source: Path) -> Track:
    known = {field.name for field in dataclasses.fields(Track)} - {"name"}
    unknown = sorted(set(table) - known)
    if unknown:
        raise SpecError(f"{source}: track {name!r} has unknown keys {unknown}; known keys: {sorted(known)}")
    missing = [key for key in ("dataset", "ranks", "target_accuracy", "time_budget_s") if key not in table]
    if missing:
        raise SpecError(f"{source}: track {name!r} lacks {', '.join(missing)}")
    values = dict(table)
    values["launcher_options"] = tuple(str(option) for option in values.get("launcher_options", ()))
    track = Track(name=name, **values)
    if track.dataset not in DATASETS:
        raise SpecError(f"{source}: track {name!r} has dataset {track.dataset!r}; known: {', '.join(DATASETS)}")
    if track.launcher not in LAUNCHERS:
        raise SpecError(f"{source}: track {name!r} has launcher {track.launcher!r}; known: {', '.join(LAUNCHERS)}")
    if track.framework not in FRAMEWORKS:
        raise SpecError(f"{source}: track {name!r} has framework {track.framework!r}; known: {', '.join(FRAMEWORKS)}")
    if track.launcher == "torchrun" and track.framework != "pytorch":
        raise SpecError(f"{source}: track {name!r}: torchrun launches PyTorch runs only (framework = \"pytorch\")")
    if not (track.ranks == ALL_GPUS or (isinstance(track.ranks, int) and track.ranks >= 1)):
        raise SpecError(f"{source}: track {name!r}: ranks must be a number ≥ 1 or {ALL_GPUS!r}")
    if not 0 < track.target_accuracy <= 1 or track.time_budget_s <= 0 or track.grace_s < 0:
        raise SpecError(f"{source}: track {name!r}: target_accuracy must be in (0, 1], time_budget_s positive "
                        f"and grace_s not negative")
    if not track.memory_limit_gib > 0:
        raise SpecError(f"{source}: track {name!r}: memory_limit_gib must be positive")
    if not 0 <= track.min_spread_deciles <= 10:
        raise SpecError(f"{source}: track {name!r}: min_spread_deciles must be between 0 and 10")
    return track


def load_tracks(path: str | os.PathLike | None = None) -> dict[str, Track]:
    source = tracks_file(path)
    try:
        document = tomllib.loads(source.read_text())
    except FileNotFoundError:
        raise SpecError(f"track file {source} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise SpecError(f"track file {source} is not readable TOML: {error}") from None
    tables = document.get("tracks")
    if not isinstance(tables, dict) or not tables:
        raise SpecError(f"{source} has no [tracks.NAME] tables")
    return {name: _track_from_table(name, table, source) for name, table in tables.items()}


def load_track(name: str | None = None, path: str | os.PathLike | None = None) -> Track:
    """The track called ``name`` (default: $SCALELAB_TRACK, else cifar10-cpu, or cifar10-ddp-cpu on the PyTorch
    edition). A Keras track where TensorFlow is not installed is refused with the reason."""
    from scalelab.environment import KERAS_LEFT_OUT, edition

    pytorch_only = edition() == "pytorch"
    name = name or os.environ.get("SCALELAB_TRACK") or (DEFAULT_PYTORCH_TRACK if pytorch_only else DEFAULT_TRACK)
    tracks = load_tracks(path)
    if name not in tracks:
        raise SpecError(f"unknown track {name!r}; known tracks: {', '.join(sorted(tracks))}")
    if pytorch_only and tracks[name].framework == "keras":
        usable = sorted(other for other, track in tracks.items() if track.framework != "keras")
        raise SpecError(f"track {name!r} grades a Keras model: {KERAS_LEFT_OUT}; the PyTorch tracks: "
                        f"{', '.join(usable)}")
    return tracks[name]
