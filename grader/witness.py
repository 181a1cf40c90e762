"""Evidence that all ranks trained together, collected while the run goes, where the run cannot rewrite it.

Two witnesses, both read by the grader on its own clock:

1. **Horovod's timeline, read as it is written.** horovodrun writes its timeline into a file the grader made
   outside the job directory (bound into the sandbox as ``/run/scalelab/timeline.json``). A grader thread reads
   what is added as it is added and stamps each event with the grader's clock. What counts is when events
   arrived, never the timestamps inside them, and rewriting the file afterwards changes nothing already read; a
   timeline file in the job directory counts for nothing. Events are parsed as they come and only counts are
   kept, so memory stays bounded whatever the run writes.
2. **Loopback traffic.** The ranks run in the sandbox's private network namespace, so the bytes on its loopback
   interface are theirs, counted by the kernel. The grader samples them from ``/proc/<pid>/net/dev`` of a process
   inside the sandbox. Averaging a model's float32 gradients at every step with a ring allreduce sends about
   parameters × 4 bytes × 2(N−1)/N per rank and step, N × that on the interface. Open MPI would move local
   messages through shared memory, out of sight: graded ``--mpi`` runs use its TCP transport on the loopback
   (:func:`witnessed_mpi_settings`), so the same witness holds for both launchers.
   Horovod's coordination talks on the same loopback while the job lives, whatever is allreduced (about 0.7 MB
   a second between two ranks at its default cycle time, more at a shorter one, which a run can set itself), in
   small packets: coordination messages and acknowledgements average 90 bytes, while gradients cross the loopback
   in segments of up to 64 KB. So each packet is charged ``SMALL_PACKET_BYTES`` before the bytes are compared
   with what the gradients need: a run cannot make up the gradients' traffic by running long or cycling fast.
   (Bulk bytes are counted, not inspected: a run that allreduces as many junk bytes as the gradients would
   is beyond this witness.)

A run under torchrun (PyTorch's DDP) writes no Horovod timeline. In its place (:class:`RankEvidence`), again read
by the grader on its own clock from what the kernel counts:

3. **Each rank's CPU time.** The grader finds the ranks' processes in the sandbox and reads the CPU time the kernel
   charged each: every rank must have computed about as much as the busiest (a rank that only waits, while one
   other trains, shows a fraction of its CPU time).
4. **The traffic's spread and volume.** The loopback's counters are sampled as the run goes, so the grader sees
   when the bulk bytes flowed: DDP averages the gradients at every step, so they must flow in most tenths of the
   span from the first bulk exchange to the last, and amount to at least ``MIN_DDP_STEPS`` averagings of the
   model's gradients (how many steps a run takes is its own choice, so the volume is a floor, not a count).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from pathlib import Path

# Where horovodrun is told to write the timeline, inside the sandbox.
TIMELINE_INSIDE = Path("/run/scalelab/timeline.json")
READ_CHUNK_BYTES = 1 << 16
READ_CAP_BYTES = 256 << 20
POLL_INTERVAL_S = 0.1
UNPARSED_CAP_BYTES = 1 << 20  # a run writing garbage into the timeline cannot grow the grader's memory
TENSOR_NAMES_CAP = 100_000
TIMES_CAP = 1_000_000
# Horovod's file buffer holds back a few kilobytes of events; the last ones wait for the run's exit (saving the
# model, shutting down). Later than this after the timeline's own clock, an allreduce was written after the fact.
LATE_AFTER_S = 5.0
LATE_SHARE_ALLOWED = 0.2
# The traffic needed at every step, as a fraction of what float32 ring allreduces move: fp16 compression
# (hvd.Compression.fp16) halves it, and Horovod may pick another algorithm; allreducing a few tiny tensors
# instead of the gradients moves next to no bulk (see SMALL_PACKET_BYTES).
MIN_TRAFFIC_RATIO = 0.25
# Charged per packet sent on the loopback: more than Horovod's coordination sends per packet (measured: 89-90 bytes
# on average, idle or at a 0.1 ms cycle), a fraction of a percent of the gradients' 64 KB segments.
SMALL_PACKET_BYTES = 128


# A DDP run's bulk loopback traffic must amount to at least this many averagings of the model's gradients.
MIN_DDP_STEPS = 20
# Under DDP each rank's CPU time must be at least this share of the busiest rank's.
MIN_RANK_CPU_SHARE = 0.5
# A traffic sample counts towards the spread when this many bulk bytes flowed since the previous one.
BULK_SAMPLE_BYTES = 64 << 10


def witnessed_mpi_settings() -> dict[str, str]:
    """Open MPI settings for graded --mpi runs: local messages go through TCP on the loopback (where the kernel
    counts them) instead of shared memory (where nothing outside the ranks can see them)."""
    return {"OMPI_MCA_btl_vader_exclusivity": "0", "OMPI_MCA_btl_tcp_if_include": "lo",
            "OMPI_MCA_oob_tcp_if_include": "lo"}


@dataclasses.dataclass
class TimelineEvidence:
    ranks_seen: list[int]          # ranks that submitted tensors for negotiation
    allreduce_count: int           # allreduce operations performed
    allreduced_tensors: int        # distinct tensor names allreduced
    active_deciles: int            # tenths of the training (first to last tensor event) with an allreduce
    span_s: float                  # from the first to the last tensor event, by the timeline's own clock
    events: int                    # events read from the timeline
    late_allreduces: int = 0       # allreduces that reached the grader long after the timeline says they happened

    @property
    def readable(self) -> bool:
        return self.events > 0


class TimelineCounter:
    """Counts what a stream of Horovod timeline events shows; ``feed`` takes an event and its arrival time.

    Tensors are "processes" of the trace (``ph: M`` events name them), operations are ``B``/``E`` pairs
    (``NEGOTIATE_ALLREDUCE``, ``ALLREDUCE``, ...), and during negotiation an ``X`` event named after each rank
    marks that the rank submitted the tensor.

    Two clocks meet here. The spread of the allreduces over the training is judged on the timeline's own
    timestamps (Horovod's clock, which output buffering does not blur). Whether the timeline was written while
    the run went is judged on the grader's: Horovod writes each event within moments of it happening (its file
    buffer delays it by a few kilobytes of events at most), so an allreduce that reaches the grader more than
    ``LATE_AFTER_S`` later than the timeline's clock says, measured from the earliest event, was written after
    the fact.
    """

    def __init__(self):
        self.tensor_names: dict[int, str] = {}
        self.ranks: set[int] = set()
        self.allreduced: set[str] = set()
        self.allreduce_times: list[float] = []   # timeline clock, seconds (bounded: TIMES_CAP)
        self.arrival_lags: list[float] = []      # arrival minus timeline clock, seconds, per allreduce
        self.count = 0
        self.negotiating: dict[int, str] = {}
        self.first = self.last = None
        self.events = 0

    def feed(self, event: dict, arrived_s: float) -> None:
        self.events += 1
        phase, name, pid, ts = event.get("ph"), event.get("name"), event.get("pid"), event.get("ts")
        if phase == "M" and name == "process_name":
            tensor = (event.get("args") or {}).get("name")
            if isinstance(tensor, str) and len(self.tensor_names) < TENSOR_NAMES_CAP:
                self.tensor_names[pid] = tensor[:500]
            return
        if pid not in self.tensor_names or not isinstance(ts, (int, float)) or isinstance(ts, bool):
            return
        seconds = ts / 1e6
        self.first = seconds if self.first is None else min(self.first, seconds)
        self.last = seconds if self.last is None else max(self.last, seconds)
        if phase == "B" and isinstance(name, str):
            self.negotiating[pid] = name
            if name == "ALLREDUCE":
                self.count += 1
                if len(self.allreduce_times) < TIMES_CAP:
                    self.allreduce_times.append(seconds)
                    self.arrival_lags.append(arrived_s - seconds)
                if len(self.allreduced) < TENSOR_NAMES_CAP:
                    self.allreduced.add(self.tensor_names[pid])
        elif phase == "E":
            self.negotiating.pop(pid, None)
        elif phase == "X" and isinstance(name, str) and name.isdigit() and len(name) < 6 \
                and self.negotiating.get(pid, "").startswith("NEGOTIATE_"):
            self.ranks.add(int(name))

    def evidence(self) -> TimelineEvidence:
        active, span_s, late = 0, 0.0, 0
        if self.allreduce_times:
            span = max(self.last - self.first, 1e-6)
            span_s = self.last - self.first
            active = len({min(9, int((moment - self.first) * 10 / span)) for moment in self.allreduce_times})
            earliest = min(self.arrival_lags)
            late = sum(lag - earliest > LATE_AFTER_S for lag in self.arrival_lags)
        return TimelineEvidence(ranks_seen=sorted(self.ranks), allreduce_count=self.count,
                                allreduced_tensors=len(self.allreduced), active_deciles=active,
                                span_s=round(span_s, 2), events=self.events, late_allreduces=late)


class EventParser:
    """Turns the timeline's text, as it arrives in pieces, into events: a JSON array written one object at a
    time, never closed when the run is killed."""

    def __init__(self, on_event):
        self.on_event = on_event
        self.pending = ""
        self.decoder = json.JSONDecoder()

    def feed(self, text: str, arrived_s: float) -> None:
        self.pending += text
        position = 0
        while True:
            start = self.pending.find("{", position)
            if start < 0:
                self.pending = ""
                return
            try:
                event, position = self.decoder.raw_decode(self.pending, start)
            except json.JSONDecodeError:
                # Half an event (the rest is on its way), or garbage: keep it only while it could still end.
                self.pending = self.pending[start:]
                if len(self.pending) > UNPARSED_CAP_BYTES:
                    self.pending = self.pending[1:]  # resynchronise at the next "{"
                    position = 0
                    continue
                return
            if isinstance(event, dict):
                self.on_event(event, arrived_s)


class TimelineStream:
    """A file for horovodrun's timeline, outside the job directory, and the grader's thread that reads it as it
    grows.

    The file is the grader's (bound into the sandbox as ``TIMELINE_INSIDE``, writable by the run's uid because
    Horovod writes it from rank 0). The grader holds its own descriptor to it and reads only bytes beyond what it
    has read, stamping them when they arrive: rewriting or truncating the file later changes nothing already
    counted (truncations are counted too). A pipe would not do: Horovod's writer seeks back over the closing
    bracket before each event. Reading a regular file never blocks, and at most ``READ_CAP_BYTES`` are read.
    """

    def __init__(self, directory: Path):
        self.path = Path(directory) / "timeline.json"
        os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        self._file = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        self.counter = TimelineCounter()
        self.parser = EventParser(self.counter.feed)
        self.offset = 0
        self.truncations = 0
        self.started = time.monotonic()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._read, name="scalelab-timeline", daemon=True)

    def allow(self, uid: int | None) -> None:
        """Let the sandbox's uid write the file (Horovod runs as that uid)."""
        if uid is not None:
            os.chown(self.path, uid, -1)

    def start(self) -> "TimelineStream":
        self.started = time.monotonic()
        self.thread.start()
        return self

    def _drain(self) -> bool:
        """Read what was added since the last read; False when there was nothing (or the cap is reached)."""
        size = os.fstat(self._file).st_size
        if size < self.offset:  # truncated: Horovod opening it (at the start), or the run rewriting it
            self.truncations += 1
            self.offset = size
            return False
        if size == self.offset or self.offset >= READ_CAP_BYTES:
            return False
        chunk = os.pread(self._file, min(READ_CHUNK_BYTES, size - self.offset), self.offset)
        self.offset += len(chunk)
        self.parser.feed(chunk.decode("utf-8", "replace"), time.monotonic() - self.started)
        return bool(chunk)

    def _read(self) -> None:
        while not self._stop.is_set():
            while self._drain():
                pass
            self._stop.wait(POLL_INTERVAL_S)

    def stop(self) -> TimelineEvidence:
        self._stop.set()
        self.thread.join(timeout=5)
        while self._drain():  # what the run wrote before it ended (bounded by the cap)
            pass
        os.close(self._file)
        return self.counter.evidence()


