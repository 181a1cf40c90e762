"""Horovod in practice (lab 4): a few training steps to record in a timeline, then fp16 compression measured.

    HOROVOD_TIMELINE=timeline.json horovodrun -np 2 --gloo python horovod_in_practice.py --json practice.json

1. The course's small CNN trains --steps steps on random pixels (what is measured is the communication, not the
   accuracy) with hvd.DistributedOptimizer and Horovod's defaults: every gradient is its own allreduce request and
   Horovod's background thread fuses those that are ready together (tensor fusion). With HOROVOD_TIMELINE set,
   rank 0 records every request's negotiation and allreduce; the timeline is stopped after training so that
   part 2 does not appear in it.
2. hvd.allreduce (average) of float32 tensors of each --compression-bytes size, with and without
   compression=hvd.Compression.fp16: the median time of --repeats allreduces and the relative error of the
   average against the exact one (every rank's tensor is re-made from its seed and averaged in float64).

Rank 0 writes what it measured to --json.
"""

import argparse
import json
import time
from pathlib import Path

import horovod.tensorflow.keras as hvd
import numpy as np
import tensorflow as tf

from scalelab.allreduce_timing import barrier
from scalelab.models import small_cnn
from scalelab.runtime import configure_threads

parser = argparse.ArgumentParser(description="Training steps for a Horovod timeline, then fp16 compression")
parser.add_argument("--steps", type=int, default=6, help="training steps (the first one also builds the graph)")
parser.add_argument("--batch-size", type=int, default=64, help="images per step on each rank")
parser.add_argument("--compression-bytes", default="4096,262144,4194304,16777216",
                    help="comma-separated float32 message sizes (bytes) allreduced with and without fp16")
parser.add_argument("--repeats", type=int, default=5, help="timed allreduces per size and compression")
parser.add_argument("--json", type=Path, required=True, help="where rank 0 writes the results")
args = parser.parse_args()

# Horovod: one process per rank; the ranks share this machine's cores.
hvd.init()
configure_threads(hvd.local_size())
is_chief = hvd.rank() == 0
tf.keras.utils.set_random_seed(0)

# ------------------------------------------------------------------ 1. training steps, recorded in the timeline
pixels = np.random.default_rng(hvd.rank()).integers(0, 256, (args.steps * args.batch_size, 28, 28, 1))
labels = np.random.default_rng(100 + hvd.rank()).integers(0, 10, args.steps * args.batch_size)
model = small_cnn(dropout=0.0)
# Horovod: average the gradients; each gradient tensor is its own allreduce request, fused by Horovod.
optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01))
model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
start = time.perf_counter()
# Horovod: start every rank from rank 0's weights.
model.fit(pixels.astype("float32"), labels, batch_size=args.batch_size, epochs=1, verbose=0, shuffle=False,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
training_s = time.perf_counter() - start
# Horovod: end the timeline here; the compression measurements below are not part of training.
hvd.stop_timeline()
gradients = [dict(name=variable.name, shape=list(variable.shape), bytes=int(np.prod(variable.shape)) * 4)
             for variable in model.trainable_variables]
if is_chief:
    print(f"{args.steps} training steps of batch {args.batch_size} x {hvd.size()} in {training_s:.1f} s; "
          f"{len(gradients)} gradient tensors, {sum(g['bytes'] for g in gradients):,} bytes", flush=True)

# ------------------------------------------------------------------ 2. fp16 compression
def rank_tensor(rank: int, elements: int) -> np.ndarray:
    """Rank ``rank``'s float32 'gradient': normal, scale 0.01, the same on every rank that re-makes it."""
    return np.random.default_rng(1000 + rank).normal(0.0, 0.01, elements).astype(np.float32)


compression_rows = []
for message_bytes in (int(size) for size in args.compression_bytes.split(",")):
    elements = message_bytes // 4
    tensor = tf.constant(rank_tensor(hvd.rank(), elements))
    exact = np.mean([rank_tensor(rank, elements).astype(np.float64) for rank in range(hvd.size())], axis=0)
    for label, compression in (("none", hvd.Compression.none), ("fp16", hvd.Compression.fp16)):
        times = []
        for repeat in range(2 + args.repeats):            # 2 untimed allreduces first
            barrier(f"{label}_{message_bytes}_{repeat}")
            start = time.perf_counter()
            average = np.asarray(hvd.allreduce(tensor, op=hvd.Average, compression=compression,
                                               name=f"{label}_{message_bytes}"))
            if repeat >= 2:
                times.append(time.perf_counter() - start)
        error = np.linalg.norm(average - exact) / np.linalg.norm(exact)
        compression_rows.append(dict(message_bytes=message_bytes, compression=label,
                                     median_s=float(np.median(times)), relative_error=float(error),
                                     result_dtype=str(average.dtype)))
        if is_chief:
            print(f"{message_bytes:>10} bytes  compression {label:<4}  {np.median(times) * 1e6:>9.1f} µs  "
                  f"relative error of the average {error:.1e}", flush=True)

if is_chief:
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(dict(ranks=hvd.size(), steps=args.steps, batch_size=args.batch_size,
                                         training_s=training_s, gradients=gradients,
                                         compression=compression_rows), indent=1))
