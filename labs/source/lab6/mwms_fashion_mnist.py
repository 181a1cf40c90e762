"""Fashion-MNIST with the course's small CNN on several processes with TensorFlow's own
MultiWorkerMirroredStrategy (lab 6). horovod_fashion_mnist.py next to it trains the same model on the same data
with Horovod; diff the two.

There is no launcher: start one process per worker yourself, each with a TF_CONFIG that lists every worker's
address and says which one it is (index 0 is the chief), for example
    TF_CONFIG='{"cluster": {"worker": ["127.0.0.1:23456", "127.0.0.1:23457"]},
               "task": {"type": "worker", "index": 0}}' python mwms_fashion_mnist.py --weights-dir weights &
    TF_CONFIG='{"cluster": {"worker": ["127.0.0.1:23456", "127.0.0.1:23457"]},
               "task": {"type": "worker", "index": 1}}' python mwms_fashion_mnist.py --weights-dir weights
Every line that is there for the strategy carries a comment starting with `# MWMS:`.
"""

import argparse
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import tensorflow as tf

from scalelab.callbacks import EpochPrinter, Throughput, TotalTime
from scalelab.data import DataError, load_fashion_mnist, shard_arrays
from scalelab.models import small_cnn
from scalelab.runtime import configure_threads

parser = argparse.ArgumentParser(description="Fashion-MNIST with MultiWorkerMirroredStrategy")
parser.add_argument("--batch-size", type=int, default=64, help="training images per step on each worker")
parser.add_argument("--epochs", type=int, default=1, help="epochs to train")
parser.add_argument("--lr", type=float, default=0.02, help="learning rate of SGD (for the global batch)")
parser.add_argument("--train-images", type=int, default=4096, help="train on the first N images only")
parser.add_argument("--seed", type=int, default=0, help="random seed of the weights and the shuffling")
parser.add_argument("--weights-dir", type=Path, default=None,
                    help="each worker writes its final weights (.npz) and their SHA-256 (.json) here")
args = parser.parse_args()

# MWMS: the cluster (every worker's host:port) and this process's index in it come from TF_CONFIG.
tf_config = json.loads(os.environ["TF_CONFIG"])
workers, rank = len(tf_config["cluster"]["worker"]), tf_config["task"]["index"]
# MWMS: the chief (worker 0) alone prints progress.
is_chief = rank == 0
# MWMS: the workers on this machine share its cores (before the strategy starts TensorFlow's runtime).
configure_threads(workers)
tf.keras.utils.set_random_seed(args.seed)
# MWMS: start this worker's gRPC server, wait for the others, all-reduce gradients with collective ops.
strategy = tf.distribute.MultiWorkerMirroredStrategy()

try:
    train_images, train_labels = load_fashion_mnist("train")
except DataError as error:
    parser.exit(3, f"{parser.prog}: error: {error}\n")
train_images, train_labels = train_images[:args.train_images, ..., None], train_labels[:args.train_images]
global_batch = args.batch_size * workers
steps_per_epoch = len(train_images) // global_batch
# MWMS: each worker keeps every workers-th image, as under Horovod...
train_images, train_labels = shard_arrays(train_images, train_labels, rank, workers)
options = tf.data.Options()
# MWMS: ...so tf.data must not shard the data set again.
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
# MWMS: the data set yields global batches; the strategy gives each worker its 1/workers of each.
train_data = (tf.data.Dataset.from_tensor_slices((train_images, train_labels))
              .shuffle(len(train_images), seed=args.seed + rank).repeat().batch(global_batch)
              .with_options(options).prefetch(tf.data.AUTOTUNE))

# MWMS: variables made in the strategy's scope are mirrored: created equal on every worker, updated together.
with strategy.scope():
    model = small_cnn(input_shape=(28, 28, 1), num_classes=10)
    # MWMS: nothing to wrap: fit() all-reduces the gradients of every step itself.
    optimizer = tf.keras.optimizers.SGD(learning_rate=args.lr, momentum=0.9)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])

callbacks = [Throughput(images_per_step=global_batch), TotalTime(is_chief=is_chief),
             EpochPrinter(args.epochs, is_chief=is_chief)]
if is_chief:
    print(f"MultiWorkerMirroredStrategy: {workers} workers, {len(train_images)} images each, "
          f"batch {args.batch_size} x {workers}, {steps_per_epoch} steps per epoch", flush=True)
model.fit(train_data, steps_per_epoch=steps_per_epoch, epochs=args.epochs, callbacks=callbacks, verbose=0)

if args.weights_dir is not None:
    weights = model.get_weights()
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes() for w in weights)).hexdigest()
    args.weights_dir.mkdir(parents=True, exist_ok=True)
    # MWMS: one pair of files per worker, so the workers' weights can be compared.
    np.savez(args.weights_dir / f"weights_rank{rank}.npz", *weights)
    (args.weights_dir / f"weights_rank{rank}.json").write_text(json.dumps({"rank": rank, "size": workers,
                                                                           "sha256": digest}))
