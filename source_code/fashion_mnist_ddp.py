"""Fashion-MNIST with the course's small CNN on many processes with PyTorch's DistributedDataParallel (DDP): lab 3's
PyTorch edition, the full conversion of fashion_mnist_pytorch.py. Run it with, for example,

    torchrun --standalone --nproc_per_node 2 source_code/fashion_mnist_ddp.py
    torchrun --standalone --nproc_per_node 2 source_code/fashion_mnist_ddp.py --epochs 1 --train-images 2000

Every change from source_code/fashion_mnist_pytorch.py carries a comment starting with `# DDP:`.
"""

import argparse
import gc
import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from scalelab.data import DataError, load
from scalelab.progress import format_epoch
from scalelab.runtime import usable_cores
from scalelab.torch_models import SmallCNN

parser = argparse.ArgumentParser(description="Fashion-MNIST with a small CNN in PyTorch (DDP)")
parser.add_argument("--batch-size", type=int, default=128, help="training images per step per rank")
parser.add_argument("--val-batch-size", type=int, default=512, help="images per validation step")
parser.add_argument("--epochs", type=int, default=5, help="epochs to train")
parser.add_argument("--lr", type=float, default=0.01, help="learning rate of SGD for one rank (scaled by the ranks)")
parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
parser.add_argument("--train-images", type=int, default=None, help="train on the first N images only")
parser.add_argument("--val-images", type=int, default=None, help="validate on the first N held-out images only")
parser.add_argument("--output-dir", type=Path, default=Path("fashion_mnist_output"), help="checkpoints go here")
parser.add_argument("--weights-digest-dir", type=Path, default=None,
                    help="each rank writes the SHA-256 of its final weights here (weights_rank<R>.json)")
args = parser.parse_args()
for name in ("batch_size", "val_batch_size", "epochs", "train_images", "val_images"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
        parser.error(f"--{name.replace('_', '-')} must be at least 1")
if args.lr <= 0 or not 0 <= args.momentum < 1:
    parser.error("--lr must be positive and --momentum in [0, 1)")

# DDP: join the processes torchrun started (Gloo: the CPU's backend); each learns its rank and the world size.
dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
# DDP: rank 0 alone prints and writes files.
is_chief = rank == 0
# DDP: the ranks on this machine share its cores instead of each starting one thread per core.
torch.set_num_threads(max(1, usable_cores() // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))

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
if len(train_set) < args.batch_size * world_size:
    parser.error(f"--batch-size {args.batch_size} x {world_size} ranks is more than the {len(train_set)} "
                 "training images")
# DDP: each rank trains on its own 1/world_size of the images, in an order that changes every epoch (set_epoch).
train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
# Full batches only: every step averages the same number of images.
train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, drop_last=True)
# DDP: each rank validates on its own share of the held-out images, each image once.
val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), batch_size=args.val_batch_size)

# Model, loss and optimizer: plain SGD with momentum.
model = SmallCNN(input_shape=(28, 28, 1))
# DDP: wrap the model; it starts from rank 0's weights, and its backward pass averages the gradients of all ranks.
model = DistributedDataParallel(model)
loss_function = torch.nn.CrossEntropyLoss()
# DDP: each update averages a batch world_size times larger, so the learning rate grows with it (linear scaling).
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * world_size, momentum=args.momentum)


def summed(*figures):
    # DDP: add the figures up over the ranks, so that rank 0 prints the whole data's, not its own share's.
    totals = torch.tensor(figures, dtype=torch.float64)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    return totals.tolist()


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


if is_chief:
    args.output_dir.mkdir(parents=True, exist_ok=True)
    print(f"training on {len(train_set)} images, batch {args.batch_size} per rank on {world_size} ranks, "
          f"{len(train_loader)} steps per epoch", flush=True)
started = time.perf_counter()
for epoch in range(args.epochs):
    model.train()
    # DDP: a new order of the images each epoch, the same on every rank, so that the shares stay disjoint.
    train_sampler.set_epoch(epoch)
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
    # DDP: the epoch's figures of all ranks together (the images per second too: count is then every rank's).
    loss_sum, correct, count = summed(loss_sum, correct, count)
    images_per_s = count / (time.perf_counter() - epoch_started)
    val_loss_sum, val_correct, val_count = summed(*evaluate(val_loader))
    if is_chief:
        print(format_epoch(epoch, args.epochs, {
            "loss": loss_sum / count, "accuracy": correct / count, "val_loss": val_loss_sum / val_count,
            "val_accuracy": val_correct / val_count, "lr": optimizer.param_groups[0]["lr"],
            "images_per_s": images_per_s, "elapsed_s": time.perf_counter() - started}), flush=True)
        # DDP: rank 0 alone writes the checkpoint: every rank holds the same weights (the plain model's, .module).
        torch.save(model.module.state_dict(), args.output_dir / "checkpoint.pt")
if is_chief:
    print(f"final val_accuracy {val_correct / val_count:.4f}", flush=True)

if args.weights_digest_dir is not None:
    # For the lab: identical digests mean identical weights, bit for bit.
    digest = hashlib.sha256(b"".join(tensor.detach().contiguous().numpy().tobytes()
                                     for tensor in model.module.state_dict().values())).hexdigest()
    args.weights_digest_dir.mkdir(parents=True, exist_ok=True)
    # DDP: one file per rank (the one write every rank makes), so that the ranks' weights can be compared.
    (args.weights_digest_dir / f"weights_rank{rank}.json").write_text(json.dumps({
        "rank": rank, "world_size": world_size, "sha256": digest}))
# DDP: free the DDP wrapper while the process group is up: left to Python's exit, PyTorch's Gloo threads can abort
# the rank there ("terminate called without an active exception"), failing the whole run.
del model
gc.collect()
# DDP: wait for every rank (rank 0 may still be saving), then leave the process group together: a rank that leaves
# while another still works can abort as it exits (Gloo), failing the whole run.
dist.barrier()
dist.destroy_process_group()
