"""The course's networks in PyTorch, and how a PyTorch model is saved for the grader.

Each network has the layers of its Keras twin in ``scalelab.models`` and the same contract: it takes raw pixels as the
data loaders return them (0-255, batch x height x width x channels, uint8 or float) and outputs 10 class scores, so
the grader measures a PyTorch model on the same held-out arrays as a Keras one.

A model is saved with :func:`export_model_atomically` as a ``torch.export`` program (``model.pt2``): a graph of
PyTorch's own operators with its weights, which ``torch.export.load`` runs without the class that defined it. The
grader never imports the student's code to measure the model.
"""

from __future__ import annotations

import copy
import os
import socket
import warnings
from pathlib import Path

import torch
from torch import nn

# A first convolution with one input channel gets a weight gradient whose stride along that channel (of size 1) is not
# the one DDP's gradient bucket holds: the same memory order, so harmless, but DDP warned about it on every rank of
# every run of the course's DDP scripts, where students read it as their mistake.
warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides", category=UserWarning)


class SmallCNN(nn.Module):
    """A small, fast CNN for CPUs: per entry of ``filters`` two 3x3 convolutions and a 2x2 max-pool, then dropout, a
    dense layer and the class scores (``scalelab.models.small_cnn``'s layers).

    ``batch_norm=True`` adds batch normalisation after each convolution; ``bn_momentum`` is, as in Keras, how much of
    its running mean and variance a batch-norm layer keeps at each step (PyTorch's own ``momentum`` is the rest)."""

    def __init__(self, input_shape=(28, 28, 1), num_classes: int = 10, filters=(32, 64), dense_units: int = 128,
                 dropout: float = 0.25, batch_norm: bool = False, bn_momentum: float = 0.99):
        super().__init__()
        height, width, channels = input_shape
        blocks = []
        for block_filters in filters:
            for conv_input in (channels, block_filters):
                blocks.append(nn.Conv2d(conv_input, block_filters, 3, padding=1, bias=not batch_norm))
                if batch_norm:
                    blocks.append(nn.BatchNorm2d(block_filters, eps=1e-3, momentum=1 - bn_momentum))
                blocks.append(nn.ReLU())
            blocks.append(nn.MaxPool2d(2))
            channels, height, width = block_filters, height // 2, width // 2
        self.features = nn.Sequential(*blocks)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(channels * height * width,
                                                                                   dense_units),
                                        nn.ReLU(), nn.Linear(dense_units, num_classes))
        # Keras's initialisers (Glorot uniform, zero biases), so that both editions start alike: with PyTorch's own
        # the plain-SGD serial script did not leave chance in 4 epochs on CIFAR-10 (loss 2.30).
        for layer in self.modules():
            if isinstance(layer, (nn.Conv2d, nn.Linear)):
                nn.init.xavier_uniform_(layer.weight)
                if layer.bias is not None:
                    nn.init.zeros_(layer.bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # Raw channels-last pixels in, as the data loaders give them; the convolutions want channels first, in [0, 1].
        scaled = pixels.permute(0, 3, 1, 2).float() / 255.0
        return self.classifier(self.features(scaled))


def cifar_cnn(num_classes: int = 10, batch_norm: bool = True, dropout: float = 0.25,
              bn_momentum: float = 0.99) -> SmallCNN:
    """The CPU-sized CIFAR-10 network of the assessment (32-64-128 filters), as ``scalelab.models.cifar_cnn``."""
    return SmallCNN((32, 32, 3), num_classes, filters=(32, 64, 128), dense_units=128, dropout=dropout,
                    batch_norm=batch_norm, bn_momentum=bn_momentum)


def export_model_atomically(model: nn.Module, path: Path | str, example_pixels: torch.Tensor) -> Path:
    """Save ``model`` to ``path`` as a ``torch.export`` program that takes any number of images like
    ``example_pixels`` (at least 2 of them), whole or not at all: written beside it, then renamed over it, so that a
    reader (the grader, which copies every version while the run goes) never sees a half-written file."""
    path = Path(path)
    module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    # The program keeps its example inputs: a slice would bring its whole data set along (a view is saved with
    # all of the storage it views), so the example is copied first.
    example_pixels = example_pixels.detach().cpu().clone()
    # The grader measures on a CPU: a model trained on a GPU is exported from a copy of it on the CPU.
    if any(tensor.device.type != "cpu" for tensor in [*module.parameters(), *module.buffers()]):
        module = copy.deepcopy(module).cpu()
    was_training = module.training
    module.eval()  # the program records the layers as they evaluate: dropout off
    try:
        batch = torch.export.Dim("batch")
        program = torch.export.export(module, (example_pixels,), dynamic_shapes={"pixels": {0: batch}})
    finally:
        module.train(was_training)
    partial = path.with_name(f".{path.stem}.{socket.gethostname()}-{os.getpid()}.partial{path.suffix}")
    torch.export.save(program, partial)
    partial.replace(path)
    return path


def ddp_device(local_rank: int, local_world_size: int, cuda_devices: int | None = None) -> tuple[torch.device, str]:
    """The device a DDP rank trains on and its process group's backend, from its rank on this machine and how many
    ranks the machine runs: a GPU of its own and NCCL where there is one for every local rank; GPUs shared in turn
    and Gloo where there are fewer (NCCL refuses two ranks on one GPU); the CPU and Gloo where there is none.
    ``cuda_devices``: the GPUs this process sees (default: ``torch.cuda.device_count()``, after
    CUDA_VISIBLE_DEVICES)."""
    count = torch.cuda.device_count() if cuda_devices is None else cuda_devices
    if count < 1:
        return torch.device("cpu"), "gloo"
    return torch.device("cuda", local_rank % count), "nccl" if count >= local_world_size else "gloo"
