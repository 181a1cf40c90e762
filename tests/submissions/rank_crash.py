"""Rank 1 crashes right after start; rank 0 waits for it in an allreduce. The job must end fast."""
import horovod.tensorflow as hvd
import tensorflow as tf

hvd.init()
if hvd.rank() == 1:
    raise RuntimeError("rank one failed on purpose")
hvd.allreduce(tf.constant(1.0), name="waits_for_rank_one")
