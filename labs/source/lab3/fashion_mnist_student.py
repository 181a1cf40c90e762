"""Your Horovod conversion of the serial Fashion-MNIST script (lab 3).

This is a copy of the course's serial script, source_code/fashion_mnist.py. Make it a data-parallel Horovod
program: each `# FIXME(Horovod) step N` below marks where one change of the lab's step N goes. Replace each
FIXME with your change and a one-line comment starting `# Horovod:` that says why. List them with
    grep -n "FIXME(Horovod)" fashion_mnist_student.py
and run the script on two processes with
    horovodrun -np 2 --gloo python fashion_mnist_student.py --epochs 1 --train-images 2000

Keep the command-line options as they are: the grader runs your script with them, for one short epoch on two
ranks, and watches what each rank does (the weights it starts and ends with, the images it trains on, what it
prints and writes).
"""

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np
import tensorflow as tf
# FIXME(Horovod) step 1: import Horovod's Keras API (`import horovod.tensorflow.keras as hvd`).

from scalelab.callbacks import EpochPrinter, StopAtAccuracy, Throughput, TotalTime
from scalelab.data import DataError, load_fashion_mnist
from scalelab.lr import WarmupStepSchedule
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

# FIXME(Horovod) step 1: start Horovod (hvd.init()) before anything else uses it or builds the model.
# FIXME(Horovod) step 2: pin this process to one GPU, chosen by its local rank (pin_gpu from scalelab.runtime),
#                        and give it its share of the cores (configure_threads(hvd.local_size())).
# FIXME(Horovod) step 3: decide here which rank prints, e.g. `is_chief = hvd.rank() == 0`.

# FIXME(Horovod) step 6: with --seed every rank would shuffle its images the same way: unless each rank has its
#                        own shard, all would train on the same batches. Seed each rank differently (add its rank).
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
# FIXME(Horovod) step 6: all ranks together make one pass over the data per epoch: each rank runs 1/size of the
#                        steps, the same number on every rank. You may also give each rank its own shard of the
#                        training images (shard_arrays from scalelab.data) — after counting the steps.
steps_per_epoch = len(train_images) // args.batch_size
train_data = (tf.data.Dataset.from_tensor_slices((train_images, train_labels))
              .shuffle(len(train_images)).repeat().batch(args.batch_size).prefetch(tf.data.AUTOTUNE))
val_data = tf.data.Dataset.from_tensor_slices((val_images, val_labels)).batch(args.val_batch_size)

# Model and optimizer: SGD with momentum, warmup then a step decay at 50% and 75% of the epochs.
model = small_cnn(input_shape=(28, 28, 1), num_classes=10, weight_decay=args.wd)
# FIXME(Horovod) step 4: scale the learning rate by the number of workers (the linear scaling rule).
peak_lr = args.base_lr
learning_rate = WarmupStepSchedule(peak_lr, steps_per_epoch, warmup_epochs=args.warmup_epochs,
                                   boundaries=(0.5 * args.epochs, 0.75 * args.epochs))
optimizer = tf.keras.optimizers.SGD(learning_rate=learning_rate, momentum=args.momentum)
# FIXME(Horovod) step 4: wrap the optimizer so the ranks' gradients are averaged before every update.
model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])

callbacks = [
    # FIXME(Horovod) step 5: broadcast rank 0's weights to every rank (done at the end of the first batch).
    # FIXME(Horovod) step 7: average the metrics over the ranks, before the callbacks that read them.
    # FIXME(Horovod) step 6: one step now processes a batch on every rank (images_per_step).
    Throughput(images_per_step=args.batch_size),
    # FIXME(Horovod) step 3: only rank 0 prints (these three callbacks take is_chief=...).
    TotalTime(),
    StopAtAccuracy(args.target_accuracy, monitor="val_accuracy", patience=args.patience),
    EpochPrinter(args.epochs),
    # FIXME(Horovod) step 8: only rank 0 writes checkpoints.
    tf.keras.callbacks.ModelCheckpoint(str(args.output_dir / "checkpoint.keras")),
]

# FIXME(Horovod) step 3: only rank 0 prints (here and after training).

print(f"training on {len(train_images)} images, batch {args.batch_size}, "
      f"{steps_per_epoch} steps per epoch", flush=True)
history = model.fit(train_data, steps_per_epoch=steps_per_epoch, epochs=args.epochs, validation_data=val_data,
                    callbacks=callbacks, verbose=0)
print(f"final val_accuracy {history.history['val_accuracy'][-1]:.4f}", flush=True)

if args.weights_digest_dir is not None:
    # For tests and the lab: identical digests mean identical weights, bit for bit.
    weights = model.get_weights()
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes() for w in weights)).hexdigest()
    args.weights_digest_dir.mkdir(parents=True, exist_ok=True)
    # FIXME(Horovod) step 3: every rank writes its own pair of files, named and filled with its rank and the size.
    np.savez(args.weights_digest_dir / "weights_rank0.npz", *weights)
    (args.weights_digest_dir / "weights_rank0.json").write_text(json.dumps({
        "rank": 0, "size": 1, "sha256": digest,
        "val_accuracy": float(history.history["val_accuracy"][-1])}))
