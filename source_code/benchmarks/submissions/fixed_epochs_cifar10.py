"""An honest Horovod conversion of the assessment as many students write it: a fixed 12 epochs, its own tf.data
pipeline with tf.data's default autotuning (which can keep a finished run alive while it is torn down), Adam at
a linearly scaled rate, and the assessment's DO-NOT-EDIT section kept. P7 grades it beside the reference: under
the referee it passes at its time to accuracy, whatever its exit costs."""

import os
from pathlib import Path

import horovod.tensorflow.keras as hvd
import tensorflow as tf

from scalelab.callbacks import SaveModelEachEpoch, save_model_atomically
from scalelab.data import load
from scalelab.models import cifar_cnn

EPOCHS = 12
BATCH_SIZE = 64
LEARNING_RATE = 0.001

# Horovod: start it, and give each rank its own GPU where there are GPUs.
hvd.init()
gpus = tf.config.list_physical_devices("GPU")
if gpus:
    tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")
is_chief = hvd.rank() == 0

images, labels = load(os.environ.get("SCALELAB_DATASET", "cifar10"), "train")
# Horovod: each rank reads its own shard of the images.
train_data = (tf.data.Dataset.from_tensor_slices((images, labels)).shard(hvd.size(), hvd.rank())
              .shuffle(len(images)).batch(BATCH_SIZE).prefetch(tf.data.AUTOTUNE))

model = cifar_cnn(batch_norm=True, bn_momentum=0.9)
# Horovod: scale the rate with the number of ranks, and average the gradients at every step.
optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.Adam(LEARNING_RATE * hvd.size()))
model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])

# ---------------------------------------------------------------------------------------------------------------
# DO NOT EDIT this section: the grader evaluates the models saved here, on held-out images: each epoch's as your
# run goes (it copies every version, on its own clock) and the last one after your run ends.
# The model must take raw 0-255 pixels and output 10 class scores; it is loaded in Keras safe mode, so it may
# only use Keras's built-in layers (no Lambda layers, no custom classes). Only the chief process saves it.
output_dir = Path(os.environ.get("SCALELAB_OUTPUT_DIR", "output"))
model_path = output_dir / "model.keras"
save_model_callbacks = []
if is_chief:
    output_dir.mkdir(parents=True, exist_ok=True)
    save_model_callbacks.append(SaveModelEachEpoch(model_path))
# ---------------------------------------------------------------------------------------------------------------

callbacks = [
    # Horovod: every rank starts from rank 0's weights, and the printed metrics are the ranks' average.
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    hvd.callbacks.MetricAverageCallback(),
] + save_model_callbacks
model.fit(train_data, epochs=EPOCHS, callbacks=callbacks, verbose=2 if is_chief else 0)

# DO NOT EDIT: the final model.
if is_chief:
    save_model_atomically(model, model_path)