def loopback_sent(pid: int) -> tuple[int, int] | None:
    """(bytes, packets) sent on the loopback interface of ``pid``'s network namespace, or None if unreadable."""
    try:
        with open(f"/proc/{pid}/net/dev") as table:
            for line in table:
                interface, _, counters = line.partition(":")
                if interface.strip() == "lo":
                    fields = counters.split()
                    return int(fields[8]), int(fields[9])  # transmit bytes, transmit packets
    except (OSError, ValueError, IndexError):
        return None
    return None


def expected_traffic_bytes(trainable_parameters: int, steps: float, np: int) -> float:
    """What averaging float32 gradients of ``trainable_parameters`` at ``steps`` steps sends over the loopback:
    per rank and step, parameters × 4 bytes × 2(N−1)/N (ring allreduce), for N ranks."""
    return trainable_parameters * 4 * steps * 2 * (np - 1) / np * np


@dataclasses.dataclass
class TrafficEvidence:
    loopback_bytes: int | None     # sent on the sandbox's loopback during the run (None: not measured)
    expected_bytes: float | None   # what averaging this model's gradients at every step needs
    steps: float | None            # allreduces per allreduced tensor: the steps the timeline shows
    ratio: float | None            # bulk bytes ÷ expected bytes
    loopback_packets: int | None = None  # the packets those bytes went in
    bulk_bytes: int | None = None  # the bytes less SMALL_PACKET_BYTES a packet: what coordination cannot make up


