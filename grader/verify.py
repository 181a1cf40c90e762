"""What the grader measures itself after a run: held-out accuracy and evidence that all ranks trained together.

Accuracy comes from ``scalelab.grader.heldout`` run in a separate process (:class:`HeldoutProcess`).
Evidence comes from Horovod's timeline, which horovodrun writes because the grader asked for it
(``--timeline-filename``): a Chrome-trace JSON array in which every tensor is a "process" (``ph: M`` events name it), operations are ``B``/``E`` pairs
(``NEGOTIATE_ALLREDUCE``, ``ALLREDUCE``, ...), and during negotiation an ``X`` event named after each rank
marks that the rank submitted the tensor. The file is unterminated if the job was killed: it is read leniently.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

MODEL_SIZE_LIMIT_BYTES = 200 << 20
HELDOUT_TIMEOUT_S = 600
TIMELINE_SIZE_LIMIT_BYTES = 512 << 20


@dataclasses.dataclass
class ModelCheck:
    heldout_accuracy: float | None
    reason: str | None            # why there is no accuracy (None when measured)
    trainable_variables: int | None
    images: int | None = None


@dataclasses.dataclass
class TimelineEvidence:
    ranks_seen: list[int]          # ranks that submitted tensors for negotiation
    allreduce_count: int           # allreduce operations performed
    allreduced_tensors: int        # distinct tensor names allreduced
    active_deciles: int            # tenths of the timeline's span with at least one allreduce
    span_s: float                  # from the first to the last event
    readable: bool                 # False: no timeline, or nothing parseable in it


def check_model_file(model_path: Path) -> str | None:
    """A reason to refuse the model file before loading it, or None."""
    if not model_path.is_file():
        return ("no model was saved: the run must save $SCALELAB_OUTPUT_DIR/model.keras from rank 0 "
                "(keep the DO-NOT-EDIT section)")
    size = model_path.stat().st_size
    if size > MODEL_SIZE_LIMIT_BYTES:
        return f"the saved model is {size} bytes, over the {MODEL_SIZE_LIMIT_BYTES} byte limit"
    try:
        with zipfile.ZipFile(model_path) as archive:
            unpacked = sum(member.file_size for member in archive.infolist())
    except (zipfile.BadZipFile, OSError):
        return "the saved model.keras is not a Keras archive (corrupt, or not written by model.save)"
    if unpacked > MODEL_SIZE_LIMIT_BYTES:
        return f"the saved model unpacks to {unpacked} bytes, over the {MODEL_SIZE_LIMIT_BYTES} byte limit"
    return None


class HeldoutProcess:
    """The held-out measurement of one run, in its own process (``scalelab.grader.heldout``).

    Importing TensorFlow is most of the measurement's time (3-5 s on 2 cores). ``start_ahead()``, called when the
    run starts, starts the process at idle priority (SCHED_IDLE: a core only when nothing else wants it), so it
    imports TensorFlow and loads the held-out split in the run's idle moments instead of after the run;
    ``measure()`` puts it back to normal priority and hands it the model. Taking a process out of SCHED_IDLE
    needs CAP_SYS_NICE (root has it, unless a container dropped it); without it the process is started by
    ``measure()``, after the run, as a plain one.
    """

    def __init__(self, dataset: str, env: dict | None = None):
        self.dataset, self.env = dataset, env
        self.waiting: subprocess.Popen | None = None

    def start_ahead(self) -> None:
        if self.waiting is None and may_raise_priority():
            self.waiting = self._start("-", preexec_fn=_idle_priority)

    def _start(self, model_argument: str, preexec_fn=None) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "scalelab.grader.heldout", model_argument, self.dataset],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=self.env, preexec_fn=preexec_fn)

    def measure(self, model_path: Path) -> ModelCheck:
        """Load ``model_path`` in safe mode in the measuring process and measure it on the held-out split."""
        refused = check_model_file(model_path)
        if refused:
            return ModelCheck(None, refused, None)
        process, self.waiting = self.waiting, None
        if process is not None and process.poll() is None and _restore_normal_priority(process.pid):
            model_line = f"{model_path}\n"
        else:  # not started ahead, died meanwhile, or stuck at idle priority: a fresh process
            _stop(process)
            process, model_line = self._start(str(model_path)), ""
        try:
            stdout, stderr = process.communicate(model_line, timeout=HELDOUT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _stop(process)
            return ModelCheck(None, f"measuring the saved model took more than {HELDOUT_TIMEOUT_S} s", None)
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        if process.returncode != 0 or not lines:
            # The measuring process itself failed: the grader's problem, not the student's.
            raise RuntimeError(f"the held-out measurement failed (exit {process.returncode}): "
                               f"{stderr.strip()[-1500:]}")
        result = json.loads(lines[-1])
        return ModelCheck(result["accuracy"], result["reason"], result["trainable_variables"], result.get("images"))

    def close(self) -> None:
        """Stop a process started ahead that was never used (the run failed before there was a model)."""
        process, self.waiting = self.waiting, None
        _stop(process)


def heldout_accuracy(model_path: Path, dataset: str, env: dict | None = None) -> ModelCheck:
    """Load the model in safe mode in another process, started now, and measure it on the held-out split."""
    return HeldoutProcess(dataset, env).measure(model_path)


def may_raise_priority() -> bool:
    """Whether this process holds CAP_SYS_NICE (bit 23 of its effective capabilities)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> 23 & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _idle_priority() -> None:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def _restore_normal_priority(pid: int) -> bool:
    """Move every thread of ``pid`` from SCHED_IDLE to SCHED_OTHER; False if that was not possible."""
    # A thread started by a still-idle thread while we go through the list is idle too: go round until none is.
    for _ in range(10):
        try:
            idle = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")
                    if os.sched_getscheduler(int(tid)) == os.SCHED_IDLE]
        except (FileNotFoundError, ProcessLookupError):
            return False
        if not idle:
            return True
        for tid in idle:
            try:
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            except ProcessLookupError:
                continue  # the thread ended meanwhile
            except PermissionError:
                return False
    return False


