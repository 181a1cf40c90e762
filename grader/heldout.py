"""Held-out accuracy of a saved model, computed in its own process: ``python -m scalelab.grader.heldout``.

The grader runs this module in a separate process (never in its own): it loads ``model.keras`` in Keras safe
mode (or, on a PyTorch track, ``model.pt2`` with ``torch.export.load``), predicts the held-out split the grader
loads itself, and prints one JSON object:
``{"accuracy": float | null, "reason": str | null, "trainable_variables": int, ...}``.

With ``-`` for the model's path it imports the framework and loads the held-out split once, then measures one model
per line of stdin (``{"model": path, "explain_below": float | null}``) and answers each with one JSON line, until
stdin closes: the grader starts it that way when the run starts, so that each model the run saves is measured as
it arrives without importing the framework again.
"""

from __future__ import annotations

import argparse
import json
import os
import sys



def usual_preprocessings(pixels):
    """The ways students preprocess pixels outside the model, as (name, function of the held-out images). The
    standardizations use the held-out images' own statistics, which stand in for the training images'."""
    pixel_mean, pixel_std = pixels.mean(axis=0), pixels.std(axis=0)
    pixel_std[pixel_std == 0] = 1.0  # as scikit-learn's StandardScaler does for constant features
    return (("divided by 255", lambda x: x / 255.0),
            ("scaled to [-1, 1]", lambda x: x / 127.5 - 1.0),
            ("standardized (mean 0, std 1)", lambda x: (x - x.mean()) / max(float(x.std()), 1e-6)),
            ("standardized per pixel (each pixel to mean 0, std 1, as StandardScaler does)",
             lambda x: (x - pixel_mean) / pixel_std))


def load_heldout(dataset: str):
    """The held-out split: (images, labels)."""
    from scalelab import data

    return data.load(dataset, "test", download=False)


class ModelRefused(Exception):
    """The saved model cannot be measured; the message is the reason, for the student."""