def bulk_bytes(sent_bytes: int, packets: int | None) -> int:
    """The bytes beyond what small packets (coordination, acknowledgements) carry."""
    return max(0, sent_bytes - (packets or 0) * SMALL_PACKET_BYTES)


def traffic_evidence(measured: int | None, timeline: TimelineEvidence, trainable_parameters: int | None,
                     trainable_variables: int | None, np: int, packets: int | None = None) -> TrafficEvidence:
    """The traffic against what the model needs. Averaging the gradients allreduces each trainable variable once
    per step, so the timeline shows allreduces ÷ variables steps (counted per variable of the saved model, not per
    distinct name, so that many names allreduced once each cannot make the steps look few). ``measured`` bytes
    went in ``packets`` packets; only their bulk counts (see ``SMALL_PACKET_BYTES``)."""
    bulk = None if measured is None else bulk_bytes(measured, packets)
    if measured is None or not trainable_parameters or not trainable_variables or not timeline.allreduce_count \
            or np < 2:
        return TrafficEvidence(measured, None, None, None, packets, bulk)
    steps = timeline.allreduce_count / trainable_variables
    expected = expected_traffic_bytes(trainable_parameters, steps, np)
    return TrafficEvidence(measured, round(expected), round(steps, 1), round(bulk / expected, 3), packets, bulk)


