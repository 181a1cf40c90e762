"""A submission that asks for every CPU of the machine and says which it got, then fails at once."""
import os

before = sorted(os.sched_getaffinity(0))
try:
    os.sched_setaffinity(0, range(os.cpu_count()))
except OSError as refused:
    print(f"widening refused: {refused}", flush=True)
print(f"cpus {before} then {sorted(os.sched_getaffinity(0))}", flush=True)
raise SystemExit("trained nothing")
