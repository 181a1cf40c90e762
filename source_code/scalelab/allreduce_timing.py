"""Timing Horovod's allreduce fairly: used by lab 4's bandwidth sweep and by the P6 benchmark.

A naive timing loop measures the wrong thing on shared cores: the faster rank's clock also counts its wait for
the slower rank's previous iteration. So the ranks meet at a barrier before each timed allreduce, the tensor
is made once outside the timing, and the first allreduces of each size (buffers, Horovod's response cache)
are not timed. Call after ``hvd.init()``, on every rank, with the same arguments.

It times Horovod's TensorFlow binding where TensorFlow is installed (what the Keras labs use) and its PyTorch
binding in the PyTorch edition; ``hvd`` is the binding it uses. Each is timed as its training reduces gradients:
TensorFlow's into a new tensor, PyTorch's in place (Horovod's DistributedOptimizer, like DDP, sums the gradients'
own buffers). PyTorch's out-of-place allreduce also makes and fills a new tensor on every call, which took three
times as long as the allreduce itself at 64 MB on 2 cores (53 ms against 14).
"""

from __future__ import annotations

import importlib.util
import time

import numpy as np

if importlib.util.find_spec("tensorflow") is not None:
    import horovod.tensorflow as hvd
    import tensorflow as tf

    def _ones(count: int):
        return tf.ones(count, dtype=tf.float32)

    def _refill(tensor) -> None:
        """Nothing to do: the allreduce leaves its input as it was."""

    def _sum(tensor, name: str):
        return hvd.allreduce(tensor, op=hvd.Sum, name=name)
else:
    import horovod.torch as hvd
    import torch

    def _ones(count: int):
        return torch.ones(count, dtype=torch.float32)

    def _refill(tensor) -> None:
        """Ones again after an allreduce in place summed into it."""
        tensor.fill_(1.0)

    def _sum(tensor, name: str):
        return hvd.allreduce_(tensor, op=hvd.Sum, name=name)


def barrier(tag: str) -> None:
    """Return once every rank got here: a one-element allreduce every rank must join (``tag`` names it)."""
    np.asarray(_sum(_ones(1), name=f"barrier_{tag}"))


def time_allreduce(message_bytes: int, repeats: int, warmup: int = 2) -> list[float]:
    """Seconds of each of ``repeats`` timed allreduces (sums) of a float32 tensor of ``message_bytes`` bytes.

    ``warmup`` untimed allreduces come first. Raises ``RuntimeError`` if the sum is not the number of ranks
    (every rank contributes ones), i.e. if the ranks did not really reduce together.
    """
    if message_bytes < 4 or repeats < 1 or warmup < 0:
        raise ValueError("need message_bytes >= 4, repeats >= 1 and warmup >= 0")
    tensor = _ones(message_bytes // 4)
    samples = []
    for repeat in range(warmup + repeats):
        _refill(tensor)
        barrier(f"{message_bytes}_{repeat}")
        start = time.perf_counter()
        # np.asarray waits for the reduced tensor and views it in place; .numpy() would also copy it (a 64 MB
        # copy took 9 ms here, a third of the allreduce it was meant to time).
        result = np.asarray(_sum(tensor, name=f"allreduce_{message_bytes}"))
        elapsed = time.perf_counter() - start
        if repeat >= warmup:
            samples.append(elapsed)
    if result[0] != hvd.size() or result[-1] != hvd.size():
        raise RuntimeError(f"allreduce of {message_bytes} bytes summed to {result[0]}, not {hvd.size()}")
    return samples
