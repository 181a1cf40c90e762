"""An honest conversion whose only mistake is the classic one: the pixels are standardized feature-wise (each pixel
to mean 0 and std 1, as scikit-learn's StandardScaler does) before the model, so the saved model expects
standardized inputs while the grader (like any user of the model) feeds raw pixels. Seeded, so that its accuracies
stay put: 0.45 on raw pixels, 0.82 on standardized ones (2 epochs of 8000 images)."""
import os
from pathlib import Path

import horovod.tensorflow.keras as hvd
import tensorflow as tf

from scalelab.data import load, shard_arrays
from scalelab.runtime import configure_threads

hvd.init()
configure_threads(hvd.local_size())
tf.keras.utils.set_random_seed(2)
images, labels = load(os.environ["SCALELAB_DATASET"], "train")
images = images[:8000, ..., None].astype("float32")
pixel_mean, pixel_std = images.mean(axis=0), images.std(axis=0)
pixel_std[pixel_std == 0] = 1.0
images = (images - pixel_mean) / pixel_std
images, labels = shard_arrays(images, labels[:8000], hvd.rank(), hvd.size())
model = tf.keras.Sequential([tf.keras.Input((28, 28, 1)), tf.keras.layers.Flatten(),
                             tf.keras.layers.Dense(128, activation="relu"), tf.keras.layers.Dense(64, activation="relu"),
                             tf.keras.layers.Dense(10)])
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.001 * hvd.size())),
              loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
history = model.fit(images, labels, batch_size=32, epochs=2, verbose=0,
                    callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
if hvd.rank() == 0:
    print(f"epoch 2/2  accuracy {history.history['accuracy'][-1]:.4f}", flush=True)
    model.save(Path(os.environ["SCALELAB_OUTPUT_DIR"]) / "model.keras")
