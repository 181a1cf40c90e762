"""Step 4 of 8 (Horovod): average the gradients with DistributedOptimizer and scale the learning rate.

Each step now allreduces the gradients, so the batch of one update is batch-size x size images.
The ranks still start from different random weights: step 5 fixes that.
"""

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np
import horovod.tensorflow.keras as hvd
import tensorflow as tf

from scalelab.callbacks import EpochPrinter, StopAtAccuracy, Throughput, TotalTime
from scalelab.data import DataError, load_fashion_mnist
from scalelab.lr import WarmupStepSchedule, scaled_learning_rate
from scalelab.models import small_cnn
from scalelab.runtime import configure_threads, pin_gpu

parser = argparse.ArgumentParser(description="Fashion-MNIST with a small CNN (serial baseline)")
parser.add_argument("--batch-size", type=int, default=128, help="training images per step")
parser.add_argument("--val-batch-size", type=int, default=512, help="images per validation step")
parser.add_argument("--epochs", type=int, default=12, help="most epochs to train")
parser.add_argument("--base-lr", type=float, default=0.02, help="learning rate of SGD")
parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
parser.add_argument("--warmup-epochs", type=float, default=1.0, help="epochs of linear learning-rate warmup")
parser.add_argument("--target-accuracy", type=float, default=0.90, help="stop once val_accuracy reaches this...")
parser.add_argument("--patience", type=int, default=2, help="...for this many epochs in a row")
parser.add_argument("--wd", type=float, default=5e-5, help="L2 weight decay of the conv and dense kernels")
parser.add_argument("--train-images", type=int, default=None, help="train on the first N images only")
parser.add_argument("--val-images", type=int, default=None, help="validate on the first N held-out images only")
parser.add_argument("--output-dir", type=Path, default=Path("fashion_mnist_output"), help="checkpoints go here")
parser.add_argument("--seed", type=int, default=None, help="random seed (default: a different run every time)")
parser.add_argument("--weights-digest-dir", type=Path, default=None,
                    help="write the final weights (.npz) and their SHA-256 (.json) here, for comparing runs")
args = parser.parse_args()
for name in ("batch_size", "val_batch_size", "epochs", "patience", "train_images", "val_images"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
        parser.error(f"--{name.replace('_', '-')} must be at least 1")
if args.base_lr <= 0 or args.warmup_epochs < 0 or args.wd < 0 or not 0 <= args.momentum < 1:
    parser.error("--base-lr must be positive, --warmup-epochs and --wd not negative, --momentum in [0, 1)")

# Horovod: start the processes' communication; each one learns its rank and the number of ranks (size).
hvd.init()
# Horovod: rank 0 alone prints progress (and, from step 8, writes checkpoints).
is_chief = hvd.rank() == 0
# Horovod: one GPU per process, chosen by its rank on this machine (nothing to do on a CPU).
pin_gpu(hvd.local_rank())
# Horovod: the ranks on this machine share its cores instead of each starting one thread per core.
configure_threads(hvd.local_size())

if args.seed is not None:
    tf.keras.utils.set_random_seed(args.seed)

# Data: raw uint8 pixels (the model rescales them) with a channel axis added.
try:
    train_images, train_labels = load_fashion_mnist("train")
    val_images, val_labels = load_fashion_mnist("test")
except DataError as error:
    parser.exit(3, f"{parser.prog}: error: {error}\n")
train_images, train_labels = train_images[:args.train_images, ..., None], train_labels[:args.train_images]
val_images, val_labels = val_images[:args.val_images, ..., None], val_labels[:args.val_images]
if len(train_images) < args.batch_size:
    parser.error(f"--batch-size {args.batch_size} is more than the {len(train_images)} training images")
steps_per_epoch = len(train_images) // args.batch_size
train_data = (tf.data.Dataset.from_tensor_slices((train_images, train_labels))
              .shuffle(len(train_images)).repeat().batch(args.batch_size).prefetch(tf.data.AUTOTUNE))
val_data = tf.data.Dataset.from_tensor_slices((val_images, val_labels)).batch(args.val_batch_size)

# Model and optimizer: SGD with momentum, warmup then a step decay at 50% and 75% of the epochs.
model = small_cnn(input_shape=(28, 28, 1), num_classes=10, weight_decay=args.wd)
# Horovod: scale the learning rate by the number of workers, since the batch of one update is size times larger.
peak_lr = scaled_learning_rate(args.base_lr, hvd.size())
learning_rate = WarmupStepSchedule(peak_lr, steps_per_epoch, warmup_epochs=args.warmup_epochs,
                                   boundaries=(0.5 * args.epochs, 0.75 * args.epochs))
optimizer = tf.keras.optimizers.SGD(learning_rate=learning_rate, momentum=args.momentum)
# Horovod: average the gradients of all ranks (allreduce) before every update.
# Horovod: groups=1 allreduces all of a step's gradients together (tensor fusion alone may take a few allreduces).
optimizer = hvd.DistributedOptimizer(optimizer, groups=1)
model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])

callbacks = [
    # Horovod: one step now processes a batch on every rank.
    Throughput(images_per_step=args.batch_size * hvd.size()),
    TotalTime(is_chief=is_chief),
    StopAtAccuracy(args.target_accuracy, monitor="val_accuracy", patience=args.patience, is_chief=is_chief),
    EpochPrinter(args.epochs, is_chief=is_chief),
    tf.keras.callbacks.ModelCheckpoint(str(args.output_dir / "checkpoint.keras")),
]

if is_chief:
    print(f"training on {len(train_images)} images, batch {args.batch_size} x {hvd.size()} ranks, "
          f"{steps_per_epoch} steps per epoch", flush=True)
history = model.fit(train_data, steps_per_epoch=steps_per_epoch, epochs=args.epochs, validation_data=val_data,
                    callbacks=callbacks, verbose=0)
if is_chief:
    print(f"final val_accuracy {history.history['val_accuracy'][-1]:.4f}", flush=True)

if args.weights_digest_dir is not None:
    # For tests and the lab: identical digests mean identical weights, bit for bit.
    weights = model.get_weights()
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes() for w in weights)).hexdigest()
    args.weights_digest_dir.mkdir(parents=True, exist_ok=True)
    # Horovod: one pair of files per rank, so the ranks' weights can be compared.
    np.savez(args.weights_digest_dir / f"weights_rank{hvd.rank()}.npz", *weights)
    (args.weights_digest_dir / f"weights_rank{hvd.rank()}.json").write_text(json.dumps({
        "rank": hvd.rank(), "size": hvd.size(), "sha256": digest,
        "val_accuracy": float(history.history["val_accuracy"][-1])}))