def traffic_problem(traffic: TrafficEvidence) -> str | None:
    """A sentence when the ranks exchanged far less than averaging the model's gradients at every step needs."""
    if traffic.ratio is None or traffic.ratio >= MIN_TRAFFIC_RATIO:
        return None
    return (f"the ranks sent {traffic.bulk_bytes / 1e6:.2f} MB to each other beyond Horovod's own coordination "
            f"({traffic.loopback_bytes / 1e6:.2f} MB in all), but averaging this model's gradients at each of the "
            f"{traffic.steps:.0f} steps the timeline shows needs about {traffic.expected_bytes / 1e6:.1f} MB "
            f"(parameters × 4 bytes × 2(N−1)/N per rank and step): the "
            f"allreduces did not carry the model's gradients. Wrap the model's own optimizer in "
            f"hvd.DistributedOptimizer.")


def evidence_problems(timeline: TimelineEvidence, traffic: TrafficEvidence, np: int,
                      trainable_variables: int | None, min_spread_deciles: int) -> list[str]:
    """Sentences saying what the witnesses do not show (empty: all ranks trained together throughout)."""
    if not timeline.readable or timeline.allreduce_count == 0:
        return ["Horovod's timeline shows no allreduce: the ranks did not train together. Wrap the optimizer "
                "in hvd.DistributedOptimizer so gradients are averaged across ranks at every step."]
    problems = []
    missing = sorted(set(range(np)) - set(timeline.ranks_seen))
    if missing:
        problems.append(f"ranks {missing} never took part in an allreduce (seen: {timeline.ranks_seen} of {np}); "
                        f"every rank must call hvd.init() and train with the DistributedOptimizer.")
    if trainable_variables and timeline.allreduced_tensors < trainable_variables:
        problems.append(f"only {timeline.allreduced_tensors} distinct tensors were allreduced, fewer than the "
                        f"model's {trainable_variables} trainable variables: all gradients must be averaged "
                        f"(hvd.DistributedOptimizer).")
    if timeline.late_allreduces > LATE_SHARE_ALLOWED * timeline.allreduce_count:
        problems.append(f"{timeline.late_allreduces} of the timeline's {timeline.allreduce_count} allreduces "
                        f"reached the grader more than {LATE_AFTER_S:.0f} s after the timeline says they happened: "
                        f"the timeline was written after the fact, not by Horovod while the ranks trained.")
    if timeline.active_deciles < min_spread_deciles:
        problems.append(f"allreduces happened in only {timeline.active_deciles} of 10 tenths of the training "
                        f"(at least {min_spread_deciles} needed): gradients must be averaged throughout training, "
                        f"not only at its start or end.")
    traffic_sentence = traffic_problem(traffic)
    if traffic_sentence:
        problems.append(traffic_sentence)
    return problems


