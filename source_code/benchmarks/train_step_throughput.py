"""The bare TensorFlow training step of the course's model: images/s with nothing around it (P1's denominator,
and the img/s-vs-batch-size sweep).

    python source_code/benchmarks/train_step_throughput.py --batch-sizes 32,64,128,256 --json out.json

Same model as source_code/fashion_mnist.py (``small_cnn``, L2 5e-5, dropout, SGD with momentum), the same
real Fashion-MNIST images, but as tensors already in memory and one ``tf.function`` step: no tf.data, no
Keras ``fit`` loop, no callbacks, no metrics. TensorFlow's default threads, as the course script has.
"""

import argparse
import json
import time
from pathlib import Path

import tensorflow as tf

from scalelab.data import load_fashion_mnist
from scalelab.models import small_cnn

parser = argparse.ArgumentParser(description="images/s of a bare TF training step of the course's small CNN")
parser.add_argument("--batch-sizes", type=lambda text: [int(s) for s in text.split(",")], default=[128])
parser.add_argument("--steps", type=int, default=20, help="timed steps per repeat")
parser.add_argument("--images-per-repeat", type=int, default=None,
                    help="instead of --steps: as many steps as make this many images (at least 3)")
parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (tracing, allocations)")
parser.add_argument("--repeats", type=int, default=3, help="timed runs of --steps per batch size")
parser.add_argument("--images", type=int, default=12800, help="training images held in memory")
parser.add_argument("--json", type=Path, required=True)
args = parser.parse_args()

images, labels = load_fashion_mnist("train")
images = tf.constant(images[:args.images, ..., None])
labels = tf.constant(labels[:args.images])
loss_function = tf.keras.losses.SparseCategoricalCrossentropy()

results = []
for batch_size in args.batch_sizes:
    model = small_cnn(input_shape=(28, 28, 1), num_classes=10, weight_decay=5e-5)
    optimizer = tf.keras.optimizers.SGD(learning_rate=0.02, momentum=0.9)
    batches = max(1, args.images // batch_size)
    steps = max(3, args.images_per_repeat // batch_size) if args.images_per_repeat else args.steps

    @tf.function
    def train_step(step):
        # The batch is a slice of the in-memory tensors: no input pipeline at all.
        start = (step % batches) * batch_size
        batch_images, batch_labels = images[start:start + batch_size], labels[start:start + batch_size]
        with tf.GradientTape() as tape:
            probabilities = model(batch_images, training=True)
            loss = loss_function(batch_labels, probabilities) + tf.add_n(model.losses)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    for step in range(args.warmup):
        loss = train_step(tf.constant(step))
    loss.numpy()
    samples = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        for step in range(steps):
            loss = train_step(tf.constant(step))
        loss.numpy()  # waits for the last step
        samples.append(steps * batch_size / (time.perf_counter() - started))
    results.append({"batch_size": batch_size, "images_per_s": samples})
    print(f"batch {batch_size:>5}  img/s " + " ".join(f"{s:.0f}" for s in samples), flush=True)

args.json.parent.mkdir(parents=True, exist_ok=True)
args.json.write_text(json.dumps({"results": results,
                                 "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads()}))
