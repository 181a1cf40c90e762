"""Fashion-MNIST under Horovod with checkpoints that a killed job resumes from (lab 3, "Horovod in practice").

Rank 0 alone writes a checkpoint at the end of every epoch. Started again with the same --checkpoint-dir, the job
resumes: rank 0 finds the newest checkpoint (by the epoch in its name) and broadcasts its epoch; every rank builds the
model and its DistributedOptimizer, rank 0 restores the saved weights *and* optimizer variables (momentum, step
count, so the learning-rate schedule goes on where it was), broadcasts them all before the first step, and `fit`
goes on at that epoch. For example:
    horovodrun -np 2 --gloo python resume_demo.py --epochs 4 --checkpoint-dir run --fail-after-epoch 2   # dies
    horovodrun -np 2 --gloo python resume_demo.py --epochs 4 --checkpoint-dir run                        # resumes
The data order and the dropout-free model depend only on --seed, the rank and the epoch, so a resumed run can be
compared with one that ran straight through.
"""

import argparse
import json
import os
import re
from pathlib import Path

import numpy as np
import horovod.tensorflow.keras as hvd
import tensorflow as tf
from horovod.tensorflow import broadcast_variables

from scalelab.callbacks import EpochPrinter, save_model_atomically
from scalelab.data import load_fashion_mnist, shard_arrays
from scalelab.lr import WarmupStepSchedule, scaled_learning_rate
from scalelab.models import small_cnn
from scalelab.runtime import configure_threads

CHECKPOINT_NAME = "checkpoint-epoch{epoch:03d}.keras"   # the checkpoint of each finished epoch (1, 2, …)
CHECKPOINT_PATTERN = re.compile(r"checkpoint-epoch(\d+)\.keras")

parser = argparse.ArgumentParser(description="Fashion-MNIST with checkpoints a restarted Horovod job resumes from")
parser.add_argument("--epochs", type=int, default=4, help="epochs of the whole training, resumed or not")
parser.add_argument("--batch-size", type=int, default=64, help="training images per step and rank")
parser.add_argument("--base-lr", type=float, default=0.02, help="learning rate of SGD for one rank")
parser.add_argument("--warmup-epochs", type=float, default=1.0, help="epochs of linear learning-rate warmup")
parser.add_argument("--train-images", type=int, default=6000, help="train on the first N images")
parser.add_argument("--val-images", type=int, default=1000, help="validate on the first N held-out images")
parser.add_argument("--seed", type=int, default=1, help="the same seed gives the same run, resumed or not")
parser.add_argument("--checkpoint-dir", type=Path, required=True, help="checkpoints and history.jsonl go here")
parser.add_argument("--fail-after-epoch", type=int, default=None,
                    help="the last rank dies (exits at once) after this epoch's checkpoint is written")
parser.add_argument("--weights-dir", type=Path, default=None, help="each rank writes its final weights (.npz) here")
args = parser.parse_args()

# Horovod: start the processes' communication; each one learns its rank and the number of ranks.
hvd.init()
is_chief = hvd.rank() == 0
# Horovod: the ranks on this machine share its cores.
configure_threads(hvd.local_size())
# The same initial weights on every rank and no nondeterministic kernels: a resumed run can equal a straight one.
tf.keras.utils.set_random_seed(args.seed)
tf.config.experimental.enable_op_determinism()

# Horovod: rank 0 alone reads the checkpoint folder (it alone writes it; on a cluster it may be its own disk) ...
resume_from, resume_epoch = None, 0
if is_chief and args.checkpoint_dir.is_dir():
    for path in args.checkpoint_dir.iterdir():
        match = CHECKPOINT_PATTERN.fullmatch(path.name)   # a partial file (.partial.keras) does not match
        if match and int(match.group(1)) > resume_epoch:
            resume_from, resume_epoch = path, int(match.group(1))
# Horovod: ... and tells the others at which epoch to start: every rank must run the same epochs and steps.
resume_epoch = int(hvd.broadcast(tf.constant(resume_epoch), root_rank=0, name="resume_epoch"))

train_images, train_labels = load_fashion_mnist("train")
val_images, val_labels = load_fashion_mnist("test")
train_images, train_labels = train_images[:args.train_images, ..., None], train_labels[:args.train_images]
# Horovod: each rank trains on its own shard and validates on its own part of the held-out images.
train_images, train_labels = shard_arrays(train_images, train_labels, hvd.rank(), hvd.size())
val_images, val_labels = shard_arrays(val_images[:args.val_images, ..., None], val_labels[:args.val_images],
                                      hvd.rank(), hvd.size())
steps_per_epoch = args.train_images // (args.batch_size * hvd.size())
if steps_per_epoch < 1:
    parser.error(f"--train-images {args.train_images} is less than one batch of {args.batch_size} on every rank")


def epoch_order(epoch: int) -> np.ndarray:
    """This rank's image order in `epoch`: a function of the seed, the rank and the epoch only, not of how many
    epochs this process has run (a tf.data shuffle would start again from its first order after a restart)."""
    order = np.random.default_rng([args.seed, hvd.rank(), epoch]).permutation(len(train_images))
    return order[:steps_per_epoch * args.batch_size]