@dataclasses.dataclass
class RankEvidence:
    """What the grader saw of the rank processes and of the traffic's timing (the witnesses of a torchrun run)."""
    rank_cpu_s: list[float]        # CPU time the kernel charged each rank process (in the order they started)
    active_deciles: int            # tenths of the bulk traffic's span (first to last bulk exchange) with bulk bytes
    span_s: float                  # that span, on the grader's clock


def traffic_spread(samples) -> tuple[int, float]:
    """(active tenths, span in seconds) of the bulk traffic in ``samples``: (seconds, bytes, packets) read from
    the loopback's cumulative counters, in order. A sample is bulk when ``BULK_SAMPLE_BYTES`` flowed beyond what
    its packets' small-packet allowance covers since the sample before."""
    bulk_times = []
    for (_, bytes_before, packets_before), (moment, sent, packets) in zip(samples, samples[1:]):
        if bulk_bytes(sent - bytes_before, packets - packets_before) >= BULK_SAMPLE_BYTES:
            bulk_times.append(moment)
    if len(bulk_times) < 2:
        return len(bulk_times), 0.0
    first, last = bulk_times[0], bulk_times[-1]
    span = max(last - first, 1e-6)
    return len({min(9, int((moment - first) * 10 / span)) for moment in bulk_times}), round(last - first, 2)


