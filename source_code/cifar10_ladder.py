"""The large-batch ladder on CIFAR-10 (lab 5): one large batch, five rungs, each adding one remedy.

    base        the small-batch recipe run unchanged at a large batch: plain CNN, SGD, base learning rate
    batch_norm  + batch normalisation after every convolution (a different model)
    scaled_lr   + the learning rate scaled linearly with the batch (k = global batch / reference batch)
    warmup      + a linear warmup of that learning rate over the first epochs (a different schedule)
    lamb        LAMB instead of SGD: per-layer trust ratio, its own learning rate scaled by sqrt(k)
    novograd    NovoGrad instead of LAMB (an alternative last rung): per-layer normalised gradients, sqrt(k)

Runs alone or under Horovod (the global batch is --batch-size x ranks); rank 0 prints and writes the CSV:

    python source_code/cifar10_ladder.py --variant warmup --csv runs/warmup.csv
    horovodrun -np 2 --gloo python source_code/cifar10_ladder.py --variant lamb --csv runs/lamb.csv

The learning rate drops ×0.1 at half and at three quarters of the epochs, so accuracies at a fixed number of
*steps* mix batch sizes with the drops. To compare steps to a target across batch sizes, hold the rate after
warmup and measure often (a CSV row each time, with the steps and images so far):

    python source_code/cifar10_ladder.py --variant warmup --batch-size 64 --schedule constant \
        --eval-every-steps 20 --csv runs/warmup_b64.csv

CIFAR-10 comes from $SCALELAB_CIFAR10_DIR (or the Keras cache); see scalelab.data.
"""

import argparse
from pathlib import Path

import horovod.tensorflow.keras as hvd
import tensorflow as tf

from scalelab.callbacks import CSVTimeLog, EpochPrinter, HeldOutEverySteps, Throughput, TotalTime
from scalelab.data import DataError, load_cifar10, shard_arrays
from scalelab.lr import WarmupStepSchedule, scaled_learning_rate
from scalelab.models import cifar_cnn
from scalelab.optimizers import LAMB, NovoGrad
from scalelab.runtime import configure_threads, pin_gpu

# What each rung changes; every rung keeps what the one before it added (LAMB swaps the optimizer).
VARIANTS = {
    "base":       dict(batch_norm=False, scaling="none",   warmup=False, optimizer="sgd"),
    "batch_norm": dict(batch_norm=True,  scaling="none",   warmup=False, optimizer="sgd"),
    "scaled_lr":  dict(batch_norm=True,  scaling="linear", warmup=False, optimizer="sgd"),
    "warmup":     dict(batch_norm=True,  scaling="linear", warmup=True,  optimizer="sgd"),
    "lamb":       dict(batch_norm=True,  scaling="sqrt",   warmup=True,  optimizer="lamb"),
    "novograd":   dict(batch_norm=True,  scaling="sqrt",   warmup=True,  optimizer="novograd"),
}

parser = argparse.ArgumentParser(description="CIFAR-10 large-batch ladder (lab 5)")
parser.add_argument("--variant", choices=tuple(VARIANTS), required=True, help="which rung of the ladder")
parser.add_argument("--batch-size", type=int, default=512, help="training images per step on each rank")
parser.add_argument("--reference-batch-size", type=int, default=64,
                    help="the small batch the base learning rates were tuned for")
parser.add_argument("--val-batch-size", type=int, default=512, help="images per validation step")
parser.add_argument("--epochs", type=int, default=12, help="epochs to train")
parser.add_argument("--base-lr", type=float, default=0.02, help="SGD learning rate at the reference batch")
parser.add_argument("--lamb-lr", type=float, default=0.002, help="LAMB learning rate at the reference batch")
parser.add_argument("--novograd-lr", type=float, default=0.01, help="NovoGrad learning rate at the reference batch")
parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
parser.add_argument("--warmup-epochs", type=float, default=2.0, help="warmup length of the warmup and lamb rungs")
parser.add_argument("--schedule", choices=("step", "constant"), default="step",
                    help="after warmup: step = ×0.1 at half and three quarters of --epochs; constant = the peak "
                         "rate held to the end")
