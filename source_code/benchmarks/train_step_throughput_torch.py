"""The bare PyTorch training step of the PyTorch assessment's model: images/s with nothing around it (P10's
denominator), on the GPU where there is one.

    python source_code/benchmarks/train_step_throughput_torch.py --batch-size 64 --json out.json [--device cpu]

Same model as assessment/solution/assessment_pytorch.py on CIFAR-10 (``cifar_cnn`` with batch norm, SGD with
momentum 0.9, cross-entropy), the same real images, but as tensors already on the device, one step after another:
no DataLoader, no copy to the device per batch, no ``.item()`` per step, no DDP, no learning-rate schedule.
PyTorch's default threads, as the reference run alone has. A GPU's queue is emptied (synchronize) before the clock
starts and before it stops.
"""

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from scalelab.data import load
from scalelab.torch_models import cifar_cnn

parser = argparse.ArgumentParser(description="images/s of a bare PyTorch training step of the assessment's CNN")
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--steps", type=int, default=40, help="timed steps per repeat")
parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (allocations, cuDNN's choices)")
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--images", type=int, default=2048, help="training images held on the device")
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
parser.add_argument("--json", type=Path, required=True)
args = parser.parse_args()
if min(args.batch_size, args.steps, args.repeats, args.images) < 1 or args.warmup < 0:
    parser.error("--batch-size, --steps, --repeats and --images must be at least 1, --warmup at least 0")

device = torch.device(args.device)
torch.manual_seed(0)
images, labels = load("cifar10", "train")
count = min(args.images, len(images))
if count < args.batch_size:
    parser.error(f"--batch-size {args.batch_size} is more than the {count} images held")
pixels = torch.tensor(images[:count]).to(device)
classes = torch.from_numpy(labels[:count].astype(np.int64)).to(device)
batches = count // args.batch_size

model = cifar_cnn(batch_norm=True, bn_momentum=0.9).to(device)
model.train()
loss_function = torch.nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.025, momentum=0.9)


def wait_for_device():
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(step):
    # The batch is a slice of the tensors already on the device: no input pipeline at all.
    start = (step % batches) * args.batch_size
    optimizer.zero_grad()
    loss = loss_function(model(pixels[start:start + args.batch_size]), classes[start:start + args.batch_size])
    loss.backward()
    optimizer.step()


for step in range(args.warmup):
    train_step(step)
wait_for_device()
samples = []
for _ in range(args.repeats):
    started = time.perf_counter()
    for step in range(args.steps):
        train_step(step)
    wait_for_device()
    samples.append(args.steps * args.batch_size / (time.perf_counter() - started))
print(f"batch {args.batch_size}  {device}  img/s " + " ".join(f"{s:.0f}" for s in samples), flush=True)

args.json.parent.mkdir(parents=True, exist_ok=True)
args.json.write_text(json.dumps({
    "batch_size": args.batch_size, "images_per_s": samples, "device": str(device),
    "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    "intra_op_threads": torch.get_num_threads()}))
