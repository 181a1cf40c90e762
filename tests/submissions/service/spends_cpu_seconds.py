"""Each rank spends a few seconds of CPU time (its own clock, whatever else runs), then ends without a model: on a
quiet machine it ends well inside a short budget and fails honestly; crowded off the CPU, it runs out of time."""
import time

CPU_SECONDS = 3.0

started = time.process_time()
while time.process_time() - started < CPU_SECONDS:
    pass
