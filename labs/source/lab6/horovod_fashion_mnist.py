"""Fashion-MNIST with the course's small CNN on several processes with Horovod (lab 6): the same model, data,
batch and optimizer as mwms_fashion_mnist.py next to it; diff the two.

    horovodrun -np 2 --gloo python horovod_fashion_mnist.py --weights-dir weights
Every line that is there for Horovod carries a comment starting with `# Horovod:`.
"""

import argparse
import hashlib
import json
from pathlib import Path

import horovod.tensorflow.keras as hvd
import numpy as np
import tensorflow as tf

from scalelab.callbacks import EpochPrinter, Throughput, TotalTime
from scalelab.data import DataError, load_fashion_mnist, shard_arrays
from scalelab.models import small_cnn
from scalelab.runtime import configure_threads

parser = argparse.ArgumentParser(description="Fashion-MNIST with Horovod")
parser.add_argument("--batch-size", type=int, default=64, help="training images per step on each worker")
parser.add_argument("--epochs", type=int, default=1, help="epochs to train")
parser.add_argument("--lr", type=float, default=0.02, help="learning rate of SGD (for the global batch)")
parser.add_argument("--train-images", type=int, default=4096, help="train on the first N images only")
parser.add_argument("--seed", type=int, default=0, help="random seed of the weights and the shuffling")
parser.add_argument("--weights-dir", type=Path, default=None,
                    help="each worker writes its final weights (.npz) and their SHA-256 (.json) here")
args = parser.parse_args()

# Horovod: horovodrun started the processes; each learns its rank and the number of ranks (size).
hvd.init()
workers, rank = hvd.size(), hvd.rank()
# Horovod: rank 0 alone prints progress.
is_chief = rank == 0
# Horovod: the ranks on this machine share its cores instead of each starting one thread per core.
configure_threads(hvd.local_size())
tf.keras.utils.set_random_seed(args.seed)

try:
    train_images, train_labels = load_fashion_mnist("train")
except DataError as error:
    parser.exit(3, f"{parser.prog}: error: {error}\n")
train_images, train_labels = train_images[:args.train_images, ..., None], train_labels[:args.train_images]
global_batch = args.batch_size * workers
steps_per_epoch = len(train_images) // global_batch
# Horovod: each rank keeps every size-th image.
train_images, train_labels = shard_arrays(train_images, train_labels, rank, workers)
# Horovod: each rank's data set yields its own batches of --batch-size.
train_data = (tf.data.Dataset.from_tensor_slices((train_images, train_labels))
              .shuffle(len(train_images), seed=args.seed + rank).repeat().batch(args.batch_size)
              .prefetch(tf.data.AUTOTUNE))

model = small_cnn(input_shape=(28, 28, 1), num_classes=10)
optimizer = tf.keras.optimizers.SGD(learning_rate=args.lr, momentum=0.9)
# Horovod: average the gradients of all ranks (allreduce) before every update; one allreduce for all of them.
optimizer = hvd.DistributedOptimizer(optimizer, groups=1)
model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])

callbacks = [
    # Horovod: copy rank 0's weights to every rank, at the end of the first batch.
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    # Horovod: average loss and accuracy over the ranks at each epoch's end, before they are printed.
    hvd.callbacks.MetricAverageCallback(),
    Throughput(images_per_step=global_batch), TotalTime(is_chief=is_chief),
    EpochPrinter(args.epochs, is_chief=is_chief)]
if is_chief:
    print(f"Horovod: {workers} workers, {len(train_images)} images each, "
          f"batch {args.batch_size} x {workers}, {steps_per_epoch} steps per epoch", flush=True)
model.fit(train_data, steps_per_epoch=steps_per_epoch, epochs=args.epochs, callbacks=callbacks, verbose=0)

if args.weights_dir is not None:
    weights = model.get_weights()
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes() for w in weights)).hexdigest()
    args.weights_dir.mkdir(parents=True, exist_ok=True)
    # Horovod: one pair of files per rank, so the ranks' weights can be compared.
    np.savez(args.weights_dir / f"weights_rank{rank}.npz", *weights)
    (args.weights_dir / f"weights_rank{rank}.json").write_text(json.dumps({"rank": rank, "size": workers,
                                                                           "sha256": digest}))
