"""Writes 8 MB of output on each rank, as fast as it can, then exits without a model."""
import sys

line = "flood " * 20 + "\n"
for _ in range(8 * 1024 * 1024 // len(line)):
    sys.stdout.write(line)
sys.stdout.write("x" * (3 * 1024 * 1024) + "\n")  # one very long line too
sys.stdout.flush()
