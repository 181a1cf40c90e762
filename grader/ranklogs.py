"""A rank's output, from horovodrun's merged stream: one capped log file per rank, tracebacks and progress.

horovodrun prefixes each whole line of a rank with ``[0]<stdout>:`` under Gloo; Open MPI tags each chunk it reads
from a rank with ``[1,0]<stdout>:``, also in mid-line: ``[1,1]<stderr>:RuntimeError[1,1]<stderr>:: ...``; torchrun
(``--tee 3``) prefixes each line of a rank, stdout and stderr alike, with ``[default0]:``, and PyTorch's own
exception hook, once a process group is up, prints each line of an uncaught exception as ``[rank0]: ...``.
Memory stays bounded whatever a rank prints: lines are cut at ``LINE_CAP_BYTES``, each log stops at its cap, and
only a bounded tail of each rank is kept (for its traceback).
"""

from __future__ import annotations

import collections
import re
import threading
from pathlib import Path

LOG_CAP_BYTES = 1 << 20
LINE_CAP_BYTES = 16 << 10
UNENDED_LINES_CAP = 64  # rank streams whose unended line is held back at once (memory stays bounded)
RANK_TAG = re.compile(rb"\[(?:\d+,)?(\d+)\]<(stdout|stderr)>:|\[default(\d+)\]:")
MPI_TAG = re.compile(rb"\[\d+,(\d+)\]<(stdout|stderr)>:")
EPOCH_LINE = re.compile(r"\bepoch (\d+)/(\d+)")
ACCURACY_IN_LINE = re.compile(r"\b(val_accuracy|accuracy)[ =:]+([0-9]*\.?[0-9]+)")
TORCH_EXCEPTION_PREFIX = re.compile(r"^\[rank\d+\]: ?")
# A rank that dies in C++ (std::terminate) prints no Python traceback, only this line (and, for an exception,
# "  what():  ..." after it): PyTorch's Gloo threads can end a DDP rank so as Python exits.
CPP_TERMINATE = re.compile(r"^terminate called (without an active exception|after throwing an instance of .*)$")


class CappedLog:
    """A log file that stops growing at ``cap_bytes`` and says at its end how much it dropped."""

    def __init__(self, path: Path, cap_bytes: int):
        self.path, self.cap_bytes = path, cap_bytes
        self.handle = path.open("wb")
        self.written = 0
        self.dropped = 0

    def write(self, chunk: bytes) -> None:
        room = self.cap_bytes - self.written
        if room > 0:
            kept = chunk[:room]
            self.handle.write(kept)
            self.written += len(kept)
            chunk = chunk[room:]
        self.dropped += len(chunk)

    def close(self) -> None:
        if self.dropped:
            self.handle.write(f"\n[scalelab: log capped at {self.cap_bytes} bytes; "
                              f"{self.dropped} more bytes were dropped]\n".encode())
        self.handle.close()


