"""Time Horovod's allreduce over a range of message sizes (lab 4); rank 0 writes one CSV row per size.

    horovodrun -np 2 --gloo python allreduce_bandwidth.py --csv allreduce.csv

Every rank allreduces (sums) a float32 tensor of each size, a few times; the median time is reported with the
algorithm bandwidth (bytes / time) and the bus bandwidth (what one link of a ring carried, comparable with a
link's or memcpy's bandwidth; see scalelab.comm.bus_bandwidth).
"""

import argparse
import csv
from pathlib import Path

import horovod.tensorflow as hvd
import numpy as np

from scalelab.allreduce_timing import time_allreduce
from scalelab.comm import bus_bandwidth
from scalelab.runtime import configure_threads

parser = argparse.ArgumentParser(description="hvd.allreduce time and bandwidth vs message size")
parser.add_argument("--min-bytes", type=int, default=4, help="smallest message (bytes, a multiple of 4)")
parser.add_argument("--max-bytes", type=int, default=64 * 2**20, help="largest message (bytes)")
parser.add_argument("--factor", type=int, default=4, help="each size is this many times the previous one")
parser.add_argument("--repeats", type=int, default=10, help="timed allreduces per size (after 2 untimed ones)")
parser.add_argument("--csv", type=Path, required=True, help="where rank 0 writes the results")
args = parser.parse_args()
if args.min_bytes < 4 or args.max_bytes < args.min_bytes or args.factor < 2 or args.repeats < 1:
    parser.error("need 4 <= --min-bytes <= --max-bytes, --factor >= 2 and --repeats >= 1")

# Horovod: one process per rank; ranks share this machine's cores.
hvd.init()
configure_threads(hvd.local_size())
is_chief = hvd.rank() == 0

sizes = []
size = args.min_bytes
while size <= args.max_bytes:
    sizes.append(size)
    size *= args.factor

rows = []
for message_bytes in sizes:
    # Horovod: every rank sums a float32 tensor of this size with the others, `repeats` times. The ranks meet at
    # a barrier before each timed allreduce, so a time is the allreduce's, not a wait for the slower rank's
    # previous one (read scalelab/allreduce_timing.py: it is short).
    times = time_allreduce(message_bytes, args.repeats, warmup=2)
    median_s = float(np.median(times))
    rows.append(dict(ranks=hvd.size(), message_bytes=message_bytes, median_s=median_s,
                     algorithm_gb_per_s=message_bytes / median_s / 1e9,
                     bus_gb_per_s=bus_bandwidth(message_bytes, median_s, hvd.size()) / 1e9))
    if is_chief:
        print(f"{message_bytes:>10} bytes  {median_s * 1e6:>10.1f} µs  bus bandwidth "
              f"{rows[-1]['bus_gb_per_s']:.3f} GB/s", flush=True)

if is_chief:
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with args.csv.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
