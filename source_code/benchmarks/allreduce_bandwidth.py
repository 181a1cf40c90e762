"""P6 and the bandwidth sweep: hvd.allreduce time vs message size, and single-core memcpy, in one Horovod job.

    horovodrun -np 2 --mpi python source_code/benchmarks/allreduce_bandwidth.py --json out.json

Rank 0 first times a single-core memcpy (NumPy copy between two preallocated buffers of the largest size) while
the other ranks wait, then all ranks allreduce float32 tensors of each size. Rank 0 writes one JSON document.

The allreduces are timed by scalelab.allreduce_timing (a barrier before each, warmup untimed: a naive loop
gets a tenth of what the transport can do). Every sample of every size is kept, so the report can give
min/median/max.
"""

import argparse
import json
import os
import socket
import time
from pathlib import Path

import numpy as np

from scalelab.allreduce_timing import barrier, hvd, time_allreduce  # hvd: the installed edition's binding
from scalelab.comm import bus_bandwidth
from scalelab.runtime import configure_threads

parser = argparse.ArgumentParser(description="hvd.allreduce bus bandwidth vs message size, and memcpy bandwidth")
parser.add_argument("--sizes", type=lambda text: [int(s) for s in text.split(",")],
                    default=[4 ** k * 1024 for k in range(0, 9)], help="message sizes in bytes, comma-separated")
parser.add_argument("--repeats", type=int, default=7, help="timed allreduces (and memcpys) per size")
parser.add_argument("--warmup", type=int, default=2, help="untimed allreduces per size before the timed ones")
parser.add_argument("--json", type=Path, required=True, help="where rank 0 writes the results")
args = parser.parse_args()

# Horovod: one process per rank; the ranks share this machine's cores (one intra-op thread each on 2 cores).
hvd.init()
configure_threads(hvd.local_size())
is_chief = hvd.rank() == 0

memcpy_s = []
largest = max(args.sizes)
if is_chief:
    source = np.ones(largest // 4, dtype=np.float32)
    target = np.empty_like(source)
    np.copyto(target, source)  # touch every page first: page faults are not copying
    for _ in range(args.repeats + 1):
        start = time.perf_counter()
        np.copyto(target, source)
        memcpy_s.append(time.perf_counter() - start)
    memcpy_s = memcpy_s[1:]
    del source, target
barrier("after_memcpy")

results = []
for message_bytes in args.sizes:
    # Horovod: every rank sums a float32 tensor of this size with the others, timed one allreduce at a time.
    samples = time_allreduce(message_bytes, args.repeats, args.warmup)
    results.append({"message_bytes": message_bytes, "seconds": samples,
                    "bus_gb_per_s": [bus_bandwidth(message_bytes, s, hvd.size()) / 1e9 for s in samples]})
    if is_chief:
        median = float(np.median(samples))
        print(f"{message_bytes:>10} bytes  {median * 1e6:>9.0f} µs  bus bandwidth "
              f"{bus_bandwidth(message_bytes, median, hvd.size()) / 1e9:.3f} GB/s", flush=True)

if is_chief:
    document = {
        "ranks": hvd.size(),
        "controller": "mpi" if hvd.mpi_enabled() else "gloo",
        "host": socket.gethostname(),
        "memcpy_bytes": largest,
        "memcpy_seconds": memcpy_s,
        "memcpy_gb_per_s": [largest / s / 1e9 for s in memcpy_s],
        "sizes": results,
        "horovod_env": {k: v for k, v in os.environ.items() if k.startswith(("HOROVOD_", "OMPI_MCA_", "MALLOC_"))},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(document, indent=2))
    print(f"memcpy {largest} bytes: {np.median(document['memcpy_gb_per_s']):.2f} GB/s (one core)", flush=True)
