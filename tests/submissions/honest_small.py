"""An honest, small Horovod submission for the test tracks: 1 epoch on 8,000 Fashion-MNIST images."""
import os
from pathlib import Path

import horovod.tensorflow.keras as hvd
import tensorflow as tf

from scalelab.data import load, shard_arrays
from scalelab.models import small_cnn
from scalelab.runtime import configure_threads

hvd.init()
configure_threads(hvd.local_size())
images, labels = load(os.environ["SCALELAB_DATASET"], "train")
images, labels = shard_arrays(images[:8000, ..., None], labels[:8000], hvd.rank(), hvd.size())
model = small_cnn(input_shape=(28, 28, 1), filters=(16, 32), dense_units=64)
optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.001 * hvd.size()))
model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
output = Path(os.environ.get("SCALELAB_OUTPUT_DIR", "output"))
callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0)]
if hvd.rank() == 0:
    output.mkdir(parents=True, exist_ok=True)
    callbacks.append(tf.keras.callbacks.ModelCheckpoint(str(output / "model.keras")))
history = model.fit(images, labels, batch_size=64, epochs=1, callbacks=callbacks, verbose=0)
if hvd.rank() == 0:
    print(f"epoch 1/1  accuracy {history.history['accuracy'][-1]:.4f}", flush=True)
    model.save(output / "model.keras")
