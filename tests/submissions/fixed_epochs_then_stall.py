"""An honest Horovod submission that trains a fixed number of epochs with its own tf.data pipeline, saving the model
each epoch as the DO-NOT-EDIT section does, and then stalls on its way out (as a tf.data teardown can): it reaches
the target early, and its ranks would stay alive until the budget ran out."""
import os
import time
from pathlib import Path

import horovod.tensorflow.keras as hvd
import tensorflow as tf

from scalelab.callbacks import SaveModelEachEpoch
from scalelab.data import load
from scalelab.models import small_cnn
from scalelab.runtime import configure_threads

EPOCHS = 8

hvd.init()
configure_threads(hvd.local_size())
images, labels = load(os.environ["SCALELAB_DATASET"], "train")
dataset = (tf.data.Dataset.from_tensor_slices((images[:16000, ..., None], labels[:16000]))
           .shard(hvd.size(), hvd.rank()).shuffle(8000, seed=1).batch(64).prefetch(tf.data.AUTOTUNE))
model = small_cnn(input_shape=(28, 28, 1), filters=(16, 32), dense_units=64)
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.0005 * hvd.size())),
              loss="sparse_categorical_crossentropy", metrics=["accuracy"])
output = Path(os.environ.get("SCALELAB_OUTPUT_DIR", "output"))
callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
if hvd.rank() == 0:
    output.mkdir(parents=True, exist_ok=True)
    callbacks.append(SaveModelEachEpoch(output / "model.keras"))
model.fit(dataset, epochs=EPOCHS, callbacks=callbacks, verbose=2 if hvd.rank() == 0 else 0)
time.sleep(3600)  # the stall on the way out: nothing left to train
