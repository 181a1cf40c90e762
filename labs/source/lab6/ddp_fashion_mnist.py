"""Fashion-MNIST with the course's small CNN on several processes with PyTorch's DistributedDataParallel (lab 6):
the same model, data, batch and optimizer as horovod_fashion_mnist.py and mwms_fashion_mnist.py next to it, in
PyTorch (scalelab.torch_models.SmallCNN has the Keras model's layers and initialisers).

    torchrun --standalone --nproc_per_node 2 ddp_fashion_mnist.py --weights-dir weights
Every line that is there for DDP carries a comment starting with `# DDP:`.
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
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from scalelab.data import DataError, load_fashion_mnist
from scalelab.progress import format_epoch
from scalelab.runtime import usable_cores
from scalelab.torch_models import SmallCNN

parser = argparse.ArgumentParser(description="Fashion-MNIST with PyTorch DDP")
parser.add_argument("--batch-size", type=int, default=64, help="training images per step on each worker")
parser.add_argument("--epochs", type=int, default=1, help="epochs to train")
parser.add_argument("--lr", type=float, default=0.02, help="learning rate of SGD (for the global batch)")
parser.add_argument("--train-images", type=int, default=4096, help="train on the first N images only")
parser.add_argument("--seed", type=int, default=0, help="random seed of the weights and the shuffling")
parser.add_argument("--weights-dir", type=Path, default=None,
                    help="each worker writes its final weights (.npz) and their SHA-256 (.json) here")
args = parser.parse_args()

# DDP: torchrun started the processes; joining the group (Gloo on CPUs) tells each its rank and the world size.
dist.init_process_group("gloo")
workers, rank = dist.get_world_size(), dist.get_rank()
# DDP: rank 0 alone prints progress.
is_chief = rank == 0
# DDP: the ranks on this machine share its cores instead of each starting one thread per core.
torch.set_num_threads(max(1, usable_cores() // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
torch.manual_seed(args.seed)

try:
    train_images, train_labels = load_fashion_mnist("train")
except DataError as error:
    parser.exit(3, f"{parser.prog}: error: {error}\n")
train_set = TensorDataset(torch.tensor(train_images[:args.train_images, ..., None]),
                          torch.tensor(train_labels[:args.train_images].astype(np.int64)))
# DDP: each rank its own 1/workers of the images, reshuffled each epoch (set_epoch below) with the same seed everywhere.
sampler = DistributedSampler(train_set, num_replicas=workers, rank=rank, shuffle=True, seed=args.seed)
# DDP: each rank's loader yields its own batches of --batch-size.
train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
steps_per_epoch = len(train_loader)

model = SmallCNN(input_shape=(28, 28, 1), num_classes=10)
# DDP: copy rank 0's weights to every rank now, and average the gradients of all ranks in every backward pass.
model = DistributedDataParallel(model)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
loss_function = torch.nn.CrossEntropyLoss()

if is_chief:
    print(f"DDP: {workers} workers, {len(sampler)} images each, "
          f"batch {args.batch_size} x {workers}, {steps_per_epoch} steps per epoch", flush=True)
started = time.perf_counter()
for epoch in range(args.epochs):
    model.train()
    # DDP: a new order each epoch, the same on every rank, so that the shares stay disjoint.
    sampler.set_epoch(epoch)
    epoch_started, totals = time.perf_counter(), torch.zeros(3, dtype=torch.float64)
    for pixels, classes in train_loader:
        optimizer.zero_grad()
        scores = model(pixels)
        loss = loss_function(scores, classes)
        loss.backward()
        optimizer.step()
        totals += torch.tensor([loss.item() * len(classes), (scores.argmax(dim=1) == classes).sum().item(),
                                len(classes)], dtype=torch.float64)
    # DDP: add up the ranks' sums of loss, correct answers and images before rank 0 prints their ratios.
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    loss_sum, correct, count = totals.tolist()
    if is_chief:
        print(format_epoch(epoch, args.epochs, {
            "loss": loss_sum / count, "accuracy": correct / count, "lr": args.lr,
            "images_per_s": count / (time.perf_counter() - epoch_started),
            "elapsed_s": time.perf_counter() - started}), flush=True)
if is_chief:
    print(f"total training time {time.perf_counter() - started:.1f} s", flush=True)

if args.weights_dir is not None:
    weights = [tensor.detach().numpy() for tensor in model.module.state_dict().values()]
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(w).tobytes() for w in weights)).hexdigest()
    args.weights_dir.mkdir(parents=True, exist_ok=True)
    # DDP: one pair of files per rank, so the ranks' weights can be compared.
    np.savez(args.weights_dir / f"weights_rank{rank}.npz", *weights)
    (args.weights_dir / f"weights_rank{rank}.json").write_text(json.dumps({"rank": rank, "size": workers,
                                                                           "sha256": digest}))
# DDP: free the DDP wrapper while the process group is up: left to Python's exit, PyTorch's Gloo threads can abort
# the rank there ("terminate called without an active exception"), failing the whole run.
del model
gc.collect()
# DDP: wait for every rank (rank 0 may still be saving), then leave the process group together: a rank that leaves
# while another still works can abort as it exits (Gloo), failing the whole run.
dist.barrier()
dist.destroy_process_group()
