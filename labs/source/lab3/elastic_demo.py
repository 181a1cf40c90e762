"""Fashion-MNIST under elastic Horovod: the job goes on when a worker is taken away (lab 3, "Horovod in practice").

Horovod's elastic mode (docs/elastic.rst) keeps the model, the optimizer and the epoch and batch counters in a
`hvd.elastic.KerasState`, commits them to memory after every batch, and re-forms the job whenever the hosts that
`--host-discovery-script` reports change: the workers that stay synchronise from the new rank 0 and go on from the
last commit, without a restart or a checkpoint. It needs Gloo. For example:
    horovodrun -np 2 --min-np 1 --max-np 2 --host-discovery-script ./discover_hosts.sh --network-interface lo \
        python elastic_demo.py --event-log events.jsonl
`--network-interface` is needed on one machine: without it the elastic driver waits for two hosts to find the
network interfaces they share. Rank 0 prints one line per epoch and appends every epoch and every reset to
--event-log (JSON lines), so a notebook can show what happened.
"""

import argparse
import json
import time
from pathlib import Path

import horovod.tensorflow.keras as hvd
import tensorflow as tf

from scalelab.data import load_fashion_mnist
from scalelab.models import small_cnn
from scalelab.runtime import configure_threads

parser = argparse.ArgumentParser(description="Fashion-MNIST with elastic Horovod")
parser.add_argument("--epochs", type=int, default=4, help="epochs of the whole training, across resets")
parser.add_argument("--batch-size", type=int, default=64, help="training images per step and rank")
parser.add_argument("--base-lr", type=float, default=0.02, help="learning rate of SGD for one rank")
parser.add_argument("--train-images", type=int, default=6000, help="train on the first N images")
parser.add_argument("--event-log", type=Path, required=True, help="rank 0 appends each epoch and reset here")
parser.add_argument("--hold-after-epoch", type=int, default=None,
                    help="after this epoch, wait up to --hold-s for the hosts to change (so that a demo does not "
                         "depend on timing; a real job goes on and sees the change at its next commit)")
parser.add_argument("--hold-s", type=float, default=30.0, help="longest wait after --hold-after-epoch")
args = parser.parse_args()

# Horovod: start the processes' communication. Elastic mode: no collective operation before train() below.
hvd.init()
configure_threads(hvd.local_size())

images, labels = load_fashion_mnist("train")
images, labels = images[:args.train_images, ..., None], labels[:args.train_images]
# Horovod: elastic training samples at random on every rank rather than sharding: the shards would change with
# every change of workers (Horovod's docs recommend random sampling for elastic jobs).
train_data = (tf.data.Dataset.from_tensor_slices((images, labels)).shuffle(len(images), seed=hvd.rank()).repeat()
              .batch(args.batch_size).prefetch(tf.data.AUTOTUNE))

model = small_cnn(input_shape=(28, 28, 1), num_classes=10)
# Horovod: scale the learning rate by the number of ranks (and again at every reset, below).
optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(args.base_lr * hvd.size(), momentum=0.9), groups=1)
model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
# The optimizer's variables must exist before the state can copy and broadcast them (no collective here).
optimizer.build(model.trainable_variables)

# Horovod: what the workers keep in sync: the model, its optimizer, and where training is.
state = hvd.elastic.KerasState(model, batch=0, epoch=0)


def log_event(**event) -> None:
    """Rank 0 (whichever process it is now) appends one event to the log."""
    if hvd.rank() == 0:
        with open(args.event_log, "a") as log:
            log.write(json.dumps({"time": time.time(), **event}) + "\n")


def on_reset() -> None:
    # Horovod: called after the workers re-formed the job, before the state is synchronised from the new rank 0.
    optimizer.learning_rate.assign(args.base_lr * hvd.size())
    if hvd.rank() == 0:
        print(f"reset: the job now has {hvd.size()} rank(s); training goes on from the last commit "
              f"(epoch {state.epoch} done, batch {state.batch} of the next), learning rate "
              f"{args.base_lr * hvd.size():.4g}", flush=True)
    log_event(event="reset", ranks=hvd.size(), epochs_done=state.epoch, batch=state.batch)


state.register_reset_callbacks([on_reset])


class ReportEpoch(tf.keras.callbacks.Callback):
    """One line per epoch on rank 0, numbered across resets (state.epoch), with the number of ranks."""

    def on_epoch_end(self, epoch, logs=None):
        if hvd.rank() == 0:
            print(f"epoch {state.epoch}/{args.epochs}  ranks {hvd.size()}  loss {logs['loss']:.4f}  "
                  f"accuracy {logs['accuracy']:.4f}", flush=True)
        log_event(event="epoch", epoch=state.epoch, ranks=hvd.size(), steps=self.params["steps"],
                  loss=float(logs["loss"]), accuracy=float(logs["accuracy"]))


class HoldAfterEpoch(tf.keras.callbacks.Callback):
    """After epoch `epoch`, check for a change of hosts every 0.25 s for up to `hold_s` seconds."""

    def __init__(self, epoch: int, hold_s: float):
        super().__init__()
        self.epoch, self.checks = epoch, max(1, round(hold_s / 0.25))

    def on_epoch_end(self, epoch, logs=None):
        if state.epoch != self.epoch:
            return
        if hvd.rank() == 0:
            print(f"epoch {state.epoch} done: waiting up to {self.checks * 0.25:.0f} s for the hosts to change",
                  flush=True)
        # A fixed number of checks, not a time limit: each check is a collective every rank must call.
        for _ in range(self.checks):
            state.check_host_updates()   # Horovod: raises HostsUpdatedInterrupt once the driver reports a change
            time.sleep(0.25)


callbacks = [
    # Horovod: keep state.epoch and state.batch up to date.
    hvd.elastic.UpdateEpochStateCallback(state),
    hvd.elastic.UpdateBatchStateCallback(state),
    # Horovod: average the metrics over the ranks before the report reads them.
    hvd.callbacks.MetricAverageCallback(),
    ReportEpoch(),
    # Horovod: commit the state to memory after every batch; a commit also checks for a change of hosts.
    hvd.elastic.CommitStateCallback(state),
]
if args.hold_after_epoch is not None:
    callbacks.append(HoldAfterEpoch(args.hold_after_epoch, args.hold_s))


@hvd.elastic.run
def train(state):
    # Horovod: run again after every reset, with the ranks there are now and the epochs that are left.
    steps_per_epoch = args.train_images // (args.batch_size * hvd.size())
    model.fit(train_data, steps_per_epoch=steps_per_epoch, epochs=args.epochs - state.epoch, callbacks=callbacks,
              verbose=0)


log_event(event="start", ranks=hvd.size())
train(state)
if hvd.rank() == 0:
    print(f"done: {state.epoch} epochs, {hvd.size()} rank(s) at the end", flush=True)