def _stop(process: subprocess.Popen | None) -> None:
    if process is not None and process.poll() is None:
        process.kill()
    if process is not None:
        process.communicate()


def read_timeline_events(path: Path) -> list[dict]:
    """The events of a timeline file, also when it was cut off mid-write (no closing bracket, half an event)."""
    try:
        if path.stat().st_size > TIMELINE_SIZE_LIMIT_BYTES:
            return []
        text = path.read_text(errors="replace")
    except OSError:
        return []
    decoder = json.JSONDecoder()
    events, position = [], text.find("[") + 1
    if position == 0:
        return []
    length = len(text)
    while position < length:
        while position < length and text[position] in " \t\r\n,":
            position += 1
        if position >= length or text[position] == "]":
            break
        try:
            event, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            break  # the cut-off tail
        if isinstance(event, dict):
            events.append(event)
    return events


def timeline_evidence(path: Path) -> TimelineEvidence:
    events = read_timeline_events(path)
    tensor_names: dict[int, str] = {}
    for event in events:
        if event.get("ph") == "M" and event.get("name") == "process_name":
            name = (event.get("args") or {}).get("name")
            if isinstance(name, str):
                tensor_names[event.get("pid")] = name
    ranks, allreduce_times, allreduced = set(), [], set()
    timestamps = []
    negotiating: dict[int, str] = {}
    for event in events:
        phase, name, pid, timestamp = event.get("ph"), event.get("name"), event.get("pid"), event.get("ts")
        if isinstance(timestamp, (int, float)) and pid in tensor_names:
            timestamps.append(timestamp)
        if phase == "B" and isinstance(name, str):
            negotiating[pid] = name
            if name == "ALLREDUCE" and isinstance(timestamp, (int, float)):
                allreduce_times.append(timestamp)
                if pid in tensor_names:
                    allreduced.add(tensor_names[pid])
        elif phase == "E":
            negotiating.pop(pid, None)
        elif phase == "X" and isinstance(name, str) and name.isdigit() \
                and negotiating.get(pid, "").startswith("NEGOTIATE_"):
            ranks.add(int(name))
    span_s, active_deciles = 0.0, 0
    if timestamps and allreduce_times:
        first, last = min(timestamps), max(timestamps)
        span = max(last - first, 1)
        span_s = span / 1e6
        active_deciles = len({min(9, int((t - first) * 10 / span)) for t in allreduce_times})
    return TimelineEvidence(ranks_seen=sorted(ranks), allreduce_count=len(allreduce_times),
                            allreduced_tensors=len(allreduced), active_deciles=active_deciles,
                            span_s=round(span_s, 2), readable=bool(events))


def evidence_problems(evidence: TimelineEvidence, np: int, trainable_variables: int | None,
                      min_spread_deciles: int, epochs_seen: int) -> list[str]:
    """Sentences saying what the timeline does not show (empty: all ranks trained together throughout)."""
    problems = []
    if not evidence.readable or evidence.allreduce_count == 0:
        return ["Horovod's timeline shows no allreduce: the ranks did not train together. Wrap the optimizer "
                "in hvd.DistributedOptimizer so gradients are averaged across ranks at every step."]
    missing = sorted(set(range(np)) - set(evidence.ranks_seen))
    if missing:
        problems.append(f"ranks {missing} never took part in an allreduce (seen: {evidence.ranks_seen} of {np}); "
                        f"every rank must call hvd.init() and train with the DistributedOptimizer.")
    if trainable_variables and evidence.allreduced_tensors < trainable_variables:
        problems.append(f"only {evidence.allreduced_tensors} distinct tensors were allreduced, fewer than the "
                        f"model's {trainable_variables} trainable variables: all gradients must be averaged "
                        f"(hvd.DistributedOptimizer).")
    if evidence.active_deciles < min_spread_deciles:
        problems.append(f"allreduces happened in only {evidence.active_deciles} of 10 tenths of the run (at least "
                        f"{min_spread_deciles} needed): gradients must be averaged throughout training, not only "
                        f"at its start or end.")
    return problems
