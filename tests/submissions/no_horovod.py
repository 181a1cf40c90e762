"""Trains a good model on every rank, each on its own, without Horovod: accurate, but not distributed."""
import os
from pathlib import Path

import tensorflow as tf

from scalelab.data import load
from scalelab.models import small_cnn

images, labels = load(os.environ["SCALELAB_DATASET"], "train")
model = small_cnn(input_shape=(28, 28, 1), filters=(16, 32), dense_units=64)
model.compile(optimizer=tf.keras.optimizers.Adam(0.002), loss="sparse_categorical_crossentropy",
              metrics=["accuracy"])
model.fit(images[:6000, ..., None], labels[:6000], batch_size=64, epochs=2, verbose=0)
output = Path(os.environ["SCALELAB_OUTPUT_DIR"])
output.mkdir(parents=True, exist_ok=True)
# Without Horovod every process believes it is alone, so both write the model (to different names first,
# then the last one wins the rename).
model.save(output / f"model-{os.getpid()}.keras")
os.replace(output / f"model-{os.getpid()}.keras", output / "model.keras")
