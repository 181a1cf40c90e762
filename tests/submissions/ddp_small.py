"""A small PyTorch submission for the torchrun test track: 8,000 Fashion-MNIST images, DDP on every rank.

MODE picks how it behaves; the tests write a copy with another MODE:
  honest           every rank trains its share with the DDP-wrapped model
  rank0_alone      rank 0 trains without DDP while rank 1 only waits for it; both print epoch lines, and the run
                   writes a Horovod-like timeline and a verdict of its own into its job directory
  no_ddp           every rank trains its own copy, never averaging (no DDP): no bulk traffic
  bursts           rank 0 trains alone, and the ranks allreduce gradient-sized tensors 15 times at the start and
                   15 times at the end: the bytes of 30 steps, in two tenths of the run
"""
import gc
import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from scalelab.data import load
from scalelab.torch_models import SmallCNN, export_model_atomically

MODE = "honest"

dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
images, labels = load(os.environ["SCALELAB_DATASET"], "train")
pixels = torch.from_numpy(images[:8000, ..., None])
data = TensorDataset(pixels, torch.from_numpy(labels[:8000].astype(np.int64)))
model = SmallCNN(input_shape=(28, 28, 1), filters=(16, 32), dense_units=64)
output = Path(os.environ.get("SCALELAB_OUTPUT_DIR", "output"))
output.mkdir(parents=True, exist_ok=True)


def burst(times):
    for _ in range(times):
        for parameter in model.parameters():
            dist.all_reduce(torch.randn_like(parameter.data))


def train(trained, loader, epochs):
    optimizer = torch.optim.Adam(trained.parameters(), lr=0.001 * (world_size if MODE == "honest" else 1))
    for epoch in range(epochs):
        for batch_pixels, batch_classes in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(trained(batch_pixels), batch_classes).backward()
            optimizer.step()
        print(f"epoch {epoch + 1}/{epochs}  val_accuracy 0.99", flush=True)


if MODE == "honest":
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    train(DistributedDataParallel(model), DataLoader(data, batch_size=64, sampler=sampler), 2)
elif MODE == "no_ddp":
    train(model, DataLoader(data, batch_size=64, shuffle=True), 2)
else:
    if MODE == "bursts":
        burst(15)
    if rank == 0:
        train(model, DataLoader(data, batch_size=64, shuffle=True), 2)
        (output / "timeline.json").write_text(json.dumps([{"ph": "B", "name": "ALLREDUCE", "pid": 1, "ts": 1}]))
        (output / "verdict.json").write_text(json.dumps({"verdict": "pass"}))
    else:
        print("epoch 2/2  val_accuracy 0.99", flush=True)
    if MODE == "bursts":
        burst(15)
    dist.barrier()  # rank 1 waits here, using no CPU to speak of, until rank 0 has trained
if rank == 0:
    export_model_atomically(model, output / "model.pt2", pixels[:2])
gc.collect()  # frees the DDP wrapper while the process group is up: left to Python's exit, it can abort a rank
dist.barrier()
dist.destroy_process_group()