def ddp_traffic_evidence(measured: int | None, trainable_parameters: int | None, np: int,
                         packets: int | None = None) -> TrafficEvidence:
    """A torchrun run's traffic against ``MIN_DDP_STEPS`` averagings of the model's gradients (no timeline counts
    its steps); ``steps`` is how many averagings the bulk bytes could have carried."""
    bulk = None if measured is None else bulk_bytes(measured, packets)
    if measured is None or not trainable_parameters or np < 2:
        return TrafficEvidence(measured, None, None, None, packets, bulk)
    per_step = expected_traffic_bytes(trainable_parameters, 1, np)
    expected = per_step * MIN_DDP_STEPS
    return TrafficEvidence(measured, round(expected), round(bulk / per_step, 1), round(bulk / expected, 3), packets,
                           bulk)


def ddp_evidence_problems(ranks: RankEvidence, traffic: TrafficEvidence, np: int,
                          min_spread_deciles: int) -> list[str]:
    """Sentences saying what a torchrun run's witnesses do not show (empty: all ranks trained together)."""
    problems = []
    if len(ranks.rank_cpu_s) < np:
        problems.append(f"the grader saw {len(ranks.rank_cpu_s)} rank processes of the {np} the track launches: "
                        f"every rank must run the training (torchrun starts them; do not exit early on some).")
    elif ranks.rank_cpu_s:
        busiest = max(ranks.rank_cpu_s)
        idle = [rank for rank, seconds in enumerate(ranks.rank_cpu_s) if seconds < MIN_RANK_CPU_SHARE * busiest]
        if idle:
            times = ", ".join(f"{seconds:.0f} s" for seconds in ranks.rank_cpu_s)
            problems.append(f"the ranks' CPU times were {times}: {len(idle)} of them computed less than "
                            f"{MIN_RANK_CPU_SHARE:.0%} of the busiest one, so not every rank trained. Each rank must "
                            f"train on its own share of the data (DistributedSampler) with the DDP-wrapped model.")
    if traffic.bulk_bytes is not None and traffic.ratio is not None and traffic.ratio < 1:
        problems.append(f"the ranks sent {traffic.bulk_bytes / 1e6:.2f} MB to each other in bulk, less than "
                        f"{MIN_DDP_STEPS} averagings of this model's gradients need "
                        f"({traffic.expected_bytes / 1e6:.1f} MB): the gradients were not averaged at every step. "
                        f"Wrap the model in DistributedDataParallel and train the wrapped model.")
    elif traffic.loopback_bytes is not None and ranks.active_deciles < min_spread_deciles:
        problems.append(f"the ranks exchanged bulk data in only {ranks.active_deciles} of 10 tenths of the training "
                        f"(at least {min_spread_deciles} needed): gradients must be averaged throughout training, "
                        f"not only at its start or end.")
    return problems


def figures(timeline: TimelineEvidence, traffic: TrafficEvidence, trainable_parameters: int | None) -> dict:
    """Each witness's figures, for the verdict JSON."""
    return {
        "timeline": {"source": "Horovod's timeline in a file of the grader's, read as it grew, stamped on arrival",
                     **dataclasses.asdict(timeline)},
        "traffic": {"source": "bytes sent on the sandbox's loopback, read by the grader",
                    "trainable_parameters": trainable_parameters, "minimum_ratio": MIN_TRAFFIC_RATIO,
                    **dataclasses.asdict(traffic)},
    }


def ddp_figures(ranks: RankEvidence, traffic: TrafficEvidence, trainable_parameters: int | None) -> dict:
    """A torchrun run's witnesses' figures, for the verdict JSON."""
    return {
        "ranks": {"source": "CPU time the kernel charged each rank process, and when the loopback carried bulk "
                            "bytes, read by the grader as the run went",
                  "minimum_cpu_share": MIN_RANK_CPU_SHARE, **dataclasses.asdict(ranks)},
        "traffic": {"source": "bytes sent on the sandbox's loopback, read by the grader",
                    "trainable_parameters": trainable_parameters, "minimum_steps": MIN_DDP_STEPS,
                    **dataclasses.asdict(traffic)},
    }
