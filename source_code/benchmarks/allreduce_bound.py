"""What no transport can beat here: a 2-rank allreduce done directly in shared memory, timed against a
single-core memcpy of the same size (the P6 ratio of an ideal, zero-overhead allreduce).

    python source_code/benchmarks/allreduce_bound.py --bytes 67108864 --json bound.json

Each rank sums its half of the two inputs into its output, then copies the other rank's summed half: the least
memory traffic a 2-rank allreduce needs (read 3/2 n, write n per rank), with both ranks sharing the memory bus.
Horovod does more: its TensorFlow op copies the input into a new output first, and Gloo (TCP) or MPI moves the
halves through buffers. If this ratio is near the goal, the goal is a property of the machine, not of Horovod.
"""

import argparse
import json
import time
from multiprocessing import Barrier, Process, shared_memory
from pathlib import Path

import numpy as np

parser = argparse.ArgumentParser(description="ideal shared-memory allreduce vs memcpy")
parser.add_argument("--bytes", type=int, default=64 << 20)
parser.add_argument("--repeats", type=int, default=7)
parser.add_argument("--json", type=Path, required=True)
args = parser.parse_args()
elements = args.bytes // 4
half = elements // 2


def memcpy_seconds() -> list[float]:
    source = np.ones(elements, np.float32)
    target = np.empty_like(source)
    np.copyto(target, source)  # fault the pages in first
    samples = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        np.copyto(target, source)
        samples.append(time.perf_counter() - started)
    return samples


def rank(index: int, names: list[str], barrier, timings_name: str) -> None:
    blocks = [shared_memory.SharedMemory(name=name) for name in names]
    inputs = [np.ndarray((elements,), np.float32, buffer=blocks[i].buf) for i in (0, 1)]
    outputs = [np.ndarray((elements,), np.float32, buffer=blocks[i].buf) for i in (2, 3)]
    timing_block = shared_memory.SharedMemory(name=timings_name)
    timings = np.ndarray((args.repeats + 1,), np.float64, buffer=timing_block.buf)
    mine = slice(index * half, (index + 1) * half)
    theirs = slice((1 - index) * half, (2 - index) * half)
    for repeat in range(args.repeats + 1):  # the first one is a warm-up
        barrier.wait()
        started = time.perf_counter()
        np.add(inputs[0][mine], inputs[1][mine], out=outputs[index][mine])
        barrier.wait()  # both halves are summed
        np.copyto(outputs[index][theirs], outputs[1 - index][theirs])
        barrier.wait()
        if index == 0:
            timings[repeat] = time.perf_counter() - started
    for block in blocks + [timing_block]:
        block.close()


memcpy_s = memcpy_seconds()
blocks = [shared_memory.SharedMemory(create=True, size=args.bytes) for _ in range(4)]
timing_block = shared_memory.SharedMemory(create=True, size=8 * (args.repeats + 1))
try:
    for block in blocks:
        np.ndarray((elements,), np.float32, buffer=block.buf)[:] = 1.0
    barrier = Barrier(2)
    ranks = [Process(target=rank, args=(i, [b.name for b in blocks], barrier, timing_block.name)) for i in (0, 1)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join()
    allreduce_s = np.ndarray((args.repeats + 1,), np.float64, buffer=timing_block.buf)[1:].tolist()
finally:
    for block in blocks + [timing_block]:
        block.close()
        block.unlink()
memcpy_median = float(np.median(memcpy_s))
# Bus bandwidth of a 2-rank allreduce is n / t (see scalelab.comm.bus_bandwidth).
document = {"message_bytes": args.bytes, "memcpy_s": memcpy_s, "allreduce_s": allreduce_s,
            "ratio": [memcpy_median / seconds for seconds in allreduce_s]}
args.json.parent.mkdir(parents=True, exist_ok=True)
args.json.write_text(json.dumps(document, indent=2))
print(f"memcpy {args.bytes / memcpy_median / 1e9:.2f} GB/s; ideal allreduce bus bandwidth "
      f"{args.bytes / float(np.median(allreduce_s)) / 1e9:.2f} GB/s: ratio {np.median(document['ratio']):.3f}")
