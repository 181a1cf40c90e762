"""A step-time model of data-parallel training (lab 4): throughput and scaling efficiency from 1 to many ranks.

One synchronous step on ``p`` ranks, each with ``batch_per_rank`` images (weak scaling: the global batch grows
with the ranks), takes

    compute + allreduce = t₀ + b·t_image + allreduce(algorithm, model bytes, p, α, β)

with the allreduce priced by the α-β cost models of :mod:`scalelab.comm` (the lab's own formulas; the ring's is
``2(p−1)·α + 2(p−1)/p·n·β``). Nothing overlaps: Horovod starts allreducing during the backward pass, so a real
run can do somewhat better than this model. The throughput is ``p·b / step``; the scaling efficiency is the
throughput divided by ``p`` times one rank's, 1 at ``p = 1``.

Plain numbers only (no TensorFlow), so the notebook, its sliders and the tests use it as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from scalelab.comm import ALGORITHMS, allreduce_time_s


@dataclass(frozen=True)
class StepFigures:
    """What one rank's training step costs: the figures the model needs (seconds, bytes, images)."""

    t_fixed_s: float           # t₀: the fixed cost of a step (kernel launches, reading the weights)
    t_image_s: float           # t_image: the cost of each image in the batch
    model_bytes: float         # n: the gradients every rank allreduces each step
    alpha_s: float             # α: latency of one message step
    beta_s_per_byte: float     # β: seconds per byte (1 / bandwidth)
    batch_per_rank: int        # b: images per rank per step

    def __post_init__(self):
        if min(self.t_fixed_s, self.t_image_s, self.model_bytes, self.alpha_s, self.beta_s_per_byte) < 0:
            raise ValueError("times, bytes, α and β must not be negative")
        if self.batch_per_rank < 1:
            raise ValueError(f"batch_per_rank must be at least 1, not {self.batch_per_rank}")
        if self.t_fixed_s + self.t_image_s <= 0:
            raise ValueError("a step must take some time: t_fixed_s + t_image_s must be positive")


def compute_time_s(figures: StepFigures) -> float:
    """``t₀ + b·t_image``: one rank's forward and backward pass on its batch."""
    return figures.t_fixed_s + figures.batch_per_rank * figures.t_image_s


def step_time_s(algorithm: str, ranks: int, figures: StepFigures) -> tuple[float, float]:
    """(compute, allreduce) seconds of one synchronous step on ``ranks`` ranks."""
    communicate = allreduce_time_s(algorithm, figures.model_bytes, ranks, figures.alpha_s, figures.beta_s_per_byte)
    return compute_time_s(figures), communicate


def throughput(algorithm: str, ranks: int, figures: StepFigures) -> float:
    """Images per second of all ``ranks`` together: ``p·b / (compute + allreduce)``."""
    compute, communicate = step_time_s(algorithm, ranks, figures)
    return ranks * figures.batch_per_rank / (compute + communicate)


def scaling_efficiency(algorithm: str, ranks: int, figures: StepFigures) -> float:
    """Throughput on ``ranks`` ranks over ``ranks`` times one rank's: ``compute / (compute + allreduce)``."""
    return throughput(algorithm, ranks, figures) / (ranks * throughput(algorithm, 1, figures))


def predict(figures: StepFigures, ranks: list[int], algorithms=ALGORITHMS) -> dict[str, dict[str, list[float]]]:
    """For each algorithm, the throughput (images/s), the scaling efficiency and the allreduce's share of the step
    at every count in ``ranks``: ``{algorithm: {"images_per_s": [...], "efficiency": [...],
    "communication_share": [...]}}``. The butterfly needs power-of-two counts."""
    prediction = {}
    for algorithm in algorithms:
        rows = {"images_per_s": [], "efficiency": [], "communication_share": []}
        for p in ranks:
            compute, communicate = step_time_s(algorithm, p, figures)
            rows["images_per_s"].append(throughput(algorithm, p, figures))
            rows["efficiency"].append(scaling_efficiency(algorithm, p, figures))
            rows["communication_share"].append(communicate / (compute + communicate))
        prediction[algorithm] = rows
    return prediction
