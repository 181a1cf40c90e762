"""Prints a high accuracy it never reached: trains on 256 images only, then claims 0.99 everywhere."""
import os
from pathlib import Path

import horovod.tensorflow.keras as hvd
import tensorflow as tf

from scalelab.data import load, shard_arrays
from scalelab.models import small_cnn

hvd.init()
images, labels = load(os.environ["SCALELAB_DATASET"], "train")
images, labels = shard_arrays(images[:256, ..., None], labels[:256], hvd.rank(), hvd.size())
model = small_cnn(input_shape=(28, 28, 1), filters=(8, 16), dense_units=16)
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.001)),
              loss="sparse_categorical_crossentropy", metrics=["accuracy"])
model.fit(images, labels, batch_size=32, epochs=1, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
if hvd.rank() == 0:
    for epoch in range(1, 11):
        print(f"epoch {epoch}/10  loss 0.0100  accuracy 0.9900  val_accuracy 0.9900", flush=True)
    print("held-out accuracy 0.9900 -- target reached, PASS", flush=True)
    output = Path(os.environ["SCALELAB_OUTPUT_DIR"])
    output.mkdir(parents=True, exist_ok=True)
    model.save(output / "model.keras")
