"""Rank 0 waits in an allreduce that rank 1 never joins: a hang, which only the budget ends."""
import time

import horovod.tensorflow as hvd
import tensorflow as tf

hvd.init()
if hvd.rank() == 0:
    hvd.allreduce(tf.constant(1.0), name="never_joined")
else:
    while True:
        time.sleep(1)
