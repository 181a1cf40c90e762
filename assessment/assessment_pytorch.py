"""The ScaleLab assessment, PyTorch edition: make this serial CIFAR-10 training script distributed with PyTorch's
DistributedDataParallel (DDP), and fast.

It runs as it is, on one process, with no arguments:

    python assessment_pytorch.py

Your task: convert it to DDP so that

    torchrun --nproc_per_node 2 assessment_pytorch.py

trains one model on all ranks together, and tune it so that the saved model reaches the track's held-out accuracy
within the track's time budget. The grader runs it exactly like that, with no arguments, so the settings you choose
must be the argparse defaults. Leave the marked DO-NOT-EDIT section as it is.

The grader sets SCALELAB_OUTPUT_DIR (where the run may write), SCALELAB_TRACK, SCALELAB_DATASET and the data location
(SCALELAB_CIFAR10_DIR or SCALELAB_FASHION_MNIST_DIR). The data there is the training split only: validate on a
slice of it. The grader measures accuracy itself, on held-out images you cannot read.

The grader's track for it is cifar10-ddp-cpu (assessment/tracks.toml): `scalelab assess assessment_pytorch.py
--track cifar10-ddp-cpu` grades it from a terminal. Converted to Horovod for PyTorch instead, it is graded on
cifar10-horovod-torch-cpu (horovodrun). Where the course's Assess service grades one of these tracks, the Assess
button in assessment.ipynb grades this file.
"""

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from scalelab.data import DataError, load
from scalelab.progress import format_epoch
from scalelab.torch_models import SmallCNN, cifar_cnn, export_model_atomically

parser = argparse.ArgumentParser(description="ScaleLab assessment: CIFAR-10 with PyTorch (serial starting point)")
parser.add_argument("--dataset", choices=("cifar10", "fashion-mnist"),
                    default=os.environ.get("SCALELAB_DATASET", "cifar10"), help="which data set to train on")
parser.add_argument("--batch-size", type=int, default=32, help="training images per step")
parser.add_argument("--epochs", type=int, default=30, help="epochs to train")
parser.add_argument("--lr", type=float, default=0.01, help="learning rate of SGD")
parser.add_argument("--momentum", type=float, default=0.0, help="SGD momentum")
parser.add_argument("--val-fraction", type=float, default=0.1,
                    help="fraction of the training images kept aside for validation")
args = parser.parse_args()
if args.batch_size < 1 or args.epochs < 1 or args.lr <= 0 or not 0 < args.val_fraction < 1:
    parser.error("--batch-size and --epochs must be at least 1, --lr positive, --val-fraction in (0, 1)")

# The process that prints progress and saves the model (the DO-NOT-EDIT section below reads this name).
is_chief = True
# The same initial weights and order of images in every run, so that two runs differ only by what you changed.
torch.manual_seed(0)

# Data: raw uint8 pixels (the models rescale them). Only the training split is available to this script, so the
# last images of it are kept aside for validation.
try:
    images, labels = load(args.dataset, "train")
except DataError as error:
    parser.exit(3, f"{parser.prog}: error: {error}\n")
if images.ndim == 3:  # Fashion-MNIST is greyscale: add the channel axis the convolutions expect
    images = images[..., None]
validation_size = int(len(images) * args.val_fraction)
pixels, classes = torch.from_numpy(images), torch.from_numpy(labels.astype(np.int64))
train_set = TensorDataset(pixels[:-validation_size], classes[:-validation_size])
val_set = TensorDataset(pixels[-validation_size:], classes[-validation_size:])
train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
val_loader = DataLoader(val_set, batch_size=512)

# Model, loss and optimizer.
model = cifar_cnn(batch_norm=False) if args.dataset == "cifar10" else SmallCNN(input_shape=images.shape[1:])
loss_function = torch.nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)

# ---------------------------------------------------------------------------------------------------------------
# DO NOT EDIT this section: the grader evaluates the models saved here, on held-out images: each epoch's as your
# run goes (it copies every version, on its own clock) and the last one after your run ends.
# The model must take raw 0-255 pixels (batch x height x width x channels) and output 10 class scores; it is saved
# as a torch.export program, which the grader runs without your code. Only the chief process saves it.
output_dir = Path(os.environ.get("SCALELAB_OUTPUT_DIR", "output"))
model_path = output_dir / "model.pt2"
example_pixels = pixels[:2]
if is_chief:
    output_dir.mkdir(parents=True, exist_ok=True)


def save_model():
    if is_chief:
        export_model_atomically(model, model_path, example_pixels)
# ---------------------------------------------------------------------------------------------------------------


def evaluate(loader):
    """Mean loss and accuracy of the model on ``loader``'s images."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for batch_pixels, batch_classes in loader:
            scores = model(batch_pixels)
            loss_sum += loss_function(scores, batch_classes).item() * len(batch_classes)
            correct += (scores.argmax(dim=1) == batch_classes).sum().item()
            count += len(batch_classes)
    return loss_sum / count, correct / count


if is_chief:
    print(f"training on {len(train_set)} images, validating on {len(val_set)}, batch {args.batch_size}", flush=True)
started = time.perf_counter()
for epoch in range(args.epochs):
    model.train()
    epoch_started, loss_sum, correct, count = time.perf_counter(), 0.0, 0, 0
    for batch_pixels, batch_classes in train_loader:
        optimizer.zero_grad()
        scores = model(batch_pixels)
        loss = loss_function(scores, batch_classes)
        loss.backward()
        optimizer.step()
        loss_sum += loss.item() * len(batch_classes)
        correct += (scores.argmax(dim=1) == batch_classes).sum().item()
        count += len(batch_classes)
    images_per_s = count / (time.perf_counter() - epoch_started)
    val_loss, val_accuracy = evaluate(val_loader)
    save_model()
    if is_chief:
        print(format_epoch(epoch, args.epochs, {
            "loss": loss_sum / count, "accuracy": correct / count, "val_loss": val_loss, "val_accuracy": val_accuracy,
            "lr": optimizer.param_groups[0]["lr"], "images_per_s": images_per_s,
            "elapsed_s": time.perf_counter() - started}), flush=True)

# DO NOT EDIT: the final model.
save_model()
if is_chief:
    print(f"saved {model_path}", flush=True)