order = np.concatenate([epoch_order(epoch) for epoch in range(resume_epoch, args.epochs)] or [np.zeros(0, int)])
train_data = (tf.data.Dataset.from_tensor_slices((train_images[order], train_labels[order]))
              .batch(args.batch_size).prefetch(tf.data.AUTOTUNE))
val_data = tf.data.Dataset.from_tensor_slices((val_images, val_labels)).batch(512)

model = small_cnn(input_shape=(28, 28, 1), num_classes=10, dropout=0.0)
# Horovod: scale the learning rate by the number of ranks. The schedule is a function of the optimizer's step count,
# so a restored step count resumes it where it was, not at the start of its warmup.
learning_rate = WarmupStepSchedule(scaled_learning_rate(args.base_lr, hvd.size()), steps_per_epoch,
                                   warmup_epochs=args.warmup_epochs,
                                   boundaries=(0.5 * args.epochs, 0.75 * args.epochs))
# Horovod: average the gradients of all ranks before every update.
optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(learning_rate=learning_rate, momentum=0.9), groups=1)
model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
# The optimizer creates its variables (step count, momentum) at its first update; create them now, so that they can
# be restored and broadcast before the first step.
optimizer.build(model.trainable_variables)
if resume_from is not None:
    # Horovod: rank 0 alone restores the weights and the optimizer's variables. (hvd.load_model would rebuild the
    # model with its optimizer wrapped in DistributedOptimizer, but it cannot read TensorFlow 2.15's .keras files.)
    saved = tf.keras.models.load_model(resume_from, custom_objects={"SGD": tf.keras.optimizers.SGD})
    model.set_weights(saved.get_weights())
    for variable, value in zip(optimizer.variables(), saved.optimizer.variables(), strict=True):
        variable.assign(value)
# Horovod: every rank starts from rank 0's weights and optimizer state, restored or freshly initialised.
broadcast_variables(model.variables, root_rank=0)
broadcast_variables(optimizer.variables(), root_rank=0)

# Check that the restart worked before spending time on it: the same epoch, step and weights on every rank.
step = int(optimizer.iterations.numpy())
weights_sum = float(sum(np.sum(w, dtype=np.float64) for w in model.get_weights()))
every_rank = hvd.allgather(tf.constant([[resume_epoch, step, weights_sum]], tf.float64)).numpy()
if is_chief:
    source = f"resuming from {resume_from.name}" if resume_from else "starting afresh"
    print(f"{source}: epoch {resume_epoch} of {args.epochs} done, optimizer step {step}; the same epoch, step "
          f"and weights on all {hvd.size()} ranks: {bool((every_rank == every_rank[0]).all())}", flush=True)
if step != resume_epoch * steps_per_epoch:
    raise SystemExit(f"the optimizer's step {step} is not {resume_epoch} epochs x {steps_per_epoch} steps: was the "
                     "checkpoint written by a job with another number of ranks, images or batch size?")


class RankZeroCheckpoint(tf.keras.callbacks.Callback):
    """Rank 0 saves the model (with its optimizer) after every epoch, whole or not at all, and logs the epoch."""

    def on_epoch_end(self, epoch, logs=None):
        if not is_chief:
            return
        save_model_atomically(self.model, args.checkpoint_dir / CHECKPOINT_NAME.format(epoch=epoch + 1))
        record = {"epoch": epoch + 1, "step": int(self.model.optimizer.iterations.numpy()),
                  **{key: float(value) for key, value in logs.items()}}
        with open(args.checkpoint_dir / "history.jsonl", "a") as history:
            history.write(json.dumps(record) + "\n")


class FailAfterEpoch(tf.keras.callbacks.Callback):
    """The last rank dies at the end of epoch `epoch`, once rank 0 has written that epoch's checkpoint."""

    def __init__(self, epoch: int):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 != self.epoch:
            return
        hvd.allreduce(tf.constant(0.0), name="checkpoint_written")   # rank 0 gets here after saving
        if hvd.rank() == hvd.size() - 1:
            print(f"the last rank dies after epoch {epoch + 1} (os._exit, as a crashed machine would)", flush=True)
            os._exit(1)


if is_chief:
    args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
callbacks = [
    # Horovod: average the metrics over the ranks before the callbacks below read them.
    hvd.callbacks.MetricAverageCallback(),
    EpochPrinter(args.epochs, is_chief=is_chief),
    RankZeroCheckpoint(),
]
if args.fail_after_epoch is not None:
    callbacks.append(FailAfterEpoch(args.fail_after_epoch))
# Horovod: initial_epoch, the same on every rank, makes fit number the epochs (and the checkpoints) on from there.
model.fit(train_data, steps_per_epoch=steps_per_epoch, epochs=args.epochs, initial_epoch=resume_epoch,
          validation_data=val_data, callbacks=callbacks, verbose=0)

if args.weights_dir is not None:
    args.weights_dir.mkdir(parents=True, exist_ok=True)
    np.savez(args.weights_dir / f"weights_rank{hvd.rank()}.npz", *model.get_weights())
