"""Your DDP conversion of the serial PyTorch Fashion-MNIST script (lab 3, PyTorch edition).

This is a copy of the course's serial script, source_code/fashion_mnist_pytorch.py. Make it a data-parallel PyTorch
program: each `# FIXME(DDP) step N` below marks where one change of the lab's step N goes. Replace each FIXME with
your change and a one-line comment starting `# DDP:` that says why. List them with
    grep -n "FIXME(DDP)" fashion_mnist_ddp_student.py
and run the script on two processes with
    torchrun --standalone --nproc_per_node 2 fashion_mnist_ddp_student.py --epochs 1 --train-images 2000

Keep the command-line options as they are: the grader runs your script with them, for two short epochs on two
ranks, and watches what each rank does (its process group, the images it trains on, its learning rate, its
all-reduces, what it prints and writes).
"""

import argparse
import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch
# FIXME(DDP) step 1: import torch.distributed as dist (and os, to read torchrun's LOCAL_WORLD_SIZE).
# FIXME(DDP) step 3: import DistributedDataParallel from torch.nn.parallel.
from torch.utils.data import DataLoader, TensorDataset
# FIXME(DDP) step 2: import DistributedSampler from torch.utils.data.distributed (and Subset from
#                    torch.utils.data, for step 5).

from scalelab.data import DataError, load
from scalelab.progress import format_epoch
from scalelab.runtime import usable_cores
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

# FIXME(DDP) step 1: join the processes torchrun started: dist.init_process_group("gloo") (Gloo: the CPU's
#                    backend), then rank = dist.get_rank() and world_size = dist.get_world_size().
# FIXME(DDP) step 1: give this rank its share of the cores:
#                    torch.set_num_threads(max(1, usable_cores() // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))).
# FIXME(DDP) step 6: decide here which rank prints and writes files: is_chief = rank == 0.

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
# FIXME(DDP) step 2: one step now takes a batch on every rank: compare with args.batch_size * world_size.
if len(train_set) < args.batch_size:
    parser.error(f"--batch-size {args.batch_size} is more than the {len(train_set)} training images")
# FIXME(DDP) step 2: each rank its own share of the images, in a new order each epoch: make
#                    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True)
#                    and give it to the DataLoader (sampler=train_sampler, instead of shuffle=True).
# Full batches only: every step averages the same number of images.
train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
# FIXME(DDP) step 5: each rank validates its own share, each image once: Subset(val_set, range(rank, len(val_set),
#                    world_size)).
val_loader = DataLoader(val_set, batch_size=args.val_batch_size)

# Model, loss and optimizer: plain SGD with momentum.
model = SmallCNN(input_shape=(28, 28, 1))
# FIXME(DDP) step 3: wrap the model: model = DistributedDataParallel(model).
loss_function = torch.nn.CrossEntropyLoss()
# FIXME(DDP) step 4: scale the learning rate by the number of ranks (the linear scaling rule).
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)


# FIXME(DDP) step 5: a function that adds figures up over the ranks: put them in a float64 tensor and
#                    dist.all_reduce(tensor, op=dist.ReduceOp.SUM); every rank then holds the sums.
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


# FIXME(DDP) step 6: only rank 0 makes the folder and prints (here and below).
args.output_dir.mkdir(parents=True, exist_ok=True)
print(f"training on {len(train_set)} images, batch {args.batch_size}, {len(train_loader)} steps per epoch", flush=True)
started = time.perf_counter()
for epoch in range(args.epochs):
    model.train()
    # FIXME(DDP) step 2: train_sampler.set_epoch(epoch), so that each epoch shuffles the images differently.
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
    # FIXME(DDP) step 5: sum loss_sum, correct and count over the ranks (the validation's too) before dividing.
    images_per_s = count / (time.perf_counter() - epoch_started)
    val_loss_sum, val_correct, val_count = evaluate(val_loader)
    print(format_epoch(epoch, args.epochs, {
        "loss": loss_sum / count, "accuracy": correct / count, "val_loss": val_loss_sum / val_count,
        "val_accuracy": val_correct / val_count, "lr": optimizer.param_groups[0]["lr"], "images_per_s": images_per_s,
        "elapsed_s": time.perf_counter() - started}), flush=True)
    # FIXME(DDP) step 6: only rank 0 writes the checkpoint (of model.module: the plain model in the wrapper).
    torch.save(model.state_dict(), args.output_dir / "checkpoint.pt")
print(f"final val_accuracy {val_correct / val_count:.4f}", flush=True)

if args.weights_digest_dir is not None:
    # For the lab: identical digests mean identical weights, bit for bit.
    digest = hashlib.sha256(b"".join(tensor.detach().contiguous().numpy().tobytes()
                                     for tensor in model.state_dict().values())).hexdigest()
    # FIXME(DDP) step 6: every rank writes its own file, weights_rank{rank}.json, with its rank and the world size.
    args.weights_digest_dir.mkdir(parents=True, exist_ok=True)
    (args.weights_digest_dir / "weights_rank0.json").write_text(json.dumps({"rank": 0, "world_size": 1,
                                                                              "sha256": digest}))
# FIXME(DDP) step 1: at the end, free the DDP wrapper (del model, then gc.collect()), wait for every rank
# (dist.barrier()), then leave the process group together: dist.destroy_process_group().
