"""Per-process settings for running several Horovod ranks on one machine."""

from __future__ import annotations

import importlib.util
import os


def usable_cores() -> int:
    """Cores this process may run on (respects taskset/cgroup affinity, unlike ``os.cpu_count``)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def configure_threads(ranks_on_this_host: int = 1) -> int:
    """Give each rank an equal share of the cores so ranks do not oversubscribe them.

    TensorFlow defaults to one intra-op thread per core in every process; with two ranks on two cores
    that is four busy threads fighting over two cores. Must run before TensorFlow executes any op. Where
    TensorFlow is not installed (the PyTorch edition) it sets PyTorch's intra-op threads instead.
    Returns the intra-op thread count chosen.
    """
    threads = max(1, usable_cores() // max(1, ranks_on_this_host))
    if importlib.util.find_spec("tensorflow") is None:
        import torch

        torch.set_num_threads(threads)
        return threads
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(1 if ranks_on_this_host > 1 else 2)
    return threads


def pin_gpu(local_rank: int) -> str | None:
    """Make only GPU ``local_rank`` visible to TensorFlow (one GPU per rank); returns its name, or None on CPU.

    Raises RuntimeError when the host has no GPU left for ``local_rank``: two ranks sharing a GPU would compete
    for its memory and compute, which silently slows the run down or runs it out of memory.
    """
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return None
    if not 0 <= local_rank < len(gpus):
        raise RuntimeError(
            f"local rank {local_rank} has no GPU of its own: TensorFlow sees {len(gpus)} GPU(s) on this host, so "
            f"ranks would have to share one. Run with -np no more than the GPUs per host ({len(gpus)} here; across "
            f"hosts, -H host1:{len(gpus)},host2:{len(gpus)}).")
    gpu = gpus[local_rank]
    tf.config.experimental.set_memory_growth(gpu, True)
    tf.config.set_visible_devices(gpu, "GPU")
    return gpu.name
