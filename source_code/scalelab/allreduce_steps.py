"""Allreduce algorithms simulated step by step (lab 4): what every rank holds after each step, and who sent what.

Each function takes every rank's buffer and returns the list of states, the first the start and then one per
message step, so a notebook can draw them and a test can check them:

- :func:`reduction_tree`: a binomial tree reduces to rank 0 in ``⌈log₂ p⌉`` steps (at step ``k`` rank ``r`` with
  ``r mod 2^(k+1) = 0`` adds what rank ``r + 2^k`` sends), then broadcasts the sum back down the same tree.
- :func:`butterfly`: recursive doubling; at step ``k`` rank ``r`` and rank ``r XOR 2^k`` swap buffers and add.
- :func:`ring`: each buffer cut into ``p`` chunks; ``p − 1`` reduce-scatter steps (rank ``r`` sends chunk
  ``(r − s) mod p`` to its right neighbour, who adds it), then ``p − 1`` allgather steps passing the summed chunks on.

Within a step every rank sends at once: all of a step's messages are read before any rank adds or stores what it
received. The step counts are those of :func:`scalelab.comm.allreduce_cost`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


class Message(NamedTuple):
    source: int
    destination: int
    chunk: int | None      # the chunk sent (ring), or None: the whole buffer
    numbers: int           # how many numbers it carries


@dataclass(frozen=True)
class AllreduceStep:
    """Every rank's buffer after one step (or at the start), and the messages of that step."""

    phase: str                       # "start", "reduce", "broadcast", "exchange", "reduce-scatter", "allgather"
    messages: tuple[Message, ...]
    values: np.ndarray               # (ranks, numbers): each rank's buffer after the step
    contributors: np.ndarray         # (ranks, chunks): how many ranks' inputs each chunk holds the sum of

    def sent_numbers(self, rank: int) -> int:
        return sum(message.numbers for message in self.messages if message.source == rank)


def _start(buffers, chunks: int) -> tuple[np.ndarray, np.ndarray, AllreduceStep]:
    values = np.array([np.atleast_1d(np.asarray(buffer, dtype=float)) for buffer in buffers])
    if values.ndim != 2 or len(values) < 1:
        raise ValueError("give one buffer (a number or a 1-D array, all the same length) per rank")
    contributors = np.ones((len(values), chunks), dtype=int)
    return values, contributors, AllreduceStep("start", (), values.copy(), contributors.copy())


def reduction_tree(buffers) -> list[AllreduceStep]:
    """A binomial-tree reduce to rank 0, then a broadcast from rank 0 down the same tree."""
    values, contributors, start = _start(buffers, 1)
    ranks, numbers = values.shape
    steps = [start]
    levels = math.ceil(math.log2(ranks)) if ranks > 1 else 0
    pairs = [[(r + 2 ** k, r) for r in range(0, ranks, 2 ** (k + 1)) if r + 2 ** k < ranks] for k in range(levels)]
    for level in pairs:                                   # reduce: the higher rank of each pair sends to the lower
        received = [(source, destination, values[source].copy(), contributors[source].copy())
                    for source, destination in level]
        for source, destination, data, count in received:
            values[destination] += data
            contributors[destination] += count
        steps.append(AllreduceStep("reduce", tuple(Message(s, d, None, numbers) for s, d in level),
                                   values.copy(), contributors.copy()))
    for level in reversed(pairs):                         # broadcast: the same pairs, the other way, top down
        received = [(source, destination, values[destination].copy(), contributors[destination].copy())
                    for source, destination in level]
        for child, parent, data, count in received:
            values[child], contributors[child] = data, count
        steps.append(AllreduceStep("broadcast", tuple(Message(d, s, None, numbers) for s, d in level),
                                   values.copy(), contributors.copy()))
    return steps


def butterfly(buffers) -> list[AllreduceStep]:
    """Recursive doubling: ``log₂ p`` steps, in each every rank swaps its whole buffer with a partner and adds."""
    values, contributors, start = _start(buffers, 1)
    ranks, numbers = values.shape
    if ranks & (ranks - 1):
        raise ValueError(f"the butterfly needs a power-of-two number of ranks, not {ranks}")
    steps = [start]
    for k in range(int(math.log2(ranks))):
        partners = [rank ^ 2 ** k for rank in range(ranks)]
        values, contributors = values + values[partners], contributors + contributors[partners]
        steps.append(AllreduceStep("exchange", tuple(Message(partners[r], r, None, numbers) for r in range(ranks)),
                                   values.copy(), contributors.copy()))
    return steps


def ring(buffers) -> list[AllreduceStep]:
    """Reduce-scatter then allgather around a ring, each buffer cut into ``p`` chunks (``np.array_split``)."""
    ranks = len(buffers)
    values, contributors, start = _start(buffers, ranks)
    bounds = np.cumsum([0] + [len(part) for part in np.array_split(np.arange(values.shape[1]), ranks)])
    chunk = [slice(bounds[c], bounds[c + 1]) for c in range(ranks)]
    steps = [start]
    for phase, first_chunk in (("reduce-scatter", 0), ("allgather", 1)):
        for step in range(ranks - 1):
            sent = [(r + first_chunk - step) % ranks for r in range(ranks)]     # the chunk rank r sends
            messages = tuple(Message(r, (r + 1) % ranks, c, bounds[c + 1] - bounds[c]) for r, c in enumerate(sent))
            received = [(m, values[m.source, chunk[m.chunk]].copy(), contributors[m.source, m.chunk])
                        for m in messages]
            for message, data, count in received:
                if phase == "reduce-scatter":
                    values[message.destination, chunk[message.chunk]] += data
                    contributors[message.destination, message.chunk] += count
                else:
                    values[message.destination, chunk[message.chunk]] = data
                    contributors[message.destination, message.chunk] = count
            steps.append(AllreduceStep(phase, messages, values.copy(), contributors.copy()))
    return steps


SIMULATIONS = {"reduction_tree": reduction_tree, "butterfly": butterfly, "ring": ring}


def simulate(algorithm: str, buffers) -> list[AllreduceStep]:
    """The states of ``algorithm`` ("reduction_tree", "butterfly" or "ring") on ``buffers``, start included."""
    if algorithm not in SIMULATIONS:
        raise ValueError(f"no simulation of {algorithm!r}; choose one of {tuple(SIMULATIONS)}")
    return SIMULATIONS[algorithm](buffers)
