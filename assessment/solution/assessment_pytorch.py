"""The instructor's reference solution of the PyTorch assessment: assessment_pytorch.py converted to DDP and tuned.

Diff it against ../assessment_pytorch.py: every distributed change carries a `# DDP:` comment; the tuning changes
(batch norm, momentum, a larger batch with a scaled learning rate, warmup and a step decay, fewer epochs) are the
argparse defaults, so that a plain `torchrun --nproc_per_node N assessment_pytorch.py`, with no arguments, runs them.

Students never see this file: the grader hides assessment/solution/ from every submission it runs.
"""

import argparse
import gc
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
from scalelab.torch_models import SmallCNN, cifar_cnn, ddp_device, export_model_atomically

# Tuned per data set: the grader runs with no arguments, so the data set the track names picks these.
DATASET = os.environ.get("SCALELAB_DATASET", "cifar10")
TUNED = {
    "cifar10": dict(batch_size=64, epochs=8, lr=0.025, warmup_epochs=1.0, decay_epochs=(6,)),
    "fashion-mnist": dict(batch_size=128, epochs=1, lr=0.05, warmup_epochs=0.25, decay_epochs=()),
}[DATASET]

parser = argparse.ArgumentParser(description="ScaleLab assessment: CIFAR-10 with PyTorch (reference DDP solution)")
parser.add_argument("--dataset", choices=("cifar10", "fashion-mnist"), default=DATASET,
                    help="which data set to train on")
parser.add_argument("--batch-size", type=int, default=TUNED["batch_size"], help="training images per step per rank")
parser.add_argument("--epochs", type=int, default=TUNED["epochs"], help="epochs to train")
parser.add_argument("--lr", type=float, default=TUNED["lr"], help="SGD learning rate for one rank (scaled by ranks)")
parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
parser.add_argument("--warmup-epochs", type=float, default=TUNED["warmup_epochs"],
                    help="epochs over which the learning rate rises linearly to its scaled value")
parser.add_argument("--val-fraction", type=float, default=0.1,
                    help="fraction of the training images kept aside for validation")
args = parser.parse_args()
if args.batch_size < 1 or args.epochs < 1 or args.lr <= 0 or not 0 < args.val_fraction < 1:
    parser.error("--batch-size and --epochs must be at least 1, --lr positive, --val-fraction in (0, 1)")

# DDP: each rank trains on a GPU of its own where the machine has one per rank (NCCL moves the gradients), else on
# shared GPUs or the CPU (Gloo); torchrun tells each rank its place on the machine.
device, backend = ddp_device(int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
if device.type == "cuda":
    torch.cuda.set_device(device)
# DDP: join the processes torchrun started; each learns its rank (which one it is) and the world size (how many).
dist.init_process_group(backend)
rank, world_size = dist.get_rank(), dist.get_world_size()
# DDP: only rank 0 prints and saves the model (the DO-NOT-EDIT section below reads this name).
is_chief = rank == 0
# DDP: the same initial weights everywhere (DDP also broadcasts rank 0's when it wraps the model).
torch.manual_seed(0)

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
# DDP: each rank trains on its own 1/world_size of the images, in an order that changes every epoch (set_epoch).
train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
# DDP: and validates on its own share of the validation images, exactly once each.
val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), batch_size=512)
steps_per_epoch = len(train_loader)

model = cifar_cnn(batch_norm=True, bn_momentum=0.9) if args.dataset == "cifar10" else \
    SmallCNN(input_shape=images.shape[1:], batch_norm=True, bn_momentum=0.9)
# DDP: wrap the model; its backward pass averages the gradients of all ranks, bucket by bucket as they are ready.
model = DistributedDataParallel(model.to(device), device_ids=[device.index] if device.type == "cuda" else None)
loss_function = torch.nn.CrossEntropyLoss()
# DDP: the global batch is world_size times larger, so the learning rate grows with it (linear scaling), reached by
# a warmup that keeps the first steps stable, then divided by 10 at each decay epoch.
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * world_size, momentum=args.momentum)
warmup_steps = max(1, round(args.warmup_epochs * steps_per_epoch))


def learning_rate_factor(step):
    warmup = min(1.0, (step + 1) / warmup_steps)
    return warmup * 0.1 ** sum(step >= epoch * steps_per_epoch for epoch in TUNED["decay_epochs"])


schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, learning_rate_factor)

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


def summed(*figures):
    # DDP: add up a figure over the ranks, so rank 0 prints the whole model's, not its own share's.
    total = torch.tensor(figures, dtype=torch.float64, device=device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.tolist()


def evaluate(loader):
    """Mean loss and accuracy of the model on every rank's share of the validation images together."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for batch_pixels, batch_classes in loader:
            batch_pixels, batch_classes = batch_pixels.to(device), batch_classes.to(device)
            scores = model(batch_pixels)
            loss_sum += loss_function(scores, batch_classes).item() * len(batch_classes)
            correct += (scores.argmax(dim=1) == batch_classes).sum().item()
            count += len(batch_classes)
    loss_sum, correct, count = summed(loss_sum, correct, count)
    return loss_sum / count, correct / count


if is_chief:
    print(f"training on {len(train_set)} images, validating on {len(val_set)}, batch {args.batch_size} per rank "
          f"on {world_size} ranks", flush=True)
started = time.perf_counter()
for epoch in range(args.epochs):
    model.train()
    # DDP: a new order of the images each epoch, the same on every rank, so the shards stay disjoint.
    train_sampler.set_epoch(epoch)
    epoch_started, loss_sum, correct, count = time.perf_counter(), 0.0, 0, 0
    for batch_pixels, batch_classes in train_loader:
        batch_pixels, batch_classes = batch_pixels.to(device), batch_classes.to(device)
        optimizer.zero_grad()
        scores = model(batch_pixels)
        loss = loss_function(scores, batch_classes)
        loss.backward()
        optimizer.step()
        schedule.step()
        loss_sum += loss.item() * len(batch_classes)
        correct += (scores.argmax(dim=1) == batch_classes).sum().item()
        count += len(batch_classes)
    loss_sum, correct, count = summed(loss_sum, correct, count)
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
# DDP: free the DDP wrapper while the process group is up: left to Python's exit, PyTorch's Gloo threads can abort
# the rank there ("terminate called without an active exception"), failing the whole run.
del model
gc.collect()
# DDP: wait for every rank (rank 0 may still be saving), then leave the process group together: a rank that leaves
# while another still works can abort as it exits (Gloo), failing the whole run.
dist.barrier()
dist.destroy_process_group()
