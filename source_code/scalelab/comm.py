"""Communication cost models for allreduce (lab 4): steps and bytes per algorithm, the α-β time model.

The α-β (latency-bandwidth, "Hockney") model prices one message of ``n`` bytes at ``α + n·β``: ``α`` seconds
of latency, ``β`` seconds per byte (1 / bandwidth). An algorithm's time is its number of message *steps* on
the critical path times ``α`` plus the bytes the busiest link carries times ``β`` (Thakur, Rabenseifner and
Gropp 2005). Reduction arithmetic is left out: it is cheap next to the network.

No TensorFlow here: the notebook and the tests use it with plain numbers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

ALGORITHMS = ("parameter_server", "reduction_tree", "butterfly", "ring")


@dataclass(frozen=True)
class AllreduceCost:
    """One allreduce of ``message_bytes`` on ``ranks`` ranks: what the α-β model charges for it."""

    algorithm: str
    ranks: int
    message_bytes: float
    steps: int                 # messages on the critical path (each pays α once)
    busiest_bytes: float       # bytes through the busiest rank's link on the critical path (each pays β)
    total_bytes: float         # bytes sent over the whole network

    def time_s(self, alpha_s: float, beta_s_per_byte: float) -> float:
        return self.steps * alpha_s + self.busiest_bytes * beta_s_per_byte

    def as_dict(self) -> dict:
        return asdict(self)


def allreduce_cost(algorithm: str, message_bytes: float, ranks: int) -> AllreduceCost:
    """Steps and bytes of one allreduce of a ``message_bytes`` buffer held by each of ``ranks`` ranks.

    - ``parameter_server``: every worker pushes its buffer to one server, which sums and sends the result back;
      the server's link carries all of it, one message after another.
    - ``reduction_tree``: a binomial-tree reduce to rank 0, then a binomial-tree broadcast (full buffer each step).
    - ``butterfly``: recursive doubling, every rank exchanges its full buffer with a partner ``log2 p`` times
      (``ranks`` a power of two).
    - ``ring``: reduce-scatter then allgather around a ring, ``2(p−1)`` steps of ``n/p`` bytes — bandwidth-optimal.
    """
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, not {ranks}")
    if message_bytes < 0:
        raise ValueError(f"message_bytes must not be negative, not {message_bytes}")
    p, n = ranks, float(message_bytes)
    if p == 1:
        return AllreduceCost(algorithm, 1, n, 0, 0.0, 0.0)
    log_p = math.ceil(math.log2(p))
    if algorithm == "parameter_server":
        # p−1 workers (one rank is the server); the server receives and sends p−1 full buffers in turn.
        return AllreduceCost(algorithm, p, n, 2 * (p - 1), 2 * (p - 1) * n, 2 * (p - 1) * n)
    if algorithm == "reduction_tree":
        return AllreduceCost(algorithm, p, n, 2 * log_p, 2 * log_p * n, 2 * (p - 1) * n)
    if algorithm == "butterfly":
        if p & (p - 1):
            raise ValueError(f"the butterfly needs a power-of-two number of ranks, not {p}")
        return AllreduceCost(algorithm, p, n, log_p, log_p * n, p * log_p * n)
    if algorithm == "ring":
        return AllreduceCost(algorithm, p, n, 2 * (p - 1), 2 * (p - 1) / p * n, 2 * (p - 1) * n)
    raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {ALGORITHMS}")


def allreduce_time_s(algorithm: str, message_bytes: float, ranks: int, alpha_s: float, beta_s_per_byte: float) -> float:
    """The α-β model's time for one allreduce (see :func:`allreduce_cost`)."""
    return allreduce_cost(algorithm, message_bytes, ranks).time_s(alpha_s, beta_s_per_byte)


def bus_bandwidth(message_bytes: float, seconds: float, ranks: int) -> float:
    """Bytes/s a ring allreduce moved per link: ``n / t · 2(p−1)/p`` (the figure NCCL's tests call busbw).

    Unlike ``n / t`` (the "algorithm bandwidth") it does not fall as ranks are added, so it compares directly
    with a link's or memcpy's bandwidth.
    """
    return message_bytes / seconds * 2 * (ranks - 1) / ranks


def fit_alpha_beta(message_bytes, seconds, ranks: int) -> tuple[float, float]:
    """α and β of the ring model fitted (least squares) to measured allreduce times.

    ``t = 2(p−1)·α + 2(p−1)/p·n·β`` is linear in ``(α, β)``. Each row is divided by its measured time, so the fit
    minimises *relative* errors: otherwise the largest messages alone would decide it and α would be noise.
    Returns ``(alpha_s, beta_s_per_byte)``; either is clipped at a tiny positive value, since a noisy fit can
    go slightly negative.
    """
    if ranks < 2:
        raise ValueError("a fit needs at least 2 ranks (one rank does not communicate)")
    sizes = np.asarray(message_bytes, dtype=float)
    times = np.asarray(seconds, dtype=float)
    design = np.column_stack([np.full_like(sizes, 2 * (ranks - 1)), 2 * (ranks - 1) / ranks * sizes])
    (alpha, beta), *_ = np.linalg.lstsq(design / times[:, None], np.ones_like(times), rcond=None)
    return max(float(alpha), 1e-9), max(float(beta), 1e-15)