def _first_line(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"


def load_keras(model_path: str):
    """(predict(images) → scores, input shape, trainable variables, trainable parameters) of a Keras model, loaded
    in Keras safe mode."""
    import numpy as np
    import tensorflow as tf

    try:
        model = tf.keras.models.load_model(model_path, compile=False, safe_mode=True)
    except Exception as error:  # any failure to load is the submission's problem, said plainly
        raise ModelRefused(f"the saved model could not be loaded in Keras safe mode ({_first_line(error)}); save it "
                           f"with the DO-NOT-EDIT section and use only built-in Keras layers") from None
    if isinstance(model.input_shape, list):
        raise ModelRefused("the saved model has several inputs; it must take one batch of images")
    parameters = int(sum(np.prod(weight.shape) for weight in model.trainable_weights))
    return (lambda images, batch_size: model.predict(images, batch_size=batch_size, verbose=0),
            tuple(model.input_shape[1:]), len(model.trainable_weights), parameters)


def load_pytorch(model_path: str):
    """The same for a ``torch.export`` program (model.pt2): run as the graph it holds, without the class that
    defined it (the measuring process is sandboxed: the file also holds pickled sample inputs)."""
    import numpy as np
    import torch

    try:
        program = torch.export.load(model_path)
        module = program.module()
    except Exception as error:
        raise ModelRefused(f"the saved model could not be loaded with torch.export.load ({_first_line(error)}); "
                           f"save it with the DO-NOT-EDIT section (export_model_atomically)") from None
    args, kwargs = program.example_inputs or ((), {})
    if len(args) + len(kwargs) != 1:
        raise ModelRefused("the saved model has several inputs; it must take one batch of images")
    example = (list(args) + list(kwargs.values()))[0]
    if not isinstance(example, torch.Tensor) or example.dtype not in (torch.uint8, torch.float32):
        raise ModelRefused("the saved model must take a batch of images as uint8 or float32 pixels (it was "
                           "exported with another kind of input)")
    state = program.state_dict
    parameters = [state[name] for name in program.graph_signature.parameters if name in state]

    def predict(images, batch_size):
        # Raw 0-255 pixels, in the type the program was exported with (only the reasons' rescaled pixels are not
        # whole numbers; a uint8 program is not asked about those).
        if example.dtype == torch.uint8 and not np.array_equal(images, np.round(images)):
            raise ModelRefused("the model takes uint8 pixels")
        outputs = []
        with torch.no_grad():
            for start in range(0, len(images), batch_size):
                batch = torch.from_numpy(np.ascontiguousarray(images[start:start + batch_size])).to(example.dtype)
                scores = module(batch)
                outputs.append(scores.detach().numpy() if isinstance(scores, torch.Tensor) else np.asarray(scores))
        return np.concatenate(outputs) if outputs else np.zeros((0, 10), "float32")
    return (predict, tuple(example.shape[1:]), len(parameters),
            int(sum(parameter.numel() for parameter in parameters)))


LOADERS = {"keras": load_keras, "pytorch": load_pytorch}


def measure(model_path: str, dataset: str, batch_size: int = 256, heldout=None,
            explain_below: float | None = None, framework: str = "keras") -> dict:
    """The model's accuracy on the held-out split, as a dict (see ``result`` below). Below ``explain_below`` (the
    track's target) the model is also measured on pixels preprocessed the usual ways, for the reasons only."""
    import numpy as np

    result = {"accuracy": None, "reason": None, "trainable_variables": None, "trainable_parameters": None,
              "output_shape": None, "images": None}
    try:
        predict, input_shape, result["trainable_variables"], result["trainable_parameters"] = \
            LOADERS[framework](model_path)
    except ModelRefused as refused:
        result["reason"] = str(refused)
        return result
    images, labels = heldout if heldout is not None else load_heldout(dataset)
    if images.ndim == 3 and len(input_shape) == 3 and input_shape[-1] == 1:
        images = images[..., None]
    if tuple(d for d in input_shape) != tuple(images.shape[1:]) and None not in input_shape:
        result["reason"] = (f"the saved model takes inputs of shape {input_shape}, but the {dataset} images are "
                            f"{tuple(images.shape[1:])}")
        return result
    try:
        scores = predict(images.astype("float32"), batch_size)
    except Exception as error:
        result["reason"] = f"the saved model failed on the held-out images ({_first_line(error)})"
        return result
    result["output_shape"] = list(scores.shape)
    if scores.ndim != 2 or scores.shape != (len(images), 10):
        result["reason"] = (f"the saved model outputs shape {tuple(scores.shape)} for {len(images)} images; "
                            f"it must output 10 class scores per image")
        return result
    if not np.all(np.isfinite(scores)):
        result["reason"] = "the saved model outputs NaN or infinite scores (training diverged: lower the learning rate)"
        return result
    result["images"] = int(len(images))
    result["accuracy"] = float(np.mean(np.argmax(scores, axis=1) == labels.astype(np.int64)))
    if explain_below is not None and result["accuracy"] < explain_below:
        pixels = images.astype("float32")
        result["accuracy_with_preprocessing"] = {}
        for name, prepare in usual_preprocessings(pixels):
            try:
                scaled = predict(prepare(pixels).astype("float32"), batch_size)
            except ModelRefused:
                continue
            if scaled.shape == scores.shape and np.all(np.isfinite(scaled)):
                result["accuracy_with_preprocessing"][name] = float(np.mean(np.argmax(scaled, axis=1) == labels))
    return result


def serve(dataset: str, requests=sys.stdin, answers=sys.stdout, framework: str = "keras") -> int:
    """Measure the model named by each request line, answering each with one JSON line; stop when stdin closes."""
    # The slow part, done once, before the first model exists.
    __import__("tensorflow" if framework == "keras" else "torch")

    heldout = load_heldout(dataset)
    for line in iter(requests.readline, ""):
        if not line.strip():
            continue
        request = json.loads(line)
        result = measure(request["model"], dataset, heldout=heldout, explain_below=request.get("explain_below"),
                         framework=framework)
        answers.write("\n" + json.dumps(result) + "\n")
        answers.flush()
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="held-out accuracy of a saved model (JSON on stdout)")
    parser.add_argument("model", help="path of model.keras or model.pt2; - to measure one model per line of stdin "
                                      "({\"model\": path, \"explain_below\": x}) once the framework is loaded")
    parser.add_argument("dataset", help="cifar10 or fashion-mnist")
    parser.add_argument("--framework", choices=tuple(LOADERS), default="keras",
                        help="keras (model.keras, Keras safe mode) or pytorch (model.pt2, torch.export)")
    parser.add_argument("--explain-below", type=float, default=None, metavar="ACCURACY",
                        help="below this accuracy also try the usual preprocessings (for the reasons)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.model == "-":
        status = serve(args.dataset, framework=args.framework)
        sys.stdout.flush()
        # Every answer is given and the grader waits for this exit: skip the frameworks' own teardown (most of a
        # second). Nothing is left to clean: the temporary folder is the sandbox's, or one the grader removes.
        os._exit(status)
    result = measure(args.model, args.dataset, explain_below=args.explain_below, framework=args.framework)
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
