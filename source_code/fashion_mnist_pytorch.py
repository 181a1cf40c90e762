"""Fashion-MNIST with the course's small CNN in PyTorch, on one process: the serial baseline of lab 3's DDP edition.

    python source_code/fashion_mnist_pytorch.py                       # the real settings
    python source_code/fashion_mnist_pytorch.py --epochs 1 --train-images 2000

Lab 3 (PyTorch edition, labs/source/lab3_ddp/) turns this file into fashion_mnist_ddp.py, one step at a time.
"""

import argparse
import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from scalelab.data import DataError, load
from scalelab.progress import format_epoch
from scalelab.torch_models import SmallCNN

parser = argparse.ArgumentParser(description="Fashion-MNIST with a small CNN in PyTorch (serial baseline)")
parser.add_argument("--batch-size", type=int, default=128, help="training images per step")
parser.add_argument("--val-batch-size", type=int, default=512, help="images per validation step")
parser.add_argument("--epochs", type=int, default=5, help="epochs to train")
parser.add_argument("--lr", type=float, default=0.01, help="learning rate of SGD")
parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
parser.add_argument("--train-images", type=int, default=None, help="train on the first N images only")
parser.add_argument("--val-images", type=int, default=None, help="validate on the first N held-out images only")
parser.add_argument("--output-dir", type=Path, default=Path("fashion_mnist_output"), help="checkpoints go here")
parser.add_argument("--weights-digest-dir", type=Path, default=None,
                    help="write the SHA-256 of the final weights here (weights_rank0.json), for comparing runs")
args = parser.parse_args()
for name in ("batch_size", "val_batch_size", "epochs", "train_images", "val_images"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
        parser.error(f"--{name.replace('_', '-')} must be at least 1")
if args.lr <= 0 or not 0 <= args.momentum < 1:
    parser.error("--lr must be positive and --momentum in [0, 1)")

# The same initial weights and order of images in every run, so that two runs differ only by what was changed.
torch.manual_seed(0)

# Data: raw uint8 pixels (the model rescales them) with a channel axis added, copied (the loader's arrays are
# read-only).
try:
    train_images, train_labels = load("fashion-mnist", "train")
    val_images, val_labels = load("fashion-mnist", "test")
except DataError as error:
    parser.exit(3, f"{parser.prog}: error: {error}\n")
train_set = TensorDataset(torch.tensor(train_images[:args.train_images, ..., None]),
                          torch.from_numpy(train_labels[:args.train_images].astype(np.int64)))
val_set = TensorDataset(torch.tensor(val_images[:args.val_images, ..., None]),
                        torch.from_numpy(val_labels[:args.val_images].astype(np.int64)))
if len(train_set) < args.batch_size:
    parser.error(f"--batch-size {args.batch_size} is more than the {len(train_set)} training images")
# Full batches only: every step averages the same number of images.
train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
val_loader = DataLoader(val_set, batch_size=args.val_batch_size)

# Model, loss and optimizer: plain SGD with momentum.
model = SmallCNN(input_shape=(28, 28, 1))
loss_function = torch.nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)


def evaluate(loader):
    """Summed loss, correct answers and image count of the model on ``loader``'s images."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for pixels, classes in loader:
            scores = model(pixels)
            loss_sum += loss_function(scores, classes).item() * len(classes)
            correct += (scores.argmax(dim=1) == classes).sum().item()
            count += len(classes)
    return loss_sum, correct, count


args.output_dir.mkdir(parents=True, exist_ok=True)
print(f"training on {len(train_set)} images, batch {args.batch_size}, {len(train_loader)} steps per epoch", flush=True)
started = time.perf_counter()
for epoch in range(args.epochs):
    model.train()
    epoch_started, loss_sum, correct, count = time.perf_counter(), 0.0, 0, 0
    for pixels, classes in train_loader:
        optimizer.zero_grad()
        scores = model(pixels)
        loss = loss_function(scores, classes)
        loss.backward()
        optimizer.step()
        loss_sum += loss.item() * len(classes)
        correct += (scores.argmax(dim=1) == classes).sum().item()
        count += len(classes)
    images_per_s = count / (time.perf_counter() - epoch_started)
    val_loss_sum, val_correct, val_count = evaluate(val_loader)
    print(format_epoch(epoch, args.epochs, {
        "loss": loss_sum / count, "accuracy": correct / count, "val_loss": val_loss_sum / val_count,
        "val_accuracy": val_correct / val_count, "lr": optimizer.param_groups[0]["lr"], "images_per_s": images_per_s,
        "elapsed_s": time.perf_counter() - started}), flush=True)
    torch.save(model.state_dict(), args.output_dir / "checkpoint.pt")
print(f"final val_accuracy {val_correct / val_count:.4f}", flush=True)

if args.weights_digest_dir is not None:
    # For the lab: identical digests mean identical weights, bit for bit.
    digest = hashlib.sha256(b"".join(tensor.detach().contiguous().numpy().tobytes()
                                     for tensor in model.state_dict().values())).hexdigest()
    args.weights_digest_dir.mkdir(parents=True, exist_ok=True)
    (args.weights_digest_dir / "weights_rank0.json").write_text(json.dumps({"rank": 0, "world_size": 1,
                                                                              "sha256": digest}))