class RankLogDemux:
    """Splits horovodrun's merged output (``[rank]<stdout>:`` with Gloo, ``[1,rank]<stdout>:`` with MPI) into
    ``rank-K.log`` files and ``launcher.log``, each capped; keeps only a bounded tail of each rank in memory
    (for tracebacks) and the progress that rank 0 printed."""

    def __init__(self, logs_dir: Path, cap_bytes: int = LOG_CAP_BYTES):
        self.logs_dir, self.cap_bytes = logs_dir, cap_bytes
        self.logs: dict[int | None, CappedLog] = {}
        self.tails: dict[int, collections.deque] = {}
        self.epochs_seen = 0
        self.latest_accuracy: float | None = None
        self.partial_lines: dict[tuple[int, bytes], bytes] = {}  # a rank's line that has not ended yet
        self.lock = threading.Lock()

    def _log(self, rank: int | None) -> CappedLog:
        if rank not in self.logs:
            name = "launcher.log" if rank is None else f"rank-{rank}.log"
            self.logs[rank] = CappedLog(self.logs_dir / name, self.cap_bytes)
        return self.logs[rank]

    def feed_line(self, line: bytes) -> None:
        first = RANK_TAG.match(line)
        with self.lock:
            if first is None:
                self._log(None).write(line)
                return
            tags = list(MPI_TAG.finditer(line)) if MPI_TAG.match(line) else [first]
            for tag, following in zip(tags, tags[1:] + [None]):
                end = following.start() if following else len(line)
                rank = int(tag.group(1) or tag.group(3))
                if rank > 4096:  # not a real rank: output that only looks like a tag
                    self._log(None).write(line[tag.start():end])
                else:  # torchrun merges a rank's stdout and stderr: taken as its stdout
                    self._take(rank, tag.group(2) or b"stdout", line[tag.end():end])

    def _take(self, rank: int, stream: bytes, content: bytes) -> None:
        """A piece of one rank's output: into its log now; into its tail and progress once its line is whole."""
        self._log(rank).write(content)
        key = (rank, stream)
        pending = self.partial_lines.pop(key, b"") + content
        if pending.endswith(b"\n") or len(pending) >= LINE_CAP_BYTES \
                or len(self.partial_lines) >= UNENDED_LINES_CAP:
            self._line_seen(rank, stream, pending)
        else:
            self.partial_lines[key] = pending

    def _line_seen(self, rank: int, stream: bytes, line: bytes) -> None:
        text = line.decode("utf-8", "replace").rstrip("\n")
        self.tails.setdefault(rank, collections.deque(maxlen=400)).append(text[:2000])
        if rank == 0 and stream == b"stdout":
            epoch = EPOCH_LINE.search(text)
            if epoch:
                self.epochs_seen = max(self.epochs_seen, int(epoch.group(1)))
                accuracies = dict((name, value) for name, value in ACCURACY_IN_LINE.findall(text))
                value = accuracies.get("val_accuracy", accuracies.get("accuracy"))
                if value is not None:
                    self.latest_accuracy = float(value)

    def pump(self, stream) -> None:
        """Read ``stream`` to its end, line by line, with lines cut at LINE_CAP_BYTES (memory stays bounded)."""
        pending_rank_prefix = b""
        while True:
            line = stream.readline(LINE_CAP_BYTES)
            if not line:
                break
            if not line.endswith(b"\n"):
                # An over-long line: keep its rank prefix on the continuation so it lands in the same log.
                match = RANK_TAG.match(line)
                self.feed_line(pending_rank_prefix + line if match is None else line)
                if match is not None:
                    pending_rank_prefix = match.group(0)
                continue
            self.feed_line(line if RANK_TAG.match(line) else pending_rank_prefix + line)
            pending_rank_prefix = b""

    def tracebacks(self) -> dict[int, str]:
        """The last Python traceback (or fatal error) of each rank, as the rank printed it."""
        found = {}
        for rank, tail in self.tails.items():
            lines = [TORCH_EXCEPTION_PREFIX.sub("", line, count=1) for line in tail]
            starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
            if starts:
                block = lines[starts[-1]:]
                # the traceback ends at its first unindented line after the header: the exception itself
                for end, line in enumerate(block[1:], start=1):
                    if line and not line.startswith((" ", "\t")):
                        block = block[:end + 1]
                        break
                found[rank] = "\n".join(block[-25:])
            elif terminated := [i for i, line in enumerate(lines) if CPP_TERMINATE.match(line)]:
                found[rank] = "\n".join(lines[terminated[-1]:terminated[-1] + 2]).rstrip()
        return found

    def close(self) -> tuple[dict[int, str], str, list[str]]:
        with self.lock:
            for (rank, stream), unended in self.partial_lines.items():  # output that ended without a newline
                self._line_seen(rank, stream, unended)
            self.partial_lines.clear()
            launcher = self._log(None)
            for log in self.logs.values():
                log.close()
            ranks = {rank: str(log.path) for rank, log in self.logs.items() if rank is not None}
            truncated = [str(log.path) for log in self.logs.values() if log.dropped]
        return ranks, str(launcher.path), truncated