parser.add_argument("--wd", type=float, default=5e-4, help="L2 weight decay of the kernels")
parser.add_argument("--ghost-batch-size", type=int, default=None,
                    help="batch-norm statistics over groups of this many images (ghost batch norm)")
parser.add_argument("--bn-momentum", type=float, default=0.9, help="momentum of batch norm's moving averages")
parser.add_argument("--train-images", type=int, default=None, help="train on the first N images only")
parser.add_argument("--val-images", type=int, default=None, help="validate on the first N held-out images only")
parser.add_argument("--csv", type=Path, default=None, help="append one row per epoch (time, accuracy, ...) here")
parser.add_argument("--eval-every-steps", type=int, default=None,
                    help="measure held-out accuracy every N steps and at each epoch's end, a --csv row each time "
                         "(steps, images, time, accuracy); default: once per epoch")
parser.add_argument("--stop-at-accuracy", type=float, default=None,
                    help="with --eval-every-steps: stop at the first held-out measurement at or above this accuracy")
parser.add_argument("--label", default=None, help="the run's name in the CSV (default: the variant)")
parser.add_argument("--seed", type=int, default=None, help="random seed (default: a different run every time)")
args = parser.parse_args()
for name in ("batch_size", "reference_batch_size", "val_batch_size", "epochs", "ghost_batch_size",
             "train_images", "val_images", "eval_every_steps"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
        parser.error(f"--{name.replace('_', '-')} must be at least 1")
if (min(args.base_lr, args.lamb_lr, args.novograd_lr) <= 0 or args.warmup_epochs < 0 or args.wd < 0
        or not 0 <= args.momentum < 1 or not 0 <= args.bn_momentum < 1):
    parser.error("learning rates must be positive, --warmup-epochs and --wd not negative, "
                 "--momentum and --bn-momentum in [0, 1)")
if args.ghost_batch_size and args.batch_size % args.ghost_batch_size:
    parser.error(f"--batch-size {args.batch_size} must be a multiple of --ghost-batch-size {args.ghost_batch_size}")
if args.eval_every_steps is not None and args.csv is None:
    parser.error("--eval-every-steps writes its measurements to the --csv file: give one")
if args.stop_at_accuracy is not None and (args.eval_every_steps is None or not 0 < args.stop_at_accuracy <= 1):
    parser.error("--stop-at-accuracy needs --eval-every-steps (it acts on those measurements) and a value in (0, 1]")
variant = VARIANTS[args.variant]

# Horovod: one process per device; rank 0 prints and logs; ranks share this machine's cores.
hvd.init()
is_chief = hvd.rank() == 0
pin_gpu(hvd.local_rank())
configure_threads(hvd.local_size())
if args.seed is not None:
    tf.keras.utils.set_random_seed(args.seed + hvd.rank())

try:
    train_images, train_labels = load_cifar10("train")
    val_images, val_labels = load_cifar10("test")
except DataError as error:
    parser.exit(3, f"{parser.prog}: error: {error}\n")
train_images, train_labels = train_images[:args.train_images], train_labels[:args.train_images]
val_images, val_labels = val_images[:args.val_images], val_labels[:args.val_images]
global_batch = args.batch_size * hvd.size()
if len(train_images) < global_batch:
    parser.error(f"the global batch ({args.batch_size} x {hvd.size()} ranks) is more than the "
                 f"{len(train_images)} training images")
if global_batch < args.reference_batch_size:
    parser.error(f"the global batch {global_batch} is smaller than --reference-batch-size {args.reference_batch_size}")
steps_per_epoch = len(train_images) // global_batch
if args.eval_every_steps is not None and args.eval_every_steps > steps_per_epoch * args.epochs:
    parser.error(f"--eval-every-steps {args.eval_every_steps} is more than the run's {steps_per_epoch * args.epochs} "
                 f"steps ({args.epochs} epochs of {steps_per_epoch})")
train_images, train_labels = shard_arrays(train_images, train_labels, hvd.rank(), hvd.size())
val_images, val_labels = shard_arrays(val_images, val_labels, hvd.rank(), hvd.size())
# drop_remainder: every step has the full batch (ghost batch norm needs a multiple of its group size).
train_data = (tf.data.Dataset.from_tensor_slices((train_images, train_labels)).shuffle(len(train_images))
              .repeat().batch(args.batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE))
val_data = tf.data.Dataset.from_tensor_slices((val_images, val_labels)).batch(args.val_batch_size)

# The rung's model, learning rate, schedule and optimizer.
batch_ratio = global_batch / args.reference_batch_size
model = cifar_cnn(batch_norm=variant["batch_norm"],
                  ghost_batch_size=args.ghost_batch_size if variant["batch_norm"] else None, weight_decay=args.wd)
# A large batch means few steps: batch norm's moving averages (momentum 0.99 by default) would still remember
# their initial values at validation time, so they get a shorter memory here.
for layer in model.layers:
    if isinstance(layer, tf.keras.layers.BatchNormalization):
        layer.momentum = args.bn_momentum
reference_lr = {"sgd": args.base_lr, "lamb": args.lamb_lr, "novograd": args.novograd_lr}[variant["optimizer"]]
# The scaling rules take the batch ratio k where Horovod's examples take the number of workers.
peak_lr = scaled_learning_rate(reference_lr, batch_ratio, variant["scaling"])
warmup_epochs = args.warmup_epochs if variant["warmup"] else 0.0
# The step schedule's drops sit at fixed epochs: a longer run drops later (Hoffer et al.'s "regime adaptation").
drop_epochs = (0.5 * args.epochs, 0.75 * args.epochs) if args.schedule == "step" else ()
learning_rate = WarmupStepSchedule(peak_lr, steps_per_epoch, warmup_epochs=warmup_epochs, boundaries=drop_epochs)
if variant["optimizer"] == "lamb":
    optimizer = LAMB(learning_rate=learning_rate)
elif variant["optimizer"] == "novograd":
    optimizer = NovoGrad(learning_rate=learning_rate)
else:
    optimizer = tf.keras.optimizers.SGD(learning_rate=learning_rate, momentum=args.momentum)
# Horovod: average gradients over ranks, so the update is that of the global batch.
model.compile(optimizer=hvd.DistributedOptimizer(optimizer), loss="sparse_categorical_crossentropy",
              metrics=["accuracy"])

callbacks = [
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    hvd.callbacks.MetricAverageCallback(),
    Throughput(images_per_step=global_batch),
    TotalTime(is_chief=is_chief),
]
if args.eval_every_steps is not None:
    # Horovod: each rank measures its shard of the held-out images; the counts are summed over ranks.
    callbacks.append(HeldOutEverySteps(val_data, args.eval_every_steps, global_batch, args.csv, is_chief=is_chief,
                                       run_label=args.label or args.variant,
                                       sum_over_workers=lambda totals: hvd.allreduce(totals, op=hvd.Sum),
                                       stop_at=args.stop_at_accuracy))
callbacks.append(EpochPrinter(args.epochs, is_chief=is_chief))
if args.csv is not None and args.eval_every_steps is None:
    callbacks.append(CSVTimeLog(args.csv, is_chief=is_chief, run_label=args.label or args.variant))

if is_chief:
    print(f"variant {args.variant}: batch norm {'on' if variant['batch_norm'] else 'off'}, "
          f"{variant['optimizer'].upper()} peak lr {peak_lr:.4g} ({variant['scaling']} scaling, "
          f"k = {batch_ratio:g}), warmup {warmup_epochs:g} epochs, "
          + (f"×0.1 at epochs {drop_epochs[0]:g} and {drop_epochs[1]:g}, " if drop_epochs else "then constant, ")
          + f"global batch {global_batch}, {steps_per_epoch} steps per epoch"
          + (f", held-out accuracy every {args.eval_every_steps} steps" if args.eval_every_steps else "")
          + (f", stopping at {args.stop_at_accuracy:g}" if args.stop_at_accuracy else ""), flush=True)
# With --eval-every-steps the held-out images are measured by that callback, not once more by fit.
history = model.fit(train_data, steps_per_epoch=steps_per_epoch, epochs=args.epochs,
                    validation_data=None if args.eval_every_steps else val_data, callbacks=callbacks, verbose=0)
if is_chief:
    print(f"final val_accuracy {history.history['val_accuracy'][-1]:.4f}", flush=True)
