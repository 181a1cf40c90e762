"""One rank of a student's lab-3 conversion, run with the grader's instruments around Horovod and Keras.

    python -m scalelab.grader.labchecks.conversion_probe RECORD_DIR SCRIPT [SCRIPT'S ARGUMENTS...]

The student's script runs unchanged (``runpy``, as ``__main__``); nothing of the harness is in it. Around it the
probe records what the rank did, in ``RECORD_DIR/rank<R>.json``, rewritten after every event so that a rank that
hangs still leaves where it stopped:

- whether ``hvd.init()`` ran, and whether TensorFlow's runtime had already started then;
- the GPU the rank pinned and when. Each rank is shown a machine of its own with two GPUs: ``hvd.local_rank()``
  answers 0 and ``hvd.local_size()`` 1 on every rank, and ``tf.config`` lists two stand-in GPUs to the script
  (never to TensorFlow's own code), so pinning by the global rank or guarding by the local rank shows;
- at ``fit``: the callbacks in order, whether the compiled optimizer is a ``DistributedOptimizer`` and how it
  combines gradients, its peak learning rate, whether there is validation data;
- every example of the first batches (a short hash of its bytes), the batch sizes, the steps per epoch;
- a digest of the weights when training begins, after the first step (Horovod broadcasts at its end) and at the
  end; the metrics the last callback sees at each epoch's end; broadcasts called by hand; models saved.

Nothing here decides a grade: :mod:`conversion_questions` asks its questions of the records.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import numbers
import os
import runpy
import sys
import time
import traceback
from pathlib import Path

MAX_RECORDED_BATCHES = 64
MAX_RECORDED_ARRAY_EXAMPLES = 8192
STAND_IN_GPUS = 2
PROBE_MODULES = ("tensorflow", "keras", "horovod")

record: dict = {"rank": None, "size": None, "stage": "starting", "events": [], "init": None, "pins": [],
                "optimizer_wrappings": [], "fits": [], "batches": [], "array_examples": None, "steps": [],
                "weights": {}, "epoch_logs": [], "broadcast_calls": [], "saves": [], "error": None}
_record_path: Path | None = None
_distributed_optimizers: dict[int, dict] = {}


def environment_rank() -> int:
    for name in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return -1


def save() -> None:
    if _record_path is None:
        return
    partial = _record_path.with_suffix(".partial")
    partial.write_text(json.dumps(record, default=str))
    os.replace(partial, _record_path)


def reached(stage: str) -> None:
    record["stage"] = stage
    record["events"].append([round(time.monotonic(), 3), stage])
    save()


def tensorflow_started() -> bool:
    from tensorflow.python.eager import context
    return bool(context.context()._initialized)


def called_by_the_script() -> bool:
    """True when the caller of the instrumented function is not TensorFlow, Keras or Horovod themselves."""
    frame = inspect.currentframe().f_back.f_back
    module = frame.f_globals.get("__name__", "") if frame else ""
    return not module.split(".")[0] in PROBE_MODULES


def weights_digest(model) -> str:
    import numpy as np
    return hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes() for w in model.get_weights())).hexdigest()[:16]


def example_hashes(columns) -> list[str]:
    import numpy as np
    columns = [np.asarray(column) for column in columns]
    return [hashlib.sha1(b"".join(np.ascontiguousarray(column[i]).tobytes() for column in columns)).hexdigest()[:12]
            for i in range(len(columns[0]))]


# ------------------------------------------------------------------------------------------------ Horovod

def instrument_horovod() -> None:
    import horovod.tensorflow as hvd_tf
    import horovod.tensorflow.keras as hvd

    real_init, real_wrap = hvd.init, hvd.DistributedOptimizer
    op_names = {hvd_tf.Average: "Average", hvd_tf.Sum: "Sum", hvd_tf.Adasum: "Adasum"}

    def init(*args, **kwargs):
        started = tensorflow_started()
        result = real_init(*args, **kwargs)
        record["rank"], record["size"] = hvd.rank(), hvd.size()
        record["init"] = {"tensorflow_started": started, "calls": (record["init"] or {}).get("calls", 0) + 1}
        reached("hvd.init")
        return result

    def distributed_optimizer(optimizer, *args, **kwargs):
        bound = inspect.signature(real_wrap).bind(optimizer, *args, **kwargs)
        op = bound.arguments.get("op", hvd_tf.Average)
        inner = _distributed_optimizers.get(id(optimizer))
        record["optimizer_wrappings"].append({"op": op_names.get(op, str(op)),
                                              "wraps_a_distributed_optimizer": inner is not None})
        reached("hvd.DistributedOptimizer")
        wrapped = real_wrap(*bound.args, **bound.kwargs)
        _distributed_optimizers[id(wrapped)] = {
            "op": op_names.get(op, str(op)), "wrappings": 1 + (inner["wrappings"] if inner else 0),
            "inner_op": inner["op"] if inner else None, "object": wrapped}
        return wrapped

    def broadcast(real, name):
        signature = inspect.signature(real)

        def call(*args, **kwargs):
            if not called_by_the_script():  # Horovod's own broadcast callback is recorded from fit's callbacks
                return real(*args, **kwargs)
            root = signature.bind(*args, **kwargs).arguments.get("root_rank")
            record["broadcast_calls"].append({"function": name, "root_rank": root,
                                              "tensorflow_started": tensorflow_started()})
            reached(f"hvd.{name}")
            return real(*args, **kwargs)
        return call

    real_local_rank, real_local_size = hvd.local_rank, hvd.local_size

    def simulated_local_rank():
        real_local_rank()  # raises, as Horovod does, before hvd.init()
        return 0

    def simulated_local_size():
        real_local_size()
        return 1

    for module in (hvd, hvd_tf):
        module.init = init
        module.local_rank, module.local_size = simulated_local_rank, simulated_local_size
        for name in ("broadcast_variables", "broadcast_global_variables"):
            if hasattr(module, name):
                setattr(module, name, broadcast(getattr(module, name), name))
    hvd.DistributedOptimizer = distributed_optimizer


# --------------------------------------------------------------------------------------------- TensorFlow

def instrument_tensorflow() -> None:
    import tensorflow as tf

    stand_ins = [tf.config.PhysicalDevice(name=f"/physical_device:GPU:{i}", device_type="GPU")
                 for i in range(STAND_IN_GPUS)]

    def listing(real):
        def list_physical_devices(device_type=None):
            if device_type == "GPU" and called_by_the_script():
                return list(stand_ins)
            return real(device_type)
        return list_physical_devices

    def set_visible(real):
        def set_visible_devices(devices, device_type=None):
            # A PhysicalDevice is a named tuple itself: only a list or a tuple of them is several devices.
            chosen = [devices] if isinstance(devices, tf.config.PhysicalDevice) else list(devices)
            if any(device in stand_ins for device in chosen):
                record["pins"].append({"gpus": [stand_ins.index(d) for d in chosen if d in stand_ins],
                                       "tensorflow_started": tensorflow_started()})
                reached("pinned a GPU")
                return None
            return real(devices, device_type)
        return set_visible_devices

    def memory_growth(real):
        def set_memory_growth(device, enable):
            return None if device in stand_ins else real(device, enable)
        return set_memory_growth

    for namespace in (tf.config, tf.config.experimental):
        namespace.list_physical_devices = listing(namespace.list_physical_devices)
        namespace.set_visible_devices = set_visible(namespace.set_visible_devices)
    tf.config.experimental.set_memory_growth = memory_growth(tf.config.experimental.set_memory_growth)


def peak_learning_rate(optimizer, total_steps: int) -> float | None:
    import tensorflow as tf
    rate = getattr(optimizer, "_learning_rate", None)
    if rate is None:
        rate = getattr(optimizer, "learning_rate", None)
    try:
        if isinstance(rate, tf.keras.optimizers.schedules.LearningRateSchedule):
            stride = max(1, total_steps // 64)
            return max(float(rate(step)) for step in range(0, total_steps + 1, stride))
        return float(tf.keras.backend.get_value(rate))
    except Exception:  # a rate the probe cannot read is reported as unknown, never guessed
        return None


def probe_callbacks(model_fit_record: dict):
    import tensorflow as tf

    class FirstProbe(tf.keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            record["weights"]["train_begin"] = weights_digest(self.model)
            reached("training began")

        def on_epoch_begin(self, epoch, logs=None):
            record["steps"].append(0)
            reached(f"epoch {epoch + 1}")

    class LastProbe(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            record["steps"][-1] += 1
            if "after_first_step" not in record["weights"]:
                record["weights"]["after_first_step"] = weights_digest(self.model)
            reached(f"epoch {len(record['steps'])} step {record['steps'][-1]}")

        def on_test_begin(self, logs=None):
            reached(f"epoch {len(record['steps'])} validation")

        def on_epoch_end(self, epoch, logs=None):
            record["epoch_logs"].append({key: float(value) for key, value in (logs or {}).items()
                                         if isinstance(value, numbers.Real) or getattr(value, "shape", None) == ()})
            reached(f"epoch {epoch + 1} ended")

        def on_train_end(self, logs=None):
            record["weights"]["train_end"] = weights_digest(self.model)
            reached("training ended")

    return FirstProbe(), LastProbe()


def note_batch(*columns):
    import numpy as np
    if len(record["batches"]) < MAX_RECORDED_BATCHES:
        record["batches"].append(example_hashes([column.numpy() for column in columns]))
    return np.int64(len(record["batches"]))


def tagged(dataset):
    """The dataset, each batch of which the probe sees (in the order it is made) as it passes to training."""
    import tensorflow as tf

    def tag(*element):
        token = tf.py_function(note_batch, tf.nest.flatten(element), tf.int64)
        with tf.control_dependencies([token]):
            same = tf.nest.map_structure(tf.identity, element)
        return same if len(element) > 1 else same[0]

    return dataset.map(tag)


def instrument_keras() -> None:
    import tensorflow as tf

    model_class = tf.keras.Model
    real_fit, real_save, real_save_weights = model_class.fit, model_class.save, model_class.save_weights
    signature = inspect.signature(real_fit)

    def fit(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        arguments = bound.arguments
        callbacks = list(arguments.get("callbacks") or [])
        x, steps, epochs = arguments.get("x"), arguments.get("steps_per_epoch"), arguments.get("epochs", 1)
        distributed = _distributed_optimizers.get(id(self.optimizer))
        if distributed is not None and distributed["object"] is not self.optimizer:
            distributed = None
        fit_record = {
            "callbacks": [type(callback).__name__ for callback in callbacks],
            "broadcast_roots": [getattr(callback, "root_rank", None) for callback in callbacks
                                if "BroadcastGlobalVariables" in type(callback).__name__],
            "steps_per_epoch": steps, "epochs": epochs, "verbose": arguments.get("verbose", "auto"),
            "batch_size": arguments.get("batch_size"), "validation": arguments.get("validation_data") is not None,
            "optimizer": type(self.optimizer).__name__,
            "distributed": None if distributed is None else {k: v for k, v in distributed.items() if k != "object"},
            "peak_learning_rate": peak_learning_rate(self.optimizer, (steps or 100) * (epochs or 1))}
        record["fits"].append(fit_record)
        if isinstance(x, tf.data.Dataset):
            arguments["x"] = tagged(x)
        elif x is not None:
            columns = [x] + ([arguments["y"]] if arguments.get("y") is not None else [])
            record["array_examples"] = example_hashes([column[:MAX_RECORDED_ARRAY_EXAMPLES] for column in columns])
        first, last = probe_callbacks(fit_record)
        arguments["callbacks"] = [first, *callbacks, last]
        reached("fit")
        return real_fit(*bound.args, **bound.kwargs)

    def saving(real, what):
        def save(self, filepath, *args, **kwargs):
            record["saves"].append({"what": what, "path": str(filepath)})
            reached(f"{what} {Path(str(filepath)).name}")
            return real(self, filepath, *args, **kwargs)
        return save

    model_class.fit = fit
    model_class.save = saving(real_save, "save")
    model_class.save_weights = saving(real_save_weights, "save_weights")


def main(argv: list[str]) -> int:
    global _record_path
    if len(argv) < 2:
        print("usage: python -m scalelab.grader.labchecks.conversion_probe RECORD_DIR SCRIPT [ARGS...]",
              file=sys.stderr)
        return 2
    record_dir, script, script_args = Path(argv[0]), argv[1], argv[2:]
    record["rank"] = environment_rank()
    _record_path = record_dir / f"rank{record['rank']}.json"
    reached("importing TensorFlow and Horovod")
    instrument_tensorflow()
    instrument_keras()
    instrument_horovod()
    reached("running the script")
    sys.argv = [script, *script_args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as leaving:
        code = leaving.code if isinstance(leaving.code, int) else (0 if leaving.code is None else 1)
        if code:
            record["error"] = f"the script exited with status {code}"
            reached("exited")
            return code
    except BaseException as error:  # the student's error, recorded where the questions can name it
        record["error"] = "".join(traceback.format_exception_only(type(error), error)).strip()
        record["traceback"] = traceback.format_exc()[-4000:]
        reached("raised an exception")
        return 1
    reached("finished")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
